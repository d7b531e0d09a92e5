/* psw_client_shards.c - the worker library with psd shards (ASSIGN names
 * shards 1..n-1; see psw_client_int.h): their connections, a push split
 * into each shard's pieces, pulls from every shard, and the weights put
 * together from their parts. pswc_shards_ops, chosen at registration. */
#include "psw_client_int.h"

static void defer_free(psw_client_t *c)
{
    for (int i = 0; i < c->sh.n_defer; i++) ps_msg_deinit(&c->sh.defer[i]);
    free(c->sh.defer);
    c->sh.defer = NULL;
    c->sh.n_defer = 0;
}

/* The shards' sockets and buffers (pswc_ops_t.close): one psd from here on. */
static void shards_close(psw_client_t *c)
{
    for (int k = 1; k < PS_MAX_SHARDS; k++)
        if (c->sh.sock[k]) {
            ps_msg_drain(c->sh.sock[k], 0.05, 0.3);
            pswc_fork_forget(c, k);
            ps_zmq_close_monitored(c->sh.sock[k], c->sh.mon[k]);
            c->sh.sock[k] = NULL;
            c->sh.mon[k] = NULL;
            c->tcp_fd[k] = 0;
        }
    free(c->sh.wbuf);
    c->sh.wbuf = NULL;
    free(c->sh.tbuf);
    c->sh.tbuf = NULL;
    c->sh.tbuf_cap = 0;
    defer_free(c);
    c->sh.n = 1;
    c->ops = &pswc_one_ops;
}

/* want[*a, *a + *n): the rows of shard k's piece of the table among the n
 * sorted ids (none when its piece holds no rows). */
static void shard_slice(const psw_client_t *c, int k, const uint32_t *want, size_t n, size_t *a, size_t *m)
{
    size_t r0, r1;
    const ps_piece_t *p = &c->sh.pieces[k][c->layout.table];
    *a = *m = 0;
    if (p->n == 0 || !ps_piece_rows(&c->layout, p, &r0, &r1)) return;
    *a = pswc_first_row_at(want, n, r0);
    *m = pswc_first_row_at(want, n, r1) - *a;
}

