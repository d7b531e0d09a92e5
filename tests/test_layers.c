/* test_layers.c - the CPU backend's ops against naive double-precision
 * references, the MLP's gradients against central finite differences, the
 * grad-ready order, a short training run, and the seeded initialisation. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ps_model.h"
#include "ps_rng.h"
#include "psw_backend.h"
#include "psw_model.h"

/* ---- helpers ---- */

static psw_backend_t *be;

static void setup(void)
{
    be = psw_backend_cpu_new(1);
    cr_assert_not_null(be);
}

static void teardown(void)
{
    if (be) be->destroy(be);
    be = NULL;
}

static float *fill_uniform(float *p, size_t n, float lo, float hi, ps_rng_t *r)
{
    for (size_t i = 0; i < n; i++) p[i] = lo + (hi - lo) * ps_rng_uniform(r);
    return p;
}

static float *dev_floats(size_t n)
{
    float *p = be->alloc(be, n * sizeof(float));
    cr_assert_not_null(p);
    return p;
}

/* Float results of sums of products are compared with a tolerance relative to
 * the sum of the absolute values of the terms: float rounding of each term and
 * of the running sum is bounded by a few ulp of that, whatever the cancellation. */
static void expect_close(const float *got, const double *ref, const double *abs_ref, size_t n,
                         double rtol, const char *what)
{
    for (size_t i = 0; i < n; i++) {
        double tol = rtol * (abs_ref[i] + fabs(ref[i])) + 1e-7;
        cr_expect(fabs((double)got[i] - ref[i]) <= tol, "%s[%zu]: got %.9g want %.9g (tol %.3g)",
                  what, i, (double)got[i], ref[i], tol);
    }
}

/* ---- (a) ops vs naive references ---- */

static void check_linear(int B, int in, int out, uint64_t seed)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 1);
    const size_t nx = (size_t)B * in, nw = (size_t)out * in, ny = (size_t)B * out;
    float *x = dev_floats(nx), *W = dev_floats(nw), *b = dev_floats((size_t)out);
    float *y = dev_floats(ny), *dy = dev_floats(ny);
    float *dx = dev_floats(nx), *dW = dev_floats(nw), *db = dev_floats((size_t)out);
    fill_uniform(x, nx, -1, 1, &r);
    fill_uniform(W, nw, -1, 1, &r);
    fill_uniform(b, (size_t)out, -1, 1, &r);
    fill_uniform(dy, ny, -1, 1, &r);
    /* Outputs must be overwritten, not accumulated. */
    fill_uniform(y, ny, 100, 200, &r);
    fill_uniform(dx, nx, 100, 200, &r);
    fill_uniform(dW, nw, 100, 200, &r);
    fill_uniform(db, (size_t)out, 100, 200, &r);

    be->linear_fwd(be, y, x, W, b, B, in, out);
    be->linear_bwd(be, dx, dW, db, dy, x, W, B, in, out);
    be->sync(be);

    size_t nmax = nx > nw ? nx : nw;
    nmax = nmax > ny ? nmax : ny;
    double *ref = calloc(nmax, sizeof(double)), *aref = calloc(nmax, sizeof(double));
    cr_assert(ref && aref);

    for (int i = 0; i < B; i++)
        for (int o = 0; o < out; o++) {
            double s = b[o], a = fabs(b[o]);
            for (int k = 0; k < in; k++) {
                double t = (double)x[(size_t)i * in + k] * W[(size_t)o * in + k];
                s += t;
                a += fabs(t);
            }
            ref[(size_t)i * out + o] = s;
            aref[(size_t)i * out + o] = a;
        }
    expect_close(y, ref, aref, ny, 1e-5, "y");

    for (int o = 0; o < out; o++)
        for (int k = 0; k < in; k++) {
            double s = 0, a = 0;
            for (int i = 0; i < B; i++) {
                double t = (double)dy[(size_t)i * out + o] * x[(size_t)i * in + k];
                s += t;
                a += fabs(t);
            }
            ref[(size_t)o * in + k] = s;
            aref[(size_t)o * in + k] = a;
        }
    expect_close(dW, ref, aref, nw, 1e-5, "dW");

    for (int o = 0; o < out; o++) {
        double s = 0, a = 0;
        for (int i = 0; i < B; i++) {
            s += dy[(size_t)i * out + o];
            a += fabs(dy[(size_t)i * out + o]);
        }
        ref[o] = s;
        aref[o] = a;
    }
    expect_close(db, ref, aref, (size_t)out, 1e-5, "db");

    for (int i = 0; i < B; i++)
        for (int k = 0; k < in; k++) {
            double s = 0, a = 0;
            for (int o = 0; o < out; o++) {
                double t = (double)dy[(size_t)i * out + o] * W[(size_t)o * in + k];
                s += t;
                a += fabs(t);
            }
            ref[(size_t)i * in + k] = s;
            aref[(size_t)i * in + k] = a;
        }
    expect_close(dx, ref, aref, nx, 1e-5, "dx");

    /* dx == NULL computes the same dW and db. */
    float *dW2 = dev_floats(nw), *db2 = dev_floats((size_t)out);
    be->linear_bwd(be, NULL, dW2, db2, dy, x, W, B, in, out);
    be->sync(be);
    cr_expect(memcmp(dW, dW2, nw * sizeof(float)) == 0, "dW differs without dx");
    cr_expect(memcmp(db, db2, (size_t)out * sizeof(float)) == 0, "db differs without dx");

    free(ref);
    free(aref);
    float *bufs[] = {x, W, b, y, dy, dx, dW, db, dW2, db2};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) be->free(be, bufs[i]);
}

