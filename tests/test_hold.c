/* Unit tests of the parameter holder (server/psd_hold.c), driven in-process
 * with hand-built PUSH messages (no sockets): pushes of 2 and 3
 * contributors reduce in the order given with their weights and the SGD
 * step gives the hand-computed bits; bf16 pushes reduce as their f32
 * values; a push is checked whole before anything is kept (a tensor twice,
 * a piece of the wrong size, offset or dtype, rows that are not rows of
 * the table); table rows merge by rank and only they are stepped, a table
 * pushed whole becoming its nonzero rows; release gives row buffers back;
 * the rows a push asks for replace the table in the reply; a psd shard
 * takes its piece of a tensor only. */
#include <criterion/criterion.h>
#include <string.h>

#include "psd_hold.h"

#define LR 0.25

/* A PUSH message built by hand: a header, its descriptors and frames. */
typedef struct {
    ps_msg_t m;
    Psd__Header hdr;
    Psd__Push push;
    Psd__TensorDesc d[PS_MAX_FRAMES];
    Psd__TensorDesc *dp[PS_MAX_FRAMES];
} msg_t;

static void msg_init(msg_t *x)
{
    memset(x, 0, sizeof *x);
    x->hdr = (Psd__Header)PSD__HEADER__INIT;
    x->push = (Psd__Push)PSD__PUSH__INIT;
    x->hdr.body_case = PSD__HEADER__BODY_PUSH;
    x->hdr.push = &x->push;
    x->hdr.tensors = x->dp;
    x->m.hdr = &x->hdr;
    x->m.srcfd = -1;
}

static void msg_add(msg_t *x, uint32_t id, Psd__DType dt, const void *data, size_t bytes, uint64_t offset)
{
    int i = x->m.n_frames++;
    x->d[i] = (Psd__TensorDesc)PSD__TENSOR_DESC__INIT;
    x->d[i].id = id;
    x->d[i].dtype = dt;
    x->d[i].offset = offset;
    x->d[i].nbytes = bytes;
    x->dp[i] = &x->d[i];
    x->hdr.n_tensors = (size_t)x->m.n_frames;
    cr_assert_eq(zmq_msg_init_size(&x->m.frames[i], bytes), 0);
    if (bytes) memcpy(zmq_msg_data(&x->m.frames[i]), data, bytes);
}

static void add_f32(msg_t *x, uint32_t id, const float *v, size_t n)
{
    msg_add(x, id, PSD__DTYPE__DT_F32, v, n * 4, 0);
}
static void add_u32(msg_t *x, uint32_t id, const uint32_t *v, size_t n)
{
    msg_add(x, id, PSD__DTYPE__DT_U32, v, n * 4, 0);
}

/* the frames push_take did not move */
static void msg_close(msg_t *x)
{
    for (int i = 0; i < x->m.n_frames; i++) zmq_msg_close(&x->m.frames[i]);
}

/* A store of layout l (SGD, no momentum) and its holder for up to 4 contributors. */
typedef struct {
    ps_layout_t l;
    ps_config_t c;
    psd_store_t s;
    psd_hold_t h;
    psd_push_t p[4];
} rig_t;

static void rig_init(rig_t *r, bool table, ps_wire_dtype_t wire)
{
    memset(r, 0, sizeof *r);
    if (table) /* fc1: 3 x 4 and 3; the table 40 x 4 */
        cr_assert_eq(ps_layout_init_table(&r->l, (const int[]){4, 3}, 2, 40, 4), 0);
    else /* 20, 4, 12 and 3 floats */
        cr_assert_eq(ps_layout_init(&r->l, (const int[]){5, 4, 3}, 3), 0);
    cr_assert_leq(r->l.n_params, 4096, "the tests' buffers");
    ps_config_defaults(&r->c);
    r->c.wire_gradients = wire;
    psd_optim_t o = {.kind = PS_OPT_SGD};
    cr_assert_eq(psd_store_init(&r->s, &r->l, &o, 7), 0);
    cr_assert_eq(psd_hold_init(&r->h, &r->s, &r->l, &r->c, false, 4), 0);
    if (table) cr_assert_eq(psd_store_lazy_table(&r->s, 4 * r->h.room_rows, 4), 0);
}

