/* psw_client.c - worker side of the psd protocol (see include/psworker.h). */
#include "psworker.h"

#include <math.h>

#include "psw_client_int.h"
#include "ps_table.h"
#include "ps_data.h"


_Static_assert(PS_MAX_TENSORS <= 64, "a push's units fit a 64-bit mask");
_Static_assert(PSW_MAX_TENSORS == PS_MAX_TABLE && PSW_NAME_MAX == PS_NAME_MAX && PSW_MAX_DIMS == PS_MAX_DIMS,
               "the public table is the layout's");

static void shm_unmap(psw_client_t *c)
{
    if (c->shm_grad) munmap(c->shm_grad, c->layout.n_params * sizeof(float));
    if (c->shm_w) munmap((void *)c->shm_w, c->shm_w_bytes);
    c->shm_grad = NULL;
    c->shm_w = NULL;
    c->shm = 0;
}

/* Trade a sealed gradient memfd for psd's parameter slots over psd's unix
 * socket `name`. 0, or -errno with why (the caller then uses the wire). */
static int shm_connect(psw_client_t *c, const char *name, const uint8_t *token, char *why, size_t n)
{
    size_t gbytes = c->layout.n_params * sizeof(float);
    int mfd = ps_shm_memfd("psw-grad", gbytes, 1), sock = -1, rfd = -1, rc;
    if (mfd < 0) {
        snprintf(why, n, "memfd: %s", strerror(-mfd));
        return mfd;
    }
    void *g = mmap(NULL, gbytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
    if (g == MAP_FAILED) {
        rc = -errno;
        snprintf(why, n, "mmap: %s", strerror(errno));
        goto out;
    }
    c->shm_grad = g;
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    struct timeval tv = {5, 0};
    sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0 || setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv) != 0 ||
        setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0 ||
        connect(sock, (struct sockaddr *)&a, alen) != 0) {
        rc = -errno;
        snprintf(why, n, "cannot reach psd's socket @%s: %s", name, strerror(errno));
        goto out;
    }
    ps_shm_hello_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, PS_SHM_MAGIC, sizeof h.magic);
    h.run_id = c->run_id;
    h.rank = c->rank;
    memcpy(h.token, token, PS_SHM_TOKEN);
    h.grad_bytes = gbytes;
    ps_shm_reply_t r;
    if ((rc = ps_shm_send(sock, &h, sizeof h, mfd)) != 0 || (rc = ps_shm_recv(sock, &r, sizeof r, &rfd, 0)) != 0) {
        snprintf(why, n, "exchange with psd failed: %s", strerror(-rc));
        goto out;
    }
    r.message[sizeof r.message - 1] = '\0';
    if (memcmp(r.magic, PS_SHM_MAGIC, sizeof r.magic) != 0 || r.status != 0 || rfd < 0) {
        rc = r.status ? r.status : -EBADMSG;
        snprintf(why, n, "psd refused: %s", r.message[0] ? r.message : "(no reason)");
        goto out;
    }
    struct stat st;
    if (r.slots < 1 || r.slots > 64 || r.slot_bytes % sizeof(float) || r.slot_bytes < gbytes ||
        r.slot_bytes > ((uint64_t)1 << 40) || fstat(rfd, &st) != 0 ||
        (uint64_t)st.st_size < r.slots * r.slot_bytes) {
        rc = -EBADMSG;
        snprintf(why, n, "psd's parameter region does not fit the model");
        goto out;
    }
    c->shm_w_bytes = r.slots * r.slot_bytes;
    void *w = mmap(NULL, c->shm_w_bytes, PROT_READ, MAP_SHARED, rfd, 0);
    if (w == MAP_FAILED) {
        rc = -errno;
        snprintf(why, n, "mmap of psd's parameters: %s", strerror(errno));
        goto out;
    }
    c->shm_w = w;
    c->slots = r.slots;
    c->slot_floats = r.slot_bytes / sizeof(float);
    c->shm = 1;
    rc = 0;
out:
    if (rc != 0) shm_unmap(c);
    if (rfd >= 0) close(rfd);
    if (sock >= 0) close(sock);
    close(mfd);
    return rc;
}

void pswc_push_frame_done(void *data, void *hint)
{
    (void)data;
    psw_client_t *c = hint;
    if (atomic_fetch_sub_explicit(&c->push_inflight, 1, memory_order_acq_rel) == 1) { /* the last: wake a waiter */
        pthread_mutex_lock(&c->push_mu);
        pthread_cond_broadcast(&c->push_cv);
        pthread_mutex_unlock(&c->push_mu);
    }
}

psw_client_t *psw_client_new(const char *endpoint, const psw_info_t *info, char *err, size_t errlen)
{
    psw_client_t *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&c->push_mu, NULL);
    pthread_cond_init(&c->push_cv, &ca);
    pthread_condattr_destroy(&ca);
    pswc_fork_add(c);
    c->info = *info;
    c->sh.n = 1;
    c->ops = &pswc_one_ops;
    c->protocol = info->protocol ? info->protocol : PS_PROTOCOL_VERSION;
    c->run_id = info->run_id;
    c->prev_rank = info->run_id ? (int32_t)info->prev_rank : -1;
    snprintf(c->endpoint, sizeof c->endpoint, "%s", endpoint);
    c->ctx = zmq_ctx_new();
    if (!c->ctx) goto zfail;
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    if (!c->sock) goto zfail;
    /* tmo: how long after a PING a connection may stay without a whole
     * message from psd. Long, since one may be the whole model (ZeroMQ counts
     * only whole messages: libzmq issue 2709); a psd that falls silent is
     * still noticed within the TTL psd sets in its PINGs (6 s for a model of
     * a few MB, longer for larger ones: psd_router_open). ttl, psd's
     * timeout of this connection when it hears nothing: long too, for the
     * same reason; psd's own PING timeout (sized for the model) is the
     * short one */
    int linger = 2000, ivl = 1000, tmo = 60000, ttl = 65000, zero = 0;
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TIMEOUT, &tmo, sizeof tmo);
    zmq_setsockopt(c->sock, ZMQ_HEARTBEAT_TTL, &ttl, sizeof ttl);
    /* no send/receive queue limit: at most a few messages are ever in flight */
    zmq_setsockopt(c->sock, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(c->sock, ZMQ_RCVHWM, &zero, sizeof zero);
    /* a stable identity: psd recognises a worker whose connection was reset */
    if (info->identity_len > 0)
        zmq_setsockopt(c->sock, ZMQ_ROUTING_ID, info->identity, info->identity_len);
    if (info->curve_server) { /* CurveZMQ: encrypted, and psd checks our key */
        if (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, info->curve_server, 40) != 0 ||
            zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, info->curve_public, 40) != 0 ||
            zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, info->curve_secret, 40) != 0) {
            snprintf(err, errlen, "cannot set up CURVE: %s", zmq_strerror(zmq_errno()));
            goto fail;
        }
    }
    /* learn at once when the connection to psd drops (psd killed), or when
     * psd refuses us (authentication) */
    char mon_ep[64];
    snprintf(mon_ep, sizeof mon_ep, "inproc://psw-monitor-%p", (void *)c);
    c->mon = ps_zmq_monitor(c->ctx, c->sock, mon_ep,
                            ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                                ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL);
    ps_zmq_endpoint_opts(c->sock, endpoint);
    if (zmq_connect(c->sock, endpoint) != 0) {
        snprintf(err, errlen, "cannot connect to '%s': %s", endpoint, zmq_strerror(zmq_errno()));
        goto fail;
    }
    return c;
zfail:
    snprintf(err, errlen, "zeromq: %s", zmq_strerror(zmq_errno()));
fail:
    psw_client_destroy(&c);
    return NULL;
}

/* Let go of the streamed tensors held. */
void pswc_stream_release(psw_client_t *c)
{
    for (int t = 0; t < PS_MAX_TENSORS; t++)
        if (c->smask & (1ull << t)) zmq_msg_close(&c->sheld[t]);
    c->smask = 0;
    c->sdone = 0;
    c->sver = 0;
}

