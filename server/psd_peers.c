/* psd_peers.c - psd's peers as the coordinator addresses them: message
 * headers, sends to a worker or a psd shard, dropped messages (counted,
 * logged within limits), the connection a peer's messages come on, the
 * ASSIGN a worker gets, and the end of the run (every peer told, the loop
 * stopped). The lowest of the coordinator's files: every other one uses
 * these, and these call none of them. */
#include "psd_core.h"

const char *const psd_wstate_name[] = {"assigned", "ready",      "training", "at barrier",
                                   "validating", "validated", "gone"};
const char *const psd_wend_name[] = {"", "left", "failed", "lost", "refused"};

/* Slot of a peer: the one with that identity. A worker that rejoins keeps
 * its identity and gets another slot (or its own back); psd_run_on_register makes
 * any other slot forget the identity, so that there is one. */
worker_t *psd_peers_find_worker(srv_t *s, const uint8_t *ident, size_t len)
{
    for (int i = s->n - 1; i >= 0; i--)
        if (s->w[i].ident_len == len && memcmp(s->w[i].ident, ident, len) == 0) return &s->w[i];
    return NULL;
}

/* A message dropped: counted; true if it is logged (the first 20, then
 * every 1000th), so that a flood of bad messages costs no formatting. */
static bool drop_logged(srv_t *s)
{
    s->net.dropped++;
    s->net.cur_bad = true;
    return s->net.dropped <= 20 || s->net.dropped % 1000 == 0;
}

/* Log a dropped message from `who` ("rank 3 (host pid 12)", "psd shard 1
 * (...)"), or NULL: a peer psd does not know (its address if libzmq gave one). */
static void vdrop(srv_t *s, const char *who, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    const char *more = s->net.dropped == 20 ? " (further drops logged every 1000th)" : "";
    if (who)
        PS_WARN("dropped a message from %s: %s%s", who, msg, more);
    else
        PS_WARN("dropped a message from an unknown peer%s%s: %s%s", s->net.cur_peer && s->net.cur_peer[0] ? " at " : "",
                s->net.cur_peer ? s->net.cur_peer : "", msg, more);
}

static void vrefuse_after(srv_t *s, const worker_t *w, const char *fmt, va_list ap)
{
    s->net.refuse = (int)(w - s->w) + 1;
    vsnprintf(s->net.refuse_why, sizeof s->net.refuse_why, fmt, ap);
}

void psd_peers_refuse_after(srv_t *s, const worker_t *w, const char *fmt, ...)
{
    if (!w || w->state == W_GONE) return;
    va_list ap;
    va_start(ap, fmt);
    vrefuse_after(s, w, fmt, ap);
    va_end(ap);
}

void psd_peers_drop(srv_t *s, const worker_t *w, const char *fmt, ...)
{
    va_list ap;
    if (w && w->state != W_GONE) { /* a worker in the run: refused, in one line (psd_run_refuse_worker) */
        s->net.cur_bad = true;
        va_start(ap, fmt);
        vrefuse_after(s, w, fmt, ap);
        va_end(ap);
        return;
    }
    if (!drop_logged(s)) return;
    char who[128];
    if (w) snprintf(who, sizeof who, "rank %u (%s pid %u)", w->rank, w->hostname, w->pid);
    va_start(ap, fmt);
    vdrop(s, w ? who : NULL, fmt, ap);
    va_end(ap);
}

void psd_peers_drop_stale(srv_t *s, const worker_t *w, const char *fmt, ...)
{
    if (!drop_logged(s)) return;
    char who[128];
    snprintf(who, sizeof who, "rank %u (%s pid %u)", w->rank, w->hostname, w->pid);
    va_list ap;
    va_start(ap, fmt);
    vdrop(s, who, fmt, ap);
    va_end(ap);
}

/* the same for a message from psd shard i (> 0) */
void psd_peers_drop_shard(srv_t *s, int i, const char *fmt, ...)
{
    if (!drop_logged(s)) return;
    char who[128];
    snprintf(who, sizeof who, "psd shard %d (%s pid %u)", i, s->sh.shard[i].hostname, s->sh.shard[i].pid);
    va_list ap;
    va_start(ap, fmt);
    vdrop(s, who, fmt, ap);
    va_end(ap);
}

void psd_peers_hdr_for(srv_t *s, worker_t *w, Psd__Header *h, Psd__MsgType type)
{
    psd__header__init(h);
    h->run_id = s->run_id;
    h->type = type;
    h->rank = w ? w->rank : 0;
    h->seq = w ? ++w->seq_out : 0;
}

