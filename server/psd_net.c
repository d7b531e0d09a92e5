/* psd_net.c - psd's sockets (see psd_net.h). */
#include "psd_net.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <zmq.h>

#include "ps_log.h"
#include "ps_tcp.h"
#include "ps_auth.h"
#include "ps_util.h"
#include "ps_wire.h"
#include "psd_lock.h"
#include "psd_opts.h"
#include "psd_zap.h"

#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93 /* a DRAFT option of libzmq 4.3, built into Debian's */
#endif

int psd_io_threads(const ps_config_t *c)
{
    /* ZeroMQ's I/O threads receive and send the tensors: with several workers
     * pushing at once one thread is the bottleneck (2 workers over tcp: 3.0
     * GB/s with 1, 3.5 with 2 on a 2-core VM) */
    return c->io_threads > 0 ? c->io_threads : psd_io_threads_for(ps_cpus_usable(NULL, NULL));
}

int psd_io_threads_for(int cores) { return cores < 2 ? 1 : cores / 4 > 4 ? 4 : cores / 4 < 2 ? 2 : cores / 4; }

void *psd_zmq_context(const ps_config_t *c)
{
    void *ctx = zmq_ctx_new();
    int io = psd_io_threads(c);
    if (ctx && zmq_ctx_set(ctx, ZMQ_IO_THREADS, io) != 0)
        PS_WARN("zeromq: cannot use %d I/O threads: %s", io, zmq_strerror(zmq_errno()));
    return ctx;
}

double psd_transfer_s(size_t n_params)
{
    double s = 4.0 * (double)n_params / 40e6;
    return s < 57.0 ? s : 57.0;
}

double psd_silence_limit(const ps_config_t *c, size_t n_params)
{
    return c->worker_timeout + 2.0 * psd_transfer_s(n_params);
}

/* psd's ROUTER socket on `listen`: CURVE with the allow-list (failing
 * closed) when there is a key, else the loopback rule; socket options; bind.
 * allow_self: also let in psd's own key (psd shards). 0, or the exit code
 * (logged). */