TestSuite(ops, .init = setup, .fini = teardown);

Test(ops, linear_matches_reference)
{
    check_linear(1, 1, 1, 1);
    check_linear(1, 13, 7, 2);
    check_linear(6, 7, 5, 3);
    check_linear(17, 33, 9, 4);
    check_linear(64, 100, 40, 5);
    check_linear(3, 300, 2, 6);
}

/* Embedding bags against a double-precision reference (sum and mean, bags
 * with repeated rows), and the backward pass as the forward's adjoint:
 * <fwd(E), dy> = <E, bwd(dy)> for any E and dy, since the op is linear. */
Test(ops, embag_matches_reference_and_its_adjoint)
{
    ps_rng_t r;
    ps_rng_seed(&r, 11, 3);
    const int R = 37, D = 5, B = 6, F = 3, m = 4;
    const size_t nb = (size_t)B * F, ne = nb * m;
    float *E = dev_floats((size_t)R * D), *y = dev_floats(nb * D), *dy = dev_floats(nb * D);
    float *dE = dev_floats((size_t)R * D);
    uint32_t *ids = be->alloc(be, ne * sizeof *ids);
    fill_uniform(E, (size_t)R * D, -1, 1, &r);
    fill_uniform(dy, nb * D, -1, 1, &r);
    for (size_t e = 0; e < ne; e++) ids[e] = (uint32_t)ps_rng_below(&r, 8) * 4 + 1; /* rows repeat */
    for (int mean = 0; mean < 2; mean++) {
        be->embag_fwd(be, y, E, ids, B, F, m, D, mean);
        memset(dE, 0, (size_t)R * D * sizeof *dE);
        be->embag_bwd(be, dE, dy, ids, B, F, m, D, mean);
        be->sync(be);
        double lhs = 0, rhs = 0;
        for (size_t k = 0; k < nb; k++)
            for (int d = 0; d < D; d++) {
                double want = 0;
                for (int j = 0; j < m; j++) want += E[ids[k * m + j] * D + d];
                if (mean) want /= m;
                cr_expect(fabs(y[k * D + d] - want) < 1e-6, "bag %zu col %d: %g, want %g", k, d, y[k * D + d], want);
                lhs += (double)y[k * D + d] * dy[k * D + d];
            }
        for (size_t i = 0; i < (size_t)R * D; i++) {
            rhs += (double)E[i] * dE[i];
            if ((i / D) % 4 != 1) cr_expect(dE[i] == 0.0f, "row %zu is in no bag", i / D);
        }
        cr_expect(fabs(lhs - rhs) < 1e-5 * (fabs(lhs) + 1), "adjoint (mean %d): %.9g against %.9g", mean, lhs, rhs);
    }
    float *bufs[] = {E, y, dy, dE};
    for (size_t i = 0; i < 4; i++) be->free(be, bufs[i]);
    be->free(be, ids);
}

Test(ops, relu_fwd_bwd)
{
    ps_rng_t r;
    ps_rng_seed(&r, 7, 1);
    const size_t n = 1001;
    float *x = dev_floats(n), *y = dev_floats(n), *dy = dev_floats(n), *dx = dev_floats(n);
    fill_uniform(x, n, -1, 1, &r);
    fill_uniform(dy, n, -1, 1, &r);
    x[0] = 0.0f;
    x[1] = -0.0f;
    be->relu_fwd(be, y, x, n);
    be->relu_bwd(be, dx, dy, y, n);
    be->sync(be);
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(y[i], x[i] > 0 ? x[i] : 0.0f, "y[%zu]", i);
        cr_expect_eq(dx[i], x[i] > 0 ? dy[i] : 0.0f, "dx[%zu]", i);
    }
    /* In place: y == x and dx == dy. */
    float *z = dev_floats(n), *dz = dev_floats(n);
    memcpy(z, x, n * sizeof(float));
    memcpy(dz, dy, n * sizeof(float));
    be->relu_fwd(be, z, z, n);
    be->relu_bwd(be, dz, dz, z, n);
    be->sync(be);
    cr_expect(memcmp(z, y, n * sizeof(float)) == 0, "in-place relu_fwd differs");
    cr_expect(memcmp(dz, dx, n * sizeof(float)) == 0, "in-place relu_bwd differs");
    float *bufs[] = {x, y, dy, dx, z, dz};
    for (size_t i = 0; i < 6; i++) be->free(be, bufs[i]);
}