int psd_peers_send_to(srv_t *s, worker_t *w, Psd__Header *h, const ps_frame_t *fr, int n)
{
    int rc = ps_msg_send(s->net.sock, w->ident, w->ident_len, h, fr, n);
    w->sent_at = ps_now();
    if (rc < 0)
        PS_WARN("cannot send %s to rank %u (%s pid %u): %s", ps_msg_type_name((int)h->type), w->rank,
                w->hostname, w->pid, zmq_strerror(-rc));
    return rc;
}

void psd_peers_send_error_ident(srv_t *s, const uint8_t *ident, size_t len, Psd__ErrCode code,
                             const char *msg)
{
    psd_peers_send_error_as(s, ident, len, code, msg, 0);
}

void psd_peers_send_error_as(srv_t *s, const uint8_t *ident, size_t len, Psd__ErrCode code, const char *msg, uint32_t protocol)
{
    Psd__Header h;
    Psd__Error e = PSD__ERROR__INIT;
    psd_peers_hdr_for(s, NULL, &h, PSD__MSG_TYPE__MSG_ERROR);
    h.protocol = protocol; /* 0: this build's (ps_msg_send) */
    e.code = code;
    e.message = (char *)msg;
    h.body_case = PSD__HEADER__BODY_ERROR;
    h.error = &e;
    ps_msg_send(s->net.sock, ident, len, &h, NULL, 0);
}

/* A SHUTDOWN header for w (sd: its body, the caller's). */
static void shutdown_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Shutdown *sd, int code, const char *reason)
{
    psd_peers_hdr_for(s, w, h, PSD__MSG_TYPE__MSG_SHUTDOWN);
    sd->exit_code = code;
    sd->reason = (char *)reason;
    sd->last_val = told_val(s);
    h->body_case = PSD__HEADER__BODY_SHUTDOWN;
    h->shutdown = sd;
}

void psd_peers_send_shutdown(srv_t *s, worker_t *w, int code, const char *reason)
{
    Psd__Header h;
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    shutdown_hdr(s, w, &h, &sd, code, reason);
    psd_peers_send_to(s, w, &h, NULL, 0);
}

/* ---- the end of the run ------------------------------------------------ */

/* End the run: tell every live worker, stop the loop. Workers lost for
 * their silence that have not registered again (their identity is still
 * their slot's) are told too, where their connection still stands (no
 * complaint where it does not): one that was only frozen or slow would
 * otherwise wait for a psd that is gone for its whole --retry-for. */
void psd_peers_finish(srv_t *s, int code, const char *reason)
{
    if (s->phase == PHASE_DONE) return;
    if (s->tty) ps_log_status(NULL);
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state != W_GONE) {
            psd_peers_send_shutdown(s, w, code, reason);
        } else if (w->lost_silent && w->ident_len > 0) {
            Psd__Header h;
            Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
            shutdown_hdr(s, w, &h, &sd, code, reason);
            ps_msg_send(s->net.sock, w->ident, w->ident_len, &h, NULL, 0);
        }
    }
    if (sharded(s)) {
        Psd__Header h;
        Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHUTDOWN;
        sd.exit_code = code;
        sd.reason = (char *)reason;
        h.body_case = PSD__HEADER__BODY_SHUTDOWN;
        h.shutdown = &sd;
        psd_peers_shards_send_all(s, &h);
    }
    s->phase = PHASE_DONE;
    s->exit_code = code;
    ps_weights_abort(s->sh.wr); /* a weights file not finished is not left behind */
    s->sh.wr = NULL;
    uv_stop(&s->net.loop);
}

/* ---- a worker's resources -------------------------------------------- */

/* Forget a worker's shared memory (after psd_step_release_push). */
void psd_peers_shm_forget(srv_t *s, worker_t *w)
{
    if (w->hold) psd_store_frame_free(NULL, w->hold);
    w->hold = NULL;
    if (w->shm_grad) munmap((void *)w->shm_grad, s->layout.n_params * sizeof(float));
    w->shm_grad = NULL;
    w->shm = false;
}

/* A worker's table buffers: the rows it asked for (its gradient rows went
 * back to the holder with its push). */
void psd_peers_rows_free(worker_t *w) { psd_push_free(&w->contrib.push); }

/* ---- message handlers --------------------------------------------------- */

