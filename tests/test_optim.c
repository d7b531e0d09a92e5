/* test_optim.c - psd_optim against hand-computed PyTorch semantics.
 *
 * Expected numbers are written out as literals with their derivation; the
 * stated tolerance is 1e-6 relative (float math vs exact arithmetic). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "psd_optim.h"

#define REL_TOL 1e-6

static int close_rel(double got, double exp)
{
    return fabs(got - exp) <= REL_TOL * fabs(exp) + 1e-12;
}

static void check_vec(const float *got, const double *exp, size_t n, const char *what)
{
    for (size_t i = 0; i < n; i++)
        cr_expect(close_rel(got[i], exp[i]), "%s[%zu]: got %.9g, expected %.9g", what, i,
                  (double)got[i], exp[i]);
}

static psd_optim_t make_opt(ps_opt_kind_t kind, float mom, int nesterov, float wd, float b1,
                            float b2, float eps)
{
    psd_optim_t o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.momentum = mom;
    o.nesterov = nesterov;
    o.weight_decay = wd;
    o.beta1 = b1;
    o.beta2 = b2;
    o.eps = eps;
    return o;
}

/* ---- config / slots ---------------------------------------------------- */

Test(optim, from_config_and_slots)
{
    ps_config_t c;
    memset(&c, 0, sizeof c);
    c.opt = PS_OPT_SGD;
    c.momentum = 0.9;
    c.nesterov = true;
    c.weight_decay = 5e-4;
    c.beta1 = 0.8;
    c.beta2 = 0.99;
    c.eps = 1e-7;
    psd_optim_t o;
    psd_optim_from_config(&o, &c);
    cr_expect_eq(o.kind, PS_OPT_SGD);
    cr_expect_float_eq(o.momentum, 0.9f, 1e-7);
    cr_expect_eq(o.nesterov, 1);
    cr_expect_float_eq(o.weight_decay, 5e-4f, 1e-10);
    cr_expect_float_eq(o.beta1, 0.8f, 1e-7);
    cr_expect_float_eq(o.beta2, 0.99f, 1e-7);
    cr_expect_float_eq(o.eps, 1e-7f, 1e-13);
    cr_expect_eq(psd_optim_slots(&o), 1);

    c.momentum = 0.0;
    c.nesterov = false;
    psd_optim_from_config(&o, &c);
    cr_expect_eq(o.nesterov, 0);
    cr_expect_eq(psd_optim_slots(&o), 0);

    c.opt = PS_OPT_ADAM;
    psd_optim_from_config(&o, &c);
    cr_expect_eq(o.kind, PS_OPT_ADAM);
    cr_expect_eq(psd_optim_slots(&o), 2);
    c.opt = PS_OPT_ADAMW;
    psd_optim_from_config(&o, &c);
    cr_expect_eq(o.kind, PS_OPT_ADAMW);
    cr_expect_eq(psd_optim_slots(&o), 2);
}

/* ---- SGD ------------------------------------------------------------------ */

Test(sgd, plain)
{
    /* lr 0.1, w = (1, -2, 0.5), g = (0.5, 1, -2) every step:
     * step 1: w - 0.1*g = (0.95, -2.1, 0.7)
     * step 2: (0.9, -2.2, 0.9) */
    psd_optim_t o = make_opt(PS_OPT_SGD, 0, 0, 0, 0, 0, 0);
    float w[3] = {1.0f, -2.0f, 0.5f};
    const float g[3] = {0.5f, 1.0f, -2.0f};
    psd_optim_apply(&o, w, w, g, 1.0f, NULL, NULL, 3, 0.1, 1);
    check_vec(w, (const double[]){0.95, -2.1, 0.7}, 3, "step1");
    psd_optim_apply(&o, w, w, g, 1.0f, NULL, NULL, 3, 0.1, 2);
    check_vec(w, (const double[]){0.9, -2.2, 0.9}, 3, "step2");
}

Test(sgd, gscale)
{
    /* gscale 0.5, lr 0.2, w = (1), g = (3): g' = 1.5, w = 1 - 0.3 = 0.7,
     * then 0.7 - 0.3 = 0.4 */
    psd_optim_t o = make_opt(PS_OPT_SGD, 0, 0, 0, 0, 0, 0);
    float w[1] = {1.0f};
    const float g[1] = {3.0f};
    psd_optim_apply(&o, w, w, g, 0.5f, NULL, NULL, 1, 0.2, 1);
    check_vec(w, (const double[]){0.7}, 1, "step1");
    psd_optim_apply(&o, w, w, g, 0.5f, NULL, NULL, 1, 0.2, 2);
    check_vec(w, (const double[]){0.4}, 1, "step2");
}

Test(sgd, momentum)
{
    /* mu 0.9, lr 0.1, w = (1, -2), g = (0.5, 1) every step:
     * step 1: buf = g = (0.5, 1);                    w = (0.95, -2.1)
     * step 2: buf = 0.9*buf + g = (0.95, 1.9);       w = (0.855, -2.29)
     * step 3: buf = (0.855+0.5, 1.71+1) = (1.355, 2.71); w = (0.7195, -2.561) */
    psd_optim_t o = make_opt(PS_OPT_SGD, 0.9f, 0, 0, 0, 0, 0);
    cr_assert_eq(psd_optim_slots(&o), 1);
    float w[2] = {1.0f, -2.0f}, buf[2] = {0, 0};
    const float g[2] = {0.5f, 1.0f};
    psd_optim_apply(&o, w, w, g, 1.0f, buf, NULL, 2, 0.1, 1);
    check_vec(buf, (const double[]){0.5, 1.0}, 2, "buf1");
    check_vec(w, (const double[]){0.95, -2.1}, 2, "step1");
    psd_optim_apply(&o, w, w, g, 1.0f, buf, NULL, 2, 0.1, 2);
    check_vec(buf, (const double[]){0.95, 1.9}, 2, "buf2");
    check_vec(w, (const double[]){0.855, -2.29}, 2, "step2");
    psd_optim_apply(&o, w, w, g, 1.0f, buf, NULL, 2, 0.1, 3);
    check_vec(buf, (const double[]){1.355, 2.71}, 2, "buf3");
    check_vec(w, (const double[]){0.7195, -2.561}, 2, "step3");
}

Test(sgd, nesterov)
{
    /* mu 0.9, lr 0.1, w = (1, -2), g = (0.5, 1), update = g + mu*buf:
     * step 1: buf = (0.5, 1);     u = (0.5+0.45, 1+0.9) = (0.95, 1.9);
     *         w = (1-0.095, -2-0.19) = (0.905, -2.19)
     * step 2: buf = (0.95, 1.9);  u = (0.5+0.855, 1+1.71) = (1.355, 2.71);
     *         w = (0.905-0.1355, -2.19-0.271) = (0.7695, -2.461) */
    psd_optim_t o = make_opt(PS_OPT_SGD, 0.9f, 1, 0, 0, 0, 0);
    float w[2] = {1.0f, -2.0f}, buf[2] = {0, 0};
    const float g[2] = {0.5f, 1.0f};
    psd_optim_apply(&o, w, w, g, 1.0f, buf, NULL, 2, 0.1, 1);
    check_vec(w, (const double[]){0.905, -2.19}, 2, "step1");
    psd_optim_apply(&o, w, w, g, 1.0f, buf, NULL, 2, 0.1, 2);
    check_vec(buf, (const double[]){0.95, 1.9}, 2, "buf2");
    check_vec(w, (const double[]){0.7695, -2.461}, 2, "step2");
}

