/* psd_hold.c - the parameter holder (psd_hold.h): push intake, the step
 * over this psd's piece of the parameters, weights replies. */
#include "psd_hold.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_log.h"
#include "ps_util.h"

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

int psd_hold_init(psd_hold_t *h, psd_store_t *store, const ps_layout_t *l, const ps_config_t *c, bool sharded,
                  int max_k)
{
    memset(h, 0, sizeof *h);
    h->store = store;
    h->layout = l;
    h->sharded = sharded;
    h->wire_bf16 = c->wire_gradients == PS_WIRE_BF16;
    h->wire_w16 = c->wire_weights == PS_WIRE_BF16;
    h->max_k = max_k;
    for (int t = 0; t < l->n_tensors; t++) {
        if (store->own[t].n) h->all |= 1ull << t;
        h->n_sparse += l->t[t].kind == PS_TENSOR_ROWS;
    }
    const size_t nb = (size_t)max_k * (size_t)(h->n_sparse ? h->n_sparse : 1);
    if (l->table >= 0) {
        h->piece_rows = store->own[l->table].n / (size_t)l->t[l->table].cols;
        if (c->kind == PS_MODEL_CTR) { /* the click-through task: a batch reads fields x per_field rows a sample */
            size_t reads = (size_t)c->batch_size * (size_t)c->ctr_fields * (size_t)c->ctr_per_field;
            h->batch_rows = h->room_rows = min_size(reads, h->piece_rows);
            h->rows_limit = "train.batch_size x ctr.fields x ctr.per_field";
        } else { /* a user's model: a batch may read any of the table's rows; room for 64 a sample */
            h->batch_rows = h->piece_rows;
            h->room_rows = min_size((size_t)c->batch_size * 64, h->piece_rows);
            h->rows_limit = "the rows of the table";
        }
    }
    h->g = calloc((size_t)max_k, sizeof *h->g);
    h->bf16 = calloc((size_t)max_k, 1);
    h->rg = calloc(nb, sizeof *h->rg);
    h->sp_free = calloc(nb, sizeof *h->sp_free);
    if (!h->g || !h->bf16 || !h->rg || !h->sp_free) {
        psd_hold_deinit(h);
        return -ENOMEM;
    }
    return 0;
}

void psd_hold_deinit(psd_hold_t *h)
{
    for (int i = 0; h->sp_free && i < h->n_sp_free; i++) {
        psd_rowbuf_free(h->sp_free[i]);
        free(h->sp_free[i]);
    }
    free(h->sp_free);
    free(h->g);
    free(h->bf16);
    free(h->rg);
    memset(h, 0, sizeof *h);
}

/* p's row buffer for lazy table j: its own, one from the pool, or a new
 * one (NULL: out of memory). As many exist as contributors had rows of a
 * table between two steps. */
static psd_rowbuf_t *rowbuf_of(psd_hold_t *h, psd_push_t *p, int j)
{
    if (!p->sp[j] && h->n_sp_free) p->sp[j] = h->sp_free[--h->n_sp_free];
    if (!p->sp[j] && h->n_sp < h->max_k * h->n_sparse && (p->sp[j] = calloc(1, sizeof *p->sp[j]))) h->n_sp++;
    return p->sp[j];
}

/* The index of unit t among the store's lazy tables, or -1. */
static int lazy_of(const psd_hold_t *h, uint32_t t)
{
    for (int j = 0; j < h->store->n_lazy; j++)
        if (h->store->lazy_t[j] == (int)t) return j;
    return -1;
}

void psd_push_release(psd_hold_t *h, psd_push_t *p)
{
    for (int t = 0; t < PS_MAX_TENSORS; t++)
        if (p->frames & (1ull << t)) zmq_msg_close(&p->grad[t]);
    p->frames = p->mask = p->shm = p->rows = 0;
    for (int j = 0; j < PS_MAX_TENSORS; j++)
        if (p->sp[j]) {
            p->sp[j]->n = 0;
            h->sp_free[h->n_sp_free++] = p->sp[j];
            p->sp[j] = NULL;
        }
}