/* Shard k's DEALER (c->sh.sock[k]), its monitor, connected to ep. */
static int shard_open(psw_client_t *c, int k, const char *ep, char *err, size_t errlen)
{
    void *so = zmq_socket(c->ctx, ZMQ_DEALER);
    if (!so) {
        snprintf(err, errlen, "zeromq: %s", zmq_strerror(zmq_errno()));
        return -EIO;
    }
    c->sh.sock[k] = so;
    int linger = 2000, zero = 0;
    zmq_setsockopt(so, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(so, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(so, ZMQ_RCVHWM, &zero, sizeof zero);
    /* a shard sends its parts of the weights and small messages: a larger frame disconnects it */
    int64_t most = 4 * (int64_t)c->layout.n_params + (4 << 20);
    zmq_setsockopt(so, ZMQ_MAXMSGSIZE, &most, sizeof most);
    if (c->info.curve_server && (zmq_setsockopt(so, ZMQ_CURVE_SERVERKEY, c->info.curve_server, 40) != 0 ||
                                 zmq_setsockopt(so, ZMQ_CURVE_PUBLICKEY, c->info.curve_public, 40) != 0 ||
                                 zmq_setsockopt(so, ZMQ_CURVE_SECRETKEY, c->info.curve_secret, 40) != 0)) {
        snprintf(err, errlen, "cannot set up CURVE: %s", zmq_strerror(zmq_errno()));
        return -EINVAL;
    }
    /* its connection's fd, for forked children (psw_fork.c); without a monitor they keep it */
    static atomic_uint n_mon;
    char mon_ep[80];
    snprintf(mon_ep, sizeof mon_ep, "inproc://psw-monitor-%p-%u", (void *)c, atomic_fetch_add(&n_mon, 1));
    c->sh.mon[k] = ps_zmq_monitor(c->ctx, so, mon_ep,
                                  ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_CLOSED);
    if (!c->sh.mon[k]) PS_DEBUG("no monitor of psd shard %d's socket: %s", k, zmq_strerror(zmq_errno()));
    ps_zmq_endpoint_opts(so, ep);
    if (zmq_connect(so, ep) != 0) {
        snprintf(err, errlen, "cannot connect to psd shard %d at '%s': %s", k, ep, zmq_strerror(zmq_errno()));
        return -EINVAL;
    }
    return 0;
}

/* REGISTER with shard k (ep) until it answers with its ASSIGN, by deadline. */
static int shard_register(psw_client_t *c, int k, const char *ep, const uint8_t token[PS_SHM_TOKEN], double deadline,
                          double timeout_s, char *err, size_t errlen)
{
    int answered = 0;
    double next = 0;
    while (!answered) {
        double now = ps_now();
        if (now > deadline) {
            snprintf(err, errlen, "psd shard %d at %s did not answer in %.0f s", k, ep, timeout_s);
            return -ETIMEDOUT;
        }
        if (now >= next) {
            Psd__Header h;
            Psd__Register r = PSD__REGISTER__INIT;
            pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_REGISTER);
            r.pid = (uint32_t)getpid();
            r.version = PSD_VERSION;
            r.prev_rank = -1;
            r.shard_token.data = (uint8_t *)token;
            r.shard_token.len = PS_SHM_TOKEN;
            h.body_case = PSD__HEADER__BODY_REG;
            h.reg = &r;
            ps_msg_send(c->sh.sock[k], NULL, 0, &h, NULL, 0);
            next = now + 0.5;
        }
        zmq_pollitem_t it = {c->sh.sock[k], 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0) continue;
        ps_msg_t m;
        char why[256];
        if (ps_msg_recv(c->sh.sock[k], &m, false, ZMQ_DONTWAIT, why, sizeof why) != 0) continue;
        if (m.hdr->type == PSD__MSG_TYPE__MSG_ASSIGN && m.hdr->run_id == c->run_id && m.hdr->assign->rank == c->rank) {
            answered = 1;
            pswc_fork_drain(c, k); /* its CONNECTED came before this */
        } else if (m.hdr->type == PSD__MSG_TYPE__MSG_ERROR) {
            snprintf(err, errlen, "psd shard %d refused: %s", k, m.hdr->error->message ? m.hdr->error->message : "");
            ps_msg_deinit(&m);
            return -EPROTO;
        }
        ps_msg_deinit(&m);
    }
    return 0;
}

/* Connect to psd shards 1..n-1 (ASSIGN's endpoints) and register with each
 * (rank and token; repeated until it answers: shard 0 tells it about us on
 * its own connection, which may come later than ours). */
int pswc_shards_connect(psw_client_t *c, Psd__Assign *a, double timeout_s, char *err, size_t errlen)
{
    c->ops->close(c);
    if (a->n_shard_endpoints == 0) return 0;
    if (a->n_shard_endpoints >= PS_MAX_SHARDS || a->shard_token.len != PS_SHM_TOKEN) {
        snprintf(err, errlen, "psd sent an invalid list of shards");
        return -EPROTO;
    }
    c->sh.n = (int)a->n_shard_endpoints + 1;
    /* the table on psd: the model but the table (the last tensor), whose
     * rows asked for go to tbuf */
    size_t floats = c->table_on_psd ? c->layout.t[c->layout.table].offset : c->layout.n_params;
    c->sh.wbuf = calloc(floats ? floats : 1, sizeof *c->sh.wbuf);
    if (!c->sh.wbuf) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    memset(c->sh.got, 0, sizeof c->sh.got);
    c->sh.pending = 0;
    c->sh.rows = ps_shards_table_rows(&c->layout, c->sh.n);
    for (int k = 0; k < c->sh.n; k++) ps_shard_pieces(&c->layout, k, c->sh.n, c->sh.pieces[k]);
    uint8_t token[PS_SHM_TOKEN];
    int rc;
    memcpy(token, a->shard_token.data, sizeof token);
    for (int k = 1; k < c->sh.n; k++) {
        const char *ep = a->shard_endpoints[k - 1];
        char why[400];
        if (ps_endpoint_check(ep, PS_EP_CONNECT, why, sizeof why) != 0) {
            snprintf(err, errlen, "psd's ASSIGN names psd shard %d at %s", k, why);
            return -EPROTO;
        }
        if ((rc = shard_open(c, k, ep, err, errlen)) != 0) return rc;
    }
    double deadline = ps_now() + timeout_s;
    for (int k = 1; k < c->sh.n; k++)
        if ((rc = shard_register(c, k, a->shard_endpoints[k - 1], token, deadline, timeout_s, err, errlen)) != 0)
            return rc;
    PS_DEBUG("registered with %d psd shards", c->sh.n);
    return 0;
}

/* A push to psd shards: each shard gets one message with its pieces
 * (sent from the gradients without copies; none if it holds none of them:
 * then, when the push asks for the next version, a PULL for it instead).
 * With rows (rows[i].ids), a sparse-rows tensor goes
 * as rows: to each shard the ids and values of the rows in its piece
 * (slices of the caller's arrays; two empty frames when none are); with
 * want, each shard holding a piece of the table gets the rows of it the
 * next batch reads (a last frame, copied; empty when none), and answers
 * with those rows of its piece. */
static int shards_push(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                       const size_t *numel, const pswc_rows_t *rows, const uint32_t *want, size_t n_want)
{
    const void *src[PS_MAX_TENSORS];
    for (int i = 0; i < n; i++) {
        if (!pswc_layout_tensor(c, ids[i], numel[i])) return -EINVAL;
        src[i] = pswc_wire_grad(c, ids[i], grads[i], numel[i]);
    }
    size_t es = c->grad_bf16 ? 2 : 4;
    int pull = h->push->pull;
    for (int k = c->sh.n - 1; k >= 0; k--) { /* shard 0 last: its push completes the step's wait */
        ps_frame_t fr[2 * PS_MAX_TENSORS + 1];
        int m = 0, owed = 0; /* frames, and those sent without copies (pswc_push_frame_done) */
        h->push->want_rows = false;
        size_t wa = 0, wn = 0; /* want[wa, wa + wn): the rows of this shard's piece wanted */
        for (int i = 0; i < n; i++) {
            const ps_piece_t *p = &c->sh.pieces[k][ids[i]];
            if (p->n == 0) continue;
            size_t r0, r1;
            if (rows && rows[i].ids && ps_piece_rows(&c->layout, p, &r0, &r1)) {
                const uint32_t *row_ids = rows[i].ids;
                const float *row_vals = rows[i].vals;
                const size_t n_rows = rows[i].n;
                size_t a = pswc_first_row_at(row_ids, n_rows, r0), nr = pswc_first_row_at(row_ids, n_rows, r1) - a;
                size_t D = (size_t)c->layout.t[ids[i]].cols;
                void (*ffn)(void *, void *) = nr ? pswc_push_frame_done : NULL; /* none: two empty frames */
                fr[m++] = (ps_frame_t){.data = row_ids + a, .nbytes = nr * sizeof *row_ids, .ffn = ffn, .hint = c,
                                       .id = (uint32_t)ids[i], .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)nr};
                fr[m++] = (ps_frame_t){.data = row_vals + a * D, .nbytes = nr * D * sizeof(float), .ffn = ffn,
                                       .hint = c, .id = (uint32_t)ids[i], .dtype = PSD__DTYPE__DT_F32,
                                       .rows = (uint32_t)nr, .cols = (uint32_t)D};
                owed += nr ? 2 : 0;
                if (n_want && ids[i] == c->layout.table) {
                    wa = pswc_first_row_at(want, n_want, r0);
                    wn = pswc_first_row_at(want, n_want, r1) - wa;
                    h->push->want_rows = true;
                }
                continue;
            }
            fr[m++] = (ps_frame_t){.data = (const char *)src[i] + p->off * es, .nbytes = p->n * es,
                                   .ffn = pswc_push_frame_done, .hint = c, .id = (uint32_t)ids[i],
                                   .dtype = c->grad_bf16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32,
                                   .rows = c->layout.t[ids[i]].rows, .cols = pswc_tcols(c, ids[i]), .offset = p->off};
            owed++;
        }
        if (h->push->want_rows) /* the message's last frame */
            fr[m++] = (ps_frame_t){.data = want + wa, .nbytes = wn * sizeof *want, .id = (uint32_t)c->layout.table,
                                   .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)wn};
        if (c->layout.table < 0) ps_frames_small_first(fr, m);
        void *so = k ? c->sh.sock[k] : c->sock;
        int rc;
        if (m > 0) {
            atomic_fetch_add_explicit(&c->push_inflight, owed, memory_order_relaxed);
            rc = ps_msg_send(so, NULL, 0, h, fr, m);
        } else if (pull) { /* its part of the push came before: ask for the next version */
            rc = pswc_pull_on(c, so, k ? h->push->version + 1 : h->push->version, NULL, 0);
        } else {
            continue;
        }
        if (rc < 0) return rc;
    }
    return 0;
}