/* Adagrad (PyTorch): g' = g + wd*w; sum += g'^2; w -= lr * g' / (sqrt(sum) + eps).
 * lr 0.1, wd 0.1, eps 1e-10, w = (1, -2), g = (0.5, 1):
 * step 1: g' = (0.6, 0.8), sum = (0.36, 0.64), w = (1 - 0.1*0.6/0.6, -2 - 0.1*0.8/0.8) = (0.9, -2.1)
 * step 2: g' = (0.59, 0.79), sum = (0.36 + 0.3481, 0.64 + 0.6241) = (0.7081, 1.2641),
 *         w = (0.9 - 0.059/sqrt(0.7081), -2.1 - 0.079/sqrt(1.2641)).
 * A zero gradient (no weight decay) leaves w and the sum exactly as they were. */
Test(adagrad, basic)
{
    psd_optim_t o = make_opt(PS_OPT_ADAGRAD, 0, 0, 0.1f, 0, 0, 1e-10f);
    cr_assert_eq(psd_optim_slots(&o), 1);
    float w[2] = {1.0f, -2.0f}, sum[2] = {0, 0};
    const float g[2] = {0.5f, 1.0f};
    psd_optim_apply(&o, w, w, g, 1.0f, sum, NULL, 2, 0.1, 1);
    check_vec(w, (const double[]){0.9, -2.1}, 2, "step1");
    check_vec(sum, (const double[]){0.36, 0.64}, 2, "sum1");
    psd_optim_apply(&o, w, w, g, 1.0f, sum, NULL, 2, 0.1, 2);
    check_vec(w, (const double[]){0.9 - 0.059 / sqrt(0.7081), -2.1 - 0.079 / sqrt(1.2641)}, 2, "step2");
    check_vec(sum, (const double[]){0.7081, 1.2641}, 2, "sum2");
    psd_optim_t plain = make_opt(PS_OPT_ADAGRAD, 0, 0, 0, 0, 0, 1e-10f);
    float w2[2] = {w[0], w[1]}, sum2[2] = {sum[0], sum[1]};
    const float zero[2] = {0, 0};
    psd_optim_apply(&plain, w2, w2, zero, 1.0f, sum2, NULL, 2, 0.1, 3);
    cr_assert(memcmp(w2, w, sizeof w) == 0 && memcmp(sum2, sum, sizeof sum) == 0, "a zero gradient changes nothing");
}

Test(sgd, weight_decay)
{
    /* wd 0.1, lr 0.1, w = (1, -2), g = (0.5, 1), g' = g + wd*w:
     * step 1: g' = (0.6, 0.8);       w = (0.94, -2.08)
     * step 2: g' = (0.5+0.094, 1-0.208) = (0.594, 0.792);
     *         w = (0.94-0.0594, -2.08-0.0792) = (0.8806, -2.1592) */
    psd_optim_t o = make_opt(PS_OPT_SGD, 0, 0, 0.1f, 0, 0, 0);
    float w[2] = {1.0f, -2.0f};
    const float g[2] = {0.5f, 1.0f};
    psd_optim_apply(&o, w, w, g, 1.0f, NULL, NULL, 2, 0.1, 1);
    check_vec(w, (const double[]){0.94, -2.08}, 2, "step1");
    psd_optim_apply(&o, w, w, g, 1.0f, NULL, NULL, 2, 0.1, 2);
    check_vec(w, (const double[]){0.8806, -2.1592}, 2, "step2");
}

Test(sgd, momentum_weight_decay_gscale)
{
    /* mu 0.5, wd 0.1, gscale 2, lr 0.1, w = 1, g = 0.25:
     * step 1: g' = 0.5 + 0.1 = 0.6; buf = 0.6; w = 0.94
     * step 2: g' = 0.5 + 0.094 = 0.594; buf = 0.3 + 0.594 = 0.894;
     *         w = 0.94 - 0.0894 = 0.8506 */
    psd_optim_t o = make_opt(PS_OPT_SGD, 0.5f, 0, 0.1f, 0, 0, 0);
    float w[1] = {1.0f}, buf[1] = {0};
    const float g[1] = {0.25f};
    psd_optim_apply(&o, w, w, g, 2.0f, buf, NULL, 1, 0.1, 1);
    check_vec(w, (const double[]){0.94}, 1, "step1");
    psd_optim_apply(&o, w, w, g, 2.0f, buf, NULL, 1, 0.1, 2);
    check_vec(buf, (const double[]){0.894}, 1, "buf2");
    check_vec(w, (const double[]){0.8506}, 1, "step2");
}

/* ---- Adam / AdamW --------------------------------------------------------- */

Test(adam, basic)
{
    /* b1 0.5, b2 0.75, eps 1e-8, lr 0.1, wd 0.
     * elem 0: w = 1, g = 1, -1, 2
     *   t1: m = 0.5, v = 0.25; bc1 = 0.5, bc2 = 0.25 -> mhat 1, vhat 1;
     *       u = 1/(1+1e-8); w = 1 - 0.1*u = 0.900000001
     *   t2: m = 0.25 - 0.5 = -0.25; v = 0.1875 + 0.25 = 0.4375;
     *       bc1 = 0.75, bc2 = 0.4375 -> mhat -1/3, vhat 1;
     *       w = 0.9 + 0.1/3 = 0.933333334
     *   t3: m = -0.125 + 1 = 0.875; v = 0.328125 + 1 = 1.328125;
     *       bc1 = 0.875 -> mhat 1; bc2 = 1 - 0.421875 = 0.578125 ->
     *       vhat = 1.328125/0.578125 = 85/37; u = sqrt(37/85) = 0.65976823;
     *       w = 0.93333333 - 0.065976823 = 0.86735651
     * elem 1: w = -0.5, g = 0.5 constant: mhat = g, vhat = g^2 every step,
     *   u = 1 -> w = -0.6, -0.7, -0.8 */
    psd_optim_t o = make_opt(PS_OPT_ADAM, 0, 0, 0, 0.5f, 0.75f, 1e-8f);
    float w[2] = {1.0f, -0.5f}, m[2] = {0, 0}, v[2] = {0, 0};
    psd_optim_apply(&o, w, w, (const float[]){1.0f, 0.5f}, 1.0f, m, v, 2, 0.1, 1);
    check_vec(m, (const double[]){0.5, 0.25}, 2, "m1");
    check_vec(v, (const double[]){0.25, 0.0625}, 2, "v1");
    check_vec(w, (const double[]){0.9, -0.6}, 2, "step1");
    psd_optim_apply(&o, w, w, (const float[]){-1.0f, 0.5f}, 1.0f, m, v, 2, 0.1, 2);
    check_vec(m, (const double[]){-0.25, 0.375}, 2, "m2");
    check_vec(v, (const double[]){0.4375, 0.109375}, 2, "v2");
    check_vec(w, (const double[]){0.93333333, -0.7}, 2, "step2");
    psd_optim_apply(&o, w, w, (const float[]){2.0f, 0.5f}, 1.0f, m, v, 2, 0.1, 3);
    check_vec(w, (const double[]){0.86735651, -0.8}, 2, "step3");
}