/* The table's tensors for the caller, and the push's packing state */
static void table_free(psw_client_t *c)
{
    free(c->tab);
    free(c->ev_t);
    free(c->ev_n);
    free(c->pack);
    free(c->pk_src);
    free(c->pk_in);
    c->tab = NULL;
    c->ev_t = NULL;
    c->ev_n = NULL;
    c->pack = NULL;
    c->pk_src = NULL;
    c->pk_in = NULL;
    memset(c->pk_have, 0, sizeof c->pk_have);
}

/* Made for c->layout's table: 0 or -ENOMEM. */
static int table_make(psw_client_t *c)
{
    const ps_layout_t *l = &c->layout;
    const size_t nt = (size_t)ps_layout_ntab(l);
    table_free(c);
    c->tab = calloc(nt, sizeof *c->tab);
    c->ev_t = calloc(nt, sizeof *c->ev_t);
    c->ev_n = calloc(nt, sizeof *c->ev_n);
    if (l->tab) { /* units pack several: their gradients are put together (or sent from the caller's, when in one piece) */
        c->pack = calloc(l->n_params ? l->n_params : 1, sizeof *c->pack);
        c->pk_src = calloc(nt, sizeof *c->pk_src);
        c->pk_in = calloc(nt, 1);
    }
    if (!c->tab || !c->ev_t || !c->ev_n || (l->tab && (!c->pack || !c->pk_src || !c->pk_in))) {
        table_free(c);
        return -ENOMEM;
    }
    for (size_t k = 0; k < nt; k++) {
        const ps_tensor_info_t *ti = ps_layout_tensor(l, (int)k);
        psw_tensor_t *o = &c->tab[k];
        memcpy(o->name, ti->name, sizeof o->name);
        o->ndim = ti->ndim;
        memcpy(o->shape, ti->shape, sizeof o->shape);
        o->numel = ti->numel;
        o->sparse_rows = ti->kind == PS_TENSOR_ROWS;
        o->offset = ti->offset;
    }
    return 0;
}

int psw_client_offer_config(psw_client_t *c, const char *yaml, char *err, size_t errlen)
{
    char *copy = NULL;
    if (yaml && yaml[0]) {
        if (strlen(yaml) > PSW_OFFER_CONFIG_MAX) {
            snprintf(err, errlen, "the optimizer offered: %zu bytes of YAML, at most %d", strlen(yaml),
                     PSW_OFFER_CONFIG_MAX);
            return -1;
        }
        if (!(copy = strdup(yaml))) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
    }
    free(c->offer_config);
    c->offer_config = copy;
    return 0;
}

void psw_client_destroy(psw_client_t **cp)
{
    psw_client_t *c = *cp;
    if (!c) return;
    pswc_fork_remove(c); /* before its sockets close: their fds may then be anything's */
    ps_msg_deinit(&c->cur);
    pswc_room_free(c);
    c->ops->close(c);
    shm_unmap(c);
    pswc_stream_release(c);
    free(c->offer_config);
    pthread_cond_destroy(&c->push_cv);
    pthread_mutex_destroy(&c->push_mu);
    free(c->gconv);
    free(c->wconv);
    free(c->w16);
    free(c->want);
    free(c->val_ids);
    free(c->replica);
    table_free(c);
    ps_layout_free(&c->layout);
    if (c->sock) ps_msg_drain(c->sock, 0.05, 0.3); /* weights psd sent before we left */
    ps_zmq_close_monitored(c->sock, c->mon);
    if (c->ctx) zmq_ctx_term(c->ctx);
    free(c);
    *cp = NULL;
}

uint64_t psw_client_run_id(const psw_client_t *c) { return c->run_id; }

int psw_client_shutdown_code(const psw_client_t *c) { return c->shutdown_code; }

/* Read pending socket events (each connection's fd noted for forked
 * children: psw_fork.c); -ECONNRESET once an established connection to psd
 * dropped. A result found before (mon_rc) first. */
static int check_monitor(psw_client_t *c)
{
    uint16_t event;
    uint32_t value;
    int rc = c->mon_rc;
    c->mon_rc = 0;
    if (rc != 0) return rc;
    while (ps_zmq_monitor_event(c->mon, &event, &value) == 0) {
        pswc_fork_event(c, 0, event, value);
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) c->connected = 1;
        if (event == ZMQ_EVENT_DISCONNECTED && c->connected) return -ECONNRESET;
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH || event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
            (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && c->info.curve_server))
            return -EACCES;
        /* a client without keys at a psd with keys only ever sees its
         * handshakes fail without detail (libzmq 4.3): a few in a row, and
         * none ever succeeded, is that refusal. A proxy or tunnel that
         * accepts and closes because nothing listens behind it yet looks the
         * same: the message names both. */
        if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL && !c->connected && ++c->hs_failed >= 3) return -EACCES;
    }
    return 0;
}

uint32_t psw_client_rank(const psw_client_t *c) { return c->rank; }

void pswc_header_init(psw_client_t *c, Psd__Header *h, Psd__MsgType type)
{
    psd__header__init(h);
    h->run_id = c->run_id;
    h->type = type;
    h->rank = c->rank;
    h->seq = ++c->seq;
}

/* A tensor frame's second dimension: the table's cols, 0 for a vector. */
uint64_t pswc_tcols(const psw_client_t *c, int t) { return c->layout.t[t].ndim >= 2 ? c->layout.t[t].cols : 0; }

/* Send with the (possibly overridden) protocol number. */
static int send_msg(psw_client_t *c, Psd__Header *h, const ps_frame_t *frames, int n)
{
    if (c->room.pending && h->type != PSD__MSG_TYPE__MSG_HEARTBEAT) { /* the push announced goes first */
        if (h->type == PSD__MSG_TYPE__MSG_LEAVE || h->type == PSD__MSG_TYPE__MSG_ERROR) {
            pswc_room_drop(c);
        } else {
            char err[256];
            int rc = pswc_room_settle(c, c->room.timeout_s, err, sizeof err);
            if (rc < 0) {
                PS_ERROR("%s", err);
                return rc;
            }
            h->seq = ++c->seq; /* after the push's */
        }
    }
    if (c->protocol == PS_PROTOCOL_VERSION) return ps_msg_send(c->sock, NULL, 0, h, frames, n);
    /* test path: pack by hand with the other protocol number */
    h->protocol = c->protocol;
    size_t len = psd__header__get_packed_size(h);
    uint8_t *buf = malloc(len);
    if (!buf) return -ENOMEM;
    psd__header__pack(h, buf);
    int rc = zmq_send(c->sock, buf, len, 0) < 0 ? -zmq_errno() : 0;
    free(buf);
    (void)frames;
    (void)n;
    return rc;
}

static int send_hdr(psw_client_t *c, Psd__Header *h) { return send_msg(c, h, NULL, 0); }

/* Wait for one well-formed message from psd until `deadline` (ps_now()
 * time): the caller's wait of timeout_s, which messages it drops do not
 * prolong. */