/* Shard k's part of a version (the first nf frames in cur) into wbuf,
 * checked against its pieces and, with crc, against the CRC-32 it sent.
 * With rows, its piece of the table is the rows of it the last push asked
 * for, scattered into wbuf (the others keep older values: the next batch
 * does not read them), or, with the table on psd, copied to their place in
 * tbuf; without the table's piece (skip_table) when the caller takes it. */
static int take_part(psw_client_t *c, int k, uint64_t version, uint32_t crc, bool rows, int nf, bool skip_table,
                     char *err, size_t errlen)
{
    uLong got = crc32(0L, Z_NULL, 0);
    int at[PS_MAX_TENSORS], taken = 0; /* frame at[t] holds tensor t (one frame a piece, rows or not) */
    if (pswc_frames_by_id(&c->cur, nf, c->layout.n_tensors, at) != 0) {
        snprintf(err, errlen, "psd shard %d sent weights frames that are not one of each of its pieces", k);
        return -EPROTO;
    }
    for (int t = 0; t < c->layout.n_tensors; t++) {
        const ps_piece_t *p = &c->sh.pieces[k][t];
        if (p->n == 0 || (skip_table && t == c->layout.table)) continue;
        const int f = at[t];
        if (f < 0) {
            snprintf(err, errlen, "psd shard %d sent no frame of its piece of tensor %d", k, t);
            return -EPROTO;
        }
        size_t n = 0, r0, r1, wa = 0, want_n = p->n;
        const bool as_rows = rows && t == c->layout.table && ps_piece_rows(&c->layout, p, &r0, &r1);
        const size_t D = as_rows ? (size_t)c->layout.t[t].cols : 0;
        if (as_rows) { /* the rows of want in this piece */
            wa = pswc_first_row_at(c->want, c->n_want, r0);
            want_n = (pswc_first_row_at(c->want, c->n_want, r1) - wa) * D;
        }
        const uint16_t *h16 = c->weight_bf16 ? ps_msg_bf16(&c->cur, f, &n) : NULL;
        const float *h32 = !c->weight_bf16 ? ps_msg_f32(&c->cur, f, &n) : NULL;
        if ((!h16 && !h32) || c->cur.hdr->tensors[f]->offset != (as_rows ? 0 : p->off) || n != want_n || (as_rows && (h16 || crc)) ||
            (c->table_on_psd && t == c->layout.table && !as_rows)) { /* never the table's piece whole then */
            snprintf(err, errlen, "psd shard %d sent an invalid weights frame %d (%zu values of tensor %d, %zu %s "
                     "expected)", k, f, n, t, want_n, as_rows ? "rows' values" : "of its piece");
            return -EPROTO;
        }
        taken++;
        if (as_rows && c->table_on_psd) {
            if (n) memcpy(c->sh.tbuf + wa * D, h32, n * sizeof(float));
            continue;
        }
        if (as_rows) {
            float *E = c->sh.wbuf + c->layout.t[t].offset;
            pswc_scatter_rows(E, D, c->want + wa, n / D, h32);
            continue;
        }
        float *dst = c->sh.wbuf + c->layout.t[t].offset + p->off;
        if (h16) ps_bf16_to_f32_n(dst, h16, n);
        else memcpy(dst, h32, n * sizeof(float));
        if (h16 && c->w16) memcpy(c->w16 + c->layout.t[t].offset + p->off, h16, n * sizeof *h16); /* as it came */
        if (crc) got = crc32_z(got, zmq_msg_data(&c->cur.frames[f]), zmq_msg_size(&c->cur.frames[f]));
    }
    if (taken != nf) {
        snprintf(err, errlen, "psd shard %d sent %d weights frames, it holds %d pieces", k, nf, taken);
        return -EPROTO;
    }
    if (crc && (uint32_t)got != crc) {
        snprintf(err, errlen, "weights of version %llu from psd shard %d do not match its checksum: torn or corrupted "
                 "in transit", (unsigned long long)version, k);
        return -EPROTO;
    }
    if (crc) c->verified++;
    c->sh.got[k] = version + 1;
    c->sh.rows_part = rows ? c->sh.rows_part | (1u << k) : c->sh.rows_part & ~(1u << k);
    return 0;
}