int psd_router_open(void *zctx, const ps_config_t *c, const char *listen, int no_zap, size_t n_params, bool allow_self,
                    bool watch_closed, psd_locks_t *locks, void **sockp, psd_zap_t **zapp, void **monp)
{
    char why[400];
    int mon_events = watch_closed ? ZMQ_EVENT_DISCONNECTED : 0;
    *sockp = NULL;
    if (ps_endpoint_bindable(listen, why, sizeof why) != 0) { /* before keys: the first thing to fix */
        PS_ERROR("cannot listen on %s", why);
        return PSD_EXIT_USAGE;
    }
    *sockp = zctx ? zmq_socket(zctx, ZMQ_ROUTER) : NULL;
    if (!*sockp) {
        PS_ERROR("zeromq: %s", zmq_strerror(zmq_errno()));
        return PSD_EXIT_ERROR;
    }
    /* authentication: CURVE with an allow-list, failing closed */
    if (c->key_file[0]) {
        char err[512];
        ps_keypair_t kp;
        if (!c->allow_dir[0]) {
            PS_ERROR("server.key is set but server.allow is not: give the directory of allowed worker keys (--allow DIR)");
            return PSD_EXIT_USAGE;
        }
        if (ps_auth_load_secret(c->key_file, &kp, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            return PSD_EXIT_USAGE;
        }
        if (!no_zap) {
            *zapp = psd_zap_start(zctx, c->allow_dir, err, sizeof err);
            if (*zapp && allow_self) psd_zap_allow_self(*zapp, kp.public_z85);
            if (!*zapp) {
                PS_ERROR("%s", err);
                memset(&kp, 0, sizeof kp);
                return PSD_EXIT_USAGE;
            }
        }
        int on = 1;
        zmq_setsockopt(*sockp, ZMQ_CURVE_SERVER, &on, sizeof on);
        zmq_setsockopt(*sockp, ZMQ_CURVE_SECRETKEY, kp.secret_z85, 40);
        zmq_setsockopt(*sockp, ZMQ_ZAP_DOMAIN, "psd", 3);
        /* no handler (or a crashed one) means nobody gets in */
        int enforce = zmq_setsockopt(*sockp, ZMQ_ZAP_ENFORCE_DOMAIN, &on, sizeof on);
        memset(&kp, 0, sizeof kp);
        /* handshakes that fail before the ZAP handler sees them (a client
         * without encryption, or with the wrong server key) are logged too */
        mon_events |= ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;
        if (enforce != 0) { /* fail closed: without it a missing handler would let everyone in */
            PS_ERROR("this libzmq cannot enforce authentication (ZMQ_ZAP_ENFORCE_DOMAIN: %s); refusing to run",
                     zmq_strerror(zmq_errno()));
            return PSD_EXIT_ERROR;
        }
    } else if (!ps_endpoint_is_loopback(listen)) {
        if (!c->insecure) {
            PS_ERROR("refusing to listen on %s without authentication. Make keys: `psd keygen server` and, per "
                     "worker host, `psd keygen worker1`; put worker1.pub in a directory DIR; run `psd --key "
                     "server.key --allow DIR` and `pworker --key worker1.key --server-key server.pub`. Or listen "
                     "on loopback (--listen tcp://127.0.0.1:PORT), or pass --insecure on a network you trust",
                     listen);
            return PSD_EXIT_USAGE;
        }
        PS_WARN("*** --insecure: listening on %s WITHOUT AUTHENTICATION: anyone who can reach this port can "
                "read the model or change it with one push ***",
                listen);
    }
    /* ZeroMQ's heartbeat counts only whole messages as traffic (libzmq issue
     * 2709): a peer whose PONG waits behind a message of the whole model
     * must not be taken for dead while it goes. 3 s, plus the model's
     * transfer time (a 1.28 GB model: 32 s), at most 60 s; the peer's TTL
     * twice that, at most 65 s (ZMTP carries it in deciseconds, 16 bits). */
    int one = 1, linger = 1000, hwm = 1000, ivl = 1000, tmo = (int)(3000 + 1000 * psd_transfer_s(n_params)),
        ttl = 2 * tmo < 65000 ? 2 * tmo : 65000;
    zmq_setsockopt(*sockp, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(*sockp, ZMQ_ROUTER_HANDOVER, &one, sizeof one); /* a worker reconnecting keeps its id */
    zmq_setsockopt(*sockp, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(*sockp, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(*sockp, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(*sockp, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(*sockp, ZMQ_HEARTBEAT_TIMEOUT, &tmo, sizeof tmo);
    zmq_setsockopt(*sockp, ZMQ_HEARTBEAT_TTL, &ttl, sizeof ttl);
    /* a message larger than the biggest legitimate one disconnects its sender */
    int64_t maxmsg = (int64_t)(4 * n_params + (size_t)(4 << 20));
    if (c->kind == PS_MODEL_CTR) maxmsg += 4 * c->ctr_test; /* a VAL_RESULT's scores */
    zmq_setsockopt(*sockp, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    ps_zmq_endpoint_opts(*sockp, listen);
    if (mon_events) *monp = ps_zmq_monitor(zctx, *sockp, "inproc://psd-monitor", mon_events);
    /* ZeroMQ would take over an ipc:// path another psd listens on (it
     * removes the socket file): refused as tcp's "address in use" is */
    char lerr[PS_PATH_MAX + 400];
    if (strncmp(listen, "ipc://", 6) == 0 && psd_lock_beside(locks, listen + 6, lerr, sizeof lerr) != 0) {
        PS_ERROR("cannot listen on '%s': %s", listen, lerr);
        return PSD_EXIT_USAGE;
    }
    if (zmq_bind(*sockp, listen) != 0) {
        PS_ERROR("cannot listen on '%s': %s", listen, zmq_strerror(zmq_errno()));
        return PSD_EXIT_USAGE;
    }
    return 0;
}

void psd_router_monitor(void *mon, uint64_t *refused, void (*on_closed)(void *arg, int fd), void *arg)
{
    uint16_t event;
    uint32_t value;
    while (ps_zmq_monitor_event(mon, &event, &value) == 0) {
        if (event == ZMQ_EVENT_DISCONNECTED) {
            if (on_closed) on_closed(arg, (int)value);
            continue;
        }
        ++*refused;
        if (*refused <= 20 || *refused % 1000 == 0)
            PS_WARN("refused a connection: %s handshake failed (code 0x%x): a client without encryption, or "
                    "with the wrong server key%s",
                    event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? "CURVE" : "the", value,
                    *refused == 20 ? " (further ones logged every 1000th)" : "");
    }
}