static void rig_deinit(rig_t *r)
{
    for (int i = 0; i < 4; i++) {
        psd_push_release(&r->h, &r->p[i]);
        psd_push_free(&r->p[i]);
    }
    psd_hold_deinit(&r->h);
    psd_store_deinit(&r->s);
    ps_config_free(&r->c);
    ps_layout_free(&r->l);
}

/* contributor c's gradient value at float i of tensor t (distinct, not round) */
static float gval(int c, int t, size_t i)
{
    return (float)(c + 1) * 0.37f - (float)t * 0.11f + (float)i * 0.013f * (float)(c + 2);
}

/* x taken as contributor c's push, then x's frames (those not taken) closed: 0 or -1 */
static int take(rig_t *r, int c, msg_t *x, bool bf16, uint64_t also, psd_took_t *took, char *why)
{
    int rc = psd_push_take(&r->h, &r->p[c], &x->m, bf16, also, took, why, 200);
    msg_close(x);
    return rc;
}

/* contributor c pushes every dense tensor whole (f32); 0 or -1 */
static int push_dense(rig_t *r, int c, char *why)
{
    msg_t x;
    msg_init(&x);
    float v[64];
    for (int t = 0; t < r->l.n_tensors; t++) {
        if (r->l.t[t].kind == PS_TENSOR_ROWS) continue;
        for (size_t i = 0; i < r->l.t[t].numel; i++) v[i] = gval(c, t, i);
        add_f32(&x, (uint32_t)t, v, r->l.t[t].numel);
    }
    psd_took_t took;
    return take(r, c, &x, false, 0, &took, why);
}

/* gather contributors order[0..k) and step with weights wt (no clipping) */
static void step(rig_t *r, const int *order, int k, const double *wt)
{
    psd_push_t *ps[4];
    for (int j = 0; j < k; j++) ps[j] = &r->p[order[j]];
    cr_assert_eq(psd_hold_gather(&r->h, ps, NULL, k), 0);
    cr_assert_eq(psd_hold_step(&r->h, k, wt, 0, LR, false), 0.0);
}

/* SGD without momentum or decay: the store's arithmetic, one float */
static float sgd(float w, float g) { return w - (float)LR * (1.0f * g + 0.0f * w); }

/* The dense tensors after a step of contributors order[0..k) with weights
 * wt from w0: acc = w[0] g[0], then acc += w[j] g[j], in that order. */
static void expect_dense(const rig_t *r, const float *w0, const int *order, int k, const double *wt)
{
    for (int t = 0; t < r->l.n_tensors; t++) {
        if (r->l.t[t].kind == PS_TENSOR_ROWS) continue;
        for (size_t i = 0; i < r->l.t[t].numel; i++) {
            size_t at = r->l.t[t].offset + i;
            float acc = (float)wt[0] * gval(order[0], t, i);
            for (int j = 1; j < k; j++) acc += (float)wt[j] * gval(order[j], t, i);
            float want = sgd(w0[at], acc), got = r->s.cur->w[at];
            cr_assert(memcmp(&want, &got, 4) == 0, "tensor %d [%zu]: %.9g, want %.9g", t, i, got, want);
        }
    }
}