int pswc_recv_msg(psw_client_t *c, double deadline, double timeout_s, char *err, size_t errlen)
{
    ps_msg_deinit(&c->cur);
    for (;;) {
        double left = deadline - ps_now();
        if (left <= 0) {
            snprintf(err, errlen, "psd at %s sent nothing for %.0f s", c->endpoint, timeout_s);
            return -ETIMEDOUT;
        }
        /* psd (shard 0), its monitor, the other shards */
        zmq_pollitem_t it[2 + PS_MAX_SHARDS] = {{c->sock, 0, ZMQ_POLLIN, 0}, {c->mon, 0, ZMQ_POLLIN, 0}};
        int ni = c->mon ? 2 : 1, s0 = ni;
        ni = c->ops->poll_add(c, it, ni);
        /* an hour at most per poll: an infinite timeout (psd's server.start_timeout: .inf)
         * waits for ever without overflowing the conversion; none with a
         * monitor result waiting */
        int n = zmq_poll(it, ni, c->mon_rc ? 0 : left < 3600 ? (long)(left * 1000) + 1 : 3600000L);
        if (n < 0) {
            if (zmq_errno() == EINTR) {
                snprintf(err, errlen, "interrupted");
                return -EINTR;
            }
            snprintf(err, errlen, "zeromq: %s", zmq_strerror(zmq_errno()));
            return -zmq_errno();
        }
        c->from = 0;
        if (!(it[0].revents & ZMQ_POLLIN)) { /* a shard's message */
            int rc = c->ops->recv_polled(c, it + s0, err, errlen);
            if (rc == PSWC_AGAIN) continue;
            if (rc != PSWC_NONE) return rc == PSWC_GOT ? 0 : rc;
        }
        const bool mon_in = c->mon && ((it[1].revents & ZMQ_POLLIN) || c->mon_rc);
        if (!(it[0].revents & ZMQ_POLLIN) && !mon_in) continue; /* nothing read */
        /* messages first: psd's last words (SHUTDOWN) arrive before its
         * connection closes */
        if (!(it[0].revents & ZMQ_POLLIN)) {
            int mrc = mon_in ? check_monitor(c) : 0;
            if (mrc == -EACCES) {
                if (c->info.curve_server)
                    snprintf(err, errlen, "psd at %s refused this worker: authentication failed (is this worker's "
                             "public key in psd's allow-list, and --server-key psd's public key?)", c->endpoint);
                else
                    snprintf(err, errlen, "psd at %s refused this worker: authentication failed (psd uses keys: give "
                             "this worker --key and --server-key; or that address is a proxy or tunnel with no "
                             "psd behind it yet: ZeroMQ cannot tell the two apart)", c->endpoint);
                return -EACCES;
            }
            if (mrc == -ECONNRESET) {
                int events = 0;
                size_t elen = sizeof events;
                zmq_getsockopt(c->sock, ZMQ_EVENTS, &events, &elen);
                if (!(events & ZMQ_POLLIN)) {
                    snprintf(err, errlen, "lost the connection to psd at %s", c->endpoint);
                    return -ECONNRESET;
                }
            } else {
                continue;
            }
        }
        char why[256];
        int rc = ps_msg_recv(c->sock, &c->cur, false, ZMQ_DONTWAIT, why, sizeof why);
        if (rc == -EAGAIN) continue;
        if (rc == -EPROTO) {
            PS_WARN("dropped a malformed message from psd: %s", why);
            continue;
        }
        if (rc < 0) {
            snprintf(err, errlen, "zeromq: %s", zmq_strerror(-rc));
            return rc;
        }
        Psd__Header *h = c->cur.hdr;
        if (h->protocol != c->protocol) {
            snprintf(err, errlen, "psd at %s speaks protocol %u, this worker %u", c->endpoint,
                     h->protocol, c->protocol);
            return -EPROTO;
        }
        if (h->type == PSD__MSG_TYPE__MSG_ERROR) {
            snprintf(err, errlen, "psd refused: %s",
                     h->error->message && h->error->message[0] ? h->error->message : "(no reason)");
            /* declared lost: register again to rejoin */
            return h->error->code == PSD__ERR_CODE__ERR_LOST ? -ENOLINK : -EPROTO;
        }
        if (c->run_id && h->run_id != c->run_id) {
            PS_WARN("dropped a message of run %016llx (this run is %016llx)",
                    (unsigned long long)h->run_id, (unsigned long long)c->run_id);
            continue;
        }
        ps_tcp_cc_conn(&c->tcp_fd[0], c->cur.srcfd, c->tcp_cc, false);
        /* a connection not noted yet (the first message on it, the
         * assignment): its CONNECTED came before it, read now so that a
         * child forked from here on closes it; what else the monitor says
         * waits for the next call */
        if (c->mon && !c->mon_rc && c->cur.srcfd >= 0 && c->cur.srcfd != c->conn[0].fd) c->mon_rc = check_monitor(c);
        return 0;
    }
}

static int offer_specs(const psw_client_t *c, ps_tensor_spec_t *sp, ps_layout_t *l, uint8_t **tb, size_t *tlen,
                       char *why, size_t why_len, char *err, size_t errlen);

/* The model info.offer describes, laid out (l owns: ps_layout_free) and packed. 0, or -1 (why). */
static int offer_table(const psw_client_t *c, ps_layout_t *l, uint8_t **tb, size_t *tlen, char *err, size_t errlen)
{
    char why[400];
    if (c->info.n_offer > PS_MAX_TABLE || !c->info.offer || !c->info.offer_values) {
        snprintf(err, errlen, "the model offered: %d tensors (1 to %d), with their values", c->info.n_offer,
                 PS_MAX_TABLE);
        return -1;
    }
    ps_tensor_spec_t *sp = calloc((size_t)c->info.n_offer, sizeof *sp);
    if (!sp) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    int rc = offer_specs(c, sp, l, tb, tlen, why, sizeof why, err, errlen);
    free(sp);
    return rc;
}

/* offer_table's work, into sp (n_offer of them) */
static int offer_specs(const psw_client_t *c, ps_tensor_spec_t *sp, ps_layout_t *l, uint8_t **tb, size_t *tlen,
                       char *why, size_t why_len, char *err, size_t errlen)
{
    for (int t = 0; t < c->info.n_offer; t++) {
        const psw_tensor_t *o = &c->info.offer[t];
        memcpy(sp[t].name, o->name, sizeof sp[t].name);
        sp[t].name[PS_NAME_MAX] = '\0';
        sp[t].ndim = o->ndim;
        if (o->ndim >= 0 && o->ndim <= PS_MAX_DIMS) memcpy(sp[t].shape, o->shape, (size_t)o->ndim * sizeof *o->shape);
        sp[t].kind = o->sparse_rows ? PS_TENSOR_ROWS : PS_TENSOR_DENSE;
        if (!c->info.offer_values[t]) {
            snprintf(err, errlen, "the model offered: tensor %s has no values", sp[t].name);
            return -1;
        }
    }
    if (ps_layout_init_specs(l, sp, c->info.n_offer, why, why_len) != 0) {
        snprintf(err, errlen, "the model offered: %s", why);
        return -1;
    }
    if (ps_table_pack(l, tb, tlen) != 0) {
        ps_layout_free(l);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

/* VALUES: each unit of the offered model whole, in order (copied; a
 * packed unit's tensors put together first). */
static int send_values(psw_client_t *c, const ps_layout_t *l)
{
    Psd__Header h;
    Psd__Values v = PSD__VALUES__INIT;
    ps_frame_t fr[PS_MAX_TENSORS];
    float *packed = l->tab ? malloc((l->n_params ? l->n_params : 1) * sizeof *packed) : NULL;
    if (l->tab && !packed) return -ENOMEM;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_VALUES);
    h.body_case = PSD__HEADER__BODY_VALUES;
    h.values = &v;
    for (int k = 0; packed && k < l->n_tab; k++)
        memcpy(packed + l->tab[k].offset, c->info.offer_values[k], l->tab[k].numel * sizeof *packed);
    for (int u = 0; u < l->n_tensors; u++) {
        const float *src = packed ? packed + l->t[u].offset : c->info.offer_values[u];
        fr[u] = (ps_frame_t){.data = src, .nbytes = l->t[u].numel * sizeof(float), .id = (uint32_t)u,
                             .dtype = PSD__DTYPE__DT_F32, .rows = l->t[u].numel, .copy = true};
    }
    PS_INFO("psd asked for this worker's model: sending its %d tensors (%zu parameters)", ps_layout_ntab(l),
            ps_layout_numel(l));
    int rc = send_msg(c, &h, fr, l->n_tensors);
    free(packed);
    return rc;
}

/* Send REGISTER (with this worker's own model's table when it offers one, its
 * values when psd asks for them) and wait for the ASSIGN: 0 with it in
 * c->cur, or an error (err says why; -ESHUTDOWN: psd ended the run). */
static int register_and_wait(psw_client_t *c, double timeout_s, char *err, size_t errlen)
{
    char host[256], hostid[256];
    ps_hostname(host, sizeof host);
    ps_host_id(hostid, sizeof hostid);
    Psd__Header h;
    Psd__Register r = PSD__REGISTER__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_REGISTER);
    r.hostname = host;
    r.host_id = hostid;
    r.pid = (uint32_t)getpid();
    r.device = (char *)(c->info.device ? c->info.device : "cpu");
    r.device_index = c->info.device_index;
    r.identity_hint = (char *)(c->info.identity_hint ? c->info.identity_hint : "");
    r.version = PSD_VERSION;
    r.threads = c->info.threads;
    r.prev_rank = c->prev_rank;
    r.config = c->offer_config ? c->offer_config : (char *)"";
    h.body_case = PSD__HEADER__BODY_REG;
    h.reg = &r;
    /* this worker's own model, offered (model.kind from_worker: psd asks for its values with OFFER) */
    ps_layout_t offer = {0};
    uint8_t *tb = NULL;
    size_t tlen = 0;
    if (c->info.n_offer > 0 && offer_table(c, &offer, &tb, &tlen, err, errlen) != 0) return -EINVAL;
    ps_frame_t tf = {.data = tb, .nbytes = tlen, .dtype = PSD__DTYPE__DT_U8, .rows = tlen, .copy = true};
    int rc = send_msg(c, &h, tb ? &tf : NULL, tb ? 1 : 0);
    if (rc < 0) {
        free(tb);
        ps_layout_free(&offer);
        snprintf(err, errlen, "cannot send to psd: %s", zmq_strerror(-rc));
        return rc;
    }
    for (double deadline = ps_now() + timeout_s;;) {
        rc = pswc_recv_msg(c, deadline, timeout_s, err, errlen);
        if (rc < 0) {
            free(tb);
            ps_layout_free(&offer);
            return rc;
        }
        if (c->cur.hdr->type == PSD__MSG_TYPE__MSG_ASSIGN) break;
        if (c->cur.hdr->type == PSD__MSG_TYPE__MSG_OFFER && c->cur.hdr->offer && tb) {
            /* psd has no model yet: send ours (asked to), or wait a moment; then register again */
            if (c->cur.hdr->offer->send_values) rc = send_values(c, &offer);
            else usleep(200000);
            h.seq = ++c->seq; /* a new sequence number for the REGISTER sent again */
            if (rc == 0) rc = send_msg(c, &h, &tf, 1);
            if (rc < 0) {
                free(tb);
                ps_layout_free(&offer);
                snprintf(err, errlen, "cannot send to psd: %s", zmq_strerror(-rc));
                return rc;
            }
            continue;
        }
        if (c->cur.hdr->type == PSD__MSG_TYPE__MSG_HEARTBEAT) continue; /* for its last slot, sent before this */
        if (c->cur.hdr->type == PSD__MSG_TYPE__MSG_SHUTDOWN && c->cur.hdr->shutdown) {
            /* the run ended: psd told this worker's identity so (it had declared it lost) */
            const Psd__Shutdown *sd = c->cur.hdr->shutdown;
            snprintf(err, errlen, "psd ended the run: %s", sd->reason && sd->reason[0] ? sd->reason : "done");
            c->shutdown_code = sd->exit_code;
            return -ESHUTDOWN;
        }
        PS_WARN("dropped an unexpected %s before the assignment", ps_msg_type_name((int)c->cur.hdr->type));
    }
    free(tb);
    ps_layout_free(&offer);
    return 0;
}