Test(adam, l2_weight_decay)
{
    /* b1 0.5, b2 0.75, eps 1e-8, lr 0.1, wd 0.1, w = 2, g = 0.8 constant,
     * g' = g + wd*w:
     *   t1: g' = 1.0; m 0.5, v 0.25; mhat 1, vhat 1; w = 1.9
     *   t2: g' = 0.8 + 0.19 = 0.99; m = 0.25 + 0.495 = 0.745;
     *       v = 0.1875 + 0.25*0.9801 = 0.432525; mhat = 0.745/0.75 = 0.99333333;
     *       vhat = 0.432525/0.4375 = 0.98862857; sqrt = 0.99429803;
     *       u = 0.99902977; w = 1.9 - 0.099902977 = 1.80009702
     *   t3: g' = 0.8 + 0.180009702 = 0.980009702; m = 0.3725 + 0.490004851
     *       = 0.862504851; v = 0.32439375 + 0.25*0.960419016 = 0.564498504;
     *       mhat = m/0.875 = 0.98571983; vhat = v/0.578125 = 0.97642985;
     *       u = 0.98571983/0.98814465 = 0.99754609; w = 1.70034242 */
    psd_optim_t o = make_opt(PS_OPT_ADAM, 0, 0, 0.1f, 0.5f, 0.75f, 1e-8f);
    float w[1] = {2.0f}, m[1] = {0}, v[1] = {0};
    const float g[1] = {0.8f};
    psd_optim_apply(&o, w, w, g, 1.0f, m, v, 1, 0.1, 1);
    check_vec(w, (const double[]){1.9}, 1, "step1");
    psd_optim_apply(&o, w, w, g, 1.0f, m, v, 1, 0.1, 2);
    check_vec(m, (const double[]){0.745}, 1, "m2");
    check_vec(v, (const double[]){0.432525}, 1, "v2");
    check_vec(w, (const double[]){1.80009702}, 1, "step2");
    psd_optim_apply(&o, w, w, g, 1.0f, m, v, 1, 0.1, 3);
    check_vec(w, (const double[]){1.70034242}, 1, "step3");
}

Test(adam, adamw_decoupled)
{
    /* AdamW b1 0.5, b2 0.75, eps 1e-8, lr 0.1, wd 0.1: w' = w*(1 - 0.01)
     * then the Adam step on the raw gradient. w = 2, g = 1, -1, 0.5:
     *   t1: w' = 1.98; mhat 1, vhat 1; w = 1.88
     *   t2: w' = 1.88*0.99 = 1.8612; m -0.25, v 0.4375 -> mhat -1/3, vhat 1;
     *       w = 1.8612 + 0.0333333 = 1.89453333
     *   t3: w' = 1.89453333*0.99 = 1.8755880; m = -0.125 + 0.25 = 0.125,
     *       v = 0.328125 + 0.0625 = 0.390625; mhat = 0.125/0.875 = 1/7;
     *       vhat = 0.390625/0.578125 = 25/37; u = (1/7)/(5/sqrt(37))
     *       = sqrt(37)/35 = 0.17379322; w = 1.8755880 - 0.017379322 = 1.85820868 */
    psd_optim_t o = make_opt(PS_OPT_ADAMW, 0, 0, 0.1f, 0.5f, 0.75f, 1e-8f);
    float w[1] = {2.0f}, m[1] = {0}, v[1] = {0};
    psd_optim_apply(&o, w, w, (const float[]){1.0f}, 1.0f, m, v, 1, 0.1, 1);
    check_vec(w, (const double[]){1.88}, 1, "step1");
    psd_optim_apply(&o, w, w, (const float[]){-1.0f}, 1.0f, m, v, 1, 0.1, 2);
    check_vec(w, (const double[]){1.89453333}, 1, "step2");
    psd_optim_apply(&o, w, w, (const float[]){0.5f}, 1.0f, m, v, 1, 0.1, 3);
    check_vec(m, (const double[]){0.125}, 1, "m3");
    check_vec(v, (const double[]){0.390625}, 1, "v3");
    check_vec(w, (const double[]){1.85820868}, 1, "step3");
}

Test(adam, gscale_and_default_betas)
{
    /* PyTorch defaults b1 0.9, b2 0.999, eps 1e-8, lr 1e-3, w = 0, g = 4 with
     * gscale 0.25 -> g' = 1. t1: mhat = 1, vhat = 1 -> w = -0.001*(1/(1+1e-8)).
     * t2 (same g'): m = 0.19, bc1 = 0.19; v = 0.001999, bc2 = 0.001999 ->
     * mhat 1, vhat 1 -> w = -0.002. */
    psd_optim_t o = make_opt(PS_OPT_ADAM, 0, 0, 0, 0.9f, 0.999f, 1e-8f);
    float w[1] = {0.0f}, m[1] = {0}, v[1] = {0};
    const float g[1] = {4.0f};
    psd_optim_apply(&o, w, w, g, 0.25f, m, v, 1, 1e-3, 1);
    check_vec(w, (const double[]){-0.001}, 1, "step1");
    psd_optim_apply(&o, w, w, g, 0.25f, m, v, 1, 1e-3, 2);
    check_vec(w, (const double[]){-0.002}, 1, "step2");
}

/* ---- in place vs out of place, chunked vs whole -------------------------- */

#define N_BIG 1037