Test(hold, two_and_three_contributors_step_to_their_weighted_mean_in_rank_order)
{
    static const double w2[2] = {3.0 / 8, 5.0 / 8}, w3[3] = {1.0 / 6, 2.0 / 6, 3.0 / 6};
    for (int k = 2; k <= 3; k++) {
        rig_t r;
        rig_init(&r, false, PS_WIRE_F32);
        char why[200];
        for (int c = 0; c < k; c++) cr_assert_eq(push_dense(&r, c, why), 0, "%s", why);
        cr_assert_eq(r.p[0].mask, r.h.all, "every tensor received");
        static float w0[4096];
        memcpy(w0, r.s.cur->w, r.l.n_params * sizeof(float));
        const int order[3] = {0, 1, 2};
        step(&r, order, k, k == 2 ? w2 : w3);
        cr_assert_eq(r.s.steps, 1);
        cr_assert_eq(r.s.cur->version, 1);
        expect_dense(&r, w0, order, k, k == 2 ? w2 : w3);
        /* the current version's frames are those weights, smallest first (no table) */
        ps_frame_t fr[PS_MAX_TENSORS];
        uint32_t crc = 1;
        int n = psd_hold_frames(&r.h, fr, &crc);
        cr_assert_eq(n, r.l.n_tensors);
        cr_assert_eq(crc, 0, "no CRC without verify");
        for (int i = 0; i < n; i++) {
            cr_assert(i == 0 || fr[i - 1].nbytes <= fr[i].nbytes, "smallest first");
            cr_assert_eq(fr[i].nbytes, r.l.t[fr[i].id].numel * 4);
            cr_assert(memcmp(fr[i].data, r.s.cur->w + r.l.t[fr[i].id].offset, fr[i].nbytes) == 0);
            fr[i].ffn((void *)fr[i].data, fr[i].hint);
        }
        rig_deinit(&r);
    }
}

Test(hold, the_order_of_contributors_is_the_order_of_the_sum)
{
    /* values whose float sum depends on the order: 1 + 1e8 - 1e8 */
    static float w_a[4096], w_b[4096];
    const double wt[3] = {1.0 / 3, 1.0 / 3, 1.0 / 3};
    static const float big[3] = {1.0f, 1e8f, -1e8f};
    for (int run = 0; run < 2; run++) {
        rig_t r;
        rig_init(&r, false, PS_WIRE_F32);
        for (int c = 0; c < 3; c++) {
            msg_t x;
            msg_init(&x);
            for (int t = 0; t < r.l.n_tensors; t++) {
                float v[64];
                for (size_t i = 0; i < r.l.t[t].numel; i++) v[i] = big[c];
                add_f32(&x, (uint32_t)t, v, r.l.t[t].numel);
            }
            psd_took_t took;
            char why[200];
            cr_assert_eq(take(&r, c, &x, false, 0, &took, why), 0, "%s", why);
        }
        const float w0 = r.s.cur->w[0];
        const int order[2][3] = {{0, 1, 2}, {1, 2, 0}};
        step(&r, order[run], 3, wt);
        float acc = (float)wt[0] * big[order[run][0]];
        acc += (float)wt[1] * big[order[run][1]];
        acc += (float)wt[2] * big[order[run][2]];
        float want = sgd(w0, acc);
        cr_assert(memcmp(&want, &r.s.cur->w[0], 4) == 0, "order %d: %.9g, want %.9g", run, r.s.cur->w[0], want);
        memcpy(run ? w_b : w_a, r.s.cur->w, r.l.n_params * sizeof(float));
        rig_deinit(&r);
    }
    cr_assert(memcmp(w_a, w_b, 20 * sizeof(float)) != 0, "another order, other bits (same seed, same pushes)");
}