static void check_xent(int B, int C, float scale, float spread, uint64_t seed)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 2);
    const size_t n = (size_t)B * C;
    float *lg = dev_floats(n), *d = dev_floats(n);
    int32_t *lab = be->alloc(be, (size_t)B * sizeof(int32_t));
    cr_assert_not_null(lab);
    fill_uniform(lg, n, -spread, spread, &r);
    for (int i = 0; i < B; i++) lab[i] = (int32_t)ps_rng_below(&r, (uint64_t)C);

    double loss = 0.5; /* xent adds to what is there */
    int64_t correct = 3;
    be->xent(be, d, lg, lab, B, C, scale, &loss, &correct);
    double loss2 = 0.0;
    int64_t correct2 = 0;
    be->xent(be, NULL, lg, lab, B, C, scale, &loss2, &correct2);
    be->sync(be);

    double ref_loss = 0.0;
    int64_t ref_correct = 0;
    for (int i = 0; i < B; i++) {
        const float *l = lg + (size_t)i * C;
        double m = l[0];
        int arg = 0;
        for (int j = 1; j < C; j++)
            if (l[j] > m) m = l[arg = j];
        double s = 0;
        for (int j = 0; j < C; j++) s += exp(l[j] - m);
        ref_loss += log(s) + m - l[lab[i]];
        ref_correct += arg == lab[i];
        for (int j = 0; j < C; j++) {
            double want = (exp(l[j] - m) / s - (j == lab[i])) * scale;
            double got = d[(size_t)i * C + j];
            cr_expect(fabs(got - want) <= 1e-6 * fabs(scale) + 1e-5 * fabs(want),
                      "dlogits[%d,%d]: got %.9g want %.9g", i, j, got, want);
        }
    }
    cr_expect(fabs((loss - 0.5) - ref_loss) <= 1e-5 * (B + fabs(ref_loss)), "loss %.9g want %.9g",
              loss - 0.5, ref_loss);
    cr_expect_eq(correct - 3, ref_correct);
    cr_expect_eq(loss2, loss - 0.5, "loss differs without dlogits");
    cr_expect_eq(correct2, ref_correct);
    be->free(be, lg);
    be->free(be, d);
    be->free(be, lab);
}

Test(ops, xent_matches_reference)
{
    check_xent(1, 1, 1.0f, 1.0f, 1);
    check_xent(1, 10, 1.0f, 3.0f, 2);
    check_xent(6, 3, 1.0f / 6, 2.0f, 3);
    check_xent(64, 10, 1.0f / 64, 5.0f, 4);
    /* Large logits: max subtraction keeps exp finite. */
    check_xent(8, 5, 0.125f, 200.0f, 5);
}

Test(ops, xent_argmax_is_first_maximum)
{
    float *lg = dev_floats(6);
    int32_t *lab = be->alloc(be, 2 * sizeof(int32_t));
    cr_assert_not_null(lab);
    const float v[6] = {1, 3, 3, 2, 2, 0};
    memcpy(lg, v, sizeof(v));
    lab[0] = 1; /* first of the tied maxima: counted */
    lab[1] = 1; /* second of the tied maxima: not counted */
    double loss = 0;
    int64_t correct = 0;
    be->xent(be, NULL, lg, lab, 2, 3, 1.0f, &loss, &correct);
    be->sync(be);
    cr_expect_eq(correct, 1);
    double want = 2 * (log(exp(1.0) + 2 * exp(3.0)) - 3.0);
    cr_expect(fabs(loss - want) < 1e-5, "loss %.9g want %.9g", loss, want);
    be->free(be, lg);
    be->free(be, lab);
}

Test(ops, alloc_is_zeroed_and_aligned)
{
    const size_t sizes[] = {0, 1, 3, 64, 1000};
    for (size_t k = 0; k < 5; k++) {
        unsigned char *p = be->alloc(be, sizes[k]);
        cr_assert_not_null(p);
        cr_expect_eq((uintptr_t)p % 64, 0);
        for (size_t i = 0; i < sizes[k]; i++) cr_expect_eq(p[i], 0);
        be->free(be, p);
    }
}

/* ---- model helpers ---- */

typedef struct {
    ps_layout_t l;
    psw_model_t *m;
    float *params; /* host */
} fixture_t;

static void fixture_init(fixture_t *f, const int *sizes, int n_sizes, int max_batch,
                         uint64_t seed)
{
    cr_assert_eq(ps_layout_init(&f->l, sizes, n_sizes), 0);
    f->m = psw_model_new(be, &f->l, max_batch);
    cr_assert_not_null(f->m);
    f->params = calloc(f->l.n_params, sizeof(float));
    cr_assert_not_null(f->params);
    ps_model_init_params(&f->l, f->params, seed);
    psw_model_set_params(f->m, f->params);
}

static void fixture_deinit(fixture_t *f)
{
    psw_model_destroy(&f->m);
    cr_expect_null(f->m);
    free(f->params);
}

static void random_batch(float *x, int32_t *y, int B, int in, int C, uint64_t seed)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 3);
    fill_uniform(x, (size_t)B * in, -1, 1, &r);
    for (int i = 0; i < B; i++) y[i] = (int32_t)ps_rng_below(&r, (uint64_t)C);
}

/* Hidden pre-activation signs of a double-precision forward pass. */
static void preact_signs(const ps_layout_t *l, const float *p, const float *x, int B,
                         unsigned char *signs)
{
    double a[64], z[64];
    size_t k = 0;
    for (int s = 0; s < B; s++) {
        for (int j = 0; j < l->sizes[0]; j++) a[j] = x[(size_t)s * l->sizes[0] + j];
        for (int i = 0; i < l->n_layers - 1; i++) {
            const float *W = p + l->t[2 * i].offset, *b = p + l->t[2 * i + 1].offset;
            const int in = l->sizes[i], out = l->sizes[i + 1];
            for (int o = 0; o < out; o++) {
                z[o] = b[o];
                for (int j = 0; j < in; j++) z[o] += (double)W[(size_t)o * in + j] * a[j];
                signs[k++] = z[o] > 0;
            }
            for (int o = 0; o < out; o++) a[o] = z[o] > 0 ? z[o] : 0;
        }
    }
}

/* ---- (b) gradient check ---- */

TestSuite(model, .init = setup, .fini = teardown);