/* The ASSIGN in c->cur, checked, into out (and the run id and rank into c). */
static int assign_read(psw_client_t *c, psw_assign_t *out, char *err, size_t errlen)
{
    Psd__Header *ah = c->cur.hdr;
    Psd__Assign *a = ah->assign;
    memset(out, 0, sizeof *out);
    if (c->run_id && ah->run_id != c->run_id) {
        snprintf(err, errlen, "psd at %s runs run %016llx, this worker belongs to run %016llx", c->endpoint,
                 (unsigned long long)ah->run_id, (unsigned long long)c->run_id);
        return -EPROTO;
    }
    const bool tensors = a->model && strcmp(a->model, "tensors") == 0;
    if (ah->run_id == 0 || (tensors ? a->n_layers != 0 || a->ctr : a->n_layers < 2 || a->n_layers > PSW_MAX_LAYERS + 1) ||
        !a->hyper || a->n_files != (a->ctr || tensors ? 0u : 4u) || a->hyper->batch_size == 0 ||
        a->hyper->val_batch_size == 0 || a->hyper->batch_size > PS_MAX_BATCH || a->hyper->val_batch_size > PS_MAX_BATCH ||
        !(a->hyper->norm_std > 0) || !(a->start_timeout_s > 0) || !(a->step_timeout_s > 0) ||
        c->cur.n_frames != 1 || ah->tensors[0]->dtype != PSD__DTYPE__DT_U8) {
        snprintf(err, errlen, "psd sent an invalid assignment");
        return -EPROTO;
    }
    c->run_id = ah->run_id;
    c->rank = a->rank;
    out->rank = a->rank;
    out->run_id = ah->run_id;
    out->model = tensors ? PSW_MODEL_TENSORS : a->ctr ? PSW_MODEL_CTR : PSW_MODEL_MLP;
    out->n_sizes = (int)a->n_layers;
    for (size_t i = 0; i < a->n_layers; i++) {
        if (a->layers[i] < 1 || a->layers[i] > (1u << 20)) {
            snprintf(err, errlen, "psd sent an invalid layer size");
            return -EPROTO;
        }
        out->sizes[i] = (int)a->layers[i];
    }
    out->n_files = (int)a->n_files;
    for (int i = 0; i < out->n_files; i++) {
        Psd__DataFile *f = a->files[i];
        snprintf(out->files[i].role, sizeof out->files[i].role, "%s", f->role ? f->role : "");
        if (!f->path || strlen(f->path) >= PSW_PATH_MAX) {
            snprintf(err, errlen, "psd sent an invalid data path");
            return -EPROTO;
        }
        snprintf(out->files[i].path, sizeof out->files[i].path, "%s", f->path);
        out->files[i].size = f->size;
        out->files[i].hash = f->hash;
    }
    out->batch_size = a->hyper->batch_size;
    out->val_batch_size = a->hyper->val_batch_size;
    out->norm_mean = a->hyper->norm_mean;
    out->norm_std = a->hyper->norm_std;
    out->train_limit = a->hyper->train_limit;
    out->epochs = a->hyper->epochs;
    out->seed = a->hyper->seed;
    out->sync = a->hyper->sync;
    out->staleness = a->hyper->staleness;
    out->sparse_threshold = a->hyper->sparse_threshold >= 0 && a->hyper->sparse_threshold <= 1 ? a->hyper->sparse_threshold : 0;
    if (out->sync > 2) {
        snprintf(err, errlen, "psd sent an unknown consistency mode %u", out->sync);
        return -EPROTO;
    }
    out->start_timeout_s = a->start_timeout_s;
    out->step_timeout_s = a->step_timeout_s;
    out->silence_s = a->silence_s;
    out->world = a->world;
    if (a->ctr) { /* model.kind ctr: checked as psd checks its config */
        Psd__CtrTask *t = a->ctr;
        out->ctr.fields = (int)t->fields;
        out->ctr.per_field = (int)t->per_field;
        out->ctr.dim = (int)t->dim;
        out->ctr.mean = t->mean;
        out->ctr.vocab = t->vocab;
        out->ctr.rows = t->rows;
        out->ctr.seed = t->seed;
        out->ctr.train = t->train;
        out->ctr.test = t->test;
        out->ctr.zipf = t->zipf;
        out->ctr.weight_std = t->weight_std;
        out->ctr.bias = t->bias;
        out->ctr.table_on_psd = t->table_on_psd;
        ps_ctr_t g = {.fields = (int)t->fields, .per_field = (int)t->per_field, .vocab = t->vocab, .zipf = t->zipf,
                      .rows = t->rows, .weight_std = t->weight_std, .bias = t->bias, .seed = t->seed};
        char why[128];
        if (t->fields > PS_CTR_MAX_IDS || t->per_field > PS_CTR_MAX_IDS || ps_ctr_check(&g, why, sizeof why) != 0 ||
            t->dim < 1 || t->dim > 4096 || t->fields * t->dim != a->layers[0] || a->layers[a->n_layers - 1] != 2 ||
            t->train < 1 || t->test < 1 || t->train > UINT32_MAX || t->test > UINT32_MAX - t->train) {
            snprintf(err, errlen, "psd sent an invalid ctr task");
            return -EPROTO;
        }
    }
    return 0;
}

/* After the assignment: the connections' congestion control, the tensor
 * table, shared memory, the psd shards, bfloat16 buffers, streamed pushes. */
