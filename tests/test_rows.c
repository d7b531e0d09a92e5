/* Unit tests of psd's row-sparse table updates (server/psd_rows.c): the
 * sparse step gives the dense step's weights for SGD and Adagrad, merges
 * duplicates and contributors in a fixed order, leaves untouched rows alone
 * (lazy Adam), and refuses what does not fit; and psd's store steps a table
 * lazily with the dense step's bits (SGD, Adagrad), in place or out; and
 * a psd shard's piece of a table is whole rows, its rows checked and
 * gathered, and psd shards stepping their pieces of a table lazily give
 * one store's bits, clipped or not. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps_rng.h"
#include "psd_rows.h"
#include "psd_store.h"

#define ROWS 500
#define DIM 8
#define K 3
#define PER 40 /* entries per contributor, with duplicates */

typedef struct {
    uint32_t ids[K][PER];
    float rows[K][PER * DIM];
} batch_t;

static void make_batch(batch_t *b, uint64_t seed)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 1);
    for (int k = 0; k < K; k++)
        for (int j = 0; j < PER; j++) {
            b->ids[k][j] = (uint32_t)ps_rng_below(&r, 60); /* 60 of 500 rows: duplicates within and across */
            for (int d = 0; d < DIM; d++) b->rows[k][j * DIM + d] = (ps_rng_uniform(&r) - 0.5f) * 0.2f + 0.01f;
        }
}

/* The dense step the rows stand for: each contributor's gradient of the
 * whole table (its rows added up in the order sent), reduced in rank order
 * as psd's store does (acc = w0 g0, then acc += wk gk), then the optimizer
 * over the whole table. */
static void dense_step(const batch_t *b, const double *w, const psd_optim_t *o, float *table, float *s0, double lr,
                       uint64_t t)
{
    static float g[K][ROWS * DIM], acc[ROWS * DIM];
    memset(g, 0, sizeof g);
    for (int k = 0; k < K; k++)
        for (int j = 0; j < PER; j++)
            for (int d = 0; d < DIM; d++) g[k][b->ids[k][j] * DIM + d] += b->rows[k][j * DIM + d];
    for (size_t i = 0; i < ROWS * DIM; i++) {
        acc[i] = (float)w[0] * g[0][i];
        for (int k = 1; k < K; k++) acc[i] += (float)w[k] * g[k][i];
    }
    psd_optim_apply(o, table, table, acc, 1.0f, s0, NULL, ROWS * DIM, lr, t);
}

static void sparse_step(psd_rows_t *r, const batch_t *b, const double *w, const psd_optim_t *o, float *table,
                        float *s0, float *s1, double lr, uint64_t t)
{
    psd_rowgrad_t g[K];
    for (int k = 0; k < K; k++) g[k] = (psd_rowgrad_t){b->ids[k], b->rows[k], PER};
    cr_assert_eq(psd_rows_merge(r, K, g, w, ROWS), 0);
    for (size_t i = 1; i < r->n_ids; i++) cr_assert_lt(r->ids[i - 1], r->ids[i], "ascending, unique");
    psd_rows_apply(r, o, table, s0, s1, 1.0f, lr, t);
}

static void init_table(float *table)
{
    for (size_t i = 0; i < ROWS * DIM; i++) table[i] = sinf((float)i) * 0.1f;
}

Test(rows, sparse_steps_give_the_dense_weights_for_sgd_and_adagrad)
{
    const double w[K] = {0.5, 0.3, 0.2};
    psd_optim_t opts[2] = {{.kind = PS_OPT_SGD}, {.kind = PS_OPT_ADAGRAD, .eps = 1e-10f}};
    for (int o = 0; o < 2; o++) {
        static float dense[ROWS * DIM], sparse[ROWS * DIM], ds0[ROWS * DIM], ss0[ROWS * DIM];
        init_table(dense);
        memcpy(sparse, dense, sizeof dense);
        memset(ds0, 0, sizeof ds0);
        memset(ss0, 0, sizeof ss0);
        psd_rows_t r;
        cr_assert_eq(psd_rows_init(&r, DIM, K * PER, K), 0);
        for (uint64_t t = 1; t <= 5; t++) {
            batch_t b;
            make_batch(&b, t);
            dense_step(&b, w, &opts[o], dense, ds0, 0.1, t);
            sparse_step(&r, &b, w, &opts[o], sparse, ss0, NULL, 0.1, t);
            cr_assert_lt(r.n_ids, 61);
        }
        cr_assert(memcmp(dense, sparse, sizeof dense) == 0, "%s: sparse = dense, bit for bit",
                  o ? "adagrad" : "sgd");
        cr_assert(memcmp(ds0, ss0, sizeof ds0) == 0, "adagrad's sums too");
        psd_rows_deinit(&r);
    }
}

/* Lazy Adam: a touched row takes Adam's step with the merged gradient;
 * rows nobody touched keep their weights and moments. */