Test(model, gradients_match_finite_differences)
{
    enum { B = 6, IN = 7, C = 3 };
    const int sizes[] = {IN, 5, 4, C};
    fixture_t f;
    fixture_init(&f, sizes, 4, B, 42);
    ps_rng_t r;
    ps_rng_seed(&r, 99, 0);
    /* Non-zero biases, so that their gradients go through every path. */
    for (int k = 1; k < f.l.n_tensors; k += 2)
        fill_uniform(f.params + f.l.t[k].offset, f.l.t[k].numel, -0.3f, 0.3f, &r);
    psw_model_set_params(f.m, f.params);

    float x[B * IN];
    int32_t y[B];
    random_batch(x, y, B, IN, C, 5);

    double loss = 0;
    int64_t correct = 0;
    psw_model_train_step(f.m, x, y, B, &loss, &correct, NULL, NULL);
    float *g = calloc(f.l.n_params, sizeof(float));
    cr_assert_not_null(g);
    psw_model_get_grads(f.m, g);
    double loss_eval = 0;
    psw_model_eval(f.m, x, y, B, &loss_eval, NULL);
    cr_expect_eq(loss_eval, loss, "eval and train_step disagree on the loss");

    /* Float forward: each sample's loss carries ~1e-7 of rounding, so the
     * difference quotient carries up to ~1e-7 / (2 eps) = 5e-5 of noise at
     * eps = 1e-3 (worst seen: 2e-3 relative against the 1e-2 bound below);
     * O(eps^2) truncation is negligible. Larger steps cross ReLU kinks of this
     * fixed seed (eps = 1e-2 skips a third of the parameters). */
    const float eps = 1e-3f;
    const size_t n_pre = (size_t)B * (5 + 4);
    unsigned char s0[B * 9], sp[B * 9], sm[B * 9];
    preact_signs(&f.l, f.params, x, B, s0);

    int checked[PS_MAX_TENSORS] = {0}, skipped = 0;
    double worst = 0;
    for (int k = 0; k < f.l.n_tensors; k++) {
        const ps_tensor_info_t *t = &f.l.t[k];
        for (size_t j = 0; j < t->numel; j++) {
            float *p = &f.params[t->offset + j];
            const float p0 = *p, pp = p0 + eps, pm = p0 - eps;
            double lp = 0, lm = 0;
            *p = pp;
            preact_signs(&f.l, f.params, x, B, sp);
            psw_model_set_params(f.m, f.params);
            psw_model_eval(f.m, x, y, B, &lp, NULL);
            *p = pm;
            preact_signs(&f.l, f.params, x, B, sm);
            psw_model_set_params(f.m, f.params);
            psw_model_eval(f.m, x, y, B, &lm, NULL);
            *p = p0;
            /* The loss is not differentiable across a ReLU kink: a difference
             * quotient over one says nothing about the gradient. */
            if (memcmp(s0, sp, n_pre) || memcmp(s0, sm, n_pre)) {
                skipped++;
                continue;
            }
            /* pp - pm is the step actually taken after float rounding. */
            const double num = (lp - lm) / B / ((double)pp - (double)pm);
            const double ana = g[t->offset + j];
            const double err = fabs(num - ana) / fmax(fmax(fabs(num), fabs(ana)), 1e-2);
            worst = fmax(worst, err);
            cr_expect(err < 1e-2, "%s[%zu]: analytic %.7g numeric %.7g", t->name, j, ana, num);
            checked[k]++;
        }
    }
    /* Skips must stay rare, and no tensor may escape the check. */
    cr_expect(skipped <= (int)f.l.n_params / 10, "%d parameters skipped at ReLU kinks", skipped);
    for (int k = 0; k < f.l.n_tensors; k++)
        cr_expect(checked[k] * 2 >= (int)f.l.t[k].numel, "%s: only %d of %zu checked",
                  f.l.t[k].name, checked[k], f.l.t[k].numel);
    cr_log_info("gradcheck: worst relative error %.3g, %d skipped\n", worst, skipped);
    free(g);
    fixture_deinit(&f);
}

/* The model with embedding bags: the gradients of E (through the bags, with
 * a row twice in one bag and rows no bag uses), W and b against central
 * differences. No hidden layer, so no ReLU kink to step over. */
Test(model, bag_gradients_match_finite_differences)
{
    enum { B = 5, F = 3, M = 2, D = 4, ROWS = 10, C = 3 };
    const int sizes[] = {F * D, C};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 2, ROWS, D), 0);
    cr_assert_eq(l.table, 2);
    cr_assert_eq(l.n_tensors, 3);
    cr_assert_str_eq(l.t[2].name, "embedding.weight");
    psw_model_t *m = psw_model_new_bags(be, &l, B, &(psw_bags_t){.fields = F, .per_field = M, .mean = 1});
    cr_assert_not_null(m);
    float *params = calloc(l.n_params, sizeof(float)), *g = calloc(l.n_params, sizeof(float));
    cr_assert(params && g);
    ps_model_init_params(&l, params, 3);
    ps_rng_t r;
    ps_rng_seed(&r, 17, 0);
    fill_uniform(params + l.t[1].offset, l.t[1].numel, -0.3f, 0.3f, &r);
    psw_model_set_params(m, params);
    uint32_t ids[B * F * M];
    int32_t y[B];
    for (int i = 0; i < B * F * M; i++) ids[i] = (uint32_t)ps_rng_below(&r, ROWS - 2); /* rows 8, 9 unused */
    ids[1] = ids[0]; /* one row twice in a bag */
    for (int i = 0; i < B; i++) y[i] = (int32_t)ps_rng_below(&r, C);

    double loss = 0, loss_eval = 0;
    psw_model_train_bags(m, ids, y, B, &loss, NULL, NULL, NULL);
    psw_model_get_grads(m, g);
    psw_model_eval_bags(m, ids, y, B, &loss_eval, NULL);
    cr_expect_eq(loss_eval, loss, "eval and train disagree on the loss");
    const float eps = 1e-3f;
    double worst = 0;
    for (int k = 0; k < l.n_tensors; k++) {
        const ps_tensor_info_t *t = &l.t[k];
        for (size_t j = 0; j < t->numel; j++) {
            float *p = &params[t->offset + j];
            const float p0 = *p, pp = p0 + eps, pm = p0 - eps;
            double lp = 0, lm = 0;
            *p = pp;
            psw_model_set_params(m, params);
            psw_model_eval_bags(m, ids, y, B, &lp, NULL);
            *p = pm;
            psw_model_set_params(m, params);
            psw_model_eval_bags(m, ids, y, B, &lm, NULL);
            *p = p0;
            const double num = (lp - lm) / B / ((double)pp - (double)pm), ana = g[t->offset + j];
            const double err = fabs(num - ana) / fmax(fmax(fabs(num), fabs(ana)), 1e-2);
            worst = fmax(worst, err);
            cr_expect(err < 1e-2, "%s[%zu]: analytic %.7g numeric %.7g", t->name, j, ana, num);
        }
    }
    for (size_t j = (ROWS - 2) * D; j < ROWS * D; j++) cr_expect_eq(g[l.t[2].offset + j], 0.0f, "unused row");
    cr_log_info("bag gradcheck: worst relative error %.3g\n", worst);
    psw_model_destroy(&m);
    free(params);
    free(g);
}