Test(hold, bf16_pushes_reduce_as_their_f32_values)
{
    rig_t r;
    rig_init(&r, false, PS_WIRE_BF16);
    const double wt[2] = {0.5, 0.5};
    for (int c = 0; c < 2; c++) {
        msg_t x;
        msg_init(&x);
        for (int t = 0; t < r.l.n_tensors; t++) {
            uint16_t v[64];
            for (size_t i = 0; i < r.l.t[t].numel; i++) v[i] = ps_f32_to_bf16(gval(c, t, i));
            msg_add(&x, (uint32_t)t, PSD__DTYPE__DT_BF16, v, r.l.t[t].numel * 2, 0);
        }
        psd_took_t took;
        char why[200];
        /* f32 is what a bf16 push is not */
        cr_assert_eq(psd_push_take(&r.h, &r.p[c], &x.m, false, 0, &took, why, sizeof why), -1);
        cr_assert_eq(psd_push_take(&r.h, &r.p[c], &x.m, true, 0, &took, why, sizeof why), 0, "%s", why);
        cr_assert_eq(took.bytes, 2 * (20 + 4 + 12 + 3), "bf16 bytes");
        msg_close(&x);
    }
    static float w0[4096];
    memcpy(w0, r.s.cur->w, r.l.n_params * sizeof(float));
    step(&r, (const int[]){0, 1}, 2, wt);
    for (int t = 0; t < r.l.n_tensors; t++)
        for (size_t i = 0; i < r.l.t[t].numel; i++) {
            size_t at = r.l.t[t].offset + i;
            float acc = 0.5f * ps_bf16_to_f32(ps_f32_to_bf16(gval(0, t, i)));
            acc += 0.5f * ps_bf16_to_f32(ps_f32_to_bf16(gval(1, t, i)));
            float want = sgd(w0[at], acc);
            cr_assert(memcmp(&want, &r.s.cur->w[at], 4) == 0, "tensor %d [%zu]", t, i);
        }
    rig_deinit(&r);
}

Test(hold, a_tensor_received_twice_is_refused_and_nothing_of_that_push_is_kept)
{
    rig_t r;
    rig_init(&r, false, PS_WIRE_F32);
    float v[64] = {0};
    msg_t x;
    msg_init(&x);
    add_f32(&x, 0, v, 20);
    add_f32(&x, 1, v, 4);
    psd_took_t took;
    char why[200] = "";
    cr_assert_eq(take(&r, 0, &x, false, 0, &took, why), 0, "%s", why);
    cr_assert_eq(took.mask, 3u);
    cr_assert_eq(took.bytes, 24 * 4);
    cr_assert_eq(r.p[0].mask, 3u);
    cr_assert_eq(r.p[0].frames, 3u);
    /* a second push: tensor 2 new, tensor 1 again */
    msg_init(&x);
    add_f32(&x, 2, v, 12);
    add_f32(&x, 1, v, 4);
    cr_assert_eq(psd_push_take(&r.h, &r.p[0], &x.m, false, 0, &took, why, sizeof why), -1);
    cr_assert(strstr(why, "of tensor 1: not in the model or already received"), "%s", why);
    cr_assert_eq(r.p[0].mask, 3u, "tensor 2 not kept either");
    cr_assert_eq(zmq_msg_size(&x.m.frames[0]), 48, "the message's frames stay with it");
    /* the same tensor twice in one message; a tensor the caller takes elsewhere (`also`); one past the model */
    msg_close(&x);
    msg_init(&x);
    add_f32(&x, 2, v, 12);
    add_f32(&x, 2, v, 12);
    cr_assert_eq(take(&r, 0, &x, false, 0, &took, why), -1);
    cr_assert(strstr(why, "of tensor 2: "), "%s", why);
    msg_init(&x);
    add_f32(&x, 2, v, 12);
    cr_assert_eq(take(&r, 0, &x, false, 1u << 2, &took, why), -1);
    msg_init(&x);
    add_f32(&x, 4, v, 12);
    cr_assert_eq(take(&r, 0, &x, false, 0, &took, why), -1);
    cr_assert(strstr(why, "of tensor 4: not in the model"), "%s", why);
    cr_assert_eq(r.p[0].mask, 3u);
    /* another contributor's push of the same tensors is its own */
    cr_assert_eq(push_dense(&r, 1, why), 0, "%s", why);
    cr_assert_eq(r.p[1].mask, r.h.all);
    rig_deinit(&r);
}