Test(rows, lazy_adam_leaves_untouched_rows_alone)
{
    const double w[K] = {0.25, 0.25, 0.5};
    psd_optim_t o = {.kind = PS_OPT_ADAM, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    static float table[ROWS * DIM], m[ROWS * DIM], v[ROWS * DIM], before[ROWS * DIM];
    init_table(table);
    memcpy(before, table, sizeof table);
    memset(m, 0, sizeof m);
    memset(v, 0, sizeof v);
    psd_rows_t r;
    cr_assert_eq(psd_rows_init(&r, DIM, K * PER, K), 0);
    batch_t b;
    make_batch(&b, 9);
    sparse_step(&r, &b, w, &o, table, m, v, 1e-2, 1);
    bool touched[ROWS] = {false};
    for (size_t i = 0; i < r.n_ids; i++) touched[r.ids[i]] = true;
    for (int id = 0; id < ROWS; id++) {
        const float *row = table + id * DIM, *row0 = before + id * DIM;
        if (!touched[id]) {
            cr_assert(memcmp(row, row0, DIM * sizeof *row) == 0, "row %d untouched", id);
            for (int d = 0; d < DIM; d++) cr_assert(m[id * DIM + d] == 0 && v[id * DIM + d] == 0);
            continue;
        }
        /* Adam's first step moves every element by about lr against its gradient's sign */
        for (int d = 0; d < DIM; d++) cr_assert(fabsf(fabsf(row[d] - row0[d]) - 1e-2f) < 1e-4f, "row %d moved", id);
    }
    psd_rows_deinit(&r);
}

Test(rows, what_does_not_fit_is_refused)
{
    psd_rows_t r;
    cr_assert_eq(psd_rows_init(&r, DIM, 10, 2), 0);
    uint32_t ids[11] = {0};
    float rows[11 * DIM] = {0};
    const double w[3] = {1, 0, 0};
    psd_rowgrad_t g[3] = {{ids, rows, 11}, {ids, rows, 1}, {ids, rows, 1}};
    cr_assert_eq(psd_rows_merge(&r, 1, g, w, ROWS), -E2BIG, "more entries than it was made for");
    cr_assert_eq(psd_rows_merge(&r, 3, g + 1, w, ROWS), -E2BIG, "more contributors");
    ids[0] = ROWS;
    g[0].n = 1;
    cr_assert_eq(psd_rows_merge(&r, 1, g, w, ROWS), -ERANGE, "an id past the table");
    cr_assert_eq(psd_rows_init(&(psd_rows_t){0}, 0, 10, 1), -EINVAL);
    psd_rows_deinit(&r);
    cr_assert(psd_rows_sparse(10, 1000, 0.1) && !psd_rows_sparse(100, 1000, 0.1), "sparse below the threshold");
    cr_assert_eq(psd_rows_bytes(10, 32), 10 * (4 + 128));
}

/* The store of an MLP 6-5-3 with a ROWS x DIM table, the table stepped
 * lazily or not; every step's table gradient comes as rows (lazy) or as
 * the dense gradients those rows stand for, the MLP's gradients dense. */
static void store_steps(psd_store_t *st, bool lazy, const psd_optim_t *o, double clip, bool hold)
{
    static const int sizes[3] = {6, 5, 3};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, ROWS, DIM), 0);
    cr_assert_eq(psd_store_init(st, &l, o, 11), 0);
    cr_assert_eq(psd_store_set_parallel(st, 2, 4096), 0);
    if (lazy) cr_assert_eq(psd_store_lazy_table(st, 10, 1), 0, "made again below with more room");
    if (lazy) cr_assert_eq(psd_store_lazy_table(st, K * PER, K), 0);
    static float mlp[K][64], dense[K][ROWS * DIM];
    const double w[K] = {0.5, 0.3, 0.2};
    for (uint64_t step = 0; step < 5; step++) {
        batch_t b;
        make_batch(&b, 100 + step);
        const void *g[K][PS_MAX_TENSORS];
        psd_rowgrad_t rg[K];
        memset(dense, 0, sizeof dense);
        for (int k = 0; k < K; k++) {
            for (int i = 0; i < 64; i++) mlp[k][i] = sinf((float)(i + 7 * k + 3 * (int)step)) * 0.1f;
            for (int t = 0; t < l.n_tensors - 1; t++) g[k][t] = mlp[k];
            for (int j = 0; j < PER; j++)
                for (int d = 0; d < DIM; d++) dense[k][b.ids[k][j] * DIM + d] += b.rows[k][j * DIM + d];
            /* rows: ascending and unique, as a worker sends them */
            static uint32_t ids[K][PER];
            static float rows[K][PER * DIM];
            size_t n = 0;
            for (uint32_t id = 0; id < ROWS; id++) {
                bool any = false;
                for (int j = 0; j < PER; j++) any |= b.ids[k][j] == id;
                if (!any) continue;
                ids[k][n] = id;
                memcpy(rows[k] + n * DIM, dense[k] + id * DIM, DIM * sizeof(float));
                n++;
            }
            rg[k] = (psd_rowgrad_t){ids[k], rows[k], n};
            g[k][l.table] = lazy ? NULL : dense[k];
        }
        psd_arena_t *held = hold ? psd_store_ref_current(st) : NULL; /* the next version out of place */
        double norm = psd_store_step_rows(st, K, (const void *const(*)[PS_MAX_TENSORS])g, NULL, w,
                                          lazy ? rg : NULL, clip, 1e-2);
        cr_assert_geq(norm, 0);
        if (held) {
            cr_assert_neq(held, st->cur, "stepped out of place");
            psd_store_frame_free(NULL, held);
        }
    }
}

