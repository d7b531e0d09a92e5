/* psd_rows.c - row-sparse updates of an embedding table (see psd_rows.h). */
#include "psd_rows.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "ps_wire.h"

int psd_rows_init(psd_rows_t *r, size_t dim, size_t max_entries, int max_k)
{
    memset(r, 0, sizeof *r);
    if (dim == 0 || max_entries == 0 || max_entries > UINT32_MAX || max_k < 1) return -EINVAL;
    r->dim = dim;
    r->max_entries = max_entries;
    r->max_k = max_k;
    r->keys = malloc(max_entries * sizeof *r->keys);
    r->owner = malloc(max_entries * sizeof *r->owner);
    r->first = malloc(((size_t)max_k + 1) * sizeof *r->first);
    r->t = malloc(dim * sizeof *r->t);
    r->ids = malloc(max_entries * sizeof *r->ids);
    r->sum = malloc(max_entries * dim * sizeof *r->sum);
    if (!r->keys || !r->owner || !r->first || !r->t || !r->ids || !r->sum) {
        psd_rows_deinit(r);
        return -ENOMEM;
    }
    return 0;
}

void psd_rows_deinit(psd_rows_t *r)
{
    free(r->keys);
    free(r->owner);
    free(r->first);
    free(r->t);
    free(r->ids);
    free(r->sum);
    memset(r, 0, sizeof *r);
}

/* Heapsort of n keys in place: the keys are distinct, so any sort gives the
 * same order, and this one allocates nothing (glibc's qsort may malloc a
 * buffer on every call, and psd allocates nothing per step). */
static void sift(uint64_t *k, size_t i, size_t n)
{
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) return;
        if (c + 1 < n && k[c + 1] > k[c]) c++;
        if (k[i] >= k[c]) return;
        uint64_t t = k[i];
        k[i] = k[c];
        k[c] = t;
        i = c;
    }
}

static void sort_keys(uint64_t *k, size_t n)
{
    for (size_t i = n / 2; i-- > 0;) sift(k, i, n);
    for (size_t e = n; e-- > 1;) {
        uint64_t t = k[0];
        k[0] = k[e];
        k[e] = t;
        sift(k, 0, e);
    }
}

/* acc = w * t (first contributor of the row) or acc += w * t */
static void fold(float *acc, const float *t, float w, size_t dim, bool first)
{
    if (first)
        for (size_t i = 0; i < dim; i++) acc[i] = w * t[i];
    else
        for (size_t i = 0; i < dim; i++) acc[i] += w * t[i];
}

int psd_rows_merge(psd_rows_t *r, int k, const psd_rowgrad_t *g, const double *w, uint64_t n_rows)
{
    r->n_ids = 0;
    if (k > r->max_k) return -E2BIG;
    size_t total = 0;
    for (int c = 0; c < k; c++) {
        if (g[c].n > r->max_entries - total) return -E2BIG;
        r->first[c] = total;
        for (size_t j = 0; j < g[c].n; j++) {
            if (g[c].ids[j] >= n_rows) return -ERANGE;
            r->keys[total] = ((uint64_t)g[c].ids[j] << 32) | (uint64_t)total; /* entry order within an id */
            r->owner[total] = (uint32_t)c;
            total++;
        }
    }
    r->first[k] = total;
    sort_keys(r->keys, total);
    const size_t dim = r->dim;
    for (size_t i = 0; i < total;) {
        uint32_t id = (uint32_t)(r->keys[i] >> 32);
        float *acc = r->sum + r->n_ids * dim;
        bool first = true;
        /* entries of this id: by contributor, each one's in the order sent */
        while (i < total && (uint32_t)(r->keys[i] >> 32) == id) {
            uint32_t e = (uint32_t)r->keys[i], c = r->owner[e];
            const float *row = g[c].rows + (e - r->first[c]) * dim;
            memcpy(r->t, row, dim * sizeof *r->t);
            i++;
            while (i < total && (uint32_t)(r->keys[i] >> 32) == id && r->owner[(uint32_t)r->keys[i]] == c) {
                uint32_t e2 = (uint32_t)r->keys[i];
                const float *row2 = g[c].rows + (e2 - r->first[c]) * dim;
                for (size_t d = 0; d < dim; d++) r->t[d] += row2[d];
                i++;
            }
            fold(acc, r->t, (float)w[c], dim, first);
            first = false;
        }
        r->ids[r->n_ids++] = id;
    }
    return 0;
}

void psd_rows_apply(const psd_rows_t *r, const psd_optim_t *o, float *table, float *s0, float *s1, float scale,
                    double lr, uint64_t t)
{
    const size_t dim = r->dim;
    for (size_t i = 0; i < r->n_ids; i++) {
        size_t at = (size_t)r->ids[i] * dim;
        psd_optim_apply(o, table + at, table + at, r->sum + i * dim, scale, s0 ? s0 + at : NULL,
                        s1 ? s1 + at : NULL, dim, lr, t);
    }
}

bool psd_rows_sparse(size_t touched, uint64_t n_rows, double threshold)
{
    return (double)touched < threshold * (double)n_rows;
}