Test(hold, a_frame_that_is_not_the_tensor_held_is_refused)
{
    rig_t r;
    rig_init(&r, false, PS_WIRE_F32);
    float v[64] = {0};
    uint16_t h16[64] = {0};
    psd_took_t took;
    char why[200];
    for (int bad = 0; bad < 4; bad++) {
        msg_t x;
        msg_init(&x);
        add_f32(&x, 0, v, 20); /* good, first: checked whole before anything is kept */
        if (bad == 0) add_f32(&x, 2, v, 11);                                    /* one element short */
        if (bad == 1) add_f32(&x, 2, v, 13);                                    /* one too many */
        if (bad == 2) msg_add(&x, 2, PSD__DTYPE__DT_F32, v, 12 * 4, 1);        /* at an offset */
        if (bad == 3) msg_add(&x, 2, PSD__DTYPE__DT_BF16, h16, 12 * 2, 0);     /* bf16, f32 expected */
        cr_assert_eq(psd_push_take(&r.h, &r.p[0], &x.m, false, 0, &took, why, sizeof why), -1, "case %d", bad);
        cr_assert(strstr(why, "tensor 2 does not match the model"), "case %d: %s", bad, why);
        cr_assert_eq(r.p[0].mask, 0u, "case %d: nothing kept", bad);
        cr_assert_eq(r.p[0].frames, 0u);
        cr_assert_eq(zmq_msg_size(&x.m.frames[0]), 80, "case %d: the good frame not taken", bad);
        msg_close(&x);
    }
    rig_deinit(&r);
}

/* the table (tensor 2, 40 x 4) and the gradient of its row id from contributor c */
#define T 2
#define D 4
static float rval(int c, uint32_t id, int d) { return 0.05f * (float)(c + 1) + 0.01f * (float)id - 0.003f * (float)d; }

/* contributor c pushes fc1 whole and the rows ids[0..n) of the table as rows, or (whole) the table whole */
static int push_table(rig_t *r, int c, const uint32_t *ids, size_t n, bool whole, psd_took_t *took, char *why)
{
    msg_t x;
    msg_init(&x);
    float v[160] = {0};
    for (int t = 0; t < T; t++) {
        for (size_t i = 0; i < r->l.t[t].numel; i++) v[i] = gval(c, t, i);
        add_f32(&x, (uint32_t)t, v, r->l.t[t].numel);
    }
    memset(v, 0, sizeof v);
    for (size_t j = 0; j < n; j++)
        for (int d = 0; d < D; d++) v[(whole ? ids[j] : j) * D + d] = rval(c, ids[j], d);
    if (whole) {
        add_f32(&x, T, v, 40 * D);
    } else {
        add_u32(&x, T, ids, n);
        add_f32(&x, T, v, n * D);
    }
    return take(r, c, &x, false, 0, took, why);
}

/* The table after a step of contributors 0 and 1 (weights wt): the rows of
 * ids0 / ids1 merged in rank order and stepped, every other row as it was. */
static void expect_table(const rig_t *r, const float *w0, const uint32_t *ids0, size_t n0, const uint32_t *ids1,
                         size_t n1, const double *wt)
{
    const float *E = r->s.cur->w + r->l.t[T].offset, *E0 = w0 + r->l.t[T].offset;
    for (uint32_t id = 0; id < 40; id++) {
        bool in0 = false, in1 = false;
        for (size_t j = 0; j < n0; j++) in0 |= ids0[j] == id;
        for (size_t j = 0; j < n1; j++) in1 |= ids1[j] == id;
        for (int d = 0; d < D; d++) {
            float want = E0[id * D + d];
            if (in0 || in1) {
                float acc = in0 ? (float)wt[0] * rval(0, id, d) : (float)wt[1] * rval(1, id, d);
                if (in0 && in1) acc += (float)wt[1] * rval(1, id, d);
                want = sgd(want, acc);
            }
            cr_assert(memcmp(&want, &E[id * D + d], 4) == 0, "row %u [%d]: %.9g, want %.9g", id, d, E[id * D + d],
                      want);
        }
    }
}