/* Seeded values in (-scale, scale) from splitmix64; 24 bits, exact in float. */
static void fill(float *x, size_t n, uint64_t seed, float scale)
{
    uint64_t st = seed;
    for (size_t i = 0; i < n; i++) {
        uint64_t z = (st += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        x[i] = (u * 2.0f - 1.0f) * scale;
    }
}

static const psd_optim_t *all_opts(int *count)
{
    static psd_optim_t opts[7];
    opts[0] = make_opt(PS_OPT_SGD, 0, 0, 0, 0, 0, 0);
    opts[1] = make_opt(PS_OPT_SGD, 0.9f, 0, 1e-4f, 0, 0, 0);
    opts[2] = make_opt(PS_OPT_SGD, 0.9f, 1, 5e-4f, 0, 0, 0);
    opts[3] = make_opt(PS_OPT_SGD, 0, 0, 1e-2f, 0, 0, 0);
    opts[4] = make_opt(PS_OPT_ADAM, 0, 0, 1e-3f, 0.9f, 0.999f, 1e-8f);
    opts[5] = make_opt(PS_OPT_ADAMW, 0, 0, 1e-2f, 0.9f, 0.999f, 1e-8f);
    opts[6] = make_opt(PS_OPT_ADAGRAD, 0, 0, 1e-3f, 0, 0, 1e-10f);
    *count = 7;
    return opts;
}

Test(optim, in_place_equals_out_of_place)
{
    int n_opts;
    const psd_optim_t *opts = all_opts(&n_opts);
    for (int k = 0; k < n_opts; k++) {
        const psd_optim_t *o = &opts[k];
        static float wa[N_BIG], wb[N_BIG], wtmp[N_BIG], g[N_BIG];
        static float sa0[N_BIG], sa1[N_BIG], sb0[N_BIG], sb1[N_BIG];
        fill(wa, N_BIG, 1, 1.0f);
        memcpy(wb, wa, sizeof wa);
        memset(sa0, 0, sizeof sa0); memset(sa1, 0, sizeof sa1);
        memset(sb0, 0, sizeof sb0); memset(sb1, 0, sizeof sb1);
        for (uint64_t t = 1; t <= 3; t++) {
            fill(g, N_BIG, 100 + t, 0.5f);
            psd_optim_apply(o, wa, wa, g, 0.7f, sa0, sa1, N_BIG, 0.05, t);
            psd_optim_apply(o, wb, wtmp, g, 0.7f, sb0, sb1, N_BIG, 0.05, t);
            memcpy(wb, wtmp, sizeof wb);
        }
        cr_expect(memcmp(wa, wb, sizeof wa) == 0, "opt %d: in-place differs", k);
        cr_expect(memcmp(sa0, sb0, sizeof sa0) == 0, "opt %d: s0 differs", k);
        cr_expect(memcmp(sa1, sb1, sizeof sa1) == 0, "opt %d: s1 differs", k);
    }
}

Test(optim, chunked_equals_whole)
{
    /* Uneven pieces, including sizes below and across any vector width. */
    static const size_t pieces[] = {1, 7, 16, 3, 100, 513, 2, 0, 395};
    size_t total = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) total += pieces[i];
    cr_assert_eq(total, (size_t)N_BIG);

    int n_opts;
    const psd_optim_t *opts = all_opts(&n_opts);
    for (int k = 0; k < n_opts; k++) {
        const psd_optim_t *o = &opts[k];
        static float wa[N_BIG], wb[N_BIG], wnew[N_BIG], g[N_BIG];
        static float sa0[N_BIG], sa1[N_BIG], sb0[N_BIG], sb1[N_BIG];
        fill(wa, N_BIG, 2, 1.0f);
        memcpy(wb, wa, sizeof wa);
        memset(sa0, 0, sizeof sa0); memset(sa1, 0, sizeof sa1);
        memset(sb0, 0, sizeof sb0); memset(sb1, 0, sizeof sb1);
        for (uint64_t t = 1; t <= 4; t++) {
            fill(g, N_BIG, 200 + t, 0.3f);
            psd_optim_apply(o, wa, wa, g, 0.9f, sa0, sa1, N_BIG, 0.01, t);
            /* chunked, out of place into wnew, then swap in */
            size_t off = 0;
            for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
                psd_optim_apply(o, wb + off, wnew + off, g + off, 0.9f, sb0 + off, sb1 + off,
                                pieces[i], 0.01, t);
                off += pieces[i];
            }
            memcpy(wb, wnew, sizeof wb);
        }
        cr_expect(memcmp(wa, wb, sizeof wa) == 0, "opt %d: chunked weights differ", k);
        cr_expect(memcmp(sa0, sb0, sizeof sa0) == 0, "opt %d: chunked s0 differs", k);
        cr_expect(memcmp(sa1, sb1, sizeof sa1) == 0, "opt %d: chunked s1 differs", k);
    }
}

