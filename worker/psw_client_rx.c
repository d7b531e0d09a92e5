/* psw_client_rx.c - what the worker library receives (see psw_client_int.h):
 * weights and table rows, whole or by psd shard or streamed chunk by chunk,
 * checked and turned into the events psw_client_next returns. */
#include "psw_client_int.h"

#include <math.h>

/* Move m's header and frames into an empty dst (m is left empty). */
static void msg_move(ps_msg_t *dst, ps_msg_t *m)
{
    dst->hdr = m->hdr;
    dst->arena = m->arena;
    dst->n_frames = m->n_frames;
    for (int i = 0; i < m->n_frames; i++) {
        zmq_msg_init(&dst->frames[i]);
        zmq_msg_move(&dst->frames[i], &m->frames[i]);
        zmq_msg_close(&m->frames[i]);
    }
    m->hdr = NULL;
    m->arena = NULL;
    m->n_frames = 0;
}

/* The frame of each tensor among the first nf frames of m, by their
 * descriptors' ids (protocol 5: in any order, smallest first): at[t], or -1
 * for a tensor none holds. 0, or -1 if a frame names no tensor of the model
 * or one named before. */
static int frames_by_id(const ps_msg_t *m, int nf, int n_tensors, int at[PS_MAX_TENSORS])
{
    for (int t = 0; t < PS_MAX_TENSORS; t++) at[t] = -1;
    for (int f = 0; f < nf; f++) {
        uint32_t id = m->hdr->tensors[f]->id;
        if (id >= (uint32_t)n_tensors || at[id] >= 0) return -1;
        at[id] = f;
    }
    return 0;
}

/* Tensor frames of a WEIGHTS/VALIDATE message: one per tensor of the
 * model, each of its size (but the table's with `rows`: take_rows checks
 * it), and, when psd sends one (psd --x-verify-weights), matching the CRC-32
 * of the version they claim to be: a frame psd changed while ZeroMQ was
 * still sending it would show here. */
static int take_tensors(psw_client_t *c, pswc_event_t *ev, uint32_t slot, uint32_t crc, bool rows, char *err,
                        size_t errlen)
{
    uLong got = crc32(0L, Z_NULL, 0); /* over what came: the frames as sent, or the shared slot */
    if (slot) { /* in psd's shared slot `slot - 1` */
        if (!c->shm || slot > c->slots || c->cur.n_frames != 0) {
            snprintf(err, errlen, "psd sent weights in shared slot %u this worker does not have", slot);
            return -EPROTO;
        }
        const float *base = c->shm_w + (size_t)(slot - 1) * c->slot_floats;
        ev->n_tensors = c->layout.n_tensors;
        for (int i = 0; i < ev->n_tensors; i++) {
            ev->tensors[i] = base + c->layout.t[i].offset;
            ev->tensor_numel[i] = c->layout.t[i].numel;
        }
        if (crc) got = ps_layout_crc32(&c->layout, base);
    } else if (c->cur.n_frames != c->layout.n_tensors) {
        snprintf(err, errlen, "psd sent %d weights frames for a model of %d tensors", c->cur.n_frames,
                 c->layout.n_tensors);
        return -EPROTO;
    } else {
        ev->n_tensors = c->cur.n_frames;
    }
    int at[PS_MAX_TENSORS];
    if (frames_by_id(&c->cur, c->cur.n_frames, c->layout.n_tensors, at) != 0) {
        snprintf(err, errlen, "psd sent weights frames that are not one of each tensor");
        return -EPROTO;
    }
    for (int i = 0; i < c->cur.n_frames; i++) { /* tensor i, in frame at[i] */
        const int f = at[i];
        size_t n = 0;
        const float *p = NULL;
        const uint16_t *h = c->weight_bf16 ? ps_msg_bf16(&c->cur, f, &n) : NULL;
        if (h && i < c->layout.n_tensors && n == c->layout.t[i].numel) { /* bfloat16: widened here */
            float *dst = c->wconv + c->layout.t[i].offset;
            ps_bf16_to_f32_n(dst, h, n);
            p = dst;
        } else if (!c->weight_bf16) {
            p = ps_msg_f32(&c->cur, f, &n);
        }
        if (!p || c->cur.hdr->tensors[f]->offset || (n != c->layout.t[i].numel && !(rows && i == c->layout.table))) {
            snprintf(err, errlen, "psd sent an invalid weights frame %d (tensor %d)", f, i);
            return -EPROTO;
        }
        if (crc) got = crc32_z(got, zmq_msg_data(&c->cur.frames[f]), zmq_msg_size(&c->cur.frames[f]));
        ev->tensors[i] = p;
        ev->tensor_numel[i] = n;
    }
    if (crc) {
        if ((uint32_t)got != crc) {
            snprintf(err, errlen, "weights of version %llu do not match psd's checksum (%08x, received %08x): "
                     "torn or corrupted in transit", (unsigned long long)ev->version, crc, (unsigned)got);
            return -EPROTO;
        }
        c->verified++;
    }
    return 0;
}