void psd_push_free(psd_push_t *p) { psd_want_free(&p->want); }

/* The rows of the table this holder takes: "the table", or a shard's piece. */
static const char *rows_of(const psd_hold_t *h) { return h->sharded ? "this shard's piece of the table" : "the table"; }

/* ids[0..n) in m's last frame, a list of rows of this piece of the table */
static bool want_ok(const psd_hold_t *h, const ps_msg_t *m, size_t most, const uint32_t **idsp, size_t *np)
{
    const ps_layout_t *l = h->layout;
    const int i = m->n_frames - 1;
    size_t n = 0, r0 = 0, r1 = 0;
    const uint32_t *ids = i >= 0 && l->table >= 0 && m->hdr->tensors[i]->id == (uint32_t)l->table
                              ? ps_msg_u32(m, i, &n)
                              : NULL;
    bool ok = ids && n <= most &&
              (h->sharded ? ps_piece_rows(l, &h->store->own[l->table], &r0, &r1) && r0 < r1 &&
                                psd_rows_in(ids, n, r0, r1)
                          : ps_rows_valid(ids, n, (uint64_t)l->t[l->table].rows));
    *idsp = ids;
    *np = n;
    return ok;
}

int psd_want_take(psd_hold_t *h, psd_push_t *p, const ps_msg_t *m, size_t most, char *why, size_t why_len)
{
    const uint32_t *ids;
    size_t n;
    if (!want_ok(h, m, most, &ids, &n)) {
        snprintf(why, why_len, "asking for table rows that are not rows of %s (strictly increasing, in its last "
                 "frame, at most %zu: %s)", rows_of(h), most,
                 most == h->batch_rows && h->rows_limit ? h->rows_limit : "the rows of the piece");
        return -1;
    }
    const ps_layout_t *l = h->layout;
    if (psd_want_keep(&p->want, ids, n, h->room_rows, (size_t)l->t[l->table].cols) != 0) {
        snprintf(why, why_len, "asking for table rows: out of memory");
        return -1;
    }
    return 0;
}