Test(rows, the_store_steps_a_table_lazily_with_the_dense_bits)
{
    psd_optim_t opts[2] = {{.kind = PS_OPT_SGD}, {.kind = PS_OPT_ADAGRAD, .eps = 1e-10f}};
    for (int o = 0; o < 2; o++)
        for (int hold = 0; hold < 2; hold++) {
            psd_store_t a, b;
            store_steps(&a, false, &opts[o], 0, hold);
            store_steps(&b, true, &opts[o], 0, hold);
            cr_assert(memcmp(a.cur->w, b.cur->w, a.layout.n_params * sizeof(float)) == 0,
                      "optimizer %d, %s: the same bits", o, hold ? "out of place" : "in place");
            cr_assert_eq(a.steps, b.steps);
            psd_store_deinit(&a);
            psd_store_deinit(&b);
        }
}

Test(rows, a_lazy_table_is_clipped_by_the_whole_gradients_norm)
{
    psd_optim_t o = {.kind = PS_OPT_SGD};
    psd_store_t a, b;
    store_steps(&a, false, &o, 0.05, false);
    store_steps(&b, true, &o, 0.05, false);
    /* the rows' norm block by block, element i of a block in lane i % 16:
     * the dense step's norm, so the same bits */
    cr_assert(memcmp(a.cur->w, b.cur->w, a.layout.n_params * sizeof(float)) == 0, "clipped: the same bits");
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}

Test(rows, lazy_adam_in_the_store_leaves_untouched_rows_alone)
{
    psd_optim_t o = {.kind = PS_OPT_ADAM, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    psd_store_t a, b;
    store_steps(&a, false, &o, 0, false);
    store_steps(&b, true, &o, 0, false);
    const ps_tensor_info_t *e = &a.layout.t[a.layout.table];
    cr_assert(memcmp(a.cur->w, b.cur->w, e->offset * sizeof(float)) == 0, "the MLP: the same bits");
    /* rows 60.. are never touched (ids below 60): lazily they keep their
     * initial values and zero state; densely Adam moves rows whose moments
     * are not zero, and these never had any, so they stay too */
    ps_layout_t l = a.layout;
    psd_store_t init;
    psd_optim_t sgd = {.kind = PS_OPT_SGD};
    cr_assert_eq(psd_store_init(&init, &l, &sgd, 11), 0);
    const size_t from = e->offset + 60 * DIM, n = (ROWS - 60) * DIM;
    cr_assert(memcmp(b.cur->w + from, init.cur->w + from, n * sizeof(float)) == 0, "untouched rows keep their values");
    for (size_t i = from; i < from + n; i++) cr_assert(b.s0[i] == 0 && b.s1[i] == 0, "and their state");
    /* a row touched at the first step only: lazy Adam leaves it after that,
     * dense Adam keeps moving it with its decaying moments */
    size_t differ = 0;
    for (size_t i = e->offset; i < from; i++) differ += a.cur->w[i] != b.cur->w[i];
    cr_assert_gt(differ, 0, "lazy and dense Adam differ on rows some steps did not touch");
    psd_store_deinit(&init);
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}

/* psd shards and table rows: a shard's piece of a table is whole rows when
 * the table's width divides the norm block, and the worker falls back to
 * whole tables otherwise (ps_piece_rows says no). */
Test(rows, shard_pieces_of_a_table_are_whole_rows_when_its_width_divides_the_block)
{
    const int sizes[] = {64, 64, 2};
    const struct {
        int dim;
        bool whole;
    } c[] = {{8, true}, {32, true}, {16384, true}, {12, false}, {24, false}};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        ps_layout_t l;
        cr_assert_eq(ps_layout_init_table(&l, sizes, 3, 65536 * 8 / (uint64_t)c[i].dim + 7, c[i].dim), 0);
        bool all = true;
        size_t covered = 0, next = 0;
        for (int k = 0; k < 3; k++) {
            ps_piece_t p[PS_MAX_TENSORS];
            ps_shard_pieces(&l, k, 3, p);
            size_t r0, r1;
            if (!ps_piece_rows(&l, &p[l.table], &r0, &r1)) {
                all = false;
                continue;
            }
            if (r0 == r1) continue;
            cr_assert_eq(r0, next, "dim %d: shard %d's rows follow the last shard's", c[i].dim, k);
            cr_assert_eq(p[l.table].off, r0 * (size_t)c[i].dim);
            covered += r1 - r0;
            next = r1;
        }
        cr_assert_eq(all, c[i].whole, "dim %d", c[i].dim);
        if (all) cr_assert_eq(covered, (size_t)l.t[l.table].rows, "dim %d: every row on one shard", c[i].dim);
    }
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, 100, 8), 0);
    ps_piece_t p = {.t = 0, .off = 0, .n = 8};
    size_t r0, r1;
    cr_assert_not(ps_piece_rows(&l, &p, &r0, &r1), "a piece of another tensor");
}