/* With shards: the pending event, once every part of its version is here. */
static int parts_done(psw_client_t *c, pswc_event_t *ev)
{
    if (!c->sh.pending) return 0;
    for (int k = 0; k < c->sh.n; k++) /* a validation reads the whole table: no part of rows only */
        if (c->sh.got[k] != c->sh.pend.version + 1 ||
            (c->sh.pend.kind == PSW_EV_VALIDATE && !c->table_on_psd && (c->sh.rows_part & (1u << k))))
            return 0;
    *ev = c->sh.pend;
    c->sh.pending = 0;
    ev->n_tensors = c->layout.n_tensors;
    for (int t = 0; t < c->layout.n_tensors; t++) {
        ev->tensors[t] = c->sh.wbuf + c->layout.t[t].offset;
        ev->tensor_numel[t] = c->layout.t[t].numel;
    }
    if (c->table_on_psd) { /* the rows asked for (a batch's, or the validation part's), in tbuf */
        const int t = c->layout.table;
        ev->tensors[t] = c->sh.tbuf;
        ev->tensor_numel[t] = c->n_want * (size_t)c->layout.t[t].cols;
        ev->row_ids = c->want;
        ev->n_row_ids = c->n_want;
        c->n_want = 0;
    }
    if (ev->kind == PSW_EV_WEIGHTS) {
        c->n_want = 0; /* the rows asked for came */
        c->t_weights = ps_now();
        c->wait = c->t_req > 0 ? c->t_weights - c->t_req : 0;
        c->t_req = 0;
    }
    return 1;
}

