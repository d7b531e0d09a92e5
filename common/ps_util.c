#include "ps_util.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

double ps_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- CPUs this process may use ---- */

/* "QUOTA PERIOD" (cgroup v2 cpu.max, or v1's two files joined): whole CPUs
 * rounded up, 0 for no limit ("max", or v1's -1) or text that is not that */
static int quota_cpus(const char *text)
{
    char q[32], p[32];
    if (sscanf(text, "%31s %31s", q, p) != 2) return 0;
    char *qe, *pe;
    errno = 0;
    long long quota = strtoll(q, &qe, 10), period = strtoll(p, &pe, 10);
    if (errno || *qe || *pe || quota <= 0 || period <= 0) return 0; /* "max", -1 */
    long long cpus = quota / period + (quota % period != 0);
    return cpus > 4096 ? 4096 : (int)cpus;
}

/* The contents of a small file, NUL-terminated; false if unreadable. */
static bool read_small(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t got = fread(buf, 1, n - 1, f);
    fclose(f);
    buf[got] = 0;
    return got > 0;
}

/* The smaller of two quotas (0: none). */
static int min_quota(int a, int b) { return a == 0 ? b : b == 0 ? a : a < b ? a : b; }

int ps_cgroup_cpu_quota(const char *root, const char *self_cgroup)
{
    int best = 0;
    char path[4096], text[128];
    for (const char *line = self_cgroup; line && *line;) {
        const char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        /* "0::/path" (v2), or "N:cpu,cpuacct:/path" (v1: the cpu controller's line) */
        const char *c1 = memchr(line, ':', len), *c2 = c1 ? memchr(c1 + 1, ':', len - (size_t)(c1 + 1 - line)) : NULL;
        if (c2) {
            size_t cl = (size_t)(c2 - c1 - 1), pl = len - (size_t)(c2 + 1 - line);
            char cg[2048];
            if (pl < sizeof cg) {
                memcpy(cg, c2 + 1, pl);
                cg[pl] = 0;
                bool v2 = cl == 0, v1 = false;
                for (const char *k = c1 + 1; !v2 && k < c2;) { /* a controller list naming "cpu" */
                    const char *e = memchr(k, ',', (size_t)(c2 - k));
                    size_t kl = e ? (size_t)(e - k) : (size_t)(c2 - k);
                    if (kl == 3 && memcmp(k, "cpu", 3) == 0) v1 = true;
                    k = e ? e + 1 : c2;
                }
                /* v1: the cpu controller where distributions mount it; one mounted
                 * together with others (cpu,cpuacct,cpuset) or elsewhere is not
                 * found, and its quota not seen */
                const char *mounts[] = {"cpu", "cpu,cpuacct", "cpuacct,cpu"};
                for (int m = 0; m < (v2 ? 1 : v1 ? 3 : 0); m++) {
                    /* the cgroup and each of its ancestors; in a cgroup namespace
                     * (a container) the path is "/" and the mount is its own */
                    char at[2048];
                    snprintf(at, sizeof at, "%s", cg);
                    for (;;) {
                        size_t al = strlen(at);
                        while (al > 1 && at[al - 1] == '/') at[--al] = 0;
                        const char *sub = strcmp(at, "/") == 0 ? "" : at;
                        int q = 0;
                        if (v2) {
                            snprintf(path, sizeof path, "%s%s/cpu.max", root, sub);
                            if (read_small(path, text, sizeof text)) q = quota_cpus(text);
                        } else {
                            char qt[64], pt[64];
                            snprintf(path, sizeof path, "%s/%s%s/cpu.cfs_quota_us", root, mounts[m], sub);
                            bool ok = read_small(path, qt, sizeof qt);
                            snprintf(path, sizeof path, "%s/%s%s/cpu.cfs_period_us", root, mounts[m], sub);
                            if (ok && read_small(path, pt, sizeof pt)) {
                                qt[strcspn(qt, "\n")] = 0;
                                snprintf(text, sizeof text, "%s %s", qt, pt);
                                q = quota_cpus(text);
                            }
                        }
                        best = min_quota(best, q);
                        char *slash = strrchr(at, '/');
                        if (!slash || strcmp(at, "/") == 0) break;
                        if (slash == at) at[1] = 0;
                        else *slash = 0;
                    }
                }
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    return best;
}

int ps_cpus_usable(bool *bound, bool *by_quota)
{
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online < 1) online = 1;
    int n = (int)(online > 4096 ? 4096 : online);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) n = CPU_COUNT(&set);
    char self[4096];
    int q = read_small("/proc/self/cgroup", self, sizeof self) ? ps_cgroup_cpu_quota("/sys/fs/cgroup", self) : 0;
    if (by_quota) *by_quota = q > 0 && q <= n;
    if (q > 0 && q < n) n = q;
    if (bound) *bound = n < online;
    return n < 1 ? 1 : n;
}

double ps_hearing_tick(ps_hearing_t *h, double now, double silence)
{
    double held = h->tick > 0 && now - h->tick >= silence / 2 ? now - h->tick : 0;
    if (held > 0) h->listen_since = now;
    h->tick = now;
    return held;
}

double ps_heard_at(const ps_hearing_t *h, double last) { return last > h->listen_since ? last : h->listen_since; }

static int stop_first, stop_count;
static double stop_first_at;

int ps_stop_signal_note(int sig)
{
    double now = ps_now(); /* clock_gettime: async-signal-safe */
    if (stop_count == 1 && sig == stop_first && now - stop_first_at < PS_SIGNAL_ECHO_S) return 0;
    if (stop_count++ == 0) {
        stop_first = sig;
        stop_first_at = now;
    }
    return stop_count;
}

static volatile sig_atomic_t early_signal;

static void on_early_signal(int sig)
{
    int n = ps_stop_signal_note(sig);
    if (n > 1) _exit(128 + sig);
    if (n == 1) early_signal = sig;
}

void ps_early_stop_signals(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_early_signal;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGINT); /* one handler at a time (ps_stop_signal_note) */
    sigaddset(&sa.sa_mask, SIGTERM);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

int ps_early_stop_signal(void)
{
    return early_signal;
}

uint64_t ps_fnv1a(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

int ps_file_hash(const char *path, uint64_t *size, uint64_t *hash)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -errno;
    uint8_t *buf = malloc(1 << 20);
    int rc = 0;
    uint64_t h = PS_FNV_INIT, total = 0;
    if (!buf) {
        rc = -ENOMEM;
        goto out;
    }
    for (;;) {
        ssize_t n = read(fd, buf, 1 << 20);
        if (n < 0) {
            if (errno == EINTR) continue;
            rc = -errno;
            goto out;
        }
        if (n == 0) break;
        h = ps_fnv1a(h, buf, (size_t)n);
        total += (uint64_t)n;
    }
    *size = total;
    *hash = h;
out:
    free(buf);
    close(fd);
    return rc;
}

static bool malloc_kept;
static void *small_fence; /* never freed: keeps the small blocks' reserve apart from the heap's top (ps_malloc_settle) */

void ps_malloc_keep(void)
{
    /* under a sanitizer's allocator these are no-ops */
    mallopt(M_ARENA_MAX, 1);                /* ZeroMQ's I/O threads too: a thread's arena caps at 64 MiB heaps */
    mallopt(M_MMAP_MAX, 0);                 /* large blocks from the heap, reused */
    mallopt(M_TRIM_THRESHOLD, INT_MAX);     /* the heap's top is kept */
    mallopt(M_TOP_PAD, 16 << 20);           /* and grows by 16 MiB at least */
    malloc_kept = true;
}

/* bytes in free blocks other than the heap's top */
static size_t free_in_bins(void)
{
    struct mallinfo2 mi = mallinfo2();
    return mi.fordblks > mi.keepcost ? mi.fordblks - mi.keepcost : 0;
}

void ps_malloc_settle(void)
{
    malloc_trim(0);
    if (!malloc_kept || small_fence) return;
    /* The small blocks' reserve: a free block of 2 MiB (resident as used)
     * between two blocks in use. glibc serves a request from the smallest
     * free block that holds it before it cuts the heap's top, so the small
     * blocks allocated while messages come and go (ZeroMQ's pipe chunks,
     * small frames) come from here, not from the space the last round's
     * large messages freed: surviving the step, they would cut it into
     * pieces that the next round's messages, in another order, no longer
     * fit. A request larger than every free block is cut from the top: the
     * reserve is (then shrunk in place, its tail given back to the top), and
     * so is the fence right after it, never freed. Neither is written:
     * address space, not memory. (volatile: a malloc freed unused is elided) */
    const size_t reserve_bytes = (size_t)2 << 20;
    void *volatile reserve = malloc(free_in_bins() + reserve_bytes);
    if (!reserve) return;
    void *volatile shrunk = realloc(reserve, reserve_bytes);
    if (shrunk) reserve = shrunk;
    small_fence = malloc(free_in_bins() + 4096);
    free(reserve);
}

void ps_hostname(char *buf, size_t n)
{
    if (gethostname(buf, n) != 0) snprintf(buf, n, "unknown");
    buf[n - 1] = '\0';
}

void ps_host_id(char *buf, size_t n)
{
    const char *env = getenv("PSD_HOST_ID"); /* containers of one host (docker-compose) */
    if (env && env[0]) {
        snprintf(buf, n, "%s", env);
        return;
    }
    FILE *f = fopen("/etc/machine-id", "r");
    if (f) {
        char line[128];
        if (fgets(line, sizeof line, f)) {
            line[strcspn(line, "\r\n")] = '\0';
            if (line[0]) {
                snprintf(buf, n, "%s", line);
                fclose(f);
                return;
            }
        }
        fclose(f);
    }
    ps_hostname(buf, n);
}

/* write() or, with off >= 0, pwrite() at off: all of buf */
static int write_loop(int fd, const void *buf, size_t n, int64_t off)
{
    const char *p = buf;
    while (n > 0) {
        ssize_t w = off >= 0 ? pwrite(fd, p, n, (off_t)off) : write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += w;
        if (off >= 0) off += w;
        n -= (size_t)w;
    }
    return 0;
}

int ps_write_all(int fd, const void *buf, size_t n) { return write_loop(fd, buf, n, -1); }

int ps_pwrite_all(int fd, const void *buf, size_t n, uint64_t off) { return write_loop(fd, buf, n, (int64_t)off); }

static void atomic_end(ps_atomic_t *a, bool remove)
{
    if (a->fd >= 0) close(a->fd);
    if (remove && a->tmp) unlink(a->tmp);
    free(a->tmp);
    free(a->path);
    a->fd = -1;
    a->tmp = a->path = NULL;
}

int ps_atomic_open(ps_atomic_t *a, const char *path)
{
    size_t len = strlen(path);
    a->fd = -1;
    a->tmp = malloc(len + 16);
    a->path = strdup(path);
    if (!a->tmp || !a->path) {
        atomic_end(a, false);
        return -ENOMEM;
    }
    snprintf(a->tmp, len + 16, "%s.tmp", path);
    a->fd = open(a->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (a->fd < 0) {
        int rc = -errno;
        atomic_end(a, false);
        return rc;
    }
    return 0;
}

void ps_atomic_abort(ps_atomic_t *a) { atomic_end(a, true); }

int ps_atomic_commit(ps_atomic_t *a)
{
    int rc = 0;
    if (fsync(a->fd) != 0) {
        rc = -errno;
        atomic_end(a, true);
        return rc;
    }
    int fd = a->fd;
    a->fd = -1;
    if (close(fd) != 0 || rename(a->tmp, a->path) != 0) {
        rc = -errno;
        atomic_end(a, true);
        return rc;
    }
    int dfd = open(dirname(a->path), O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* dirname may write into path */
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    atomic_end(a, false);
    return 0;
}

int ps_write_atomic(const char *path, ps_write_fn fn, void *ud)
{
    ps_atomic_t a;
    int rc = ps_atomic_open(&a, path);
    if (rc != 0) return rc;
    if ((rc = fn(a.fd, ud)) != 0) {
        ps_atomic_abort(&a);
        return rc;
    }
    return ps_atomic_commit(&a);
}

int ps_rows_valid(const uint32_t *ids, size_t n, uint64_t rows)
{
    if (!ids || n == 0 || n > rows) return 0;
    for (size_t i = 0; i < n; i++)
        if (ids[i] >= rows || (i && ids[i] <= ids[i - 1])) return 0;
    return 1;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

ptrdiff_t ps_find_u32(const uint32_t *a, size_t n, uint32_t v)
{
    const uint32_t *p = n ? bsearch(&v, a, n, sizeof *a, cmp_u32) : NULL;
    return p ? p - a : -1;
}

size_t ps_sort_unique_u32(uint32_t *a, size_t n)
{
    size_t k = 0;
    if (n > 1) qsort(a, n, sizeof *a, cmp_u32);
    for (size_t i = 0; i < n; i++)
        if (!k || a[i] != a[k - 1]) a[k++] = a[i];
    return k;
}

/* ---- endpoints ------------------------------------------------------------ */

#define PS_IPC_PATH_MAX 107 /* sizeof(sockaddr_un.sun_path) - 1 */

/* tcp://HOST:PORT split at the last colon: host [h, h + hl), port text p. */
static int tcp_split(const char *ep, const char **h, size_t *hl, const char **p)
{
    if (strncmp(ep, "tcp://", 6) != 0) return -1;
    const char *rest = ep + 6, *colon = strrchr(rest, ':');
    if (!colon) return -1;
    *h = rest;
    *hl = (size_t)(colon - rest);
    *p = colon + 1;
    return 0;
}

/* host [h, h + hl) is "[ADDR]", ADDR an IPv6 address (into *a if not NULL) */
static bool ipv6_literal(const char *h, size_t hl, struct in6_addr *a)
{
    char t[INET6_ADDRSTRLEN];
    struct in6_addr x;
    if (hl < 3 || h[0] != '[' || h[hl - 1] != ']' || hl - 2 >= sizeof t) return false;
    memcpy(t, h + 1, hl - 2);
    t[hl - 2] = '\0';
    return inet_pton(AF_INET6, t, a ? a : &x) == 1;
}

int ps_endpoint_check(const char *ep, ps_ep_use_t use, char *why, size_t n)
{
    if (!ep || !*ep) {
        snprintf(why, n, "an empty endpoint (tcp://HOST:PORT or ipc://PATH)");
        return -1;
    }
    if (strncmp(ep, "ipc://", 6) == 0) {
        size_t len = strlen(ep + 6);
        if (len == 0 || len > PS_IPC_PATH_MAX) {
            snprintf(why, n, "'%s': an ipc:// path must have 1 to %d bytes", ep, PS_IPC_PATH_MAX);
            return -1;
        }
        return 0;
    }
    const char *h, *p;
    size_t hl;
    if (strncmp(ep, "tcp://", 6) != 0) {
        snprintf(why, n, "'%s' is not a tcp:// or ipc:// endpoint", ep);
        return -1;
    }
    if (tcp_split(ep, &h, &hl, &p) != 0 || hl == 0) {
        snprintf(why, n, "'%s': expected tcp://HOST:PORT", ep);
        return -1;
    }
    /* IPv6 addresses in brackets (ps_zmq_endpoint_opts sets ZMQ_IPV6 for
     * them); to listen, eth0:1 is an interface's alias */
    if (h[0] == '[' ? !ipv6_literal(h, hl, NULL) : use == PS_EP_CONNECT && memchr(h, ':', hl) != NULL) {
        snprintf(why, n, "'%s': an IPv6 address goes in brackets: tcp://[ADDR]:PORT, as tcp://[::1]:5555", ep);
        return -1;
    }
    if (use == PS_EP_CONNECT && hl == 1 && h[0] == '*') {
        snprintf(why, n, "'%s': * (every interface) is for listening; give the host to connect to", ep);
        return -1;
    }
    if (use == PS_EP_BIND && strcmp(p, "*") == 0) return 0;
    size_t digits = strspn(p, "0123456789");
    long port = digits && digits <= 5 && !p[digits] ? strtol(p, NULL, 10) : -1;
    if (port < (use == PS_EP_BIND ? 0 : 1) || port > 65535) {
        snprintf(why, n, "'%s': the port must be a number from %d to 65535%s", ep, use == PS_EP_BIND ? 0 : 1,
                 use == PS_EP_BIND ? " (0 or *: any free port)" : "");
        return -1;
    }
    return 0;
}

/* A tcp:// endpoint's host into host[n]: 0, or -1 (not tcp://, or too long). */
static int tcp_host(const char *ep, char *host, size_t n)
{
    const char *h, *p;
    size_t hl;
    if (tcp_split(ep, &h, &hl, &p) != 0 || hl >= n) return -1;
    memcpy(host, h, hl);
    host[hl] = '\0';
    return 0;
}

/* Whether host is *, an IPv4 address or an interface of this host: no name
 * to look up. */
static bool host_is_address_or_interface(const char *host)
{
    struct in_addr a;
    return strcmp(host, "*") == 0 || inet_aton(host, &a) || if_nametoindex(host) != 0;
}

int ps_endpoint_bindable(const char *ep, char *why, size_t n)
{
    char host[IF_NAMESIZE + 1];
    if (strncmp(ep, "tcp://", 6) != 0) return 0; /* ipc:// */
    if (ps_endpoint_is_ipv6(ep)) return 0;
    if (tcp_host(ep, host, sizeof host) == 0 && host_is_address_or_interface(host)) return 0;
    snprintf(why, n,
             "'%s': no interface or IP address of that name here (ZeroMQ listens on an interface or an address, "
             "not a host name: tcp://0.0.0.0:PORT for every interface, tcp://127.0.0.1:PORT or tcp://[::1]:PORT "
             "for this host only)",
             ep);
    return -1;
}

bool ps_endpoint_is_loopback(const char *ep)
{
    if (strncmp(ep, "ipc://", 6) == 0 || strncmp(ep, "inproc://", 9) == 0) return true;
    char host[64];
    struct in_addr a;
    struct in6_addr a6;
    if (tcp_host(ep, host, sizeof host) != 0) return false;
    if (ipv6_literal(host, strlen(host), &a6)) /* ::1, or 127.0.0.0/8 mapped */
        return IN6_IS_ADDR_LOOPBACK(&a6) || (IN6_IS_ADDR_V4MAPPED(&a6) && a6.s6_addr[12] == 127);
    return strcmp(host, "localhost") == 0 || (inet_aton(host, &a) && (ntohl(a.s_addr) >> 24) == 127);
}

bool ps_endpoint_is_this_host(const char *ep)
{
    if (ps_endpoint_is_loopback(ep)) return true;
    char host[256], me[256];
    if (tcp_host(ep, host, sizeof host) != 0) return false;
    if (gethostname(me, sizeof me - 1) == 0) {
        me[sizeof me - 1] = '\0';
        if (strcmp(host, me) == 0) return true;
    }
    struct in_addr a4;
    struct in6_addr a6;
    const bool v6 = ipv6_literal(host, strlen(host), &a6);
    if (!v6 && inet_pton(AF_INET, host, &a4) != 1) return false; /* a name other than ours */
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0) return false;
    bool mine = false;
    for (const struct ifaddrs *i = ifs; i && !mine; i = i->ifa_next) {
        if (!i->ifa_addr) continue;
        if (!v6 && i->ifa_addr->sa_family == AF_INET)
            mine = ((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr.s_addr == a4.s_addr;
        else if (v6 && i->ifa_addr->sa_family == AF_INET6)
            mine = memcmp(&((const struct sockaddr_in6 *)(const void *)i->ifa_addr)->sin6_addr, &a6, sizeof a6) == 0;
    }
    freeifaddrs(ifs);
    return mine;
}

bool ps_endpoint_is_ipv6(const char *ep)
{
    char host[INET6_ADDRSTRLEN + 2];
    return tcp_host(ep, host, sizeof host) == 0 && ipv6_literal(host, strlen(host), NULL);
}

bool ps_endpoint_wants_ipv6(const char *ep)
{
    char host[256];
    if (strncmp(ep, "tcp://", 6) != 0 || tcp_host(ep, host, sizeof host) != 0) return false;
    if (ipv6_literal(host, strlen(host), NULL)) return true;
    if (host_is_address_or_interface(host) || strchr(host, ';')) return false;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(host, NULL, &hints, &res) != 0) return false; /* unknown now: IPv4, as before */
    bool v4 = false, v6 = false;
    for (const struct addrinfo *i = res; i; i = i->ai_next) {
        v4 |= i->ai_family == AF_INET;
        v6 |= i->ai_family == AF_INET6;
    }
    freeaddrinfo(res);
    return v6 && !v4;
}

/* Shortest of %.15g..%.17g that reads back as exactly v. */
void ps_fmt_double(double v, char *buf, size_t n)
{
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) return;
    }
}

/* A double-quoted YAML scalar that reads back byte for byte (for UTF-8 text). */
void ps_yaml_quoted(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': fputs("\\\"", f); break;
        case '\\': fputs("\\\\", f); break;
        case '\n': fputs("\\n", f); break;
        case '\t': fputs("\\t", f); break;
        case '\r': fputs("\\r", f); break;
        default:
            if (*p < 0x20 || *p == 0x7f) {
                fprintf(f, "\\x%02x", *p);
            } else if (p[0] == 0xc2 && p[1] == 0x85) { /* NEL: a line break to YAML */
                fputs("\\N", f);
                p++;
            } else if (p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) { /* C1 controls: not allowed raw */
                fprintf(f, "\\x%02x", p[1]);
                p++;
            } else if (p[0] == 0xef && p[1] == 0xbf && (p[2] == 0xbe || p[2] == 0xbf)) { /* non-characters */
                fputs(p[2] == 0xbe ? "\\uFFFE" : "\\uFFFF", f);
                p += 2;
            } else if (p[0] == 0xe2 && p[1] == 0x80 && (p[2] == 0xa8 || p[2] == 0xa9)) { /* LS, PS */
                fputs(p[2] == 0xa8 ? "\\L" : "\\P", f);
                p += 2;
            } else {
                fputc(*p, f);
            }
        }
    }
    fputc('"', f);
}

/* Strict text to number (ps_util.h). */

/* Strict base-10 integer: the whole text, no surrounding space.
 * 0, -1 not an integer, -2 out of int64 range. */
int ps_parse_i64(const char *s, int64_t *out)
{
    if (*s == '\0' || isspace((unsigned char)*s)) return -1;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0') return -1;
    if (errno == ERANGE) return -2;
    *out = (int64_t)v;
    return 0;
}

int ps_parse_u64(const char *s, uint64_t *out)
{
    /* strtoull accepts "-1" and wraps it. */
    if (*s == '\0' || isspace((unsigned char)*s) || *s == '-') return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || *end != '\0') return -1;
    if (errno == ERANGE) return -2;
    *out = (uint64_t)v;
    return 0;
}

/* Finite double, whole text. Underflow to a denormal or zero is accepted so
 * that anything ps_fmt_double writes reads back. */
int ps_parse_double(const char *s, double *out)
{
    if (*s == '\0' || isspace((unsigned char)*s)) return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0') return -1;
    if (!isfinite(v)) return -2;
    *out = v;
    return 0;
}
