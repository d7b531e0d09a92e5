/* psw_client_rx.c - what the worker library receives (see psw_client_int.h):
 * weights and table rows, whole or by psd shard or streamed chunk by chunk,
 * checked and turned into the events psw_client_next returns. */
#include "psw_client_int.h"

#include <math.h>

/* Move m's header and frames into an empty dst (m is left empty). */
void pswc_msg_move(ps_msg_t *dst, ps_msg_t *m)
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
int pswc_frames_by_id(const ps_msg_t *m, int nf, int n_tensors, int at[PS_MAX_TENSORS])
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
    if (pswc_frames_by_id(&c->cur, c->cur.n_frames, c->layout.n_tensors, at) != 0) {
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
            if (c->w16) memcpy(c->w16 + c->layout.t[i].offset, h, n * sizeof *h); /* and kept as it came */
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
void pswc_scatter_rows(float *E, size_t D, const uint32_t *ids, size_t n, const float *vals)
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
    pswc_scatter_rows(c->replica, D, c->want, c->n_want, ev->tensors[t]);
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

/* A VALIDATE's part: its range, split and samples (kept in c->val_ids:
 * the message may go before the event does, with psd shards). */
int pswc_take_val_ids(psw_client_t *c, const Psd__Validate *v, pswc_event_t *ev, char *err, size_t errlen)
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

/* One psd's WEIGHTS or VALIDATE in c->cur (pswc_ops_t.take): whole, in
 * psd's shared slot, or streamed. 1: *ev is the event; 0: wait for more
 * (streamed parts); < 0: error. */
int pswc_one_take(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen)
{
    Psd__Header *h = c->cur.hdr;
    int rc;
    if (h->type == PSD__MSG_TYPE__MSG_WEIGHTS) {
        if (h->weights->parts > 0) return stream_part(c, ev, err, errlen);
        ev->kind = PSW_EV_WEIGHTS;
        c->t_weights = ps_now();
        c->wait = c->t_req > 0 ? c->t_weights - c->t_req : 0;
        c->t_req = 0;
        ev->version = h->weights->version;
        ev->step = h->weights->step;
        c->room.go = h->weights->go; /* whether the push on these goes at once (psw_client_room.c) */
        if (c->table_on_psd && !h->weights->rows) {
            snprintf(err, errlen, "psd sent the whole table to a worker that holds only rows of it");
            return -EPROTO;
        }
        rc = take_tensors(c, ev, h->weights->shm_slot, h->weights->crc, h->weights->rows, err, errlen);
        if (rc == 0 && h->weights->rows) rc = take_rows(c, ev, err, errlen);
        c->n_want = 0;
        return rc < 0 ? rc : 1;
    }
    ev->kind = PSW_EV_VALIDATE;
    ev->epoch = h->validate->epoch;
    ev->version = h->validate->version;
    if ((rc = pswc_take_val_ids(c, h->validate, ev, err, errlen)) < 0) return rc;
    if (c->table_on_psd != h->validate->rows) {
        snprintf(err, errlen, "psd sent a validation part with%s the table's rows", h->validate->rows ? "" : "out");
        return -EPROTO;
    }
    rc = h->validate->rows ? take_val_rows(c, ev, err, errlen)
                           : take_tensors(c, ev, h->validate->shm_slot, h->validate->crc, false, err, errlen);
    return rc < 0 ? rc : 1;
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
        int rc = pswc_room_next(c) ? 0 : c->ops->next_msg(c, deadline, timeout_s, err, errlen);
        if (rc < 0) return rc;
        Psd__Header *h = c->cur.hdr;
        memset(ev, 0, sizeof *ev);
        if (c->from > 0 || h->type == PSD__MSG_TYPE__MSG_WEIGHTS || h->type == PSD__MSG_TYPE__MSG_VALIDATE) {
            rc = c->ops->take(c, ev, err, errlen); /* the weights: whole, streamed or by shard */
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
        case PSD__MSG_TYPE__MSG_HEARTBEAT: /* psd is there, and this worker waits on it: wait on */
            deadline = ps_now() + timeout_s;
            continue;
        case PSD__MSG_TYPE__MSG_GO: /* the push announced: its tensors now */
            if ((rc = pswc_room_go(c)) < 0) {
                snprintf(err, errlen, "sending the push announced: %s", zmq_strerror(-rc));
                return rc;
            }
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