/* VALIDATE from shard 0 with the table on psd: its pieces but the table's,
 * then the ids of the rows the part's examples read (all of them) and the
 * values of those in shard 0's piece of the table (none maybe). The ids
 * become the rows asked for (the other shards are asked for theirs), the
 * values go to their place in tbuf. */
static int take_val_part0(psw_client_t *c, uint64_t v, char *err, size_t errlen)
{
    const int t = c->layout.table, nf = c->cur.n_frames;
    const size_t D = (size_t)c->layout.t[t].cols;
    size_t k = 0, nv = 0, a = 0, m = 0;
    const uint32_t *ids = nf >= 2 && c->cur.hdr->tensors[nf - 2]->id == (uint32_t)t
                              ? ps_msg_u32(&c->cur, nf - 2, &k) : NULL;
    const float *vals = ids && c->cur.hdr->tensors[nf - 1]->id == (uint32_t)t ? ps_msg_f32(&c->cur, nf - 1, &nv) : NULL;
    if (!vals || (k && !pswc_table_rows(c, ids, k))) {
        snprintf(err, errlen, "psd sent an invalid validation part (the table's rows)");
        return -EPROTO;
    }
    int rc = pswc_keep_want(c, ids, k);
    if (rc < 0) {
        snprintf(err, errlen, "out of memory for a validation part's table rows");
        return rc;
    }
    shard_slice(c, 0, c->want, k, &a, &m);
    if (nv != m * D) {
        snprintf(err, errlen, "psd sent %zu values for the %zu rows of its piece a validation part reads", nv / D, m);
        return -EPROTO;
    }
    if (nv) memcpy(c->sh.tbuf + a * D, vals, nv * sizeof(float));
    return take_part(c, 0, v, 0, false, nf - 2, true, err, errlen);
}

/* With shards (pswc_ops_t.take): a message of cur, from shard c->from. 1:
 * *ev is an event to return; 0: wait for more; < 0: error. */
