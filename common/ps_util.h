/* ps_util.h - small helpers: time, file hash, hostname, atomic file writes. */
#ifndef PS_UTIL_H
#define PS_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

/* Monotonic seconds. */
double ps_now(void);

/* Silence counted only over time a process was there to hear it. A loop
 * that checks peers' deadlines calls ps_hearing_tick on each pass; a pass
 * that comes half the silence limit or more after the one before (the
 * process stopped, descheduled or paused, or a long load on its loop: the
 * peers' messages of that time may still be unread) starts every deadline
 * again from now. A peer is silent since ps_heard_at(h, its last message).
 * Shorter hold-ups cannot make a live peer look lost: it speaks every third
 * of the limit. */
typedef struct {
    double tick;         /* the last pass (0: none yet) */
    double listen_since; /* deadlines count from here at the earliest */
} ps_hearing_t;
/* Returns how long the loop was held up when that restarted the deadlines, else 0. */
double ps_hearing_tick(ps_hearing_t *h, double now, double silence);
double ps_heard_at(const ps_hearing_t *h, double last);

/* FNV-1a 64 of a byte range; chain by passing the previous value as h
 * (start with PS_FNV_INIT). */
#define PS_FNV_INIT 0xcbf29ce484222325ULL
uint64_t ps_fnv1a(uint64_t h, const void *data, size_t n);

/* Size and FNV-1a 64 of a whole file. 0, or -errno. */
int ps_file_hash(const char *path, uint64_t *size, uint64_t *hash);

/* Keep freed memory for the next message instead of giving it back to the
 * kernel (glibc): one arena, no mmap for large blocks, no trimming. ZeroMQ
 * allocates every large message it receives; by default glibc maps such a
 * block fresh (above its mmap threshold, 32 MiB at most, or when a thread's
 * arena trims the one before), and every 4 KiB page of it then faults when
 * the message is read in: 17,500 faults a round for an 80 MB model, more than
 * the wire itself on a VM. Memory stays at its high-water mark (the messages
 * in flight at once). Call first thing in main, before any thread starts: psd,
 * pworker and psbench do; a library never does on its own (libpsworker
 * exports it to its program as psw_keep_freed_memory). */
void ps_malloc_keep(void);

/* Give back what a process's start freed (its data files' decoding and the
 * like), which ps_malloc_keep would otherwise hold for good: called once,
 * when the start's loading is done. After ps_malloc_keep it also sets aside
 * a reserve for small blocks (2 MiB of address space, resident as used),
 * so that they do not land amid the large messages' blocks. */
void ps_malloc_settle(void);

/* Host name and a stable host id (/etc/machine-id, else the host name). */
void ps_hostname(char *buf, size_t n);
void ps_host_id(char *buf, size_t n);

/* Write a file atomically: PATH.tmp, fsync, rename, fsync of the directory.
 * The writer callback writes the contents to fd and returns 0 or -errno.
 * Returns 0 or -errno. */
typedef int (*ps_write_fn)(int fd, void *ud);
int ps_write_atomic(const char *path, ps_write_fn fn, void *ud);

/* The same in steps, for a file written piece by piece over time:
 * ps_atomic_open creates PATH.tmp (a->fd); ps_atomic_commit fsyncs and
 * closes it, renames it over PATH and fsyncs the directory (on failure the
 * temp file is removed); ps_atomic_abort closes and removes it. Commit and
 * abort end a. 0 or -errno. */
typedef struct {
    int fd;
    char *tmp, *path;
} ps_atomic_t;
int ps_atomic_open(ps_atomic_t *a, const char *path);
int ps_atomic_commit(ps_atomic_t *a);
void ps_atomic_abort(ps_atomic_t *a);

/* write() all of buf, retrying on EINTR/short writes. 0 or -errno.
 * ps_pwrite_all: the same at file offset off (pwrite). */
int ps_write_all(int fd, const void *buf, size_t n);
int ps_pwrite_all(int fd, const void *buf, size_t n, uint64_t off);

/* ids[0, n) is a list of rows of a table of `rows` rows: n >= 1, strictly
 * increasing, each below rows. */
int ps_rows_valid(const uint32_t *ids, size_t n, uint64_t rows);

/* Sort a[0, n) and keep each value once; returns how many remain. */
size_t ps_sort_unique_u32(uint32_t *a, size_t n);

/* The index of v in a[0, n) (sorted, increasing), or -1 if it is not there. */
ptrdiff_t ps_find_u32(const uint32_t *a, size_t n, uint32_t v);

