/* psd_rows.h - row-sparse updates of an embedding table held by psd
 * (each sparse-rows tensor of a model, one psd_rows_t each).
 *
 * A worker whose batch touches a few rows of a table (rows x dim floats)
 * pushes (ids, rows) instead of the whole gradient. psd merges the
 * contributors' rows: for every row id any of them touched,
 *
 *   g[id] = sum over contributors k, in rank order, of w_k * (sum of k's
 *           rows for id, in the order k sent them)
 *
 * which is, element by element, the arithmetic of the dense step on the
 * gradients those rows stand for (the only difference: a row a contributor
 * did not touch adds nothing instead of +0.0f, which can only turn a -0.0f
 * into +0.0f). The optimizer then updates the touched rows only: for SGD
 * without momentum or weight decay and for Adagrad without weight decay
 * this is exactly the dense step (a zero gradient changes neither the row
 * nor its state); with momentum or weight decay, and for Adam ("lazy
 * Adam"), untouched rows and their state are left as they are, where a
 * dense step would decay them.
 *
 * Everything is allocated by psd_rows_init for a bound on the entries of
 * one step: nothing is allocated per step. */
#ifndef PSD_ROWS_H
#define PSD_ROWS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ps_model.h"
#include "psd_optim.h"

/* One contributor's row gradient: n entries, ids[j] the row of rows[j * dim .. ] */
typedef struct {
    const uint32_t *ids;
    const float *rows;
    size_t n;
} psd_rowgrad_t;

typedef struct {
    size_t dim, max_entries;
    uint64_t *keys;   /* (id << 32) | entry number, sorted */
    uint32_t *owner;  /* entry number -> contributor */
    size_t *first;    /* contributor -> its first entry number (max contributors + 1) */
    int max_k;
    float *t;         /* dim: one contributor's sum for a row */
    /* the merged gradient: n_ids rows, ascending ids */
    uint32_t *ids;
    float *sum;
    size_t n_ids;
} psd_rows_t;

/* Room for max_entries entries in all from up to max_k contributors, rows
 * of dim floats. 0 or -ENOMEM. */
int psd_rows_init(psd_rows_t *r, size_t dim, size_t max_entries, int max_k);
void psd_rows_deinit(psd_rows_t *r);

/* Merge k contributors' row gradients (rank order) with weights w[k] into
 * r->ids / r->sum. 0; -E2BIG if they hold more entries than r was made for
 * or k > max_k; -ERANGE if an id is >= n_rows. */
int psd_rows_merge(psd_rows_t *r, int k, const psd_rowgrad_t *g, const double *w, uint64_t n_rows);

/* The optimizer on the merged rows of table (n_rows x dim) and its state
 * slots (laid out like the table; NULL where the optimizer has none), step
 * t, the gradient multiplied by scale (global-norm clipping; 1: none). */
void psd_rows_apply(const psd_rows_t *r, const psd_optim_t *o, float *table, float *s0, float *s1, float scale,
                    double lr, uint64_t t);

/* The squared norms of the table's norm blocks (PS_NORM_BLOCK floats of
 * the table, from its first) that the merged rows fall in, into blk[b]
 * (blk: the table's first block; the others are left as they are): the
 * same bits as psd_sumsq over the block of the whole gradient, zero where
 * no row was touched (clipping gives the same norm as a dense step, and
 * psd shards holding parts of the table add up to one psd's). */
void psd_rows_norms(const psd_rows_t *r, double *blk);

/* One contributor's table rows kept for a step: n ids and their values
 * (dim floats each), room for cap. */
typedef struct {
    uint32_t *ids;
    float *rows;
    size_t n, cap;
} psd_rowbuf_t;

/* Copy n rows in (room for at least `room` rows the first time, so that
 * later pushes up to that long allocate nothing). 0 or -ENOMEM (b->n 0). */
int psd_rowbuf_set(psd_rowbuf_t *b, const uint32_t *ids, const float *v, size_t n, size_t dim, size_t room);
/* The rows of a dense gradient g of n_rows rows (f32, or bfloat16 where
 * bf16), the first being row row0 of the table, that are not all zero:
 * the rows its batch touched. One pass; the room grows by doubling (rarely:
 * it is kept between steps). 0 or -ENOMEM (b->n 0). */
int psd_rowbuf_dense(psd_rowbuf_t *b, const void *g, bool bf16, size_t row0, size_t n_rows, size_t dim);
void psd_rowbuf_free(psd_rowbuf_t *b);
static inline psd_rowgrad_t psd_rowbuf_grad(const psd_rowbuf_t *b)
{
    return (psd_rowgrad_t){.ids = b->ids, .rows = b->rows, .n = b->n};
}

/* The encoding of a table's gradient for one step: rows when fewer than
 * threshold x n_rows rows are touched (an entry costs 4 bytes of id more
 * than the row), whole otherwise. */
bool psd_rows_sparse(size_t touched, uint64_t n_rows, double threshold);

/* ids[0..n) strictly increasing in [r0, r1) (true for n = 0): the rows of a
 * push a psd shard owning the table's rows [r0, r1) takes. */
bool psd_rows_in(const uint32_t *ids, size_t n, size_t r0, size_t r1);

/* A push's rows for a psd owning piece `own` of a sparse-rows tensor (all
 * of it for one psd): nv values for the n ids (dim each), ids strictly
 * increasing inside the piece, which is whole rows; none only when
 * empty_ok. */
bool psd_rows_fit(const ps_layout_t *l, const ps_piece_t *own, const uint32_t *ids, size_t n, size_t nv,
                  bool empty_ok);

/* Rows ids[0..n) of the table E (dim floats a row) into out (n x dim). */
void psd_rows_gather(float *out, const float *E, size_t dim, const uint32_t *ids, size_t n);

/* The table rows a worker's next batch reads (Push.want_rows), kept for
 * the reply, which then brings those rows (gathered into vals) instead of
 * the table: has is set until the reply, n may be 0 on a psd shard. */
typedef struct {
    uint32_t *ids;
    float *vals;
    size_t n, cap;
    bool has;
} psd_want_t;

/* Keep ids[0..n) (checked by the caller); room for at least `room` rows
 * of dim floats the first time, so that later lists up to that long
 * allocate nothing. 0, or -ENOMEM (what it held is kept, has not set). */
int psd_want_keep(psd_want_t *w, const uint32_t *ids, size_t n, size_t room, size_t dim);
void psd_want_free(psd_want_t *w);

/* Bytes of a row gradient of n entries on the wire, and of the whole table. */
static inline uint64_t psd_rows_bytes(size_t n, size_t dim) { return (uint64_t)n * (4 + 4 * (uint64_t)dim); }

#endif