Test(hold, table_rows_merge_by_rank_and_only_they_are_stepped)
{
    rig_t r;
    rig_init(&r, true, PS_WIRE_F32);
    cr_assert_eq(r.h.n_sparse, 1);
    cr_assert_eq(r.h.piece_rows, 40);
    const uint32_t ids0[2] = {3, 7}, ids1[3] = {7, 20, 39};
    psd_took_t took;
    char why[200];
    cr_assert_eq(push_table(&r, 0, ids0, 2, false, &took, why), 0, "%s", why);
    cr_assert(took.row_push);
    cr_assert_eq(took.rows, 2);
    cr_assert_eq(took.mask, 7u);
    cr_assert_eq(r.p[0].rows, 1u << T, "the table came as rows");
    cr_assert_eq(r.p[0].frames, 3u, "its frames are not kept: its rows are copied");
    cr_assert_eq(push_table(&r, 1, ids1, 3, false, &took, why), 0, "%s", why);
    static float w0[4096];
    memcpy(w0, r.s.cur->w, r.l.n_params * sizeof(float));
    const double wt[2] = {0.75, 0.25};
    step(&r, (const int[]){0, 1}, 2, wt);
    cr_assert_eq(r.s.rows[0].n_ids, 4, "rows 3, 7, 20, 39");
    expect_dense(&r, w0, (const int[]){0, 1}, 2, wt);
    expect_table(&r, w0, ids0, 2, ids1, 3, wt);
    rig_deinit(&r);
}

Test(hold, a_table_pushed_whole_becomes_its_nonzero_rows)
{
    static float out[2][4096];
    const uint32_t ids0[2] = {5, 9}, ids1[1] = {9};
    const double wt[2] = {0.5, 0.5};
    for (int whole = 0; whole < 2; whole++) {
        rig_t r;
        rig_init(&r, true, PS_WIRE_F32);
        psd_took_t took;
        char why[200];
        cr_assert_eq(push_table(&r, 0, ids0, 2, whole, &took, why), 0, "%s", why);
        cr_assert_eq(took.row_push, !whole);
        cr_assert_eq(push_table(&r, 1, ids1, 1, false, &took, why), 0, "%s", why);
        static float w0[4096];
        memcpy(w0, r.s.cur->w, r.l.n_params * sizeof(float));
        psd_push_t *ps[2] = {&r.p[0], &r.p[1]};
        cr_assert_eq(psd_hold_gather(&r.h, ps, NULL, 2), 0);
        /* contributor 0's rows: 5 and 9 (the 38 zero rows left out), whichever way they came */
        cr_assert_eq(r.h.rg[0].n, 2);
        cr_assert_eq(r.h.rg[0].ids[0], 5);
        cr_assert_eq(r.h.rg[0].ids[1], 9);
        cr_assert_eq(r.h.rg[0].rows[D + 1], rval(0, 9, 1));
        cr_assert_eq(r.h.rg[1].n, 1);
        cr_assert_null(r.h.g[0][T], "the table is not stepped densely");
        cr_assert_eq(psd_hold_step(&r.h, 2, wt, 0, LR, false), 0.0);
        expect_table(&r, w0, ids0, 2, ids1, 1, wt);
        memcpy(out[whole], r.s.cur->w, r.l.n_params * sizeof(float));
        rig_deinit(&r);
    }
    cr_assert(memcmp(out[0], out[1], sizeof out[0]) == 0, "whole or as rows: the same bits");
}