/* Rows ids[0..n) of table E (D floats a row) from vals (n x D). */
static void scatter_rows(float *E, size_t D, const uint32_t *ids, size_t n, const float *vals)
{
    for (size_t j = 0; j < n; j++) memcpy(E + (size_t)ids[j] * D, vals + j * D, D * sizeof(float));
}

/* WEIGHTS with rows: the table's frame holds the rows the last push asked
 * for, in its order. Scattered into the replica, which the event then
 * gives as the table: the rows the next batch reads are this version's;
 * the others are older, and nothing reads them. */
static int take_rows(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen)
{
    const int t = c->layout.table;
    const size_t D = t >= 0 ? (size_t)c->layout.t[t].cols : 0;
    if (t < 0 || (!c->n_want && !c->table_on_psd) || ev->n_tensors != c->layout.n_tensors ||
        ev->tensor_numel[t] != c->n_want * D) {
        snprintf(err, errlen, "psd sent table rows this worker did not ask for");
        return -EPROTO;
    }
    if (c->table_on_psd) { /* the rows themselves are the event's table */
        ev->row_ids = c->want;
        ev->n_row_ids = c->n_want;
        return 0;
    }
    scatter_rows(c->replica, D, c->want, c->n_want, ev->tensors[t]);
    ev->tensors[t] = c->replica;
    ev->tensor_numel[t] = c->layout.t[t].numel;
    return 0;
}

/* VALIDATE with rows (the table on psd): the MLP's tensors, then the rows
 * the range's examples read (ids strictly increasing) and their values. */
static int take_val_rows(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen)
{
    const ps_layout_t *l = &c->layout;
    const int t = l->table;
    size_t n = 0, k = 0, nv = 0;
    const uint32_t *ids = c->cur.n_frames == l->n_tensors + 1 ? ps_msg_u32(&c->cur, t, &k) : NULL;
    const float *vals = ids ? ps_msg_f32(&c->cur, t + 1, &nv) : NULL;
    bool ok = vals && c->cur.hdr->tensors[t]->id == (uint32_t)t && c->cur.hdr->tensors[t + 1]->id == (uint32_t)t &&
              nv == k * (size_t)l->t[t].cols && (k == 0 || pswc_table_rows(c, ids, k));
    for (int i = 0; ok && i < t; i++) {
        const float *p = ps_msg_f32(&c->cur, i, &n);
        ok = p && c->cur.hdr->tensors[i]->id == (uint32_t)i && n == l->t[i].numel;
        ev->tensors[i] = p;
        ev->tensor_numel[i] = n;
    }
    if (!ok) {
        snprintf(err, errlen, "psd sent an invalid validation part (the table's rows)");
        return -EPROTO;
    }
    ev->n_tensors = l->n_tensors;
    ev->tensors[t] = vals;
    ev->tensor_numel[t] = nv;
    ev->row_ids = ids;
    ev->n_row_ids = k;
    return 0;
}

uint64_t psw_client_verified(const psw_client_t *c) { return c->verified; }

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
    if (frames_by_id(&c->cur, nf, c->layout.n_tensors, at) != 0) {
        snprintf(err, errlen, "psd shard %d sent weights frames that are not one of each of its pieces", k);
        return -EPROTO;
    }
    for (int t = 0; t < c->layout.n_tensors; t++) {
        const ps_piece_t *p = &c->pieces[k][t];
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
            if (n) memcpy(c->tbuf + wa * D, h32, n * sizeof(float));
            continue;
        }
        if (as_rows) {
            float *E = c->wbuf + c->layout.t[t].offset;
            scatter_rows(E, D, c->want + wa, n / D, h32);
            continue;
        }
        float *dst = c->wbuf + c->layout.t[t].offset + p->off;
        if (h16) ps_bf16_to_f32_n(dst, h16, n);
        else memcpy(dst, h32, n * sizeof(float));
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
    c->got[k] = version + 1;
    c->rows_part = rows ? c->rows_part | (1u << k) : c->rows_part & ~(1u << k);
    return 0;
}