void psd_peers_send_assign(srv_t *s, worker_t *w)
{
    Psd__Header h;
    Psd__Assign a = PSD__ASSIGN__INIT;
    Psd__Hyper hy = PSD__HYPER__INIT;
    Psd__DataFile df[4], *dfp[4];
    uint32_t layers[PS_MAX_LAYERS + 1];
    psd_peers_hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_ASSIGN);
    a.rank = w->rank;
    const int live = live_workers(s) + !(w->state >= W_READY && w->state <= W_VALIDATED); /* this one counted */
    a.world = (uint32_t)(live > s->cfg.workers ? live : s->cfg.workers);
    a.announce_pushes = psd_fold_roomed(s, &(worker_t){.shm = false}); /* on the wire: room for its pushes */
    for (int i = 0; i < s->cfg.n_sizes; i++) layers[i] = (uint32_t)s->cfg.sizes[i];
    a.layers = layers;
    a.n_layers = (size_t)s->cfg.n_sizes;
    a.activation = "relu";
    for (int i = 0; i < 4; i++) {
        psd__data_file__init(&df[i]);
        df[i].role = s->files[i].role;
        df[i].path = s->files[i].path;
        df[i].size = s->files[i].size;
        df[i].hash = s->files[i].hash;
        dfp[i] = &df[i];
    }
    a.files = dfp;
    a.n_files = 4;
    Psd__CtrTask ct = PSD__CTR_TASK__INIT;
    if (s->cfg.kind == PS_MODEL_CTR) { /* no files: the generator */
        a.n_files = 0;
        ct.fields = (uint32_t)s->cfg.ctr_fields;
        ct.per_field = (uint32_t)s->cfg.ctr_per_field;
        ct.vocab = (uint64_t)s->cfg.ctr_vocab;
        ct.zipf = s->cfg.ctr_zipf;
        ct.rows = (uint64_t)s->cfg.ctr_rows;
        ct.dim = (uint32_t)s->cfg.ctr_dim;
        ct.mean = s->cfg.ctr_mean;
        ct.weight_std = s->cfg.ctr_weight_std;
        ct.bias = s->cfg.ctr_bias;
        ct.seed = s->cfg.ctr_seed;
        ct.train = (uint64_t)s->cfg.ctr_train;
        ct.test = (uint64_t)s->cfg.ctr_test;
        ct.table_on_psd = s->table_on_psd;
        a.ctr = &ct;
    }
    hy.batch_size = (uint32_t)s->cfg.batch_size;
    hy.val_batch_size = (uint32_t)s->cfg.val_batch_size;
    hy.norm_mean = s->cfg.norm_mean;
    hy.norm_std = s->cfg.norm_std;
    hy.train_limit = (uint64_t)s->cfg.train_limit;
    hy.epochs = (uint32_t)s->cfg.epochs;
    hy.seed = s->cfg.seed;
    hy.sync = (uint32_t)s->cfg.sync;
    hy.staleness = (uint32_t)s->cfg.staleness;
    hy.sparse_threshold = s->cfg.sparse_threshold;
    a.hyper = &hy;
    /* how long a worker waits for psd before it registers again */
    a.start_timeout_s = s->cfg.start_timeout + 10;
    a.step_timeout_s = s->silence * 3 + 10;
    a.silence_s = s->silence;
    a.tcp_congestion = s->cfg.tcp_congestion;
    a.grad_dtype = s->cfg.wire_gradients == PS_WIRE_BF16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32;
    a.weight_dtype = s->cfg.wire_weights == PS_WIRE_BF16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32;
    if (s->stream) a.stream_chunk_bytes = (uint64_t)s->store.chunk_bytes;
    char *eps[PS_MAX_SHARDS];
    if (sharded(s)) { /* where its other parts are */
        for (int i = 1; i < s->sh.n; i++) eps[i - 1] = s->sh.shard[i].endpoint;
        a.shard_endpoints = eps;
        a.n_shard_endpoints = (size_t)(s->sh.n - 1);
        a.shard_token.data = w->shard_token;
        a.shard_token.len = sizeof w->shard_token;
    }
    if (s->net.shm && strcmp(w->host_id, s->net.host_id) == 0) { /* same host: offer shared memory */
        a.shm_socket = s->net.shm_name;
        a.shm_token.data = w->shm_token;
        a.shm_token.len = sizeof w->shm_token;
    }
    const bool own = s->cfg.kind == PS_MODEL_TENSORS || s->cfg.kind == PS_MODEL_FROM_WORKER;
    a.model = own ? "tensors" : s->cfg.kind == PS_MODEL_CTR ? "ctr" : "mlp";
    if (own) { /* the workers' own model and data */
        a.n_layers = 0;
        a.n_files = 0;
    }
    ps_frame_t table = {.data = s->table_pb, .nbytes = s->table_pb_len, .dtype = PSD__DTYPE__DT_U8,
                        .rows = s->table_pb_len, .copy = true};
    h.body_case = PSD__HEADER__BODY_ASSIGN;
    h.assign = &a;
    psd_peers_send_to(s, w, &h, &table, 1);
}