Test(hold, rows_that_are_not_rows_of_the_table_are_refused)
{
    rig_t r;
    rig_init(&r, true, PS_WIRE_F32);
    psd_took_t took;
    char why[200];
    const uint32_t down[2] = {7, 3}, twice[2] = {4, 4}, past[1] = {40};
    cr_assert_eq(push_table(&r, 0, down, 2, false, &took, why), -1);
    cr_assert(strstr(why, "of rows of tensor 2 that are not rows of the table"), "%s", why);
    cr_assert_eq(push_table(&r, 0, twice, 2, false, &took, why), -1);
    cr_assert_eq(push_table(&r, 0, past, 1, false, &took, why), -1);
    cr_assert_eq(push_table(&r, 0, past, 0, false, &took, why), -1, "no rows: one psd takes none");
    cr_assert_eq(r.p[0].mask, 0u, "fc1 of those pushes not kept");
    cr_assert_eq(r.p[0].rows, 0u);
    /* rows of a dense tensor; row values of the wrong count */
    msg_t x;
    msg_init(&x);
    float v[8] = {0};
    add_u32(&x, 0, (const uint32_t[]){1}, 1);
    add_f32(&x, 0, v, 4);
    cr_assert_eq(take(&r, 0, &x, false, 0, &took, why), -1);
    cr_assert(strstr(why, "of rows of tensor 0"), "%s", why);
    msg_init(&x);
    add_u32(&x, T, (const uint32_t[]){1}, 1);
    add_f32(&x, T, v, 3);
    cr_assert_eq(take(&r, 0, &x, false, 0, &took, why), -1);
    cr_assert_eq(r.p[0].mask, 0u);
    rig_deinit(&r);
}

Test(hold, release_gives_the_row_buffer_back_for_the_next_push)
{
    rig_t r;
    rig_init(&r, true, PS_WIRE_F32);
    psd_took_t took;
    char why[200];
    cr_assert_eq(push_table(&r, 0, (const uint32_t[]){1, 2}, 2, false, &took, why), 0, "%s", why);
    psd_rowbuf_t *b = r.p[0].sp[0];
    cr_assert_not_null(b);
    cr_assert_eq(b->n, 2);
    cr_assert_eq(r.h.n_sp, 1);
    psd_push_release(&r.h, &r.p[0]);
    cr_assert_eq(r.p[0].mask | r.p[0].frames | r.p[0].rows, 0u);
    cr_assert_null(r.p[0].sp[0]);
    cr_assert_eq(r.h.n_sp_free, 1);
    cr_assert_eq(b->n, 0, "emptied");
    /* the next push (another contributor's) takes that buffer: none made */
    cr_assert_eq(push_table(&r, 1, (const uint32_t[]){6}, 1, false, &took, why), 0, "%s", why);
    cr_assert_eq(r.p[1].sp[0], b);
    cr_assert_eq(r.h.n_sp_free, 0);
    cr_assert_eq(r.h.n_sp, 1);
    /* and a released contributor may push again what it pushed before */
    cr_assert_eq(push_table(&r, 0, (const uint32_t[]){1, 2}, 2, false, &took, why), 0, "%s", why);
    cr_assert_eq(r.h.n_sp, 2);
    rig_deinit(&r);
}