int psd_push_take(psd_hold_t *h, psd_push_t *p, ps_msg_t *m, bool bf16, uint64_t also, psd_took_t *took,
                  char *why, size_t why_len)
{
    const ps_layout_t *l = h->layout;
    const Psd__Push *pu = m->hdr->push;
    const int nf = m->n_frames - (pu->want_rows && m->n_frames > 0); /* gradient frames; then the rows wanted */
    uint64_t mask = 0;
    int rows_at[PS_MAX_TENSORS], n_at = 0; /* gradients as rows: frames rows_at[a] (ids) and rows_at[a] + 1 */
    *took = (psd_took_t){0};
    for (int i = 0; i < nf; i++) {
        const Psd__TensorDesc *d = m->hdr->tensors[i];
        const uint32_t t = d->id;
        size_t n = 0;
        if (t >= (uint32_t)l->n_tensors || ((p->mask | also | mask) & (1ull << t))) {
            snprintf(why, why_len, "of tensor %u: not in the model or already received", t);
            return -1;
        }
        if (d->dtype == PSD__DTYPE__DT_U32) {
            const uint32_t *ids;
            size_t nv = 0;
            if (bf16 || !(h->store->lazy_mask & (1ull << t)) || !(h->all & (1ull << t)) ||
                !ps_msg_rows(m, i, &ids, &n, &nv) || !psd_rows_fit(l, &h->store->own[t], ids, n, nv, h->sharded)) {
                snprintf(why, why_len, "of rows of tensor %u that are not rows of %s (a sparse-rows tensor "
                         "stepped by rows: strictly increasing ids below its row count, then their f32 rows)", t,
                         rows_of(h));
                return -1;
            }
            rows_at[n_at++] = i++;
            mask |= 1ull << t;
            continue;
        }
        /* in the worker's wire type: f32, or bf16 with train.wire_gradients: bf16 */
        bool ok = bf16 ? ps_msg_bf16(m, i, &n) != NULL : ps_msg_f32(m, i, &n) != NULL;
        const ps_piece_t *pc = &h->store->own[t];
        if (!ok || d->offset != pc->off || n != pc->n || pc->n == 0) {
            snprintf(why, why_len, "tensor %u does not match %s (%zu %s at %" PRIu64 ", want %zu %s at %zu)", t,
                     h->sharded ? "this shard's part" : "the model", n,
                     d->dtype == PSD__DTYPE__DT_BF16 ? "bf16" : "elements", d->offset, pc->n, bf16 ? "bf16" : "f32",
                     pc->off);
            return -1;
        }
        mask |= 1ull << t;
    }
    if (pu->want_rows) {
        if (!pu->pull) {
            snprintf(why, why_len, "asking for table rows that are not rows of %s, or without asking for the "
                     "next version (pull)", rows_of(h));
            return -1;
        }
        if (psd_want_take(h, p, m, h->batch_rows, why, why_len) != 0) return -1;
        took->want_bytes = zmq_msg_size(&m->frames[m->n_frames - 1]);
    }
    uint64_t rows = 0;
    for (int a = 0; a < n_at; a++) { /* copied: the step merges them */
        size_t n = 0, nv = 0;
        const uint32_t t = m->hdr->tensors[rows_at[a]]->id;
        const uint32_t *ids = ps_msg_u32(m, rows_at[a], &n);
        const float *v = ps_msg_f32(m, rows_at[a] + 1, &nv);
        psd_rowbuf_t *b = rowbuf_of(h, p, lazy_of(h, t));
        if (!b || psd_rowbuf_set(b, ids, v, n, (size_t)l->t[t].cols, h->room_rows) != 0) {
            for (int j = 0; j < PS_MAX_TENSORS; j++) /* p as it was: none of this push's rows */
                if (p->sp[j] && (rows & (1ull << h->store->lazy_t[j]))) p->sp[j]->n = 0;
            p->want.has = false;
            snprintf(why, why_len, "of table rows: out of memory");
            return -1;
        }
        rows |= 1ull << t;
        took->row_push = true;
        took->rows += n;
    }
    p->rows |= rows;
    /* the rest kept without copying: reduced in rank order at the step */
    for (int i = 0; i < nf; i++) {
        const uint32_t t = m->hdr->tensors[i]->id;
        took->bytes += zmq_msg_size(&m->frames[i]);
        if (rows & (1ull << t)) continue; /* its ids and rows frames */
        zmq_msg_init(&p->grad[t]);
        zmq_msg_move(&p->grad[t], &m->frames[i]);
        p->frames |= 1ull << t;
    }
    p->mask |= mask;
    took->mask = mask;
    return 0;
}

int psd_hold_gather(psd_hold_t *h, psd_push_t *const *p, const float *const *shm, int k)
{
    const ps_layout_t *l = h->layout;
    const psd_store_t *st = h->store;
    for (int j = 0; j < k; j++) {
        const void **g = h->g[j];
        for (int t = 0; t < l->n_tensors; t++)
            g[t] = shm && shm[j] && (p[j]->shm & (1ull << t)) ? (const void *)(shm[j] + l->t[t].offset)
                   : p[j]->frames & (1ull << t)                ? (const void *)zmq_msg_data(&p[j]->grad[t])
                                                               : NULL;
        h->bf16[j] = !(shm && shm[j]) && h->wire_bf16;
        for (int x = 0; x < st->n_lazy; x++) {
            /* each table by rows: pushed as rows, or the nonzero rows of the piece pushed whole */
            const int T = st->lazy_t[x];
            const bool as_rows = p[j]->rows & (1ull << T);
            psd_rowbuf_t **sp = &p[j]->sp[x];
            if (!as_rows && g[T]) {
                const size_t D = (size_t)l->t[T].cols;
                const ps_piece_t *own = &st->own[T];
                psd_rowbuf_t *b = rowbuf_of(h, p[j], x);
                if (!b || psd_rowbuf_dense(b, g[T], h->bf16[j], own->off / D, own->n / D, D) != 0) return -ENOMEM;
            } else if (!as_rows && *sp) {
                (*sp)->n = 0;
            }
            g[T] = NULL;
            h->rg[(size_t)x * (size_t)k + (size_t)j] = *sp ? psd_rowbuf_grad(*sp) : (psd_rowgrad_t){0};
        }
    }
    if (st->n_lazy && psd_store_rows_room(h->store, k, h->rg, h->max_k) != 0) return -ENOMEM;
    return 0;
}