static int assign_setup(psw_client_t *c, psw_assign_t *out, double timeout_s, char *err, size_t errlen)
{
    Psd__Assign *a = c->cur.hdr->assign;
    const bool tensors = a->model && strcmp(a->model, "tensors") == 0;
    /* this side of the connections sends the pushes: psd's setting, on them too */
    snprintf(c->tcp_cc, sizeof c->tcp_cc, "%s", a->tcp_congestion ? a->tcp_congestion : "");
    if (ps_tcp_cc_check(c->tcp_cc, err, errlen) != 0) {
        PS_WARN("%s: this worker's connections keep the kernel's congestion control", err);
        c->tcp_cc[0] = '\0';
    }
    memset(c->tcp_fd, 0, sizeof c->tcp_fd);
    ps_tcp_cc_conn(&c->tcp_fd[0], c->cur.srcfd, c->tcp_cc, false);
    shm_unmap(c);
    char why[400];
    ps_layout_t built;
    ps_layout_free(&c->layout); /* a registration before this one's */
    if (ps_table_unpack(zmq_msg_data(&c->cur.frames[0]), zmq_msg_size(&c->cur.frames[0]), &c->layout, why,
                        sizeof why) != 0) {
        snprintf(err, errlen, "psd sent an invalid tensor table: %s", why);
        return -EPROTO;
    }
    if (!tensors) { /* a built-in model: the table its sizes make, with them */
        if (ps_layout_init_table(&built, out->sizes, out->n_sizes, out->ctr.rows, out->ctr.dim) != 0 ||
            !ps_layout_same_table(&built, &c->layout, why, sizeof why)) {
            snprintf(err, errlen, "psd sent an invalid model");
            return -EPROTO;
        }
        ps_layout_free(&c->layout);
        c->layout = built;
    }
    if (table_make(c) != 0) {
        snprintf(err, errlen, "out of memory for the model's table");
        return -ENOMEM;
    }
    out->n_tensors = ps_layout_ntab(&c->layout);
    out->tensors = c->tab;
    if (a->shm_socket && a->shm_socket[0] && a->shm_token.len == PS_SHM_TOKEN && !c->info.no_shm) {
        if (shm_connect(c, a->shm_socket, a->shm_token.data, why, sizeof why) == 0)
            PS_DEBUG("tensors go through shared memory with psd");
        else
            PS_WARN("no shared memory with psd (%s): tensors go over %s", why, c->endpoint);
    }
    out->shm = c->shm;
    c->table_on_psd = a->ctr && a->ctr->table_on_psd && c->layout.table >= 0;
    int src = pswc_shards_connect(c, a, timeout_s, err, errlen);
    c->ops = c->sh.n > 1 ? &pswc_shards_ops : &pswc_one_ops; /* the mode, chosen once */
    if (src != 0) return src;
    /* bfloat16 on the wire, when psd asks for it (never through shared memory) */
    c->grad_bf16 = !c->shm && a->grad_dtype == PSD__DTYPE__DT_BF16;
    c->weight_bf16 = !c->shm && a->weight_dtype == PSD__DTYPE__DT_BF16;
    free(c->gconv);
    free(c->wconv);
    free(c->w16);
    c->gconv = c->grad_bf16 ? calloc(c->layout.n_params, sizeof *c->gconv) : NULL;
    c->wconv = c->weight_bf16 ? calloc(c->layout.n_params, sizeof *c->wconv) : NULL;
    c->w16 = c->weight_bf16 && c->given16 ? calloc(c->layout.n_params, sizeof *c->w16) : NULL;
    free(c->replica); /* the table's replica: made at the first push asking for rows */
    c->replica = NULL;
    c->n_want = 0;
    if (c->table_on_psd && !psw_client_rows_ok(c)) {
        snprintf(err, errlen, "psd keeps the table but sent a set-up without row pushes (shared memory, shards "
                              "whose pieces are not whole rows, streams or bfloat16)");
        return -EPROTO;
    }
    if ((c->grad_bf16 && !c->gconv) || (c->weight_bf16 && !c->wconv) || (c->weight_bf16 && c->given16 && !c->w16)) {
        snprintf(err, errlen, "out of memory for the bfloat16 buffers");
        return -ENOMEM;
    }
    pswc_stream_release(c);
    c->stream_cf = 0;
    if (a->stream_chunk_bytes > 0 && c->ops->stream) {
        if (a->stream_chunk_bytes > (UINT64_C(1) << 30)) {
            snprintf(err, errlen, "psd sent an invalid chunk size");
            return -EPROTO;
        }
        c->stream_cf = ps_chunk_floats((size_t)a->stream_chunk_bytes);
    }
    out->stream = c->stream_cf > 0;
    pswc_room_free(c); /* (a new assignment: nothing announced to an earlier psd stays) */
    c->room.announce = a->announce_pushes;
    c->room.go = false;
    c->room.timeout_s = a->step_timeout_s;
    return 0;
}

int psw_client_register(psw_client_t *c, psw_assign_t *out, double timeout_s, char *err, size_t errlen)
{
    int rc = register_and_wait(c, timeout_s, err, errlen);
    if (rc == 0) rc = assign_read(c, out, err, errlen);
    if (rc == 0) rc = assign_setup(c, out, timeout_s, err, errlen);
    return rc;
}

int psw_client_ready(psw_client_t *c, uint64_t train_count, uint64_t test_count, const char *data_id)
{
    if (data_id && !ps_data_id_ok(data_id)) return -EINVAL;
    Psd__Header h;
    Psd__Ready r = PSD__READY__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_READY);
    r.train_count = train_count;
    r.test_count = test_count;
    r.shm = c->shm != 0;
    r.data_id = (char *)(data_id ? data_id : "");
    h.body_case = PSD__HEADER__BODY_READY;
    h.ready = &r;
    return send_hdr(c, &h);
}

/* PULL of min_version on sock (psd, or one of its shards). */
/* PULL on sock; with want (n >= 1) listing the table rows the reply brings
 * (one psd: sock is c->sock) */
int pswc_pull_on(psw_client_t *c, void *sock, uint64_t min_version, const uint32_t *want, size_t n)
{
    Psd__Header h;
    Psd__Pull p = PSD__PULL__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_PULL);
    p.min_version = min_version;
    p.want_rows = n > 0;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &p;
    if (n) {
        ps_frame_t fr = {.data = want, .nbytes = n * sizeof *want, .id = (uint32_t)c->layout.table,
                         .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)n}; /* copied at send */
        return ps_msg_send(sock, NULL, 0, &h, &fr, 1);
    }
    if (sock == c->sock) return send_hdr(c, &h);
    return ps_msg_send(sock, NULL, 0, &h, NULL, 0);
}

int psw_client_pull(psw_client_t *c, uint64_t min_version)
{
    c->t_req = ps_now();
    c->weights_due = true;
    return c->ops->pull(c, min_version);
}

static int one_pull(psw_client_t *c, uint64_t min_version) { return pswc_pull_on(c, c->sock, min_version, NULL, 0); }

/* Tensor id of the model with numel elements (pushes into buffers laid out
 * like the model: the shared region, the bfloat16 buffer). */
bool pswc_layout_tensor(const psw_client_t *c, int id, size_t numel)
{
    return id >= 0 && id < c->layout.n_tensors && numel == c->layout.t[id].numel;
}