Test(hold, the_rows_a_push_asks_for_replace_the_table_in_the_reply)
{
    rig_t r;
    rig_init(&r, true, PS_WIRE_F32);
    psd_took_t took;
    char why[200];
    const uint32_t want[3] = {2, 4, 39};
    for (int pull = 0; pull < 2; pull++) {
        msg_t x;
        msg_init(&x);
        float v[16] = {0};
        add_f32(&x, 0, v, 12);
        x.push.want_rows = true;
        x.push.pull = pull;
        add_u32(&x, T, want, 3);
        int rc = take(&r, 0, &x, false, 0, &took, why);
        if (!pull) { /* rows for a reply it did not ask for */
            cr_assert_eq(rc, -1);
            cr_assert(strstr(why, "without asking for the next version"), "%s", why);
            cr_assert_not(r.p[0].want.has);
            continue;
        }
        cr_assert_eq(rc, 0, "%s", why);
        cr_assert_eq(took.want_bytes, 12);
        cr_assert_eq(took.mask, 1u, "the list is not a gradient");
    }
    cr_assert(r.p[0].want.has);
    cr_assert_eq(r.p[0].want.n, 3);
    ps_frame_t fr[PS_MAX_TENSORS];
    uint32_t crc;
    long rows = 0;
    int n = psd_hold_reply(&r.h, &r.p[0], fr, &crc, &rows);
    cr_assert_eq(n, 3);
    cr_assert_eq(rows, 3);
    cr_assert_eq(fr[2].id, T);
    cr_assert_eq(fr[2].rows, 3);
    cr_assert_eq(fr[2].nbytes, 3 * D * sizeof(float));
    const float *E = r.s.cur->w + r.l.t[T].offset;
    for (int j = 0; j < 3; j++)
        cr_assert(memcmp((const float *)fr[2].data + j * D, E + want[j] * D, D * 4) == 0, "row %u", want[j]);
    cr_assert_not(r.p[0].want.has, "used up");
    for (int i = 0; i < 2; i++) fr[i].ffn((void *)fr[i].data, fr[i].hint);
    /* without a list the table goes whole */
    n = psd_hold_reply(&r.h, &r.p[0], fr, &crc, &rows);
    cr_assert_eq(rows, -1);
    cr_assert_eq(fr[2].nbytes, 40 * D * sizeof(float));
    for (int i = 0; i < n; i++) fr[i].ffn((void *)fr[i].data, fr[i].hint);
    /* a list that is not strictly increasing rows of the table */
    msg_t x;
    msg_init(&x);
    x.push.want_rows = x.push.pull = true;
    add_u32(&x, T, (const uint32_t[]){4, 2}, 2);
    cr_assert_eq(take(&r, 0, &x, false, 0, &took, why), -1);
    cr_assert(strstr(why, "asking for table rows that are not rows of the table"), "%s", why);
    cr_assert_not(r.p[0].want.has);
    rig_deinit(&r);
}

Test(hold, a_psd_shard_takes_its_piece_of_a_tensor_only)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, (const int[]){384, 128}, 2), 0); /* fc1.weight: three norm blocks */
    ps_config_t c;
    ps_config_defaults(&c);
    psd_store_t s;
    psd_hold_t h;
    psd_push_t p = {0};
    psd_optim_t o = {.kind = PS_OPT_SGD};
    cr_assert_eq(psd_store_init_part(&s, &l, &o, 7, 1, 2), 0);
    cr_assert_eq(psd_hold_init(&h, &s, &l, &c, true, 2), 0);
    const ps_piece_t *pc = &s.own[0];
    cr_assert(pc->n > 0 && pc->n < l.t[0].numel, "shard 1 of 2 holds a piece of fc1.weight (%zu at %zu of %zu, %zu)",
              pc->n, pc->off, (size_t)l.t[0].numel, l.n_params);
    static float v[384 * 128];
    psd_took_t took;
    char why[200];
    msg_t x;
    msg_init(&x);
    add_f32(&x, 0, v, l.t[0].numel); /* the whole tensor */
    cr_assert_eq(psd_push_take(&h, &p, &x.m, false, 0, &took, why, sizeof why), -1);
    cr_assert(strstr(why, "tensor 0 does not match this shard's part"), "%s", why);
    msg_close(&x);
    msg_init(&x);
    msg_add(&x, 0, PSD__DTYPE__DT_F32, v, pc->n * 4, pc->off); /* its piece */
    cr_assert_eq(psd_push_take(&h, &p, &x.m, false, 0, &took, why, sizeof why), 0, "%s", why);
    cr_assert_eq(p.mask, 1u);
    msg_close(&x);
    psd_push_release(&h, &p);
    psd_hold_deinit(&h);
    psd_store_deinit(&s);
    ps_config_free(&c);
    ps_layout_free(&l);
}
