/* psd_rows.c - row-sparse updates of an embedding table (see psd_rows.h). */
#include "psd_rows.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

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

void psd_rows_scatter(float *e, size_t e_row0, size_t dim, const uint32_t *old, size_t n_old, const uint32_t *ids,
                      const float *v, size_t n)
{
    for (size_t j = 0; j < n_old; j++) memset(e + ((size_t)old[j] - e_row0) * dim, 0, dim * sizeof(float));
    for (size_t j = 0; j < n; j++) memcpy(e + ((size_t)ids[j] - e_row0) * dim, v + j * dim, dim * sizeof(float));
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
    return l->table >= 0 && nv == n * (size_t)l->t[l->table].cols && (n > 0 || empty_ok) &&
           ps_piece_rows(l, own, &r0, &r1) && r0 < r1 && psd_rows_in(ids, n, r0, r1);
}