/* max |x[i]| in float (the reference for psd_amax_t) */
static float max_abs(const float *x, size_t n)
{
    float m = 0;
    for (size_t i = 0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

/* The largest magnitudes folded into the update's loop: those of the
 * gradient read and the weights written, in any split, with the update's
 * bits unchanged. */
Test(optim, amax_is_the_largest_magnitude_and_changes_no_bit)
{
    static const size_t pieces[] = {1, 7, 16, 3, 100, 513, 2, 0, 395};
    int n_opts;
    const psd_optim_t *opts = all_opts(&n_opts);
    for (int k = 0; k < n_opts; k++) {
        const psd_optim_t *o = &opts[k];
        static float wa[N_BIG], wb[N_BIG], wnew[N_BIG], g[N_BIG];
        static float sa0[N_BIG], sa1[N_BIG], sb0[N_BIG], sb1[N_BIG];
        fill(wa, N_BIG, 3, 1.0f);
        memcpy(wb, wa, sizeof wa);
        memset(sa0, 0, sizeof sa0); memset(sa1, 0, sizeof sa1);
        memset(sb0, 0, sizeof sb0); memset(sb1, 0, sizeof sb1);
        for (uint64_t t = 1; t <= 3; t++) {
            fill(g, N_BIG, 400 + t, 0.3f);
            g[N_BIG - 1 - t] = -0.75f; /* the largest, negative, somewhere else each step */
            psd_optim_apply(o, wa, wa, g, 0.9f, sa0, sa1, N_BIG, 0.01, t);
            psd_amax_t am = {0, 0};
            size_t off = 0;
            for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
                psd_optim_apply_amax(o, wb + off, wnew + off, g + off, 0.9f, sb0 + off, sb1 + off, pieces[i], 0.01, t,
                                     &am);
                off += pieces[i];
            }
            memcpy(wb, wnew, sizeof wb);
            cr_expect_eq(psd_amax_value(am.g), 0.75f, "opt %d step %lu: max |g|", k, t);
            cr_expect_eq(psd_amax_value(am.w), max_abs(wb, N_BIG), "opt %d step %lu: max |w|", k, t);
            cr_expect_eq(am.w, psd_amax_bits(wb, N_BIG));
        }
        cr_expect(memcmp(wa, wb, sizeof wa) == 0, "opt %d: the weights' bits changed", k);
        cr_expect(memcmp(sa0, sb0, sizeof sa0) == 0 && memcmp(sa1, sb1, sizeof sa1) == 0, "opt %d: the state", k);
    }
    cr_expect_eq(psd_amax_bits(NULL, 0), 0u);
    cr_expect_eq(psd_amax_bits((const float[]){-0.0f, 0.0f}, 2), 0u);
}

/* A NaN or an infinity anywhere in the gradient (either sign; with the
 * scale of a clipped infinite norm, 0, too) is seen in it, and makes a
 * weight that is not finite with every optimizer; an update that overflows
 * from a finite gradient is seen in the weights only. */
Test(optim, amax_sees_nan_and_infinities)
{
    const float bad[4] = {NAN, -NAN, INFINITY, -INFINITY};
    const float scale[2] = {0.9f, 0.0f};
    int n_opts;
    const psd_optim_t *opts = all_opts(&n_opts);
    for (int k = 0; k < n_opts; k++)
        for (int b = 0; b < 4; b++)
            for (int sc = 0; sc < 2; sc++) {
                static float w[N_BIG], g[N_BIG], s0[N_BIG], s1[N_BIG];
                fill(w, N_BIG, 5, 1.0f);
                fill(g, N_BIG, 6, 0.3f);
                memset(s0, 0, sizeof s0);
                memset(s1, 0, sizeof s1);
                g[517] = bad[b];
                psd_amax_t am = {0, 0};
                psd_optim_apply_amax(&opts[k], w, w, g, scale[sc], s0, s1, N_BIG, 0.01, 1, &am);
                cr_expect_geq(am.g, PSD_AMAX_INF, "opt %d, %g, scale %g: the gradient's", k, bad[b], scale[sc]);
                cr_expect_geq(am.w, PSD_AMAX_INF, "opt %d, %g, scale %g: and so the weights'", k, bad[b], scale[sc]);
                cr_expect_eq(am.g == PSD_AMAX_INF, isinf(bad[b]) != 0, "inf is 0x7f800000, NaN above");
            }
    psd_optim_t sgd = make_opt(PS_OPT_SGD, 0, 0, 0, 0, 0, 0);
    float w[3] = {-3e38f, 1.0f, 2.0f}, g[3] = {1.0f, 1.0f, 1.0f};
    psd_amax_t am = {0, 0};
    psd_optim_apply_amax(&sgd, w, w, g, 1.0f, NULL, NULL, 3, 1e38, 1, &am);
    cr_expect_lt(am.g, PSD_AMAX_INF);
    cr_expect_eq(am.w, PSD_AMAX_INF, "-3e38 - 1e38 overflows to -inf");
}

Test(optim, zero_length_is_noop)
{
    psd_optim_t o = make_opt(PS_OPT_ADAM, 0, 0, 0, 0.9f, 0.999f, 1e-8f);
    psd_optim_apply(&o, NULL, NULL, NULL, 1.0f, NULL, NULL, 0, 0.1, 1);
    cr_expect_eq(psd_sumsq(NULL, 0), 0.0);
}

/* ---- sumsq and clipping --------------------------------------------------- */

Test(clip, sumsq)
{
    cr_expect_eq(psd_sumsq((const float[]){1.0f, -2.0f, 3.0f}, 3), 14.0);
    cr_expect_eq(psd_sumsq((const float[]){0.5f}, 1), 0.25);
    /* 1e20^2 overflows float but not double */
    double big = (double)1e20f * (double)1e20f;
    cr_expect(close_rel(psd_sumsq((const float[]){1e20f, -1e20f}, 2), 2.0 * big));
    /* 2^24 + 3 ones: a float accumulator would stop at 2^24 */
    size_t n = ((size_t)1 << 24) + 3;
    float *ones = malloc(n * sizeof *ones);
    cr_assert_not_null(ones);
    for (size_t i = 0; i < n; i++) ones[i] = 1.0f;
    cr_expect_eq(psd_sumsq(ones, n), 16777219.0);
    /* split sums add up to the whole */
    cr_expect_eq(psd_sumsq(ones, 1000) + psd_sumsq(ones + 1000, n - 1000), 16777219.0);
    free(ones);
}

Test(clip, scale)
{
    /* off */
    cr_expect_eq(psd_clip_scale(100.0, 0.0), 1.0f);
    cr_expect_eq(psd_clip_scale(100.0, -1.0), 1.0f);
    /* norm 3 below max 5 */
    cr_expect_eq(psd_clip_scale(9.0, 5.0), 1.0f);
    /* zero gradient: 1/(0 + 1e-6) = 1e6 -> 1 */
    cr_expect_eq(psd_clip_scale(0.0, 1.0), 1.0f);
    /* norm 3 above max 1.5: 1.5/(3 + 1e-6) = 0.49999983 */
    cr_expect(close_rel(psd_clip_scale(9.0, 1.5), 0.4999998333));
    /* norm equal to max: 2/(2 + 1e-6) = 0.9999995 < 1 (PyTorch clips too) */
    cr_expect(close_rel(psd_clip_scale(4.0, 2.0), 0.99999950000025));
    cr_expect_lt(psd_clip_scale(4.0, 2.0), 1.0f);
    /* norm 100 max 1: 1/(100 + 1e-6) = 0.0099999999 */
    cr_expect(close_rel(psd_clip_scale(1e4, 1.0), 0.0099999999));
}

/* ---- schedules ------------------------------------------------------------ */

static ps_config_t sched_cfg(ps_sched_kind_t kind)
{
    ps_config_t c;
    memset(&c, 0, sizeof c);
    c.sched = kind;
    c.lr = 0.1;
    c.epochs = 10;
    return c;
}

static void expect_lr(const ps_config_t *c, double p, double spe, double exp)
{
    double got = psd_sched_lr(c, p, spe);
    cr_expect(close_rel(got, exp), "sched %d p=%g spe=%g: got %.12g expected %.12g",
              (int)c->sched, p, spe, got, exp);
}

Test(sched, constant)
{
    ps_config_t c = sched_cfg(PS_SCHED_CONSTANT);
    expect_lr(&c, 0.0, 100, 0.1);
    expect_lr(&c, 5.5, 100, 0.1);
    expect_lr(&c, 9.99, 100, 0.1);
}

Test(sched, constant_warmup)
{
    /* warm-up 0.5 epochs at 100 steps/epoch: W = 50 steps, step s gets (s+1)/50 */
    ps_config_t c = sched_cfg(PS_SCHED_CONSTANT);
    c.warmup_epochs = 0.5;
    expect_lr(&c, 0.0, 100, 0.1 * 1 / 50);      /* 0.002 */
    expect_lr(&c, 0.10, 100, 0.1 * 11 / 50);    /* s = 10: 0.022 */
    expect_lr(&c, 0.25, 100, 0.1 * 26 / 50);    /* s = 25: 0.052 */
    expect_lr(&c, 49.0 / 100, 100, 0.1);        /* s = 49: 50/50 */
    expect_lr(&c, 0.5, 100, 0.1);               /* s = 50: past warm-up */
    expect_lr(&c, 3.0, 100, 0.1);
    /* fractional W = 2.5 steps (spe 5): s = 2 would be 3/2.5, capped at 1 */
    expect_lr(&c, 0.0, 5, 0.1 * 1 / 2.5);
    expect_lr(&c, 1.0 / 5, 5, 0.1 * 2 / 2.5);
    expect_lr(&c, 2.0 / 5, 5, 0.1);
}

Test(sched, step)
{
    /* gamma 0.5 every 3 epochs: 0.1 on [0,3), 0.05 on [3,6), 0.025 on [6,9), ... */
    ps_config_t c = sched_cfg(PS_SCHED_STEP);
    c.gamma = 0.5;
    c.step_epochs = 3;
    expect_lr(&c, 0.0, 100, 0.1);
    expect_lr(&c, 2.99, 100, 0.1);
    expect_lr(&c, 3.0, 100, 0.05);
    expect_lr(&c, 5.5, 100, 0.05);
    expect_lr(&c, 6.0, 100, 0.025);
    expect_lr(&c, 9.5, 100, 0.0125);
    /* 0.6/0.3 = 1.9999999999999998 in double: the 1e-9 nudge makes it 2 */
    c.step_epochs = 0.3;
    expect_lr(&c, 0.6, 100, 0.025);
    expect_lr(&c, 0.59, 100, 0.05);
}

Test(sched, cosine)
{
    /* min 0.001, T = 10: f(p) = 0.001 + 0.099*0.5*(1 + cos(pi p/10)) */
    ps_config_t c = sched_cfg(PS_SCHED_COSINE);
    c.min_lr = 0.001;
    expect_lr(&c, 0.0, 100, 0.1);
    expect_lr(&c, 2.5, 100, 0.0855017857);  /* cos(pi/4) = 0.70710678 */
    expect_lr(&c, 5.0, 100, 0.0505);        /* cos(pi/2) = 0 */
    expect_lr(&c, 10.0, 100, 0.001);        /* cos(pi) = -1 */
    expect_lr(&c, 12.0, 100, 0.001);        /* clamped at T */
}

Test(sched, cosine_warmup)
{
    /* warm-up 1 epoch at 10 steps/epoch; p = 0.5 -> s = 5 -> mult 6/10;
     * base = 0.001 + 0.0495*(1 + cos(0.05 pi)) = 0.001 + 0.0495*1.98768834
     *      = 0.0993905729; lr = 0.0596343437 */
    ps_config_t c = sched_cfg(PS_SCHED_COSINE);
    c.min_lr = 0.001;
    c.warmup_epochs = 1.0;
    expect_lr(&c, 0.5, 10, 0.0596343437);
    expect_lr(&c, 0.0, 10, 0.01);   /* base 0.1, mult 1/10 */
    expect_lr(&c, 5.0, 10, 0.0505); /* past warm-up */
}

Test(sched, onecycle)
{
    /* T = 10, spe 100 -> S = 1000 steps; div 25 -> initial 0.004;
     * final_div 1e4 -> final 4e-7; pct_start 0.3 -> e1 = 299, e2 = 999. */
    ps_config_t c = sched_cfg(PS_SCHED_ONECYCLE);
    c.pct_start = 0.3;
    c.div_factor = 25;
    c.final_div_factor = 1e4;
    expect_lr(&c, 0.0, 100, 0.004);                 /* start = lr/div */
    expect_lr(&c, 1.495, 100, (0.004 + 0.1) / 2);   /* s = 149.5: half way up, 0.052 */
    expect_lr(&c, 2.99, 100, 0.1);                  /* s = 299 = e1: peak */
    expect_lr(&c, 6.49, 100, (0.1 + 4e-7) / 2);     /* s = 649: half way down */
    expect_lr(&c, 9.99, 100, 4e-7);                 /* s = 999 = e2: final */
    expect_lr(&c, 10.0, 100, 4e-7);                 /* past the end: clamped */
    /* a quarter up: s = 74.75 -> pct 0.25 -> 0.1 + (0.004-0.1)/2*(1+cos(pi/4))
     * = 0.1 - 0.048*1.70710678 = 0.0180588745 */
    expect_lr(&c, 0.7475, 100, 0.0180588745);
}

Test(sched, onecycle_odd_steps)
{
    /* spe 7, T 2 -> S = 14, pct 0.5 -> e1 = 6, e2 = 13; p = k/7 is inexact.
     * s = 6 -> lr; s = 0 -> lr/10; s = 13 -> lr/10/100 = 1e-4 */
    ps_config_t c = sched_cfg(PS_SCHED_ONECYCLE);
    c.epochs = 2;
    c.pct_start = 0.5;
    c.div_factor = 10;
    c.final_div_factor = 100;
    expect_lr(&c, 0.0 / 7, 7, 0.01);
    expect_lr(&c, 6.0 / 7, 7, 0.1);
    expect_lr(&c, 13.0 / 7, 7, 1e-4);
    /* s = 3: pct 0.5 -> (0.01 + 0.1)/2 = 0.055 */
    expect_lr(&c, 3.0 / 7, 7, 0.055);
}

Test(sched, onecycle_degenerate)
{
    /* S = 2 steps, e1 = 0.3*2 - 1 < 0: no rising phase; stays finite */
    ps_config_t c = sched_cfg(PS_SCHED_ONECYCLE);
    c.epochs = 1;
    c.pct_start = 0.3;
    c.div_factor = 25;
    c.final_div_factor = 1e4;
    for (int s = 0; s < 3; s++) {
        double lr = psd_sched_lr(&c, s / 2.0, 2);
        cr_expect(isfinite(lr) && lr > 0 && lr <= 0.1, "s=%d lr=%g", s, lr);
    }
    /* S = 1 step: e1 = -0.7, e2 = 0 */
    c.epochs = 1;
    double lr = psd_sched_lr(&c, 0.0, 1);
    cr_expect(isfinite(lr) && lr > 0 && lr <= 0.1, "lr=%g", lr);
}

/* ---- the store's parallel steps -------------------------------------------- */

#include "psd_store.h"

/* The same steps through a store on `threads` threads with chunks of
 * chunk_bytes: whole (psd_store_step; stream 0), or streamed in reverse
 * chunk order one chunk a call (stream 1) or every chunk in one call
 * (stream 2); its final weights and first moments into w and m (n_params
 * floats). Two contributors of unequal weight; clip > 0: global-norm
 * clipping. */
static const int store_sizes[3] = {300, 4000, 5}; /* W1: 1.2M floats, 74 chunks of one norm block */

static void store_run(const psd_optim_t *o, int threads, size_t chunk_bytes, int stream, double clip, float *w,
                      float *m)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, store_sizes, 3), 0);
    psd_store_t s;
    cr_assert_eq(psd_store_init(&s, &l, o, 3), 0);
    cr_assert_eq(psd_store_set_parallel(&s, threads, chunk_bytes), 0);
    float *g = malloc(2 * l.n_params * sizeof *g);
    int *ids = malloc((size_t)s.n_chunks * sizeof *ids);
    const void **src = malloc(2 * (size_t)s.n_chunks * sizeof *src);
    cr_assert(g && ids && src);
    const double wt[2] = {0.625, 0.375};
    for (uint64_t step = 1; step <= 3; step++) {
        fill(g, 2 * l.n_params, 300 + step, 0.25f);
        const void *gt[2][PS_MAX_TENSORS];
        for (int k = 0; k < 2; k++)
            for (int t = 0; t < l.n_tensors; t++) gt[k][t] = g + (size_t)k * l.n_params + l.t[t].offset;
        if (!stream) {
            cr_assert_geq(psd_store_step(&s, 2, (const void *const(*)[PS_MAX_TENSORS])gt, NULL, wt, clip, 0.05), 0);
            continue;
        }
        psd_arena_t *next = psd_store_stream_begin(&s);
        cr_assert_not_null(next);
        for (int j = 0; j < s.n_chunks; j++) { /* the last chunk first: any order, the same bits */
            ids[j] = s.n_chunks - 1 - j;
            for (int k = 0; k < 2; k++) src[2 * j + k] = g + (size_t)k * l.n_params + s.chunks[ids[j]].off;
        }
        if (stream == 1)
            for (int j = 0; j < s.n_chunks; j++)
                psd_store_stream_chunks(&s, next, &ids[j], 1, 2, &src[2 * j], NULL, wt, clip > 0, 0.05);
        else
            psd_store_stream_chunks(&s, next, ids, s.n_chunks, 2, src, NULL, wt, clip > 0, 0.05);
        if (clip > 0) psd_store_stream_apply(&s, next, clip, 0.05);
        psd_store_stream_end(&s, next);
    }
    memcpy(w, s.cur->w, l.n_params * sizeof *w);
    memcpy(m, s.s0, l.n_params * sizeof *m);
    free(g);
    free(ids);
    free(src);
    psd_store_deinit(&s);
}