/* ps_shard_pieces finds its pieces by binary search; this is its definition
 * block by block: the norm blocks whose first float's owner is k. */
static void pieces_by_blocks(const ps_layout_t *l, int k, int n, ps_piece_t out[PS_MAX_TENSORS])
{
    memset(out, 0, PS_MAX_TENSORS * sizeof *out);
    for (int t = 0; t < l->n_tensors; t++) {
        size_t lo = SIZE_MAX, hi = 0;
        for (size_t o = 0; o < l->t[t].numel; o += PS_NORM_BLOCK) {
            unsigned long long p = (unsigned long long)(l->t[t].offset + o);
            if ((n > 1 ? (int)(p * (unsigned long long)n / (unsigned long long)l->n_params) : 0) != k) continue;
            if (lo == SIZE_MAX) lo = o;
            hi = o + PS_NORM_BLOCK < l->t[t].numel ? o + PS_NORM_BLOCK : l->t[t].numel;
        }
        out[t] = (ps_piece_t){.t = t, .off = lo == SIZE_MAX ? 0 : lo, .n = lo == SIZE_MAX ? 0 : hi - lo};
    }
}

Test(rows, shard_pieces_are_the_blocks_each_shard_owns)
{
    const struct {
        int sizes[4], n_sizes;
        uint64_t rows;
        int dim;
    } c[] = {{{784, 1338}, 2, 0, 0},         {{784, 256, 128, 10}, 4, 0, 0}, {{3, 2}, 2, 0, 0},
             {{2000, 2000, 10}, 3, 0, 0},    {{64, 64, 2}, 3, 100003, 8},    {{13, 7, 1}, 3, 5000000, 32},
             {{4096, 4096, 4096}, 3, 0, 0}};
    for (size_t i = 0; i < sizeof c / sizeof c[0]; i++) {
        ps_layout_t l;
        cr_assert_eq(ps_layout_init_table(&l, c[i].sizes, c[i].n_sizes, c[i].rows, c[i].dim), 0);
        for (int n = 1; n <= PS_MAX_SHARDS; n++) {
            uint64_t total = 0;
            for (int k = 0; k < n; k++) {
                ps_piece_t a[PS_MAX_TENSORS], b[PS_MAX_TENSORS];
                ps_shard_pieces(&l, k, n, a);
                pieces_by_blocks(&l, k, n, b);
                for (int t = 0; t < PS_MAX_TENSORS; t++)
                    cr_assert(a[t].t == b[t].t && a[t].off == b[t].off && a[t].n == b[t].n,
                              "case %zu, shard %d of %d, tensor %d: [%zu, +%zu) against the blocks' [%zu, +%zu)", i,
                              k, n, t, a[t].off, a[t].n, b[t].off, b[t].n);
                total += ps_part_size(a, l.n_tensors);
            }
            uint64_t all = 0;
            for (int t = 0; t < l.n_tensors; t++) all += l.t[t].numel;
            cr_assert_eq(total, all, "case %zu, %d shards: every float on one shard", i, n);
        }
    }
}

/* A shard's rows: checked inside its piece, gathered for a reply. */
Test(rows, a_shards_rows_are_checked_and_gathered)
{
    const uint32_t in[3] = {10, 11, 19}, out_lo[2] = {9, 12}, out_hi[2] = {12, 20}, dup[2] = {12, 12};
    cr_assert(psd_rows_in(in, 3, 10, 20));
    cr_assert(psd_rows_in(NULL, 0, 10, 20), "none");
    cr_assert_not(psd_rows_in(out_lo, 2, 10, 20));
    cr_assert_not(psd_rows_in(out_hi, 2, 10, 20));
    cr_assert_not(psd_rows_in(dup, 2, 10, 20));
    float E[30 * 2], g[2 * 2];
    for (int i = 0; i < 60; i++) E[i] = (float)i;
    const uint32_t rows[2] = {3, 29};
    psd_rows_gather(g, E, 2, rows, 2);
    const float want3[4] = {6, 7, 58, 59};
    cr_assert_arr_eq(g, want3, sizeof g);
    psd_want_t w = {0};
    cr_assert_eq(psd_want_keep(&w, rows, 2, 16, 2), 0);
    cr_assert(w.has && w.n == 2 && w.cap == 16 && w.ids[1] == 29);
    uint32_t *ids = w.ids;
    cr_assert_eq(psd_want_keep(&w, NULL, 0, 16, 2), 0);
    cr_assert(w.has && w.n == 0 && w.ids == ids, "an empty list keeps its room");
    psd_want_free(&w);
    cr_assert(!w.ids && !w.vals && !w.has);
}

/* The rows' norm blocks are psd_sumsq over the blocks of the dense
 * gradient they stand for, for widths that divide the block and one whose
 * rows straddle blocks; a dense gradient's nonzero rows come back as rows
 * (f32 and bfloat16, from a piece starting at some row). */