/* Streamed weights: the whole tensors of a WEIGHTS in parts, kept where
 * they arrived (valid until the next version's first part comes). 1: the
 * version is complete (*ev set), 0: more to come, < 0: error. */
static int stream_part(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen)
{
    const Psd__Weights *wt = c->cur.hdr->weights;
    const int nt = c->layout.n_tensors;
    if (!c->stream_cf || c->weight_bf16 || wt->parts != (uint32_t)nt || wt->shm_slot) {
        snprintf(err, errlen, "psd sent weights in %u parts this worker does not expect", wt->parts);
        return -EPROTO;
    }
    if (c->sver != wt->version + 1) {
        if (c->smask && !c->sdone) {
            snprintf(err, errlen, "psd sent parts of version %llu before all of version %llu",
                     (unsigned long long)wt->version, (unsigned long long)(c->sver - 1));
            return -EPROTO;
        }
        pswc_stream_release(c); /* the last version's tensors: the caller is done with them */
        c->sver = wt->version + 1;
        c->scrc = 0;
    }
    for (int i = 0; i < c->cur.n_frames; i++) {
        const Psd__TensorDesc *d = c->cur.hdr->tensors[i];
        size_t n = 0;
        if (!ps_msg_f32(&c->cur, i, &n) || d->id >= (uint32_t)nt || d->offset || n != c->layout.t[d->id].numel ||
            (c->smask & (1ull << d->id))) {
            snprintf(err, errlen, "psd sent an invalid or repeated weights tensor (frame %d)", i);
            return -EPROTO;
        }
        zmq_msg_init(&c->sheld[d->id]);
        zmq_msg_move(&c->sheld[d->id], &c->cur.frames[i]);
        c->smask |= 1ull << d->id;
    }
    if (wt->crc) c->scrc = wt->crc;
    if (c->sdone || c->smask != (nt == 64 ? ~0ull : (1ull << nt) - 1)) return 0;
    c->sdone = 1;
    ev->kind = PSW_EV_WEIGHTS;
    ev->version = wt->version;
    ev->step = wt->step;
    ev->n_tensors = nt;
    uLong got = crc32(0L, Z_NULL, 0);
    for (int t = 0; t < nt; t++) {
        ev->tensors[t] = zmq_msg_data(&c->sheld[t]);
        ev->tensor_numel[t] = c->layout.t[t].numel;
        if (c->scrc) got = crc32_z(got, (const Bytef *)ev->tensors[t], ev->tensor_numel[t] * sizeof(float));
    }
    if (c->scrc) {
        if ((uint32_t)got != c->scrc) {
            snprintf(err, errlen, "weights of version %llu do not match psd's checksum (%08x, received %08x): "
                     "torn or corrupted in transit", (unsigned long long)ev->version, c->scrc, (unsigned)got);
            return -EPROTO;
        }
        c->verified++;
    }
    c->t_weights = ps_now();
    c->wait = c->t_req > 0 ? c->t_weights - c->t_req : 0;
    c->t_req = 0;
    return 1;
}