/* The reference: one contributor's sum and the optimizer in plain loops
 * (psd_optim_apply over the whole arena, one call a step): no chunks, no
 * items, no pool. */
static void reference_run(const psd_optim_t *o, double clip, float *w, float *m)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, store_sizes, 3), 0);
    psd_store_t s; /* for its initial weights only */
    cr_assert_eq(psd_store_init(&s, &l, o, 3), 0);
    memcpy(w, s.cur->w, l.n_params * sizeof *w);
    psd_store_deinit(&s);
    float *g = malloc(2 * l.n_params * sizeof *g), *sum = malloc(l.n_params * sizeof *sum),
          *m1 = calloc(l.n_params, sizeof *m1);
    cr_assert(g && sum && m1);
    memset(m, 0, l.n_params * sizeof *m);
    for (uint64_t step = 1; step <= 3; step++) {
        fill(g, 2 * l.n_params, 300 + step, 0.25f);
        for (size_t i = 0; i < l.n_params; i++) sum[i] = 0.625f * g[i] + 0.375f * g[l.n_params + i];
        float scale = 1.0f;
        if (clip > 0) { /* the store's order: norm blocks of each tensor, summed in block order */
            double sq = 0;
            for (int t = 0; t < l.n_tensors; t++)
                for (size_t b = 0; b < l.t[t].numel; b += PSD_NORM_BLOCK)
                    sq += psd_sumsq(sum + l.t[t].offset + b,
                                    l.t[t].numel - b < PSD_NORM_BLOCK ? l.t[t].numel - b : PSD_NORM_BLOCK);
            scale = psd_clip_scale(sq, clip);
        }
        for (int t = 0; t < l.n_tensors; t++) {
            size_t off = l.t[t].offset;
            psd_optim_apply(o, w + off, w + off, sum + off, scale, m + off, m1 + off, l.t[t].numel, 0.05, step);
        }
    }
    free(g);
    free(sum);
    free(m1);
}

