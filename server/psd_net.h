/* psd_net.h - psd's sockets, for shard 0 (psd_server.c) and the other
 * psd shards (psd_shard.c) alike: the ZeroMQ context and its I/O threads,
 * the ROUTER workers and shards connect to (authentication, options, the
 * lock on an ipc:// path, bind), its monitor, and how long a peer may be
 * silent. The caller owns what it opens. */
#ifndef PSD_NET_H
#define PSD_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ps_config.h"

/* ZeroMQ I/O threads: server.io_threads, or 1 on one usable CPU, 2, and
 * usable/4 up to 4 from 12 on. */
int psd_io_threads(const ps_config_t *c);
/* The I/O threads for `cores` usable CPUs (server.io_threads: 0). */
int psd_io_threads_for(int cores);
/* A ZeroMQ context with psd_io_threads I/O threads. NULL if it cannot be
 * made. */
void *psd_zmq_context(const ps_config_t *c);

/* Seconds a message of the whole model (n_params floats) may take on the
 * wire: its bytes at 40 MB/s, at most 57 s. ZeroMQ hands a message over only
 * whole (and counts only whole messages in its heartbeats, libzmq issue
 * 2709), so a peer is silent while one of that size is on its way. */
double psd_transfer_s(size_t n_params);
/* The silence after which a peer psd waits for is lost: worker_timeout, plus
 * a model-sized message each way (a reply that is still arriving, then a
 * push on its way back). */
double psd_silence_limit(const ps_config_t *c, size_t n_params);

struct psd_zap;
struct psd_locks;
/* psd's ROUTER socket on `listen`: CURVE with the allow-list (failing
 * closed) when the config has a key, else the loopback rule; options; bind.
 * allow_self: also let in psd's own key (shards connect with it).
 * *monp: a PAIR with the socket's events (psd_router_monitor), when there
 * are any to watch: failed handshakes (with a key), closed connections
 * (watch_closed). An ipc:// path is locked first (its <path>.lock, into
 * locks): a second psd on it is refused. 0, or the exit code (logged);
 * *sockp, *zapp, *monp are the caller's to close. */
int psd_router_open(void *zctx, const ps_config_t *c, const char *listen, int no_zap, size_t n_params, bool allow_self,
                    bool watch_closed, struct psd_locks *locks, void **sockp, struct psd_zap **zapp, void **monp);
/* Read the events waiting on mon (psd_router_open's *monp, or a monitor of
 * another socket with these events): each refused
 * handshake counts in *refused and is logged (the first 20, then every
 * 1000th; libzmq 4.3 does not say which peer: the ZAP handler logs address
 * and key of those it sees); each closed connection's fd goes to on_closed
 * (may be NULL). */
void psd_router_monitor(void *mon, uint64_t *refused, void (*on_closed)(void *arg, int fd), void *arg);

#endif