/* A connection of the ROUTER closed (its monitor's event): the workers
 * whose messages came on it are lost at the next tick (reap_closed), not
 * here: this runs inside a message's handling too (psd_peers_note_conn). */
static void conn_closed(void *arg, int fd)
{
    srv_t *s = arg;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].conn == fd + 1 && s->w[i].state != W_GONE) {
            s->w[i].conn = 0;
            s->w[i].conn_closed = true;
        }
    for (int i = 1; i < s->sh.n; i++)
        if (s->sh.shard[i].conn == fd + 1 && s->sh.shard[i].joined) {
            s->sh.shard[i].conn = 0;
            s->sh.shard[i].conn_closed = true;
        }
}

void psd_peers_poll_monitor(srv_t *s) { psd_router_monitor(s->net.mon, &s->net.hs_failed, conn_closed, s); }

/* The connection a peer's (a worker's, a shard's) message m came on, into
 * *conn. A new one (its first message, or it reconnected) is taken once the
 * monitor's events so far are read: an event about an fd number is then
 * about a connection that held it before, whose close the monitor reported
 * before this one could open. It gets server.tcp_congestion then. */
void psd_peers_note_conn(srv_t *s, int *conn, const ps_msg_t *m)
{
    if (m->srcfd < 0 || *conn == m->srcfd + 1) return;
    if (s->net.mon) psd_peers_poll_monitor(s);
    ps_tcp_cc_conn(conn, m->srcfd, s->cfg.tcp_congestion, true); /* sets *conn unless the setting is off */
    *conn = m->srcfd + 1;
}

/* ---- psctl (MSG_CONTROL) ---------------------------------------------------- */

void psd_peers_control_reply(srv_t *s, const uint8_t *ident, size_t len, bool ok, const char *text, const char *json)
{
    Psd__Header h;
    Psd__ControlReply r = PSD__CONTROL_REPLY__INIT;
    psd_peers_hdr_for(s, NULL, &h, PSD__MSG_TYPE__MSG_CONTROL_REPLY);
    r.ok = ok;
    r.text = (char *)(text ? text : "");
    r.json = (char *)(json ? json : "");
    h.body_case = PSD__HEADER__BODY_CONTROL_REPLY;
    h.control_reply = &r;
    ps_msg_send(s->net.sock, ident, len, &h, NULL, 0);
}

int psd_peers_send_shard(srv_t *s, int i, Psd__Header *h, const ps_frame_t *fr, int n)
{
    shard_peer_t *sh = &s->sh.shard[i];
    h->run_id = s->run_id;
    h->rank = (uint32_t)i;
    h->seq = ++sh->seq_out;
    int rc = ps_msg_send(s->net.sock, sh->ident, sh->ident_len, h, fr, n);
    if (rc < 0)
        PS_WARN("cannot send %s to shard %d (%s pid %u): %s", ps_msg_type_name((int)h->type), i, sh->hostname,
                sh->pid, zmq_strerror(-rc));
    return rc;
}

void psd_peers_shards_send_all(srv_t *s, Psd__Header *h)
{
    for (int i = 1; i < s->sh.n; i++)
        if (s->sh.shard[i].joined) psd_peers_send_shard(s, i, h, NULL, 0);
}

/* Tell every shard about a worker: its rank and token. */
void psd_peers_shards_worker(srv_t *s, const worker_t *w)
{
    Psd__Header h;
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_WORKER;
    sw.rank = w->rank;
    sw.token.data = (uint8_t *)w->shard_token;
    sw.token.len = sizeof w->shard_token;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    psd_peers_shards_send_all(s, &h);
}

/* A HEARTBEAT header of this epoch (hb: its body, the caller's). */
void psd_peers_heartbeat_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Heartbeat *hb)
{
    psd_peers_hdr_for(s, w, h, PSD__MSG_TYPE__MSG_HEARTBEAT);
    psd__heartbeat__init(hb);
    hb->epoch = s->epoch;
    h->body_case = PSD__HEADER__BODY_HEARTBEAT;
    h->heartbeat = hb;
}

/* Workers that wait on psd (at their barrier, for the next epoch, for the
 * reply to a push that waits for slower workers, held back in ssp) hear
 * from it at least every second, so that a long wait is not taken for a
 * psd that is gone (the worker gives psd step_timeout_s of silence). */
void psd_peers_keep_alive(srv_t *s, double now)
{
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state < W_READY || w->state > W_VALIDATED || now - w->sent_at < 1.0) continue;
        Psd__Header h;
        Psd__Heartbeat hb;
        psd_peers_heartbeat_hdr(s, w, &h, &hb);
        psd_peers_send_to(s, w, &h, NULL, 0);
    }
}