Test(store, steps_on_threads_in_chunks_and_work_items_give_the_bits_of_one_loop)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, store_sizes, 3), 0);
    const size_t bytes = l.n_params * sizeof(float);
    float *w0 = malloc(bytes), *m0 = malloc(bytes), *w1 = malloc(bytes), *m1 = malloc(bytes);
    cr_assert(w0 && m0 && w1 && m1);
    const psd_optim_t opts[2] = {make_opt(PS_OPT_SGD, 0.9f, 1, 5e-4f, 0, 0, 0),
                                 make_opt(PS_OPT_ADAM, 0, 0, 1e-2f, 0.9f, 0.999f, 1e-8f)};
    /* one chunk per tensor; 3 norm blocks (1.5 items: chunk and item ends differ); one norm
     * block (74 chunks of W1: streamed in one call, more than a pool run's 64) */
    const size_t chunk[3] = {(size_t)1 << 40, 3 * PSD_NORM_BLOCK * sizeof(float), PSD_NORM_BLOCK * sizeof(float)};
    for (int k = 0; k < 2; k++)
        for (int ci = 0; ci < 2; ci++) {
            const double clip = ci ? 1.0 : 0.0; /* the gradients' norm is far above 1: clipped */
            reference_run(&opts[k], clip, w0, m0);
            for (int c = 0; c < 3; c++)
                for (int th = 1; th <= 2; th++)
                    for (int st = 0; st < 3; st++) {
                        if (st && c == 0) continue; /* streams go by chunks */
                        store_run(&opts[k], th, chunk[c], st, clip, w1, m1);
                        cr_expect(memcmp(w0, w1, bytes) == 0 && memcmp(m0, m1, bytes) == 0,
                                  "optimizer %d, clip %g, chunks of %zu bytes, %d threads, %s: not the bits of one "
                                  "loop", k, clip, chunk[c], th, st == 0 ? "whole" : st == 1 ? "streamed one by one"
                                                                                          : "streamed at once");
                    }
        }
    free(w0);
    free(m0);
    free(w1);
    free(m1);
}

/* After each step the store's largest magnitudes are those of the reduced
 * gradient and of the new weights (its whole part), for any threads,
 * chunks, streaming and clipping; a NaN in one contributor's gradient is
 * seen, as is one in a lazy table's rows. */
static void expect_step_amax(const psd_store_t *s, const float *sum, const char *what)
{
    const ps_layout_t *l = &s->layout;
    float mg = 0, mw = 0;
    for (int t = 0; t < l->n_tensors; t++) {
        float a = max_abs(sum + l->t[t].offset, l->t[t].numel), b = max_abs(s->cur->w + l->t[t].offset, l->t[t].numel);
        mg = a > mg ? a : mg;
        mw = b > mw ? b : mw;
    }
    psd_amax_t am = psd_store_step_amax(s);
    cr_expect_eq(psd_amax_value(am.g), mg, "%s: max |g|", what);
    cr_expect_eq(psd_amax_value(am.w), mw, "%s: max |w|", what);
}