/* With shards: the pending event, once every part of its version is here. */
static int parts_done(psw_client_t *c, pswc_event_t *ev)
{
    if (!c->pending) return 0;
    for (int k = 0; k < c->n_shards; k++) /* a validation reads the whole table: no part of rows only */
        if (c->got[k] != c->pend.version + 1 ||
            (c->pend.kind == PSW_EV_VALIDATE && !c->table_on_psd && (c->rows_part & (1u << k))))
            return 0;
    *ev = c->pend;
    c->pending = 0;
    ev->n_tensors = c->layout.n_tensors;
    for (int t = 0; t < c->layout.n_tensors; t++) {
        ev->tensors[t] = c->wbuf + c->layout.t[t].offset;
        ev->tensor_numel[t] = c->layout.t[t].numel;
    }
    if (c->table_on_psd) { /* the rows asked for (a batch's, or the validation part's), in tbuf */
        const int t = c->layout.table;
        ev->tensors[t] = c->tbuf;
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
    pswc_shard_slice(c, 0, c->want, k, &a, &m);
    if (nv != m * D) {
        snprintf(err, errlen, "psd sent %zu values for the %zu rows of its piece a validation part reads", nv / D, m);
        return -EPROTO;
    }
    if (nv) memcpy(c->tbuf + a * D, vals, nv * sizeof(float));
    return take_part(c, 0, v, 0, false, nf - 2, true, err, errlen);
}

/* With shards: a message of cur, from shard c->from. 1: *ev is an event to
 * return; 0: wait for more; < 0: error. */
/* A VALIDATE's part: its range, split and samples (kept in c->val_ids:
 * the message may go before the event does, with psd shards). */
static int take_val_ids(psw_client_t *c, const Psd__Validate *v, pswc_event_t *ev, char *err, size_t errlen)
{
    const bool val = v->split == PSD__SPLIT__SPLIT_VAL;
    const uint64_t n = v->end - v->begin;
    if (v->end < v->begin || (v->split != PSD__SPLIT__SPLIT_TEST && !val) || (val && v->n_ids != n) ||
        (!val && (v->n_ids != 0 || v->end > (uint64_t)UINT32_MAX + 1)) || n > SIZE_MAX / sizeof(uint32_t)) {
        snprintf(err, errlen, "psd sent an invalid validation part");
        return -EPROTO;
    }
    if (n > c->val_ids_cap) {
        uint32_t *p = realloc(c->val_ids, (size_t)n * sizeof *p);
        if (!p) {
            snprintf(err, errlen, "out of memory for %llu validation samples", (unsigned long long)n);
            return -ENOMEM;
        }
        c->val_ids = p;
        c->val_ids_cap = (size_t)n;
    }
    if (val && n) memcpy(c->val_ids, v->ids, (size_t)n * sizeof *c->val_ids);
    for (uint64_t i = 0; !val && i < n; i++) c->val_ids[i] = (uint32_t)(v->begin + i);
    ev->val_begin = v->begin;
    ev->val_end = v->end;
    ev->split = val ? PSW_SPLIT_VAL : PSW_SPLIT_TEST;
    ev->final = v->final;
    ev->val_ids = c->val_ids;
    ev->n_val_ids = (size_t)n;
    return 0;
}

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
    if (val && c->pending && c->pend.kind == PSW_EV_VALIDATE) { /* after the one waiting */
        if (!c->defer && !(c->defer = calloc(PSW_MAX_DEFER, sizeof *c->defer))) {
            snprintf(err, errlen, "out of memory");
            return -ENOMEM;
        }
        if (c->n_defer == PSW_MAX_DEFER) {
            snprintf(err, errlen, "psd sent more than %d validation parts at once", PSW_MAX_DEFER);
            return -EPROTO;
        }
        msg_move(&c->defer[c->n_defer++], &c->cur);
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
    if (c->pending && (c->pend.kind != (val ? PSW_EV_VALIDATE : PSW_EV_WEIGHTS) || c->pend.version != v))
        PS_WARN("psd sent %s of version %llu while its %s of version %llu waited for the shards' parts: that one is "
                "dropped", val ? "VALIDATE" : "WEIGHTS", (unsigned long long)v,
                c->pend.kind == PSW_EV_VALIDATE ? "VALIDATE" : "WEIGHTS", (unsigned long long)c->pend.version);
    memset(&c->pend, 0, sizeof c->pend);
    c->pend.kind = val ? PSW_EV_VALIDATE : PSW_EV_WEIGHTS;
    c->pend.version = v;
    if (val) {
        c->pend.epoch = h->validate->epoch;
        if ((rc = take_val_ids(c, h->validate, &c->pend, err, errlen)) < 0) return rc;
        for (int j = 1; j < c->n_shards; j++) { /* the other parts of that version */
            size_t a = 0, m = 0;
            if (c->table_on_psd) { /* and the rows of their pieces the part reads */
                pswc_shard_slice(c, j, c->want, c->n_want, &a, &m);
                c->got[j] = 0;
            }
            if ((c->got[j] != v + 1 || (c->rows_part & (1u << j))) &&
                (rc = pswc_pull_on(c, c->ssock[j], v, m ? c->want + a : NULL, m)) < 0)
                return rc;
        }
    } else {
        c->pend.step = h->weights->step;
    }
    c->pending = 1;
    return parts_done(c, ev);
}

/* psd's last validation (EPOCH, SHUTDOWN: v, NULL for none) into ev,
 * the names copied into the client (valid until the next event). */
static int take_last_val(psw_client_t *c, const Psd__ValSums *v, pswc_event_t *ev, char *err, size_t errlen)
{
    if (!v) return 0;
    if (v->n_sums > PSW_MAX_SUMS || v->correct > v->count || !isfinite(v->loss_sum)) {
        snprintf(err, errlen, "psd sent invalid figures of its last validation");
        return -EPROTO;
    }
    for (size_t i = 0; i < v->n_sums; i++) {
        const Psd__NamedSum *x = v->sums[i];
        if (!x->name || !x->name[0] || strlen(x->name) > PSW_SUM_NAME_MAX) {
            snprintf(err, errlen, "psd sent a named sum of its last validation without a valid name");
            return -EPROTO;
        }
        memcpy(c->lv_names[i], x->name, strlen(x->name) + 1);
        c->lv_sums[i] = (psw_sum_t){.name = c->lv_names[i], .value = x->value};
    }
    ev->has_last_val = 1;
    ev->last_val = (psw_val_t){.epoch = v->epoch, .split = v->split == PSD__SPLIT__SPLIT_VAL ? PSW_SPLIT_VAL
                                                                                             : PSW_SPLIT_TEST,
                               .loss_sum = v->loss_sum, .correct = v->correct, .count = v->count,
                               .n_sums = (int)v->n_sums, .sums = v->n_sums ? c->lv_sums : NULL};
    ev->last_val_final = v->final;
    return 0;
}

static int next_event(psw_client_t *c, pswc_event_t *ev, double timeout_s, char *err, size_t errlen)
{
    for (double deadline = ps_now() + timeout_s;;) {
        int rc = 0;
        if (c->n_defer > 0 && !c->pending) { /* a validation part that came while another waited */
            ps_msg_deinit(&c->cur);
            msg_move(&c->cur, &c->defer[0]);
            for (int i = 1; i < c->n_defer; i++) msg_move(&c->defer[i - 1], &c->defer[i]);
            c->n_defer--;
            c->from = 0;
        } else {
            rc = pswc_recv_msg(c, deadline, timeout_s, err, errlen);
        }
        if (rc < 0) return rc;
        Psd__Header *h = c->cur.hdr;
        memset(ev, 0, sizeof *ev);
        if (c->n_shards > 1 && (c->from > 0 || h->type == PSD__MSG_TYPE__MSG_WEIGHTS ||
                                h->type == PSD__MSG_TYPE__MSG_VALIDATE)) {
            rc = shard_message(c, ev, err, errlen);
            if (rc < 0) return rc;
            if (rc > 0) return 0;
            continue;
        }
        switch (h->type) {
        case PSD__MSG_TYPE__MSG_EPOCH: {
            size_t n = 0;
            const uint32_t *ids = c->cur.n_frames == 1 ? ps_msg_u32(&c->cur, 0, &n) : NULL;
            if (!ids && c->cur.n_frames != 0) {
                snprintf(err, errlen, "psd sent an invalid epoch message");
                return -EPROTO;
            }
            ev->kind = PSW_EV_EPOCH;
            ev->epoch = h->epoch->epoch;
            ev->version = h->epoch->version;
            ev->world = h->epoch->world;
            ev->workers_on_host = h->epoch->workers_on_host;
            ev->samples = ids;
            ev->n_samples = ids ? n : 0;
            ev->append = h->epoch->append;
            ev->keep = h->epoch->keep;
            if (ev->keep > 0 && (!ev->append || ev->n_samples > 0)) {
                snprintf(err, errlen, "psd sent an invalid epoch message (keep without append, or with samples)");
                return -EPROTO;
            }
            return take_last_val(c, h->epoch->last_val, ev, err, errlen);
        }
        case PSD__MSG_TYPE__MSG_WEIGHTS:
            if (h->weights->parts > 0) {
                rc = stream_part(c, ev, err, errlen);
                if (rc < 0) return rc;
                if (rc > 0) return 0;
                continue;
            }
            ev->kind = PSW_EV_WEIGHTS;
            c->t_weights = ps_now();
            c->wait = c->t_req > 0 ? c->t_weights - c->t_req : 0;
            c->t_req = 0;
            ev->version = h->weights->version;
            ev->step = h->weights->step;
            if (c->table_on_psd && !h->weights->rows) {
                snprintf(err, errlen, "psd sent the whole table to a worker that holds only rows of it");
                return -EPROTO;
            }
            rc = take_tensors(c, ev, h->weights->shm_slot, h->weights->crc, h->weights->rows, err, errlen);
            if (rc == 0 && h->weights->rows) rc = take_rows(c, ev, err, errlen);
            c->n_want = 0;
            return rc;
        case PSD__MSG_TYPE__MSG_VALIDATE:
            ev->kind = PSW_EV_VALIDATE;
            ev->epoch = h->validate->epoch;
            ev->version = h->validate->version;
            if ((rc = take_val_ids(c, h->validate, ev, err, errlen)) < 0) return rc;
            if (c->table_on_psd != h->validate->rows) {
                snprintf(err, errlen, "psd sent a validation part with%s the table's rows",
                         h->validate->rows ? "" : "out");
                return -EPROTO;
            }
            if (h->validate->rows) return take_val_rows(c, ev, err, errlen);
            return take_tensors(c, ev, h->validate->shm_slot, h->validate->crc, false, err, errlen);
        case PSD__MSG_TYPE__MSG_HEARTBEAT: /* psd is there, and this worker waits on it: wait on */
            deadline = ps_now() + timeout_s;
            continue;
        case PSD__MSG_TYPE__MSG_SHUTDOWN:
            ev->kind = PSW_EV_SHUTDOWN;
            ev->exit_code = h->shutdown->exit_code;
            snprintf(ev->message, sizeof ev->message, "%s",
                     h->shutdown->reason ? h->shutdown->reason : "");
            return take_last_val(c, h->shutdown->last_val, ev, err, errlen);
        default:
            PS_WARN("dropped an unexpected %s from psd", ps_msg_type_name((int)h->type));
            continue;
        }
    }
}

/* iv (by unit) as the caller sees it (by tensor of the table) */
static void to_table(psw_client_t *c, const pswc_event_t *iv, psw_event_t *ev)
{
    const ps_layout_t *l = &c->layout;
    memset(ev, 0, sizeof *ev);
    ev->kind = iv->kind;
    ev->epoch = iv->epoch;
    ev->version = iv->version;
    ev->step = iv->step;
    ev->world = iv->world;
    ev->workers_on_host = iv->workers_on_host;
    ev->samples = iv->samples;
    ev->n_samples = iv->n_samples;
    ev->append = iv->append;
    ev->keep = iv->keep;
    ev->val_begin = iv->val_begin;
    ev->val_end = iv->val_end;
    ev->split = iv->split;
    ev->final = iv->final;
    ev->val_ids = iv->val_ids;
    ev->n_val_ids = iv->n_val_ids;
    ev->row_ids = iv->row_ids;
    ev->n_row_ids = iv->n_row_ids;
    ev->exit_code = iv->exit_code;
    memcpy(ev->message, iv->message, sizeof ev->message);
    ev->has_last_val = iv->has_last_val;
    ev->last_val = iv->last_val;
    ev->last_val_final = iv->last_val_final;
    const int nt = c->ev_t ? ps_layout_ntab(l) : 0;
    ev->tensors = c->ev_t; /* always the arrays: NULLs in an event without tensors */
    ev->tensor_numel = c->ev_n;
    if (iv->n_tensors != l->n_tensors || !nt) {
        if (nt && c->ev_t[0]) { /* the last event's, gone */
            memset(c->ev_t, 0, (size_t)nt * sizeof *c->ev_t);
            memset(c->ev_n, 0, (size_t)nt * sizeof *c->ev_n);
        }
        return;
    }
    for (int k = 0; k < nt; k++) {
        const ps_tensor_info_t *t = ps_layout_tensor(l, k);
        const int u = l->tab ? t->unit : k;
        if (l->t[u].count == 1) { /* the unit is the tensor (the table's rows maybe) */
            c->ev_t[k] = iv->tensors[u];
            c->ev_n[k] = iv->tensor_numel[u];
        } else {
            c->ev_t[k] = iv->tensors[u] + (t->offset - l->t[u].offset);
            c->ev_n[k] = t->numel;
        }
    }
    ev->n_tensors = nt;
}

int psw_client_next(psw_client_t *c, psw_event_t *ev, double timeout_s, char *err, size_t errlen)
{
    int rc = next_event(c, &c->iev, timeout_s, err, errlen);
    if (rc == 0 && c->iev.kind == PSW_EV_WEIGHTS) c->weights_due = false; /* what it asked for came */
    if (rc == 0) to_table(c, &c->iev, ev);
    else memset(ev, 0, sizeof *ev);
    return rc;
}