/* First of the n sorted ids that is >= r (n if none). */
size_t pswc_first_row_at(const uint32_t *ids, size_t n, size_t r)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (ids[mid] < r) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* A streamed push: every chunk in a message of its own (psd steps each
 * chunk as soon as every worker's copy is in). The PULL flag goes with
 * every one: psd sends the new values of each chunk as soon as they are
 * made, while the rest still come in. */
static int push_stream(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                       const size_t *numel)
{
    size_t es = c->grad_bf16 ? 2 : 4;
    for (int i = 0; i < n; i++) {
        if (!pswc_layout_tensor(c, ids[i], numel[i])) return -EINVAL;
        const void *src = pswc_wire_grad(c, ids[i], grads[i], numel[i]);
        for (size_t o = 0; o < numel[i]; o += c->stream_cf) {
            size_t k = numel[i] - o < c->stream_cf ? numel[i] - o : c->stream_cf;
            ps_frame_t fr = {.data = (const char *)src + o * es, .nbytes = k * es, .ffn = pswc_push_frame_done, .hint = c,
                             .id = (uint32_t)ids[i], .dtype = c->grad_bf16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32,
                             .rows = c->layout.t[ids[i]].rows, .cols = pswc_tcols(c, ids[i]), .offset = o};
            if (i > 0 || o > 0) h->seq = ++c->seq; /* every message its own number */
            atomic_fetch_add_explicit(&c->push_inflight, 1, memory_order_relaxed);
            int rc = ps_msg_send(c->sock, NULL, 0, h, &fr, 1);
            if (rc < 0) return rc;
        }
    }
    return 0;
}

/* The header of a PUSH (p becomes its body): the batch's statistics and
 * the worker's timing of the step. */
static void push_header(psw_client_t *c, Psd__Header *h, Psd__Push *p, uint64_t version, uint32_t batch,
                        double loss_sum, uint64_t correct, int pull)
{
    pswc_header_init(c, h, PSD__MSG_TYPE__MSG_PUSH);
    p->version = version;
    p->batch = batch;
    p->loss_sum = loss_sum;
    p->correct = correct;
    p->pull = pull != 0;
    /* not while weights it asked for are still to come: psd might step the
     * slot they name before they are read */
    p->release = pull && c->release_on_push && c->shm && !c->weights_due;
    if (pull) c->weights_due = true;
    double now = ps_now();
    p->compute_s = c->t_weights > 0 ? now - c->t_weights : 0;
    p->wait_s = c->wait;
    if (pull) c->t_req = now;
    h->body_case = PSD__HEADER__BODY_PUSH;
    h->push = p;
}

/* One psd: a push of whole tensors, in one message (bfloat16: rounded
 * into the conversion buffer first) */
static int push_whole(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                      const size_t *numel)
{
    ps_frame_t fr[PS_MAX_TENSORS];
    for (int i = 0; i < n; i++) {
        if (c->grad_bf16) { /* as given, or rounded into the conversion buffer and sent from there */
            if (!pswc_layout_tensor(c, ids[i], numel[i])) return -EINVAL;
            fr[i] = (ps_frame_t){.data = pswc_wire_grad(c, ids[i], grads[i], numel[i]), .nbytes = numel[i] * sizeof(uint16_t), .ffn = pswc_push_frame_done,
                                 .hint = c, .id = (uint32_t)ids[i], .dtype = PSD__DTYPE__DT_BF16,
                                 .rows = c->layout.t[ids[i]].rows, .cols = pswc_tcols(c, ids[i])};
            continue;
        }
        fr[i] = (ps_frame_t){.data = grads[i], .nbytes = numel[i] * sizeof(float),
                             .ffn = pswc_push_frame_done, .hint = c, .id = (uint32_t)ids[i],
                             .dtype = PSD__DTYPE__DT_F32, .rows = c->layout.t[ids[i]].rows, .cols = pswc_tcols(c, ids[i])};
    }
    if (c->layout.table < 0) ps_frames_small_first(fr, n);
    atomic_fetch_add_explicit(&c->push_inflight, n, memory_order_relaxed);
    return ps_msg_send(c->sock, NULL, 0, h, fr, n);
}

/* One psd: a push with some tensors as rows (rows[i].ids) and the rows
 * of the table the next batch reads (want), in one message */
static int push_rows_one(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                         const size_t *numel, const pswc_rows_t *rows, const uint32_t *want, size_t n_want)
{
    const int table = c->layout.table;
    h->push->want_rows = n_want > 0;
    ps_frame_t fr[2 * PS_MAX_TENSORS + 1];
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (!pswc_layout_tensor(c, ids[i], numel[i])) return -EINVAL;
        if (rows[i].ids) { /* the rows instead of the whole tensor */
            const uint32_t id = (uint32_t)ids[i], dim = (uint32_t)c->layout.t[ids[i]].cols;
            fr[m++] = (ps_frame_t){.data = rows[i].ids, .nbytes = rows[i].n * sizeof *rows[i].ids,
                                   .ffn = pswc_push_frame_done, .hint = c, .id = id, .dtype = PSD__DTYPE__DT_U32,
                                   .rows = (uint32_t)rows[i].n};
            fr[m++] = (ps_frame_t){.data = rows[i].vals, .nbytes = rows[i].n * (size_t)dim * sizeof(float),
                                   .ffn = pswc_push_frame_done, .hint = c, .id = id, .dtype = PSD__DTYPE__DT_F32,
                                   .rows = (uint32_t)rows[i].n, .cols = dim};
            continue;
        }
        fr[m++] = (ps_frame_t){.data = grads[i], .nbytes = numel[i] * sizeof(float), .ffn = pswc_push_frame_done,
                               .hint = c, .id = (uint32_t)ids[i], .dtype = PSD__DTYPE__DT_F32,
                               .rows = c->layout.t[ids[i]].rows, .cols = pswc_tcols(c, ids[i])};
    }
    if (n_want) /* copied at send: the worker may reuse its list */
        fr[m++] = (ps_frame_t){.data = want, .nbytes = n_want * sizeof *want, .id = (uint32_t)table,
                               .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)n_want};
    atomic_fetch_add_explicit(&c->push_inflight, m - (n_want > 0), memory_order_relaxed);
    return ps_msg_send(c->sock, NULL, 0, h, fr, m);
}

/* One psd's push: as rows, streamed, or whole */
static int one_push(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                    const size_t *numel, const pswc_rows_t *rows, const uint32_t *want, size_t n_want)
{
    if (rows) return push_rows_one(c, h, n, ids, grads, numel, rows, want, n_want);
    if (c->stream_cf) return push_stream(c, h, n, ids, grads, numel);
    return push_whole(c, h, n, ids, grads, numel);
}

int pswc_push(psw_client_t *c, uint64_t version, uint32_t batch, double loss_sum, uint64_t correct, int pull, int n,
              const int *ids, const float *const *grads, const size_t *numel)
{
    if (n < 0 || n > PS_MAX_TENSORS) return -EINVAL;
    Psd__Header h;
    Psd__Push p = PSD__PUSH__INIT;
    push_header(c, &h, &p, version, batch, loss_sum, correct, pull);
    if (c->shm) { /* into the region psd reads (no copy if computed there) */
        uint32_t sid[PS_MAX_TENSORS];
        for (int i = 0; i < n; i++) {
            if (!pswc_layout_tensor(c, ids[i], numel[i])) return -EINVAL;
            float *dst = c->shm_grad + c->layout.t[ids[i]].offset;
            if (grads[i] != dst) memcpy(dst, grads[i], numel[i] * sizeof(float));
            sid[i] = (uint32_t)ids[i];
        }
        p.shm_tensors = sid;
        p.n_shm_tensors = (size_t)n;
        return ps_msg_send(c->sock, NULL, 0, &h, NULL, 0);
    }
    int rc = pswc_room_push(c, &h, n, ids, grads, numel); /* announced: its tensors go on psd's GO */
    if (rc != 0) return rc < 0 ? rc : 0;
    return c->ops->push(c, &h, n, ids, grads, numel, NULL, NULL, 0);
}

/* The gradients of packed unit u's tensors given in this call (c->pk_src):
 * put together in c->pack, or on psd's host in the region psd reads (or,
 * when this call gives all of u in one piece of the caller's memory, sent
 * from there). Returns the unit's floats to
 * send once u is whole, else NULL. (A tensor given twice is refused before.) */