Test(store, a_steps_largest_magnitudes_are_its_gradients_and_new_weights)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, store_sizes, 3), 0);
    const psd_optim_t o = make_opt(PS_OPT_ADAM, 0, 0, 1e-2f, 0.9f, 0.999f, 1e-8f);
    float *g = malloc(2 * l.n_params * sizeof *g), *sum = malloc(l.n_params * sizeof *sum);
    int *ids = malloc(1024 * sizeof *ids);
    const void **src = malloc(2 * 1024 * sizeof *src);
    cr_assert(g && sum && ids && src);
    const double wt[2] = {0.625, 0.375}, one = 1.0;
    for (int th = 1; th <= 2; th++)
        for (int stream = 0; stream < 2; stream++)
            for (int ci = 0; ci < 2; ci++) {
                const double clip = ci ? 1.0 : 0.0;
                psd_store_t s;
                cr_assert_eq(psd_store_init(&s, &l, &o, 3), 0);
                cr_assert_eq(psd_store_set_parallel(&s, th, 3 * PSD_NORM_BLOCK * sizeof(float)), 0);
                cr_assert_leq(s.n_chunks, 1024);
                char what[96];
                for (uint64_t step = 1; step <= 4; step++) {
                    snprintf(what, sizeof what, "%d threads, %s, clip %g, step %lu", th, stream ? "streamed" : "whole",
                             clip, step);
                    fill(g, 2 * l.n_params, 600 + step, 0.25f);
                    const int K = step == 3 ? 1 : 2; /* step 3: one contributor of weight 1 (applied from it) */
                    if (step == 4) g[l.n_params + l.t[2].offset + 77] = NAN; /* contributor 1's W1 */
                    for (size_t i = 0; i < l.n_params; i++)
                        sum[i] = K == 1 ? g[i] : 0.625f * g[i] + 0.375f * g[l.n_params + i];
                    const void *gt[2][PS_MAX_TENSORS];
                    for (int k = 0; k < 2; k++)
                        for (int t = 0; t < l.n_tensors; t++) gt[k][t] = g + (size_t)k * l.n_params + l.t[t].offset;
                    const double *w = K == 1 ? &one : wt;
                    if (!stream) {
                        double norm =
                            psd_store_step(&s, K, (const void *const(*)[PS_MAX_TENSORS])gt, NULL, w, clip, 0.05);
                        cr_assert(!(norm < 0), "%s: a step (the norm returned is NaN at step 4, clipped)", what);
                    } else {
                        psd_arena_t *next = psd_store_stream_begin(&s);
                        cr_assert_not_null(next);
                        for (int j = 0; j < s.n_chunks; j++) {
                            ids[j] = j;
                            for (int k = 0; k < K; k++) src[K * j + k] = g + (size_t)k * l.n_params + s.chunks[j].off;
                        }
                        psd_store_stream_chunks(&s, next, ids, s.n_chunks, K, src, NULL, w, clip > 0, 0.05);
                        if (clip > 0) psd_store_stream_apply(&s, next, clip, 0.05);
                        psd_store_stream_end(&s, next);
                    }
                    if (step < 4) {
                        expect_step_amax(&s, sum, what);
                        continue;
                    }
                    psd_amax_t am = psd_store_step_amax(&s);
                    cr_expect(am.g > PSD_AMAX_INF && am.w > PSD_AMAX_INF, "%s: a NaN in the gradient is seen (%x %x)",
                              what, am.g, am.w);
                }
                psd_store_deinit(&s);
            }
    free(g);
    free(sum);
    free(ids);
    free(src);
}

Test(store, a_lazy_tables_rows_count_in_the_steps_largest_magnitudes)
{
    static const int sizes[3] = {6, 5, 3};
    enum { ROWS = 100, DIM = 8 };
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, sizes, 3, ROWS, DIM), 0);
    const psd_optim_t o = make_opt(PS_OPT_ADAGRAD, 0, 0, 0, 0, 0, 1e-10f);
    psd_store_t s;
    cr_assert_eq(psd_store_init(&s, &l, &o, 11), 0);
    cr_assert_eq(psd_store_lazy_table(&s, 16, 1), 0);
    static float dense[64], rows[2 * DIM];
    static const uint32_t ids[2] = {3, 50};
    fill(dense, 64, 7, 0.1f);
    fill(rows, 2 * DIM, 8, 0.5f);
    rows[DIM + 2] = -0.9f;
    const void *g[1][PS_MAX_TENSORS] = {{0}};
    for (int t = 0; t < l.n_tensors; t++) g[0][t] = t == l.table ? NULL : dense;
    const psd_rowgrad_t rg = {ids, rows, 2};
    const double one = 1.0;
    cr_assert_geq(psd_store_step_rows(&s, 1, (const void *const(*)[PS_MAX_TENSORS])g, NULL, &one, &rg, 0, 0.01), 0);
    psd_amax_t am = psd_store_step_amax(&s);
    cr_expect_eq(psd_amax_value(am.g), 0.9f, "the rows' largest");
    float mw = 0;
    for (int t = 0; t < l.n_tensors; t++) {
        if (t == l.table) continue;
        float m = max_abs(s.cur->w + l.t[t].offset, l.t[t].numel);
        mw = m > mw ? m : mw;
    }
    for (int r = 0; r < 2; r++) {
        float m = max_abs(s.cur->w + l.t[l.table].offset + ids[r] * DIM, DIM);
        mw = m > mw ? m : mw;
    }
    cr_expect_eq(psd_amax_value(am.w), mw, "the dense part's and the rows' stepped");
    rows[5] = NAN;
    cr_assert_geq(psd_store_step_rows(&s, 1, (const void *const(*)[PS_MAX_TENSORS])g, NULL, &one, &rg, 0, 0.01), 0);
    am = psd_store_step_amax(&s);
    cr_expect(am.g > PSD_AMAX_INF && am.w > PSD_AMAX_INF, "a NaN in a row is seen");
    psd_store_deinit(&s);
}

/* A streamed step whose contributors were all lost before any chunk took it
 * (with clipping: always) is no optimizer step: Adam's bias correction goes
 * on from the last real one, so the weights and moments after it are those
 * of a store that never began it; only the version moves on. */
Test(store, a_streamed_step_with_every_contributor_lost_is_no_step)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, store_sizes, 3), 0);
    const psd_optim_t o = make_opt(PS_OPT_ADAM, 0, 0, 1e-2f, 0.9f, 0.999f, 1e-8f);
    psd_store_t a, b;
    cr_assert_eq(psd_store_init(&a, &l, &o, 3), 0);
    cr_assert_eq(psd_store_init(&b, &l, &o, 3), 0);
    cr_assert_eq(psd_store_set_parallel(&a, 2, PSD_NORM_BLOCK * sizeof(float)), 0);
    cr_assert_eq(psd_store_set_parallel(&b, 2, PSD_NORM_BLOCK * sizeof(float)), 0);
    float *g = malloc(l.n_params * sizeof *g);
    cr_assert(g);
    const double wt = 1.0;
    for (int step = 1; step <= 2; step++) {
        fill(g, l.n_params, 500 + (uint64_t)step, 0.25f);
        const void *gt[1][PS_MAX_TENSORS];
        for (int t = 0; t < l.n_tensors; t++) gt[0][t] = g + l.t[t].offset;
        psd_store_t *both[2] = {&a, &b};
        for (int k = 0; k < 2; k++)
            cr_assert_geq(psd_store_step(both[k], 1, (const void *const(*)[PS_MAX_TENSORS])gt, NULL, &wt, 1.0, 0.05),
                          0);
        if (step == 2) break;
        const uint64_t v = a.cur->version;
        psd_arena_t *next = psd_store_stream_begin(&a); /* begun, then every contributor lost */
        cr_assert_not_null(next);
        for (int c = 0; c < a.n_chunks; c++) psd_store_stream_keep(&a, next, c);
        psd_store_stream_void(&a);
        psd_store_stream_end(&a, next);
        cr_assert_eq(a.cur->version, v + 1);
        cr_assert_eq(a.steps, b.steps);
        cr_assert(memcmp(a.cur->w, b.cur->w, l.n_params * sizeof(float)) == 0, "the void step changed weights");
    }
    cr_expect_eq(a.steps, 2);
    cr_expect(memcmp(a.cur->w, b.cur->w, l.n_params * sizeof(float)) == 0 &&
                  memcmp(a.s0, b.s0, l.n_params * sizeof(float)) == 0 &&
                  memcmp(a.s1, b.s1, l.n_params * sizeof(float)) == 0,
              "the step after a void streamed step is not the step of a store that never began it");
    free(g);
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}