Test(rows, row_norms_are_the_dense_blocks_norms_and_dense_gradients_become_rows)
{
    const size_t dims[2] = {8, 12}, R = 5000;
    for (int c = 0; c < 2; c++) {
        const size_t D = dims[c], nb = (R * D + PS_NORM_BLOCK - 1) / PS_NORM_BLOCK;
        psd_rows_t r;
        cr_assert_eq(psd_rows_init(&r, D, 400, 1), 0);
        float *dense = calloc(R * D, sizeof *dense);
        ps_rng_t g;
        ps_rng_seed(&g, 7 + c, 1);
        for (size_t id = 3; id < R; id += 1 + ps_rng_below(&g, 25)) { /* ascending, across every block */
            r.ids[r.n_ids] = (uint32_t)id;
            for (size_t d = 0; d < D; d++)
                dense[id * D + d] = r.sum[r.n_ids * D + d] = (ps_rng_uniform(&g) - 0.5f) * (float)(1 + d % 3);
            r.n_ids++;
        }
        cr_assert_gt(r.n_ids, 200);
        double blk[8], want;
        for (size_t b = 0; b < nb; b++) blk[b] = -1;
        psd_rows_norms(&r, blk);
        for (size_t b = 0; b < nb; b++) {
            size_t n = b + 1 < nb ? PS_NORM_BLOCK : R * D - b * PS_NORM_BLOCK;
            want = psd_sumsq(dense + b * PS_NORM_BLOCK, n);
            cr_assert(blk[b] == want, "dim %zu block %zu: %.17g vs %.17g", D, b, blk[b], want);
        }
        /* back from dense: the piece from row 1000 on */
        psd_rowbuf_t rb = {0};
        cr_assert_eq(psd_rowbuf_dense(&rb, dense + 1000 * D, false, 1000, R - 1000, D), 0);
        size_t first = 0;
        while (r.ids[first] < 1000) first++;
        cr_assert_eq(rb.n, r.n_ids - first);
        cr_assert_arr_eq(rb.ids, r.ids + first, rb.n * sizeof *rb.ids);
        cr_assert_arr_eq(rb.rows, r.sum + first * D, rb.n * D * sizeof(float));
        uint16_t *h = calloc(R * D, sizeof *h);
        for (size_t i = 0; i < R * D; i++) h[i] = (uint16_t)(dense[i] == 0 ? 0x8000 : 0x3f80); /* -0 and 1.0 */
        cr_assert_eq(psd_rowbuf_dense(&rb, h, true, 0, R, D), 0);
        cr_assert_eq(rb.n, r.n_ids, "bfloat16: -0 is zero");
        cr_assert(rb.rows[0] == 1.0f && rb.ids[0] == r.ids[0]);
        const uint32_t two[2] = {4, 9};
        const float v[24] = {1};
        cr_assert_eq(psd_rowbuf_set(&rb, two, v, 2, D, 10), 0);
        cr_assert(rb.n == 2 && rb.ids[1] == 9 && rb.rows[0] == 1.0f);
        psd_rowbuf_free(&rb);
        cr_assert(!rb.ids && !rb.rows && rb.cap == 0);
        free(h);
        free(dense);
        psd_rows_deinit(&r);
    }
}

/* Two psd shards' stores, each owning its piece of a 8192 x 8 table (4
 * norm blocks: two each) and stepping it by rows, against one store:
 * without clipping each step on its own; with clipping the shards reduce,
 * exchange their blocks' norms (as SHARD_NORM does), and apply with the
 * whole norm. Adam and Nesterov momentum with weight decay (where a lazy
 * step differs from a dense one): every shard's piece has one store's bits. */