bool psd_rows_in(const uint32_t *ids, size_t n, size_t r0, size_t r1)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < r0 || ids[i] >= r1 || (i && ids[i] <= ids[i - 1])) return false;
    return true;
}

void psd_rows_gather(float *out, const float *E, size_t dim, const uint32_t *ids, size_t n)
{
    for (size_t j = 0; j < n; j++) memcpy(out + j * dim, E + (size_t)ids[j] * dim, dim * sizeof(float));
}

int psd_want_keep(psd_want_t *w, const uint32_t *ids, size_t n, size_t room, size_t dim)
{
    if (n > w->cap) {
        size_t cap = n > room ? n : room;
        uint32_t *p = realloc(w->ids, cap * sizeof *p);
        if (p) w->ids = p;
        float *v = p ? realloc(w->vals, cap * dim * sizeof *v) : NULL;
        if (v) w->vals = v;
        if (!p || !v) return -ENOMEM;
        w->cap = cap;
    }
    if (n) memcpy(w->ids, ids, n * sizeof *ids);
    w->n = n;
    w->has = true;
    return 0;
}

void psd_want_free(psd_want_t *w)
{
    free(w->ids);
    free(w->vals);
    *w = (psd_want_t){0};
}

bool psd_rows_fit(const ps_layout_t *l, const ps_piece_t *own, const uint32_t *ids, size_t n, size_t nv,
                  bool empty_ok)
{
    size_t r0, r1;
    return own->t >= 0 && own->t < l->n_tensors && l->t[own->t].kind == PS_TENSOR_ROWS &&
           nv == n * (size_t)l->t[own->t].cols && (n > 0 || empty_ok) &&
           ps_piece_rows(l, own, &r0, &r1) && r0 < r1 && psd_rows_in(ids, n, r0, r1);
}

void psd_rows_norms(const psd_rows_t *r, double *blk)
{
    const size_t dim = r->dim;
    double lane[PSD_SUMSQ_LANES];
    size_t cur = SIZE_MAX;
    for (size_t i = 0; i < r->n_ids; i++) { /* ascending ids: block by block, each element in order */
        const float *g = r->sum + i * dim;
        for (size_t d = 0, p = (size_t)r->ids[i] * dim; d < dim; d++, p++) {
            if (p / PS_NORM_BLOCK != cur) {
                if (cur != SIZE_MAX) blk[cur] = psd_sumsq_lanes(lane);
                memset(lane, 0, sizeof lane);
                cur = p / PS_NORM_BLOCK;
            }
            lane[p % PSD_SUMSQ_LANES] += (double)g[d] * (double)g[d]; /* as psd_sumsq: lane i % 16 of the block */
        }
    }
    if (cur != SIZE_MAX) blk[cur] = psd_sumsq_lanes(lane);
}

/* Room for at least cap rows (grows, never shrinks). 0 or -ENOMEM (what
 * it held is kept). */
static int psd_rowbuf_reserve(psd_rowbuf_t *b, size_t cap, size_t dim)
{
    if (cap <= b->cap) return 0;
    uint32_t *p = realloc(b->ids, cap * sizeof *p);
    if (!p) return -ENOMEM;
    b->ids = p;
    float *v = realloc(b->rows, cap * dim * sizeof *v);
    if (!v) return -ENOMEM;
    b->rows = v;
    b->cap = cap;
    return 0;
}

int psd_rowbuf_set(psd_rowbuf_t *b, const uint32_t *ids, const float *v, size_t n, size_t dim, size_t room)
{
    b->n = 0;
    if (n > b->cap && psd_rowbuf_reserve(b, n > room ? n : room, dim) != 0) return -ENOMEM;
    if (n) {
        memcpy(b->ids, ids, n * sizeof *ids);
        memcpy(b->rows, v, n * dim * sizeof *v);
    }
    b->n = n;
    return 0;
}

int psd_rowbuf_dense(psd_rowbuf_t *b, const void *g, bool bf16, size_t row0, size_t n_rows, size_t dim)
{
    const float *f = g;
    const uint16_t *h = g;
    size_t n = 0;
    b->n = 0;
    for (size_t r = 0; r < n_rows; r++) {
        const size_t at = r * dim;
        bool nz = false;
        for (size_t d = 0; d < dim && !nz; d++) nz = bf16 ? (h[at + d] & 0x7fff) != 0 : f[at + d] != 0.0f;
        if (!nz) continue;
        if (n == b->cap) {
            size_t cap = 2 * n > 1024 ? 2 * n : 1024;
            if (psd_rowbuf_reserve(b, cap < n_rows ? cap : n_rows, dim) != 0) return -ENOMEM;
        }
        b->ids[n] = (uint32_t)(row0 + r);
        for (size_t d = 0; d < dim; d++) b->rows[n * dim + d] = bf16 ? ps_bf16_to_f32(h[at + d]) : f[at + d];
        n++;
    }
    b->n = n;
    return 0;
}

void psd_rowbuf_free(psd_rowbuf_t *b)
{
    free(b->ids);
    free(b->rows);
    *b = (psd_rowbuf_t){0};
}