/* ---- (c) ready callback ---- */

typedef struct {
    int n, forward_at; /* calls; the forward pass's (-1) came after forward_at of them (-1: none) */
    int order[PS_MAX_TENSORS * 2];
    const ps_layout_t *l;
    psw_model_t *m;
    float *snap; /* tensor contents at ready time */
} ready_log_t;

static void on_ready(void *ud, int tensor)
{
    ready_log_t *log = ud;
    if (tensor < 0) { /* the forward pass is done: once, before any gradient */
        cr_assert_eq(tensor, -1);
        cr_assert_eq(log->forward_at, -1, "the forward pass reported twice");
        log->forward_at = log->n;
        return;
    }
    cr_assert_lt(log->n, PS_MAX_TENSORS * 2);
    log->order[log->n++] = tensor;
    const ps_tensor_info_t *t = &log->l->t[tensor];
    /* CPU backend: the arena is host memory and ops are synchronous. */
    memcpy(log->snap + t->offset, psw_model_grads(log->m) + t->offset, t->numel * sizeof(float));
}

/* A model made for evaluation computes from the caller's parameters in
 * place: the same loss, correct count and probabilities as a model given a
 * copy, and it follows the caller's buffer (borrowed, not copied). */
Test(model, an_eval_model_computes_from_the_callers_parameters_in_place)
{
    enum { B = 6, F = 3, M = 2, D = 4, ROWS = 12, C = 2 };
    const int sizes[] = {F * D, 5, C};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, ROWS, D), 0);
    const psw_bags_t bags = {.fields = F, .per_field = M, .mean = 0};
    float *params = calloc(l.n_params, sizeof(float));
    cr_assert_not_null(params);
    ps_model_init_params(&l, params, 5);
    ps_rng_t r;
    ps_rng_seed(&r, 23, 0);
    fill_uniform(params + l.t[l.table].offset, l.t[l.table].numel, -0.5f, 0.5f, &r);
    uint32_t ids[B * F * M];
    int32_t y[B];
    for (int i = 0; i < B * F * M; i++) ids[i] = (uint32_t)ps_rng_below(&r, ROWS);
    for (int i = 0; i < B; i++) y[i] = (int32_t)ps_rng_below(&r, C);
    psw_model_t *m = psw_model_new_bags(be, &l, B, &bags), *e = psw_model_new_eval(be, &l, B, &bags, params);
    cr_assert(m && e);
    psw_model_set_params(m, params);
    double lm = 0, le = 0;
    int64_t cm = 0, ce = 0;
    float pm[B], pe[B];
    psw_model_eval_bags(m, ids, y, B, &lm, &cm);
    psw_model_prob1(m, pm, B);
    psw_model_eval_bags(e, ids, y, B, &le, &ce);
    psw_model_prob1(e, pe, B);
    cr_assert_eq(le, lm, "the same loss, bit for bit");
    cr_assert_eq(ce, cm);
    cr_assert_arr_eq(pe, pm, sizeof pm);
    for (size_t i = 0; i < l.t[l.table].numel; i++) params[l.t[l.table].offset + i] *= 2.0f; /* it reads them */
    double l2 = 0;
    psw_model_eval_bags(e, ids, y, B, &l2, NULL);
    cr_assert_neq(l2, le, "the eval model follows the caller's parameters");
    psw_model_destroy(&e);
    psw_model_destroy(&m);
    free(params);
}