double psd_hold_step(psd_hold_t *h, int k, const double *wt, double clip_norm, double lr, bool reduce_only)
{
    const void *const(*g)[PS_MAX_TENSORS] = (const void *const(*)[PS_MAX_TENSORS])h->g;
    const psd_rowgrad_t *rows = h->store->n_lazy ? h->rg : NULL;
    if (reduce_only) return psd_store_reduce_rows(h->store, k, g, h->bf16, wt, rows) != 0 ? -2 : 0;
    return psd_store_step_rows(h->store, k, g, h->bf16, wt, rows, clip_norm, lr);
}

/* The frames of the current version and the bfloat16 copy they come from (NULL: f32). */
static int frames_of(psd_hold_t *h, ps_frame_t *fr, uint32_t *crc, const uint16_t **w16p)
{
    const uint16_t *w16 = h->wire_w16 ? psd_store_current_bf16(h->store) : NULL;
    if (h->wire_w16 && !w16) PS_WARN("out of memory for bfloat16 weights: sending f32");
    *crc = 0;
    int n = psd_store_frames(h->store, w16, fr, h->verify && (w16 || h->sharded) ? crc : NULL);
    if (h->verify && !w16 && !h->sharded) *crc = psd_store_current_crc(h->store);
    *w16p = w16;
    return n;
}

int psd_hold_frames(psd_hold_t *h, ps_frame_t *fr, uint32_t *crc)
{
    const uint16_t *w16;
    int n = frames_of(h, fr, crc, &w16);
    if (h->layout->table < 0) ps_frames_small_first(fr, n); /* the CRC is in tensor order */
    return n;
}

int psd_hold_reply(psd_hold_t *h, psd_push_t *p, ps_frame_t *fr, uint32_t *crc, long *rows)
{
    const ps_layout_t *l = h->layout;
    const uint16_t *w16;
    int n = frames_of(h, fr, crc, &w16), tf = -1; /* the table's frame, when rows replace it */
    *rows = -1;
    if ((p->want.has || h->table_on_psd) && !w16 && l->table >= 0) {
        tf = n - 1;
        while (tf >= 0 && fr[tf].id != (uint32_t)l->table) tf--;
    }
    if (tf >= 0) {
        /* only the table rows its next batch reads (a shard: those in its piece, none maybe); with
         * the table on psd, none when it asked for none */
        const size_t D = (size_t)l->t[l->table].cols, nr = p->want.has ? p->want.n : 0;
        if (fr[tf].ffn) fr[tf].ffn((void *)fr[tf].data, fr[tf].hint); /* its reference on the version */
        psd_rows_gather(p->want.vals, h->store->cur->w + l->t[l->table].offset, D, p->want.ids, nr);
        fr[tf] = (ps_frame_t){.data = p->want.vals, .nbytes = nr * D * sizeof(float), .id = (uint32_t)l->table,
                                 .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)nr,
                                 .cols = (uint32_t)D}; /* copied at send */
        *crc = 0; /* the CRC covers whole versions */
        *rows = (long)nr;
    }
    p->want.n = 0;
    p->want.has = false;
    if (l->table < 0) ps_frames_small_first(fr, n); /* the CRC is in tensor order */
    /* the table on psd: copies, so that no reply in flight holds a reference on the version (a step
     * would then go out of place and copy the whole table); the frames are small next to it */
    for (int i = 0; i < n; i++) fr[i].copy = h->table_on_psd;
    return n;
}

void psd_hold_sent(psd_hold_t *h, psd_push_t *p)
{
    if (h->layout->table >= 0 && p->want.cap > h->room_rows) psd_want_free(&p->want);
}