static int shard_message(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen)
{
    Psd__Header *h = c->cur.hdr;
    int k = c->from;
    if (k > 0) {
        if (h->type != PSD__MSG_TYPE__MSG_WEIGHTS) {
            PS_WARN("dropped an unexpected %s from psd shard %d", ps_msg_type_name((int)h->type), k);
            return 0;
        }
        int rc = take_part(c, k, h->weights->version, h->weights->crc, h->weights->rows, c->cur.n_frames, false, err,
                           errlen);
        return rc < 0 ? rc : parts_done(c, ev);
    }
    bool val = h->type == PSD__MSG_TYPE__MSG_VALIDATE;
    uint64_t v = val ? h->validate->version : h->weights->version;
    if (val && c->sh.pending && c->sh.pend.kind == PSW_EV_VALIDATE) { /* after the one waiting */
        if (!c->sh.defer && !(c->sh.defer = calloc(PSW_MAX_DEFER, sizeof *c->sh.defer))) {
            snprintf(err, errlen, "out of memory");
            return -ENOMEM;
        }
        if (c->sh.n_defer == PSW_MAX_DEFER) {
            snprintf(err, errlen, "psd sent more than %d validation parts at once", PSW_MAX_DEFER);
            return -EPROTO;
        }
        pswc_msg_move(&c->sh.defer[c->sh.n_defer++], &c->cur);
        return 0;
    }
    if (val && c->table_on_psd != h->validate->rows) {
        snprintf(err, errlen, "psd sent a validation part with%s the table's rows", h->validate->rows ? "" : "out");
        return -EPROTO;
    }
    int rc = val && c->table_on_psd
                 ? take_val_part0(c, v, err, errlen)
                 : take_part(c, 0, v, val ? h->validate->crc : h->weights->crc, !val && h->weights->rows,
                             c->cur.n_frames, false, err, errlen);
    if (rc < 0) return rc;
    if (c->sh.pending && (c->sh.pend.kind != (val ? PSW_EV_VALIDATE : PSW_EV_WEIGHTS) || c->sh.pend.version != v))
        PS_WARN("psd sent %s of version %llu while its %s of version %llu waited for the shards' parts: that one is "
                "dropped", val ? "VALIDATE" : "WEIGHTS", (unsigned long long)v,
                c->sh.pend.kind == PSW_EV_VALIDATE ? "VALIDATE" : "WEIGHTS", (unsigned long long)c->sh.pend.version);
    memset(&c->sh.pend, 0, sizeof c->sh.pend);
    c->sh.pend.kind = val ? PSW_EV_VALIDATE : PSW_EV_WEIGHTS;
    c->sh.pend.version = v;
    if (val) {
        c->sh.pend.epoch = h->validate->epoch;
        if ((rc = pswc_take_val_ids(c, h->validate, &c->sh.pend, err, errlen)) < 0) return rc;
        for (int j = 1; j < c->sh.n; j++) { /* the other parts of that version */
            size_t a = 0, m = 0;
            if (c->table_on_psd) { /* and the rows of their pieces the part reads */
                shard_slice(c, j, c->want, c->n_want, &a, &m);
                c->sh.got[j] = 0;
            }
            if ((c->sh.got[j] != v + 1 || (c->sh.rows_part & (1u << j))) &&
                (rc = pswc_pull_on(c, c->sh.sock[j], v, m ? c->want + a : NULL, m)) < 0)
                return rc;
        }
    } else {
        c->sh.pend.step = h->weights->step;
    }
    c->sh.pending = 1;
    return parts_done(c, ev);
}

/* Polling: every shard's socket but shard 0's (psd's, c->sock) */
static int shards_poll_add(psw_client_t *c, zmq_pollitem_t *it, int ni)
{
    for (int k = 1; k < c->sh.n; k++) it[ni++] = (zmq_pollitem_t){c->sh.sock[k], 0, ZMQ_POLLIN, 0};
    return ni;
}