Test(model, ready_called_once_per_tensor_last_layer_first)
{
    enum { B = 5 };
    const int sizes[] = {6, 8, 7, 4, 3};
    fixture_t f;
    fixture_init(&f, sizes, 5, B, 1);
    float x[B * 6];
    int32_t y[B];
    random_batch(x, y, B, 6, 3, 11);

    /* Poison the gradients: each must be written by the time it is reported. */
    float *grads = psw_model_grads(f.m);
    for (size_t i = 0; i < f.l.n_params; i++) grads[i] = NAN;

    ready_log_t log = {.l = &f.l, .m = f.m, .forward_at = -1};
    log.snap = calloc(f.l.n_params, sizeof(float));
    cr_assert_not_null(log.snap);
    psw_model_train_step(f.m, x, y, B, NULL, NULL, on_ready, &log);

    cr_assert_eq(log.n, f.l.n_tensors);
    cr_assert_eq(log.forward_at, 0, "the forward pass is reported before the first gradient");
    for (int i = 0; i < f.l.n_layers; i++) {
        const int layer = f.l.n_layers - 1 - i;
        cr_expect_eq(log.order[2 * i], 2 * layer, "call %d", 2 * i);
        cr_expect_eq(log.order[2 * i + 1], 2 * layer + 1, "call %d", 2 * i + 1);
    }
    float *g = calloc(f.l.n_params, sizeof(float));
    cr_assert_not_null(g);
    psw_model_get_grads(f.m, g);
    for (int k = 0; k < f.l.n_tensors; k++) {
        const ps_tensor_info_t *t = &f.l.t[k];
        for (size_t j = 0; j < t->numel; j++) {
            cr_expect(isfinite(log.snap[t->offset + j]), "%s[%zu] not written when ready",
                      t->name, j);
            cr_expect_eq(log.snap[t->offset + j], g[t->offset + j], "%s[%zu] changed after ready",
                         t->name, j);
        }
    }
    free(g);
    free(log.snap);
    fixture_deinit(&f);
}

Test(model, bags_report_the_table_last)
{
    enum { B = 4, F = 2, M = 3, D = 5, ROWS = 7 };
    const int sizes[] = {F * D, 6, 2};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, ROWS, D), 0);
    psw_model_t *m = psw_model_new_bags(be, &l, B, &(psw_bags_t){.fields = F, .per_field = M, .mean = 0});
    cr_assert_not_null(m);
    float *params = calloc(l.n_params, sizeof(float));
    cr_assert_not_null(params);
    ps_model_init_params(&l, params, 5);
    psw_model_set_params(m, params);
    uint32_t ids[B * F * M];
    int32_t y[B] = {0, 1, 1, 0};
    for (int i = 0; i < B * F * M; i++) ids[i] = (uint32_t)(i * 5 % ROWS);
    float *grads = psw_model_grads(m);
    for (size_t i = 0; i < l.n_params; i++) grads[i] = NAN;
    ready_log_t log = {.l = &l, .m = m, .forward_at = -1};
    log.snap = calloc(l.n_params, sizeof(float));
    cr_assert_not_null(log.snap);
    for (int rep = 0; rep < 2; rep++) { /* the second step must not add to the first's dE */
        log.n = 0;
        log.forward_at = -1;
        psw_model_train_bags(m, ids, y, B, NULL, NULL, on_ready, &log);
        cr_assert_eq(log.n, 5);
        cr_assert_eq(log.forward_at, 0);
        const int want[5] = {2, 3, 0, 1, 4};
        for (int i = 0; i < 5; i++) cr_expect_eq(log.order[i], want[i], "call %d", i);
        for (size_t j = 0; j < l.t[4].numel; j++)
            cr_assert(isfinite(log.snap[l.t[4].offset + j]), "E[%zu] not written when ready", j);
    }
    float *g1 = malloc(l.n_params * sizeof(float)), *g2 = malloc(l.n_params * sizeof(float));
    cr_assert(g1 && g2);
    psw_model_get_grads(m, g1);
    psw_model_train_bags(m, ids, y, B, NULL, NULL, NULL, NULL);
    psw_model_get_grads(m, g2);
    cr_expect_arr_eq(g1, g2, l.n_params * sizeof(float), "the same batch twice, another gradient");
    free(g1);
    free(g2);
    free(log.snap);
    free(params);
    psw_model_destroy(&m);
}

/* A backward zeroes only the rows of E the previous batch wrote: after
 * batch A then batch B (other rows), dE is the gradient of B alone. */
Test(model, a_batch_table_gradient_has_only_its_own_rows)
{
    enum { B = 3, F = 2, M = 2, D = 4, ROWS = 50 };
    const int sizes[] = {F * D, 5, 2};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, ROWS, D), 0);
    psw_bags_t bags = {.fields = F, .per_field = M, .mean = 1};
    psw_model_t *m = psw_model_new_bags(be, &l, B, &bags), *fresh = psw_model_new_bags(be, &l, B, &bags);
    cr_assert(m && fresh);
    float *params = calloc(l.n_params, sizeof(float)), *g1 = malloc(l.n_params * sizeof(float)),
          *g2 = malloc(l.n_params * sizeof(float));
    cr_assert(params && g1 && g2);
    ps_model_init_params(&l, params, 9);
    psw_model_set_params(m, params);
    psw_model_set_params(fresh, params);
    uint32_t a[B * F * M], b[B * F * M];
    int32_t y[B] = {1, 0, 1};
    for (int i = 0; i < B * F * M; i++) {
        a[i] = (uint32_t)(i * 3 % 20);       /* rows 0..19 */
        b[i] = (uint32_t)(25 + i * 7 % 20);  /* rows 25..44 */
    }
    psw_model_train_bags(m, a, y, B, NULL, NULL, NULL, NULL);
    psw_model_train_bags(m, b, y, B, NULL, NULL, NULL, NULL);
    psw_model_get_grads(m, g1);
    psw_model_train_bags(fresh, b, y, B, NULL, NULL, NULL, NULL);
    psw_model_get_grads(fresh, g2);
    cr_assert_arr_eq(g1, g2, l.n_params * sizeof(float), "batch A's rows are zero again");
    size_t nz = 0;
    for (size_t j = 0; j < l.t[l.table].numel; j++) nz += g1[l.t[l.table].offset + j] != 0;
    cr_assert_gt(nz, 0, "batch B's rows are there");
    free(params);
    free(g1);
    free(g2);
    psw_model_destroy(&m);
    psw_model_destroy(&fresh);
}