static const float *pack_unit(psw_client_t *c, int u)
{
    const ps_layout_t *l = &c->layout;
    const ps_tensor_info_t *ut = &l->t[u];
    float *const to = c->shm ? c->shm_grad : c->pack; /* on psd's host straight into the region psd reads */
    int here = 0;
    for (int k = ut->first; k < ut->first + ut->count; k++) here += c->pk_src[k] != NULL;
    if (here == ut->count && c->pk_have[u] == 0) { /* all of it now: from the caller's memory if it is one piece */
        const float *base = c->pk_src[ut->first];
        bool piece = true;
        for (int k = ut->first + 1; k < ut->first + ut->count && piece; k++)
            piece = c->pk_src[k] == base + (l->tab[k].offset - ut->offset);
        for (int k = ut->first; k < ut->first + ut->count; k++) {
            if (!piece) memcpy(to + l->tab[k].offset, c->pk_src[k], l->tab[k].numel * sizeof(float));
            c->pk_src[k] = NULL;
        }
        return piece ? base : to + ut->offset;
    }
    for (int k = ut->first; k < ut->first + ut->count; k++) { /* a part now: kept until the rest comes */
        if (!c->pk_src[k]) continue;
        c->pk_in[k] = 1;
        c->pk_have[u]++;
        memcpy(to + l->tab[k].offset, c->pk_src[k], l->tab[k].numel * sizeof(float));
        c->pk_src[k] = NULL;
    }
    if (c->pk_have[u] < ut->count) return NULL;
    for (int k = ut->first; k < ut->first + ut->count; k++) c->pk_in[k] = 0;
    c->pk_have[u] = 0;
    return to + ut->offset;
}

int psw_client_push_v(psw_client_t *c, const psw_push_t *p)
{
    const ps_layout_t *l = &c->layout;
    const int nt = ps_layout_ntab(l);
    if (!p || p->n_grads < 0 || p->n_grads > nt || (p->n_grads && !p->grads) || !c->tab) return -EINVAL;
    int ids[PS_MAX_TENSORS], n = 0, n_as_rows = 0;
    pswc_rows_t rows[PS_MAX_TENSORS];
    uint64_t sent = 0; /* units in this push (at most one each: PS_MAX_TENSORS bits) */
    const float *g[PS_MAX_TENSORS];
    size_t numel[PS_MAX_TENSORS];
    bool bad = false;
    for (int i = 0; i < p->n_grads && !bad; i++) { /* each: whole (data) or a sparse tensor's rows (row_ids, row_vals) */
        const psw_grad_t *x = &p->grads[i];
        if (x->tensor >= (uint32_t)nt || !x->data == !x->row_ids) bad = true;
        const int u = bad ? 0 : l->tab ? l->tab[x->tensor].unit : (int)x->tensor;
        if (bad) break;
        if (x->row_ids && (l->t[u].kind != PS_TENSOR_ROWS || !x->row_vals || x->n_rows == 0)) bad = true;
        if (l->t[u].count > 1) { /* packed with others: put together below */
            bad = bad || c->pk_src[x->tensor] != NULL;
            c->pk_src[x->tensor] = x->data;
            continue;
        }
        if (sent & (1ull << u)) { /* a unit twice in one push */
            bad = true;
            break;
        }
        sent |= 1ull << u;
        ids[n] = u;
        g[n] = x->data;
        rows[n] = (pswc_rows_t){.ids = x->row_ids, .vals = x->row_vals, .n = x->row_ids ? x->n_rows : 0};
        n_as_rows += x->row_ids != NULL;
        numel[n++] = l->t[u].numel;
    }
    for (int i = 0; i < p->n_grads && c->pk_src && !bad; i++) /* given in a part before: refused, nothing kept */
        bad = c->pk_src[p->grads[i].tensor] && c->pk_in[p->grads[i].tensor];
    for (int i = 0; i < p->n_grads && c->pk_src && !bad; i++) { /* the packed units this push completes */
        const uint32_t k = p->grads[i].tensor;
        const int u = l->tab[k].unit;
        if (l->t[u].count == 1 || !c->pk_src[k]) continue; /* not packed, or its unit done already */
        const float *src = pack_unit(c, u);
        if (src) { /* (never twice a unit: its tensors are taken) */
            ids[n] = u;
            g[n] = src;
            rows[n] = (pswc_rows_t){0};
            numel[n++] = l->t[u].numel;
        }
    }
    if (c->pk_src)
        for (int i = 0; i < p->n_grads; i++)
            if (p->grads[i].tensor < (uint32_t)nt) c->pk_src[p->grads[i].tensor] = NULL;
    if (bad) return -EINVAL;
    if (n == 0 && !p->pull) return 0; /* tensors of packed units not complete yet: they go with the part that
                                       * completes them (nothing to send; psd refuses a PUSH without tensors) */
    if (n_as_rows > 0)
        return pswc_push_rows(c, p->version, p->batch, p->loss_sum, p->correct, p->pull, n, ids, g, numel, rows,
                              p->want, p->n_want);
    if (p->n_want) return -EINVAL; /* rows asked for with the table's rows pushed */
    return pswc_push(c, p->version, p->batch, p->loss_sum, p->correct, p->pull, n, ids, g, numel);
}

void psw_client_release_on_push(psw_client_t *c, int on) { c->release_on_push = on != 0; }

void psw_client_wire_bf16(const psw_client_t *c, int *grads, int *weights)
{
    if (grads) *grads = c->grad_bf16;
    if (weights) *weights = c->weight_bf16;
}

void psw_client_bf16_given(psw_client_t *c, int on) { c->given16 = on != 0; }

const uint16_t *psw_client_weights_bf16(const psw_client_t *c) { return c->weight_bf16 ? c->w16 : NULL; }

/* Tensor i's gradient as the wire takes it: f32 as given; bfloat16 as
 * given (psw_client_bf16_given) or rounded into the conversion buffer */
const void *pswc_wire_grad(psw_client_t *c, int id, const float *grad, size_t numel)
{
    if (!c->grad_bf16 || c->given16) return grad;
    uint16_t *dst = c->gconv + c->layout.t[id].offset;
    ps_f32_to_bf16_n(dst, grad, numel);
    return dst;
}

int psw_client_rows_ok(const psw_client_t *c)
{
    return !c->shm && c->ops->rows_ok(c) && !c->stream_cf && !c->grad_bf16 && c->layout.table >= 0;
}

/* ids[0..n) are rows of the table, strictly increasing (n >= 1) */
bool pswc_table_rows(const psw_client_t *c, const uint32_t *ids, size_t n)
{
    return ps_rows_valid(ids, n, (uint64_t)c->layout.t[c->layout.table].rows);
}

/* The rows the next reply brings (n may be 0), kept to check it and to
 * scatter it into the replica (made here, the first time; none when the
 * table stays on psd). 0 or -ENOMEM. */
int pswc_keep_want(psw_client_t *c, const uint32_t *want, size_t n)
{
    if (n > c->want_cap) {
        uint32_t *p = realloc(c->want, n * sizeof *p);
        if (!p) return -ENOMEM;
        c->want = p;
        c->want_cap = n;
    }
    if (c->ops->rows_room(c, n) != 0) return -ENOMEM;
    if (n) memcpy(c->want, want, n * sizeof *want);
    c->n_want = n;
    return 0;
}

int psw_client_pull_rows(psw_client_t *c, uint64_t min_version, const uint32_t *want, size_t n)
{
    if (!psw_client_rows_ok(c) || !pswc_table_rows(c, want, n)) return -EINVAL;
    int rc = pswc_keep_want(c, want, n);
    if (rc < 0) return rc;
    c->t_req = ps_now();
    c->weights_due = true;
    return c->ops->pull_rows(c, min_version, n);
}

static int one_pull_rows(psw_client_t *c, uint64_t min_version, size_t n)
{
    return pswc_pull_on(c, c->sock, min_version, n ? c->want : NULL, n);
}

/* One psd: the replica the rows asked for are scattered into (made the
 * first time; none when the table stays on psd) */
static int one_rows_room(psw_client_t *c, size_t n)
{
    if (n && !c->table_on_psd && !c->replica &&
        !(c->replica = calloc(c->layout.t[c->layout.table].numel, sizeof *c->replica)))
        return -ENOMEM;
    return 0;
}

static bool one_rows_ok(const psw_client_t *c)
{
    (void)c;
    return true;
}