Test(rows, psd_shards_step_their_table_pieces_by_rows_as_one_store)
{
    static const int sizes[3] = {6, 5, 3};
    enum { TR = 8192, TD = 8, KK = 2, NR = 300 };
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, TR, TD), 0);
    cr_assert(ps_shards_table_rows(&l, 2));
    psd_optim_t opts[2] = {{.kind = PS_OPT_ADAM, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f},
                           {.kind = PS_OPT_SGD, .momentum = 0.9f, .nesterov = true, .weight_decay = 1e-2f}};
    for (int o = 0; o < 2; o++)
        for (int clip = 0; clip < 2; clip++) {
            psd_store_t one, sh[2];
            cr_assert_eq(psd_store_init(&one, &l, &opts[o], 5), 0);
            cr_assert_eq(psd_store_lazy_table(&one, KK * NR, KK), 0);
            for (int k = 0; k < 2; k++) {
                cr_assert_eq(psd_store_init(&sh[k], &l, &opts[o], 5), 0);
                cr_assert_eq(psd_store_set_parallel(&sh[k], 2, 16384), 0);
                cr_assert_eq(psd_store_own(&sh[k], k, 2), 0);
                cr_assert_eq(psd_store_lazy_table(&sh[k], KK * NR, KK), 0);
            }
            size_t r0[2], r1[2];
            for (int k = 0; k < 2; k++) cr_assert(ps_piece_rows(&l, &sh[k].own[l.table], &r0[k], &r1[k]));
            cr_assert(r0[0] < r1[0] && r1[0] == r0[1] && r0[1] < r1[1] && r1[1] == TR, "the table in two pieces");
            const double w[KK] = {0.625, 0.375};
            ps_rng_t g;
            ps_rng_seed(&g, 99, 1);
            for (int step = 0; step < 6; step++) {
                static uint32_t ids[KK][NR];
                static float rows[KK][NR * TD], mlp[KK][64];
                const void *gg[KK][PS_MAX_TENSORS] = {{0}}, *gs[2][KK][PS_MAX_TENSORS] = {{{0}}};
                psd_rowgrad_t rg[KK], rs[2][KK];
                for (int k = 0; k < KK; k++) {
                    for (int i = 0; i < 64; i++) mlp[k][i] = (ps_rng_uniform(&g) - 0.5f) * 0.3f;
                    size_t n = 0;
                    for (uint32_t id = (uint32_t)ps_rng_below(&g, 20); id < TR && n < NR;
                         id += 1 + (uint32_t)ps_rng_below(&g, 60)) {
                        ids[k][n] = id;
                        for (int d = 0; d < TD; d++) rows[k][n * TD + d] = (ps_rng_uniform(&g) - 0.5f) * 2.0f;
                        n++;
                    }
                    rg[k] = (psd_rowgrad_t){ids[k], rows[k], n};
                    size_t split = 0;
                    while (split < n && ids[k][split] < r1[0]) split++;
                    rs[0][k] = (psd_rowgrad_t){ids[k], rows[k], split};
                    rs[1][k] = (psd_rowgrad_t){ids[k] + split, rows[k] + split * TD, n - split};
                    for (int t = 0; t < l.table; t++) {
                        gg[k][t] = mlp[k] + 0;
                        for (int sk = 0; sk < 2; sk++) gs[sk][k][t] = mlp[k] + sh[sk].own[t].off;
                    }
                }
                const double c = clip ? 0.5 : 0;
                cr_assert_geq(psd_store_step_rows(&one, KK, (const void *const(*)[PS_MAX_TENSORS])gg, NULL, w, rg, c,
                                                  1e-2),
                              0);
                if (!clip) {
                    for (int k = 0; k < 2; k++)
                        cr_assert_eq(psd_store_step_rows(&sh[k], KK, (const void *const(*)[PS_MAX_TENSORS])gs[k], NULL,
                                                         w, rs[k], 0, 1e-2),
                                     0);
                    continue;
                }
                for (int k = 0; k < 2; k++)
                    cr_assert_eq(psd_store_reduce_rows(&sh[k], KK, (const void *const(*)[PS_MAX_TENSORS])gs[k], NULL,
                                                       w, rs[k]),
                                 0);
                for (int k = 0; k < 2; k++) /* shard 0 takes shard 1's blocks (SHARD_NORM) */
                    for (int t = 0; t < l.n_tensors; t++) {
                        size_t b = ps_layout_first_block(&l, t) + sh[1].own[t].off / PS_NORM_BLOCK;
                        for (size_t o2 = 0; o2 < sh[1].own[t].n; o2 += PS_NORM_BLOCK, b++)
                            sh[0].blk_sq[b] = sh[1].blk_sq[b];
                    }
                double sumsq = psd_store_sumsq(&sh[0]);
                cr_assert(sumsq > 0.25, "clipping applies: norm %g", sqrt(sumsq));
                for (int k = 0; k < 2; k++) cr_assert_eq(psd_store_apply(&sh[k], sumsq, c, 1e-2), 0);
            }
            for (int k = 0; k < 2; k++)
                for (int t = 0; t < l.n_tensors; t++) {
                    size_t at = l.t[t].offset + sh[k].own[t].off, n = sh[k].own[t].n;
                    cr_assert(memcmp(sh[k].cur->w + at, one.cur->w + at, n * sizeof(float)) == 0,
                              "optimizer %d clip %d: shard %d's piece of tensor %d has one store's bits", o, clip, k,
                              t);
                    cr_assert(memcmp(sh[k].s0 + at, one.s0 + at, n * sizeof(float)) == 0, "and its state");
                }
            /* a lazy step: rows no step touched kept their initial values */
            size_t untouched = 0;
            psd_store_t init;
            cr_assert_eq(psd_store_init(&init, &l, &opts[o], 5), 0);
            const float *E = one.cur->w + l.t[l.table].offset, *E0 = init.cur->w + l.t[l.table].offset;
            for (size_t r = 0; r < TR; r++) untouched += one.s0[l.t[l.table].offset + r * TD] == 0 &&
                                                         memcmp(E + r * TD, E0 + r * TD, TD * sizeof(float)) == 0;
            cr_assert_gt(untouched, 100, "rows no step touched are left alone");
            psd_store_deinit(&init);
            psd_store_deinit(&one);
            psd_store_deinit(&sh[0]);
            psd_store_deinit(&sh[1]);
        }
}

/* A psd shard initialises only its part (psd_store_init_part,
 * ps_model_init_pieces): the parts of 3 shards put together are the whole
 * model's initial weights, bit for bit, and nothing outside a part is
 * written (a part's store takes no pages for the others). */