/* ---- (d) training ---- */

/* Three Gaussian blobs in 8 dimensions, one class each. */
static void blobs(float *x, int32_t *y, int n, uint64_t seed)
{
    static const float centre[3][8] = {
        {2, 0, 0, 1, 0, -1, 0, 0}, {0, 2, 0, -1, 0, 0, 1, 0}, {0, 0, 2, 0, -1, 0, 0, 1}};
    ps_rng_t r;
    ps_rng_seed(&r, seed, 4);
    for (int i = 0; i < n; i++) {
        y[i] = (int32_t)ps_rng_below(&r, 3);
        for (int j = 0; j < 8; j++) {
            /* Sum of 3 uniforms: roughly normal, sd 0.5. */
            float u = ps_rng_uniform(&r) + ps_rng_uniform(&r) + ps_rng_uniform(&r) - 1.5f;
            x[(size_t)i * 8 + j] = centre[y[i]][j] + u;
        }
    }
}

Test(model, sgd_lowers_the_loss)
{
    enum { B = 32, N = 512, STEPS = 200 };
    const int sizes[] = {8, 16, 3};
    fixture_t f;
    fixture_init(&f, sizes, 3, B, 3);
    float *x = calloc((size_t)N * 8, sizeof(float));
    int32_t *y = calloc(N, sizeof(int32_t));
    float *g = calloc(f.l.n_params, sizeof(float));
    cr_assert(x && y && g);
    blobs(x, y, N, 17);

    double loss0 = 0;
    int64_t correct0 = 0;
    for (int i = 0; i < N; i += B)
        psw_model_eval(f.m, x + (size_t)i * 8, y + i, B, &loss0, &correct0);

    for (int s = 0; s < STEPS; s++) {
        const int i = (s * B) % N;
        psw_model_train_step(f.m, x + (size_t)i * 8, y + i, B, NULL, NULL, NULL, NULL);
        psw_model_get_grads(f.m, g);
        for (size_t j = 0; j < f.l.n_params; j++) f.params[j] -= 0.1f * g[j];
        psw_model_set_params(f.m, f.params);
    }

    double loss1 = 0;
    int64_t correct1 = 0;
    for (int i = 0; i < N; i += B)
        psw_model_eval(f.m, x + (size_t)i * 8, y + i, B, &loss1, &correct1);
    cr_log_info("training: loss %.4f -> %.4f, accuracy %.3f -> %.3f\n", loss0 / N, loss1 / N,
                (double)correct0 / N, (double)correct1 / N);
    cr_expect_lt(loss1, 0.25 * loss0, "mean loss %.4f -> %.4f", loss0 / N, loss1 / N);
    cr_expect_geq(correct1, (int64_t)(0.95 * N), "accuracy %.3f", (double)correct1 / N);
    free(x);
    free(y);
    free(g);
    fixture_deinit(&f);
}

/* ---- (e) layout, init, partial batches ---- */

Test(layout, offsets_aligned_and_disjoint)
{
    const int sizes[] = {784, 256, 129, 10, 1};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, sizes, 5), 0);
    cr_expect_eq(l.n_sizes, 5);
    cr_expect_eq(l.n_layers, 4);
    cr_expect_eq(l.n_tensors, 8);
    size_t end = 0;
    for (int k = 0; k < l.n_tensors; k++) {
        const ps_tensor_info_t *t = &l.t[k];
        const int i = k / 2;
        char name[16];
        snprintf(name, sizeof(name), "fc%d.%s", i + 1, k % 2 ? "bias" : "weight");
        cr_expect_str_eq(t->name, name);
        cr_expect_eq(t->rows, sizes[i + 1]);
        cr_expect_eq(t->cols, k % 2 ? 1 : sizes[i]);
        cr_expect_eq(t->numel, (size_t)t->rows * (size_t)t->cols);
        cr_expect_eq(t->offset % 16, 0, "%s at %zu", t->name, t->offset);
        cr_expect_geq(t->offset, end, "%s overlaps its predecessor", t->name);
        cr_expect_lt(t->offset - end, 16, "%s: more padding than alignment needs", t->name);
        end = t->offset + t->numel;
    }
    cr_expect_geq(l.n_params, end);
    cr_expect_lt(l.n_params, end + 16);
}