int pswc_push_rows(psw_client_t *c, uint64_t version, uint32_t batch, double loss_sum, uint64_t correct, int pull,
                   int n, const int *ids, const float *const *grads, const size_t *numel, const pswc_rows_t *rows,
                   const uint32_t *want, size_t n_want)
{
    if (!psw_client_rows_ok(c) || n < 1 || n > PS_MAX_TENSORS || (n_want && (!pull || !pswc_table_rows(c, want, n_want))))
        return -EINVAL;
    for (int i = 0; i < n; i++) /* each tensor given as rows: rows of it, strictly increasing */
        if (rows[i].ids && (ids[i] < 0 || ids[i] >= c->layout.n_tensors ||
                            c->layout.t[ids[i]].kind != PS_TENSOR_ROWS || rows[i].n == 0 ||
                            !ps_rows_valid(rows[i].ids, rows[i].n, (uint64_t)c->layout.t[ids[i]].rows)))
            return -EINVAL;
    if (c->weight_bf16) n_want = 0; /* psd sends bfloat16 weights whole */
    int rc = pswc_keep_want(c, want, n_want);
    if (rc < 0) return rc;
    Psd__Header h;
    Psd__Push p = PSD__PUSH__INIT;
    push_header(c, &h, &p, version, batch, loss_sum, correct, pull);
    return c->ops->push(c, &h, n, ids, grads, numel, rows, want, n_want);
}

float *psw_client_push_region(psw_client_t *c) { return c->shm ? c->shm_grad : NULL; }

int psw_client_push_done(psw_client_t *c)
{
    return atomic_load_explicit(&c->push_inflight, memory_order_acquire) == 0;
}

int psw_client_push_wait(psw_client_t *c, double timeout_s)
{
    if (c->room.pending) { /* an announced push: its tensors go on psd's GO (others kept for psw_client_next) */
        char err[256];
        int rc = pswc_room_settle(c, timeout_s, err, sizeof err);
        if (rc == -ETIMEDOUT) return rc;
        if (rc < 0) PS_WARN("%s", err);
    }
    if (psw_client_push_done(c)) return 0;
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    double s = timeout_s > 0 ? timeout_s : 0;
    dl.tv_sec += (time_t)s;
    dl.tv_nsec += (long)((s - (double)(time_t)s) * 1e9);
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&c->push_mu);
    int rc = 0;
    while (!psw_client_push_done(c) && rc == 0) rc = pthread_cond_timedwait(&c->push_cv, &c->push_mu, &dl);
    pthread_mutex_unlock(&c->push_mu);
    return psw_client_push_done(c) ? 0 : -ETIMEDOUT;
}

int psw_client_barrier(psw_client_t *c, uint32_t epoch, uint64_t samples)
{
    Psd__Header h;
    Psd__Barrier b = PSD__BARRIER__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_BARRIER);
    b.epoch = epoch;
    b.samples = samples;
    h.body_case = PSD__HEADER__BODY_BARRIER;
    h.barrier = &b;
    return send_hdr(c, &h);
}

psw_val_t psw_val_for(const psw_event_t *ev)
{
    return (psw_val_t){.epoch = ev->epoch, .version = ev->version, .begin = ev->val_begin, .split = ev->split,
                       .count = ev->n_val_ids};
}

int psw_client_val_result(psw_client_t *c, const psw_val_t *r)
{
    if (r->n_sums < 0 || r->n_sums > PSW_MAX_SUMS || (r->n_sums && !r->sums)) return -EINVAL;
    Psd__NamedSum sums[PSW_MAX_SUMS], *sp[PSW_MAX_SUMS];
    for (int i = 0; i < r->n_sums; i++) {
        if (!r->sums[i].name || !ps_sum_name_ok(r->sums[i].name) || !isfinite(r->sums[i].value)) return -EINVAL;
        psd__named_sum__init(&sums[i]);
        sums[i].name = (char *)r->sums[i].name;
        sums[i].value = r->sums[i].value;
        sp[i] = &sums[i];
    }
    Psd__Header h;
    Psd__ValResult v = PSD__VAL_RESULT__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_VAL_RESULT);
    v.epoch = r->epoch;
    v.version = r->version;
    v.begin = r->begin;
    v.split = r->split == PSW_SPLIT_VAL ? PSD__SPLIT__SPLIT_VAL : PSD__SPLIT__SPLIT_TEST;
    v.loss_sum = r->loss_sum;
    v.correct = r->correct;
    v.count = r->count;
    v.n_sums = (size_t)r->n_sums;
    v.sums = sp;
    h.body_case = PSD__HEADER__BODY_VAL_RESULT;
    h.val_result = &v;
    if (!r->scores) return send_hdr(c, &h);
    ps_frame_t fr = {.data = r->scores, .nbytes = r->count * sizeof(float), .dtype = PSD__DTYPE__DT_F32,
                     .rows = (uint32_t)r->count}; /* copied at send */
    return send_msg(c, &h, &fr, 1);
}

int psw_client_heartbeat(psw_client_t *c, uint32_t epoch)
{
    Psd__Header h;
    Psd__Heartbeat hb = PSD__HEARTBEAT__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_HEARTBEAT);
    hb.epoch = epoch;
    h.body_case = PSD__HEADER__BODY_HEARTBEAT;
    h.heartbeat = &hb;
    return send_hdr(c, &h);
}

static int send_leave(psw_client_t *c, const char *reason, bool end_run)
{
    Psd__Header h;
    Psd__Leave l = PSD__LEAVE__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_LEAVE);
    l.reason = (char *)(reason ? reason : "");
    l.end_run = end_run;
    h.body_case = PSD__HEADER__BODY_LEAVE;
    h.leave = &l;
    return send_hdr(c, &h);
}

int psw_client_leave(psw_client_t *c, const char *reason) { return send_leave(c, reason, false); }

int psw_client_end_run(psw_client_t *c, const char *reason) { return send_leave(c, reason, true); }

int psw_client_fail(psw_client_t *c, int data_error, const char *message)
{
    Psd__Header h;
    Psd__Error e = PSD__ERROR__INIT;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_ERROR);
    e.code = data_error ? PSD__ERR_CODE__ERR_DATA : PSD__ERR_CODE__ERR_INTERNAL;
    e.message = (char *)message;
    h.body_case = PSD__HEADER__BODY_ERROR;
    h.error = &e;
    return send_hdr(c, &h);
}

void psw_keep_freed_memory(void) { ps_malloc_keep(); }

void psw_make_identity(uint8_t id[16], uint64_t salt)
{
    char hostname[64];
    ps_hostname(hostname, sizeof hostname);
    uint64_t x = ps_fnv1a(PS_FNV_INIT, hostname, strlen(hostname)) ^ (uint64_t)getpid() ^
                 (uint64_t)(ps_now() * 1e9) ^ (salt * 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < 2; i++) {
        uint64_t r = ps_splitmix64(&x);
        memcpy(id + 8 * i, &r, 8);
    }
    id[0] |= 1; /* ZeroMQ reserves routing ids starting with a zero byte */
}

size_t psw_struct_size(const char *name)
{
#define PSW_SIZE(T) \
    if (strcmp(name, #T) == 0) return sizeof(T)
    PSW_SIZE(psw_tensor_t);
    PSW_SIZE(psw_info_t);
    PSW_SIZE(psw_file_t);
    PSW_SIZE(psw_assign_t);
    PSW_SIZE(psw_event_t);
    PSW_SIZE(psw_grad_t);
    PSW_SIZE(psw_push_t);
    PSW_SIZE(psw_sum_t);
    PSW_SIZE(psw_val_t);
    PSW_SIZE(psw_ctr_gen_t);
#undef PSW_SIZE
    return 0;
}

/* One psd: its socket only (c->sock, polled by pswc_recv_msg itself) */
static int one_poll_add(psw_client_t *c, zmq_pollitem_t *it, int ni)
{
    (void)c;
    (void)it;
    return ni;
}

static int one_recv_polled(psw_client_t *c, const zmq_pollitem_t *it, char *err, size_t errlen)
{
    (void)c;
    (void)it;
    (void)err;
    (void)errlen;
    return PSWC_NONE;
}

static void one_close(psw_client_t *c) { (void)c; }

const pswc_ops_t pswc_one_ops = {
    .name = "one psd",
    .stream = true,
    .poll_add = one_poll_add,
    .recv_polled = one_recv_polled,
    .next_msg = pswc_recv_msg,
    .take = pswc_one_take,
    .push = one_push,
    .pull = one_pull,
    .pull_rows = one_pull_rows,
    .rows_room = one_rows_room,
    .rows_ok = one_rows_ok,
    .close = one_close,
};