Test(rows, shard_parts_are_initialised_as_the_whole_model_and_nothing_else)
{
    static const int sizes[3] = {6, 5, 3};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, 9000, 8), 0); /* 72 000 floats: 5 norm blocks */
    float *whole = calloc(l.n_params, sizeof *whole), *part = malloc(l.n_params * sizeof *part);
    cr_assert(whole && part);
    ps_model_init_params(&l, whole, 11);
    float *put = calloc(l.n_params, sizeof *put);
    cr_assert(put);
    for (int k = 0; k < 3; k++) {
        ps_piece_t p[PS_MAX_TENSORS];
        ps_shard_pieces(&l, k, 3, p);
        for (size_t i = 0; i < l.n_params; i++) part[i] = NAN;
        ps_model_init_pieces(&l, part, 11, p);
        size_t inside = 0;
        for (int t = 0; t < l.n_tensors; t++) {
            const size_t at = l.t[t].offset;
            for (size_t i = 0; i < l.t[t].numel; i++) {
                bool in = i >= p[t].off && i < p[t].off + p[t].n;
                cr_assert(in ? !isnan(part[at + i]) : isnan(part[at + i]), "shard %d, tensor %d, float %zu", k, t, i);
                if (in) put[at + i] = part[at + i], inside++;
            }
        }
        cr_assert_gt(inside, 0, "shard %d owns something", k);
        psd_store_t st;
        psd_optim_t o = {.kind = PS_OPT_SGD};
        cr_assert_eq(psd_store_init_part(&st, &l, &o, 11, k, 3), 0);
        for (int t = 0; t < l.n_tensors; t++) {
            cr_assert(st.own[t].off == p[t].off && st.own[t].n == p[t].n, "the store owns shard %d's pieces", k);
            const size_t at = l.t[t].offset + p[t].off;
            cr_assert(memcmp(st.cur->w + at, part + at, p[t].n * sizeof(float)) == 0, "and has their values");
        }
        psd_store_deinit(&st);
    }
    cr_assert(memcmp(put, whole, l.n_params * sizeof *put) == 0, "3 parts = the whole model, bit for bit");
    free(put);
    free(part);
    free(whole);
}

/* Two sparse-rows tensors (and dense ones between, packed) stepped lazily,
 * each from its own rows, against the same steps with both dense: the same
 * bits for SGD without weight decay and for Adagrad without it (a zero
 * gradient changes neither a row nor its state), clipped or not (the
 * norms of the merged rows are the dense blocks'), in place or out, one
 * psd or two psd shards (each its pieces of both tables). */
#define T2 2
static const uint64_t t2_rows[T2] = {5000, 90}, t2_dim[T2] = {8, 16}; /* emb.a: 3 norm blocks, split by 2 shards */

static void two_tables_layout(ps_layout_t *l)
{
    ps_tensor_spec_t sp[4];
    memset(sp, 0, sizeof sp);
    strcpy(sp[0].name, "emb.a");
    sp[0].ndim = 2, sp[0].shape[0] = t2_rows[0], sp[0].shape[1] = t2_dim[0], sp[0].kind = PS_TENSOR_ROWS;
    sp[0].init = (ps_init_t){PS_INIT_UNIFORM, 0.1};
    strcpy(sp[1].name, "fc.weight");
    sp[1].ndim = 2, sp[1].shape[0] = 5, sp[1].shape[1] = 6, sp[1].init = (ps_init_t){PS_INIT_UNIFORM, 0.3};
    strcpy(sp[2].name, "fc.bias");
    sp[2].ndim = 1, sp[2].shape[0] = 5;
    strcpy(sp[3].name, "emb.b");
    sp[3].ndim = 2, sp[3].shape[0] = t2_rows[1], sp[3].shape[1] = t2_dim[1], sp[3].kind = PS_TENSOR_ROWS;
    sp[3].init = (ps_init_t){PS_INIT_NORMAL, 0.05};
    char err[256];
    cr_assert_eq(ps_layout_init_specs(l, sp, 4, err, sizeof err), 0, "%s", err);
    cr_assert_eq(l->n_tensors, 3, "emb.a | fc.weight fc.bias | emb.b");
    cr_assert_eq(ps_layout_sparse_units(l), 2);
}

/* Contributor k's gradient of step `step`: a few rows of each table (dense
 * in g[k], zero elsewhere, and as ascending ids and rows), the dense unit whole. */
typedef struct {
    float g[3][5000 * 8];
    uint32_t ids[T2][64];
    float vals[T2][64 * 16];
    size_t n[T2];
} t2_grad_t;

static void t2_make(const ps_layout_t *l, t2_grad_t *x, int k, uint64_t step)
{
    memset(x, 0, sizeof *x);
    ps_rng_t r;
    ps_rng_seed(&r, 1000 * step + (uint64_t)k, 3);
    for (size_t i = 0; i < l->t[1].numel; i++) x->g[1][i] = (ps_rng_uniform(&r) - 0.5f) * 0.3f;
    for (int j = 0; j < T2; j++) {
        const int u = j == 0 ? 0 : 2;
        const size_t D = t2_dim[j];
        for (uint32_t row = 0; row < t2_rows[j] && x->n[j] < 64; row++) {
            if (ps_rng_below(&r, t2_rows[j] / 40) != 0) continue; /* about 40 rows, across the table */
            x->ids[j][x->n[j]] = row;
            for (size_t d = 0; d < D; d++) {
                const float v = (ps_rng_uniform(&r) - 0.5f) * 0.2f;
                x->vals[j][x->n[j] * D + d] = v;
                x->g[u][row * D + d] = v;
            }
            x->n[j]++;
        }
    }
}