/* The CPUs this process may use: those of its affinity mask (taskset,
 * docker --cpuset-cpus, SLURM's cpuset confinement and task binding), or
 * fewer when its cgroup's CPU quota allows less (docker --cpus, systemd
 * CPUQuota: cgroup v2 cpu.max of its cgroup and its ancestors, cgroup v1
 * cpu.cfs_quota_us), rounded up; at least 1. *bound (may be NULL) is set
 * when either restricts it below the host's online CPUs: the process was
 * given a share of the host; *by_quota (may be NULL) when a CPU quota is
 * what limits it (time, not CPUs: a thread that spins spends the quota).
 * Threads are sized by this, not by the host's cores, which a container or
 * a bound job would oversubscribe. */
int ps_cpus_usable(bool *bound, bool *by_quota);
/* The CPU quota set on the cgroup `self_cgroup` (the contents of
 * /proc/self/cgroup) names, under the cgroup file system mounted at `root`
 * (/sys/fs/cgroup), in whole CPUs rounded up: the smallest along its path
 * to the root; 0 if none is set or nothing can be read. */
int ps_cgroup_cpu_quota(const char *root, const char *self_cgroup);

/* ZeroMQ endpoints psd and its workers take: "tcp://HOST:PORT" (HOST a
 * name, an IPv4 address or an IPv6 address in brackets, [::1]; PORT 1-65535) or
 * "ipc://PATH" (at most 107 bytes, a unix socket's limit). To bind, PORT
 * may also be 0 or * (a free port) and HOST * (every interface). libzmq
 * itself takes a port above 65535 modulo 65536, which would listen on or
 * reach another port than the one asked for. 0, or -1 with a reason in
 * why[n]. */
typedef enum { PS_EP_CONNECT = 0, PS_EP_BIND = 1 } ps_ep_use_t;
int ps_endpoint_check(const char *ep, ps_ep_use_t use, char *why, size_t n);
/* A checked endpoint to listen on names an interface, an IPv4 address or
 * an IPv6 address of this host (libzmq resolves no host names to bind: "No such device").
 * Apart from the syntax, as the host that listens is not always the one
 * that checks a config. 0, or -1 with a reason. */
int ps_endpoint_bindable(const char *ep, char *why, size_t n);
/* Whether ep reaches this host only: ipc://, inproc://, or tcp:// to
 * 127.0.0.0/8 (as numbers, or mapped into IPv6), [::1] or localhost. */
bool ps_endpoint_is_loopback(const char *ep);
/* Whether ep names this host: loopback (above), tcp:// to an address of one
 * of its interfaces (getifaddrs), or to its host name (gethostname). No name
 * is looked up (a DNS name of this host other than its own counts as
 * another host). */
bool ps_endpoint_is_this_host(const char *ep);
/* Whether ep is tcp:// to an IPv6 address ([ADDR]): its socket needs
 * ZMQ_IPV6 (ps_zmq_endpoint_opts, ps_wire.h). */
bool ps_endpoint_is_ipv6(const char *ep);
/* Whether a socket for ep needs ZMQ_IPV6: an IPv6 address, or a host name
 * whose addresses (getaddrinfo, at the call) are all IPv6 (without the
 * option libzmq looks a name up for IPv4 only; a name with an IPv4 address
 * keeps IPv4, as libzmq with the option would try its IPv6 one first). */
bool ps_endpoint_wants_ipv6(const char *ep);

/* SIGINT/SIGTERM that come before a daemon's own handlers (while it loads
 * its data): the first is remembered for the daemon to act on once its
 * loop runs; a second exits at once with 128+N. ps_early_stop_signal()
 * returns the first one (0 if none). */
void ps_early_stop_signals(void);
int ps_early_stop_signal(void);
/* Counts the requests SIGINT/SIGTERM make of a daemon (the first: stop
 * cleanly; another: exit now) and returns how many there were with this one,
 * or 0 when it is an echo of the first: the same signal within
 * PS_SIGNAL_ECHO_S of it. timeout(1), and kill of a process group, send it to
 * the command and to its group: the daemon gets it twice at once, which is
 * one request. Async-signal-safe; one caller at a time (handlers block both
 * signals). */
#define PS_SIGNAL_ECHO_S 0.1
int ps_stop_signal_note(int sig);

/* The shortest of %.15g..%.17g that reads back as exactly v, into buf. */
void ps_fmt_double(double v, char *buf, size_t n);
/* s as a double-quoted YAML scalar that reads back byte for byte (UTF-8 text). */
void ps_yaml_quoted(FILE *f, const char *s);

/* Strict text to number: the whole text, no surrounding space, base 10.
 * ps_parse_i64: 0, -1 not an integer, -2 out of range; ps_parse_u64 the
 * same (a '-' is not an integer); ps_parse_double: a finite double (0, -1,
 * -2 for inf/nan or overflow; underflow to a denormal or zero is taken). */
int ps_parse_i64(const char *s, int64_t *out);
int ps_parse_u64(const char *s, uint64_t *out);
int ps_parse_double(const char *s, double *out);

#endif