Test(layout, rejects_bad_sizes)
{
    int sizes[PS_MAX_LAYERS + 2];
    for (int i = 0; i < PS_MAX_LAYERS + 2; i++) sizes[i] = 3;
    ps_layout_t l;
    cr_expect_eq(ps_layout_init(&l, sizes, 0), -1);
    cr_expect_eq(ps_layout_init(&l, sizes, 1), -1);
    cr_expect_eq(ps_layout_init(&l, sizes, PS_MAX_LAYERS + 2), -1);
    cr_expect_eq(ps_layout_init(&l, sizes, PS_MAX_LAYERS + 1), 0);
    cr_expect_eq(l.n_layers, PS_MAX_LAYERS);
    cr_expect_str_eq(l.t[2 * PS_MAX_LAYERS - 1].name, "fc16.bias");
    /* the largest MLP and a table */
    cr_expect_eq(ps_layout_init_table(&l, sizes, PS_MAX_LAYERS + 1, 10, 3), 0);
    cr_expect_eq(l.n_tensors, 2 * PS_MAX_LAYERS + 1);
    cr_expect_str_eq(l.t[2 * PS_MAX_LAYERS].name, "embedding.weight");
    cr_expect_eq(l.n_params, l.t[2 * PS_MAX_LAYERS].offset + 30);
    cr_expect_eq(ps_layout_init_table(&l, sizes, 3, 10, 0), -1, "a table of width 0");
    cr_expect_eq(ps_layout_init_table(&l, sizes, 3, (uint64_t)1 << 31, 1), -1, "more than INT32_MAX floats");
    cr_expect_eq(ps_layout_init_table(&l, sizes, 3, (uint64_t)1 << 28, 8), -1, "more than INT32_MAX floats");
    cr_expect_eq(ps_layout_init_table(&l, sizes, 3, 0, 0), 0, "no table");
    cr_expect_eq(l.table, -1);
    sizes[2] = 0;
    cr_expect_eq(ps_layout_init(&l, sizes, 4), -1);
    sizes[2] = -5;
    cr_expect_eq(ps_layout_init(&l, sizes, 4), -1);
}

Test(layout, init_is_seeded_and_bounded)
{
    const int sizes[] = {100, 33, 10};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, sizes, 3), 0);
    const size_t n = l.n_params;
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    float *c = malloc(n * sizeof(float));
    cr_assert(a && b && c);
    memset(a, 0xff, n * sizeof(float)); /* NaN garbage: padding must be cleared */
    memset(b, 0x7f, n * sizeof(float));
    ps_model_init_params(&l, a, 1234);
    ps_model_init_params(&l, b, 1234);
    ps_model_init_params(&l, c, 1235);
    cr_expect(memcmp(a, b, n * sizeof(float)) == 0, "same seed, different bits");

    size_t same = 0;
    for (int k = 0; k < l.n_tensors; k += 2)
        for (size_t j = 0; j < l.t[k].numel; j++)
            same += a[l.t[k].offset + j] == c[l.t[k].offset + j];
    cr_expect_lt(same, 10, "seeds 1234 and 1235 share %zu weights", same);

    size_t end = 0;
    for (int k = 0; k < l.n_tensors; k++) {
        const ps_tensor_info_t *t = &l.t[k];
        for (size_t j = end; j < t->offset; j++) cr_expect_eq(a[j], 0.0f, "padding at %zu", j);
        end = t->offset + t->numel;
        const float *p = a + t->offset;
        if (k % 2) {
            for (size_t j = 0; j < t->numel; j++) cr_expect_eq(p[j], 0.0f, "%s[%zu]", t->name, j);
            continue;
        }
        const double bound = sqrt(6.0 / t->cols);
        double lo = 0, hi = 0, sum = 0;
        for (size_t j = 0; j < t->numel; j++) {
            cr_expect(fabs(p[j]) <= bound, "%s[%zu] = %g beyond %g", t->name, j, p[j], bound);
            lo = fmin(lo, p[j]);
            hi = fmax(hi, p[j]);
            sum += p[j];
        }
        /* The draws cover the range and centre on zero (330 or 3300 draws). */
        cr_expect(lo < -0.9 * bound && hi > 0.9 * bound, "%s spans [%g, %g] of +-%g", t->name,
                  lo, hi, bound);
        const double sd_mean = bound / sqrt(3.0 * (double)t->numel);
        cr_expect(fabs(sum / t->numel) < 5 * sd_mean, "%s mean %g", t->name, sum / t->numel);
    }
    free(a);
    free(b);
    free(c);
}

Test(model, partial_batch_matches_exact_model)
{
    enum { MAXB = 8, B = 3, IN = 5, C = 4 };
    const int sizes[] = {IN, 6, C};
    fixture_t big, small;
    fixture_init(&big, sizes, 3, MAXB, 9);
    fixture_init(&small, sizes, 3, B, 9);
    float x[MAXB * IN];
    int32_t y[MAXB];
    random_batch(x, y, MAXB, IN, C, 21);

    /* A full batch first, so stale rows sit past row B in every buffer. */
    double l_full = 0, l_big = 0, l_small = 0;
    int64_t c_big = 0, c_small = 0;
    psw_model_train_step(big.m, x, y, MAXB, &l_full, NULL, NULL, NULL);
    psw_model_train_step(big.m, x, y, B, &l_big, &c_big, NULL, NULL);
    psw_model_train_step(small.m, x, y, B, &l_small, &c_small, NULL, NULL);
    cr_expect_eq(l_big, l_small);
    cr_expect_eq(c_big, c_small);

    float *gb = calloc(big.l.n_params, sizeof(float)), *gs = calloc(big.l.n_params, sizeof(float));
    cr_assert(gb && gs);
    psw_model_get_grads(big.m, gb);
    psw_model_get_grads(small.m, gs);
    for (size_t i = 0; i < big.l.n_params; i++)
        cr_expect(fabsf(gb[i] - gs[i]) <= 1e-6f * (1 + fabsf(gs[i])), "grad %zu: %g vs %g", i,
                  gb[i], gs[i]);

    /* B = 1 works as well, and eval of a partial batch matches. */
    double l1 = 0, e1 = 0;
    psw_model_train_step(big.m, x, y, 1, &l1, NULL, NULL, NULL);
    psw_model_eval(big.m, x, y, 1, &e1, NULL);
    cr_expect_eq(l1, e1);
    cr_expect(isfinite(l1) && l1 > 0);
    free(gb);
    free(gs);
    fixture_deinit(&big);
    fixture_deinit(&small);
}