/* steps on store st (its pieces own[]), tables lazily (rows) or dense */
static void t2_steps(psd_store_t *st, const ps_layout_t *l, bool lazy, double clip, bool hold)
{
    static t2_grad_t x[2];
    const double w[2] = {0.75, 0.25};
    for (uint64_t step = 1; step <= 4; step++) {
        const void *g[2][PS_MAX_TENSORS];
        psd_rowgrad_t rg[T2 * 2]; /* rg[j * 2 + k]: contributor k's rows of table j */
        for (int k = 0; k < 2; k++) {
            t2_make(l, &x[k], k, step);
            for (int u = 0; u < 3; u++) g[k][u] = lazy && u != 1 ? NULL : (const void *)(x[k].g[u] + st->own[u].off);
            for (int j = 0; j < T2; j++) {
                /* a shard: the ids of its piece only */
                size_t r0 = 0, r1 = 0, a = 0, b = 0;
                const int u = j == 0 ? 0 : 2;
                if (st->own[u].n) cr_assert(ps_piece_rows(l, &st->own[u], &r0, &r1));
                while (a < x[k].n[j] && x[k].ids[j][a] < r0) a++;
                for (b = a; b < x[k].n[j] && x[k].ids[j][b] < r1; b++) {}
                rg[j * 2 + k] = (psd_rowgrad_t){x[k].ids[j] + a, x[k].vals[j] + a * t2_dim[j], b - a};
            }
        }
        psd_arena_t *held = hold ? psd_store_ref_current(st) : NULL;
        cr_assert_eq(psd_store_rows_room(st, 2, rg, 2), 0);
        cr_assert_geq(psd_store_step_rows(st, 2, (const void *const(*)[PS_MAX_TENSORS])g, NULL, w, lazy ? rg : NULL,
                                          clip, 0.05),
                      0);
        if (held) psd_store_frame_free(NULL, held);
    }
}

Test(rows, two_sparse_tensors_step_lazily_each_with_the_dense_steps_bits)
{
    ps_layout_t l;
    two_tables_layout(&l);
    psd_optim_t opts[2] = {{.kind = PS_OPT_SGD}, {.kind = PS_OPT_ADAGRAD, .eps = 1e-10f}};
    for (int o = 0; o < 2; o++)
        for (int c = 0; c < 2; c++)
            for (int hold = 0; hold < 2; hold++) {
                const double clip = c ? 0.05 : 0;
                psd_store_t dense, lazy;
                cr_assert_eq(psd_store_init(&dense, &l, &opts[o], 4), 0);
                cr_assert_eq(psd_store_init(&lazy, &l, &opts[o], 4), 0);
                cr_assert_eq(psd_store_lazy_table(&lazy, 4, 1), 0, "grown by rows_room");
                cr_assert_eq(lazy.n_lazy, 2);
                cr_assert(lazy.lazy_t[0] == 0 && lazy.lazy_t[1] == 2);
                t2_steps(&dense, &l, false, clip, hold);
                t2_steps(&lazy, &l, true, clip, hold);
                cr_expect_eq(memcmp(dense.cur->w, lazy.cur->w, l.n_params * sizeof(float)), 0,
                             "optimizer %d, clip %g, hold %d: other bits", o, clip, hold);
                bool moved = false; /* the steps changed both tables */
                for (int u = 0; u < 3; u += 2) {
                    psd_store_t init;
                    cr_assert_eq(psd_store_init(&init, &l, &opts[o], 4), 0);
                    moved = memcmp(init.cur->w + l.t[u].offset, lazy.cur->w + l.t[u].offset,
                                   l.t[u].numel * sizeof(float)) != 0;
                    cr_expect(moved, "table unit %d did not move", u);
                    psd_store_deinit(&init);
                }
                /* two psd shards, each stepping its pieces of both tables lazily: one store's bits */
                psd_store_t sh[2];
                for (int k = 0; k < 2; k++) {
                    cr_assert_eq(psd_store_init_part(&sh[k], &l, &opts[o], 4, k, 2), 0);
                    cr_assert_eq(psd_store_lazy_table(&sh[k], 4, 1), 0, "pieces of whole rows");
                }
                cr_assert(sh[0].own[0].n && sh[1].own[0].n, "emb.a split between the shards");
                if (!clip) { /* (clipped shards need the norm exchange: psd_store_reduce_rows + apply) */
                    for (int k = 0; k < 2; k++) t2_steps(&sh[k], &l, true, 0, hold);
                    for (int u = 0; u < 3; u++)
                        for (int k = 0; k < 2; k++) {
                            const ps_piece_t *p = &sh[k].own[u];
                            const size_t at = l.t[u].offset + p->off;
                            cr_expect_eq(memcmp(sh[k].cur->w + at, dense.cur->w + at, p->n * sizeof(float)), 0,
                                         "shard %d, unit %d: other bits", k, u);
                        }
                }
                for (int k = 0; k < 2; k++) psd_store_deinit(&sh[k]);
                psd_store_deinit(&dense);
                psd_store_deinit(&lazy);
            }
    ps_layout_free(&l);
}