/* A shard's message, from the first of it (shards 1..n-1) poll found readable */
static int shards_recv_polled(psw_client_t *c, const zmq_pollitem_t *it, char *err, size_t errlen)
{
    for (int k = 1; k < c->sh.n; k++)
        if (it[k - 1].revents & ZMQ_POLLIN) {
            char why[256];
            int rc = ps_msg_recv(c->sh.sock[k], &c->cur, false, ZMQ_DONTWAIT, why, sizeof why);
            if (rc == -EPROTO) PS_WARN("dropped a malformed message from psd shard %d: %s", k, why);
            if (rc < 0) return PSWC_NONE;
            c->from = k;
            break;
        }
    if (c->from == 0) return PSWC_NONE;
    Psd__Header *h = c->cur.hdr;
    if (h->protocol != c->protocol || (c->run_id && h->run_id != c->run_id)) {
        PS_WARN("dropped a message from psd shard %d of another protocol or run", c->from);
        ps_msg_deinit(&c->cur);
        return PSWC_AGAIN;
    }
    ps_tcp_cc_conn(&c->tcp_fd[c->from], c->cur.srcfd, c->tcp_cc, false);
    if (c->cur.srcfd >= 0 && c->cur.srcfd != c->conn[c->from].fd) pswc_fork_drain(c, c->from); /* reconnected */
    if (h->type == PSD__MSG_TYPE__MSG_ERROR) {
        snprintf(err, errlen, "psd shard %d refused: %s", c->from,
                 h->error->message && h->error->message[0] ? h->error->message : "(no reason)");
        return -EPROTO;
    }
    return PSWC_GOT;
}

/* The next message: a validation part that came while another waited, or psd's or a shard's */
static int shards_next_msg(psw_client_t *c, double deadline, double timeout_s, char *err, size_t errlen)
{
    if (c->sh.n_defer == 0 || c->sh.pending) return pswc_recv_msg(c, deadline, timeout_s, err, errlen);
    ps_msg_deinit(&c->cur);
    pswc_msg_move(&c->cur, &c->sh.defer[0]);
    for (int i = 1; i < c->sh.n_defer; i++) pswc_msg_move(&c->sh.defer[i - 1], &c->sh.defer[i]);
    c->sh.n_defer--;
    c->from = 0;
    return 0;
}

static int shards_pull(psw_client_t *c, uint64_t min_version)
{
    for (int k = 1; k < c->sh.n; k++) { /* and from every other shard */
        int rc = pswc_pull_on(c, c->sh.sock[k], min_version, NULL, 0);
        if (rc < 0) return rc;
    }
    return pswc_pull_on(c, c->sock, min_version, NULL, 0);
}

/* Each shard the rows of its piece; a part of this version that came
 * before brought other rows, so every part must come again */
static int shards_pull_rows(psw_client_t *c, uint64_t min_version, size_t n)
{
    memset(c->sh.got, 0, sizeof c->sh.got);
    for (int k = c->sh.n - 1; k >= 0; k--) {
        size_t a = 0, m = 0;
        shard_slice(c, k, c->want, n, &a, &m);
        int rc = pswc_pull_on(c, k ? c->sh.sock[k] : c->sock, min_version, m ? c->want + a : NULL, m);
        if (rc < 0) return rc;
    }
    return 0;
}

/* The table on psd: the shards' rows are put together in tbuf (without
 * it, wbuf holds the table) */
static int shards_rows_room(psw_client_t *c, size_t n)
{
    if (n > c->sh.tbuf_cap && c->table_on_psd) {
        float *b = realloc(c->sh.tbuf, n * (size_t)c->layout.t[c->layout.table].cols * sizeof *b);
        if (!b) return -ENOMEM;
        c->sh.tbuf = b;
        c->sh.tbuf_cap = n;
    }
    return 0;
}

static bool shards_rows_ok(const psw_client_t *c) { return c->sh.rows; }

const pswc_ops_t pswc_shards_ops = {
    .name = "psd shards",
    .stream = false,
    .poll_add = shards_poll_add,
    .recv_polled = shards_recv_polled,
    .next_msg = shards_next_msg,
    .take = shard_message,
    .push = shards_push,
    .pull = shards_pull,
    .pull_rows = shards_pull_rows,
    .rows_room = shards_rows_room,
    .rows_ok = shards_rows_ok,
    .close = shards_close,
};
