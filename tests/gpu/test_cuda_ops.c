/* test_cuda_ops.c - every op of the CUDA backend against the CPU backend
 * (ggml's test-backend-ops, for psw): seeded random inputs with sizes that are
 * not multiples of warps or GEMM tiles, a tolerance stated per op, NaN/Inf
 * checks on every GPU output, guard regions around every buffer, one full
 * training step of an MLP, and the upload / download_async paths.
 *
 * Without the plugin or a GPU every test is skipped ("no CUDA device: ..."),
 * or fails where PSW_TEST_NEED_DEVICE=1 (the suite `emu`, against
 * libpsw_cuda_emu.so: tests/cuda_emu, always there).
 * The plugin is found as pworker finds it ($PSW_CUDA_PLUGIN, or next to the
 * executable). A one-line summary per op with the largest errors seen goes
 * to stderr ("cuda_ops: ..."), so a GPU run's log shows the numbers.
 *
 * Tolerances: |gpu - cpu| <= atol + rtol * |cpu| unless said otherwise.
 * Inputs are uniform in [-1, 1], so a dot product of K terms rounds to about
 * sqrt(K) * K * 6e-8 in float on either side in a random walk; atol
 * 1e-5 * sqrt(K) leaves more than 10x margin at K = 784. */
#include <criterion/criterion.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ps_model.h"
#include "ps_rng.h"
#include "psw_backend.h"
#include "cuda/psw_cuda.h"
#include "psw_model.h"

/* ---- backends ---- */

static psw_backend_t *gpu, *cpu;
static char no_gpu_why[512];

static void setup(void)
{
    cpu = psw_backend_cpu_new(1);
    cr_assert_not_null(cpu);
    char err[512] = "";
    const psw_cuda_plugin_t *p = psw_cuda_load(err, sizeof err);
    if (!p) {
        snprintf(no_gpu_why, sizeof no_gpu_why, "%s", err);
        return;
    }
    const int n = p->device_count(err, sizeof err);
    if (n < 1) {
        snprintf(no_gpu_why, sizeof no_gpu_why, "%s", n < 0 ? err : "0 devices visible");
        return;
    }
    /* There is a device: failing to use it is a failure, not a skip. */
    gpu = p->backend_new(0, err, sizeof err);
    cr_assert_not_null(gpu, "backend_new(0) with %d device(s): %s", n, err);
}

static void teardown(void)
{
    if (gpu) gpu->destroy(gpu);
    if (cpu) cpu->destroy(cpu);
    gpu = cpu = NULL;
}

/* Where a device must be there (PSW_TEST_NEED_DEVICE=1), its absence fails. */
static bool need_device(void)
{
    const char *v = getenv("PSW_TEST_NEED_DEVICE");
    return v && strcmp(v, "1") == 0;
}

#define SKIP_NO_GPU(...)                                                                       \
    do {                                                                                       \
        if (need_device()) cr_assert_fail(__VA_ARGS__);                                        \
        cr_skip_test(__VA_ARGS__);                                                             \
    } while (0)

#define NEED_GPU()                                                                             \
    do {                                                                                       \
        if (!gpu) SKIP_NO_GPU("no CUDA device: %s", no_gpu_why);                               \
    } while (0)

TestSuite(cuda, .init = setup, .fini = teardown);

/* ---- guarded buffers ---- */

/* Every buffer an op sees sits between two guard regions filled with a
 * sentinel; after the op both must be intact. 256 bytes keeps the buffer
 * itself 256-byte aligned, as cudaMalloc would. */
#define GUARD_BYTES 256
#define SENTINEL 0xA5 /* bytes; as a float, -2.9e-16 */

typedef struct {
    psw_backend_t *be;
    unsigned char *base;
    void *p; /* base + GUARD_BYTES: what the op gets */
    size_t bytes;
} gbuf_t;

/* init: bytes of content, or NULL for zeros */
static gbuf_t gbuf_new(psw_backend_t *be, const void *init, size_t bytes)
{
    gbuf_t g = {be, NULL, NULL, bytes};
    const size_t total = bytes + 2 * GUARD_BYTES;
    g.base = be->alloc(be, total);
    cr_assert_not_null(g.base, "%s alloc of %zu bytes", be->name, total);
    unsigned char *h = malloc(total);
    cr_assert_not_null(h);
    memset(h, SENTINEL, total);
    if (init) memcpy(h + GUARD_BYTES, init, bytes);
    else memset(h + GUARD_BYTES, 0, bytes);
    be->upload(be, g.base, h, total);
    be->sync(be);
    free(h);
    g.p = g.base + GUARD_BYTES;
    return g;
}

static void gbuf_free(gbuf_t *g)
{
    if (g->base) g->be->free(g->be, g->base);
    g->base = NULL;
    g->p = NULL;
}

/* Copy the content to out (bytes) and check both guards; what names the
 * buffer in failure messages. */
static void gbuf_get(const gbuf_t *g, void *out, const char *what)
{
    const size_t total = g->bytes + 2 * GUARD_BYTES;
    unsigned char *h = malloc(total);
    cr_assert_not_null(h);
    g->be->download(g->be, h, g->base, total);
    g->be->sync(g->be);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < total; i++) {
        if (i == GUARD_BYTES) i += g->bytes;
        if (i < total && h[i] != SENTINEL && bad++ == 0) first = i;
    }
    cr_expect(bad == 0, "%s (%s): %zu guard bytes overwritten, first at byte %td of the buffer",
              what, g->be->name, bad, (ptrdiff_t)first - GUARD_BYTES);
    memcpy(out, h + GUARD_BYTES, g->bytes);
    free(h);
}

/* ---- comparisons ---- */

typedef struct {
    const char *op;
    double max_abs, max_rel, worst; /* worst: largest error / tolerance */
    size_t n_values, n_bad;
    int n_cases;
} stat_t;

static void stat_print(const stat_t *s)
{
    fprintf(stderr,
            "cuda_ops: %-14s max abs err %.3g, max rel err %.3g, worst err/tol %.3g "
            "(%zu values, %d cases, %zu out of tolerance)\n",
            s->op, s->max_abs, s->max_rel, s->worst, s->n_values, s->n_cases, s->n_bad);
}

/* got (GPU) against want (CPU), n values: finite, and within
 * atol + rtol * m, where m = |want|, or terms[i] when terms is not NULL (the
 * sum of the magnitudes of the terms want[i] is made of). Relative errors
 * are reported against max(|want|, atol), so that values that are zero up to
 * rounding do not swamp the summary. */
static void expect_close(stat_t *s, const float *got, const float *want, size_t n, double atol,
                         double rtol, const double *terms, const char *what)
{
    size_t shown = 0;
    for (size_t i = 0; i < n; i++) {
        const double g = got[i], w = want[i];
        const double err = fabs(g - w);
        const double tol = atol + rtol * (terms ? terms[i] : fabs(w));
        const int ok = isfinite(g) && err <= tol;
        if (isfinite(g)) {
            s->max_abs = fmax(s->max_abs, err);
            s->max_rel = fmax(s->max_rel, err / fmax(fabs(w), fmax(atol, 1e-30)));
            s->worst = fmax(s->worst, tol > 0 ? err / tol : (err > 0 ? INFINITY : 0));
        }
        if (!ok) {
            s->n_bad++;
            if (shown++ < 8)
                cr_expect(ok, "%s[%zu]: gpu %.9g cpu %.9g (err %.3g, tol %.3g)", what, i, g, w,
                          err, tol);
        }
    }
    if (shown > 8) cr_expect(0, "%s: %zu more values out of tolerance", what, shown - 8);
    s->n_values += n;
}

static void expect_finite(const float *p, size_t n, const char *what)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (!isfinite(p[i]) && bad++ == 0) first = i;
    cr_expect(bad == 0, "%s: %zu values not finite, first [%zu] = %g", what, bad, first,
              bad ? (double)p[first] : 0.0);
}

static float *fill_uniform(float *p, size_t n, float lo, float hi, ps_rng_t *r)
{
    for (size_t i = 0; i < n; i++) p[i] = lo + (hi - lo) * ps_rng_uniform(r);
    return p;
}

static float *floats(size_t n)
{
    float *p = calloc(n ? n : 1, sizeof(float));
    cr_assert_not_null(p);
    return p;
}

/* ---- linear ---- */

/* linear_fwd and linear_bwd, tolerance atol = 1e-5 * sqrt(K) (K: length of
 * the sums: in + 1 for y, B for dW and db, out for dx), rtol = 1e-4. Outputs
 * start as garbage (they must be overwritten, not accumulated into). On the
 * GPU, dx = NULL must give the same dW and db bit for bit, and so must a
 * second run (cuBLAS without atomics, fixed-order db). */
static void linear_case(int B, int in, int out, uint64_t seed, stat_t st[4])
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 11);
    const size_t nx = (size_t)B * in, nw = (size_t)out * in, ny = (size_t)B * out;
    float *x = fill_uniform(floats(nx), nx, -1, 1, &r);
    float *W = fill_uniform(floats(nw), nw, -1, 1, &r);
    float *b = fill_uniform(floats((size_t)out), (size_t)out, -1, 1, &r);
    float *dy = fill_uniform(floats(ny), ny, -1, 1, &r);
    const size_t nmax = nx > nw ? (nx > ny ? nx : ny) : (nw > ny ? nw : ny);
    float *junk = fill_uniform(floats(nmax), nmax, 100, 200, &r);

    float *res[2][4]; /* [cpu, gpu][y, dW, db, dx] */
    psw_backend_t *bes[2] = {cpu, gpu};
    for (int k = 0; k < 2; k++) {
        psw_backend_t *be = bes[k];
        gbuf_t gx = gbuf_new(be, x, nx * 4), gW = gbuf_new(be, W, nw * 4);
        gbuf_t gb = gbuf_new(be, b, (size_t)out * 4), gdy = gbuf_new(be, dy, ny * 4);
        gbuf_t gy = gbuf_new(be, junk, ny * 4), gdW = gbuf_new(be, junk, nw * 4);
        gbuf_t gdb = gbuf_new(be, junk, (size_t)out * 4), gdx = gbuf_new(be, junk, nx * 4);
        be->linear_fwd(be, gy.p, gx.p, gW.p, gb.p, B, in, out);
        be->linear_bwd(be, gdx.p, gdW.p, gdb.p, gdy.p, gx.p, gW.p, B, in, out);
        be->sync(be);
        res[k][0] = floats(ny);
        res[k][1] = floats(nw);
        res[k][2] = floats((size_t)out);
        res[k][3] = floats(nx);
        gbuf_get(&gy, res[k][0], "y");
        gbuf_get(&gdW, res[k][1], "dW");
        gbuf_get(&gdb, res[k][2], "db");
        gbuf_get(&gdx, res[k][3], "dx");
        /* inputs are not written */
        float *chk = floats(nmax);
        gbuf_get(&gx, chk, "x");
        cr_expect(memcmp(chk, x, nx * 4) == 0, "%s: linear changed x", be->name);
        gbuf_get(&gW, chk, "W");
        cr_expect(memcmp(chk, W, nw * 4) == 0, "%s: linear changed W", be->name);
        gbuf_get(&gdy, chk, "dy");
        cr_expect(memcmp(chk, dy, ny * 4) == 0, "%s: linear_bwd changed dy", be->name);
        gbuf_get(&gb, chk, "b");
        cr_expect(memcmp(chk, b, (size_t)out * 4) == 0, "%s: linear_fwd changed b", be->name);

        if (be == gpu) {
            /* Without dx: the same dW and db bit for bit. Then everything
             * again: the same bits (cuBLAS without atomics, fixed-order db). */
            gbuf_t gdW2 = gbuf_new(be, junk, nw * 4), gdb2 = gbuf_new(be, junk, (size_t)out * 4);
            gbuf_t gdx2 = gbuf_new(be, junk, nx * 4), gy2 = gbuf_new(be, junk, ny * 4);
            be->linear_bwd(be, NULL, gdW2.p, gdb2.p, gdy.p, gx.p, gW.p, B, in, out);
            be->sync(be);
            gbuf_get(&gdW2, chk, "dW (dx NULL)");
            cr_expect(memcmp(chk, res[k][1], nw * 4) == 0,
                      "dW differs without dx (B %d, in %d, out %d)", B, in, out);
            gbuf_get(&gdb2, chk, "db (dx NULL)");
            cr_expect(memcmp(chk, res[k][2], (size_t)out * 4) == 0,
                      "db differs without dx (B %d, in %d, out %d)", B, in, out);
            be->linear_fwd(be, gy2.p, gx.p, gW.p, gb.p, B, in, out);
            be->linear_bwd(be, gdx2.p, gdW2.p, gdb2.p, gdy.p, gx.p, gW.p, B, in, out);
            be->sync(be);
            gbuf_t *again[4] = {&gy2, &gdW2, &gdb2, &gdx2};
            const size_t sz[4] = {ny, nw, (size_t)out, nx};
            for (int t = 0; t < 4; t++) {
                gbuf_get(again[t], chk, "second run");
                cr_expect(memcmp(chk, res[k][t], sz[t] * 4) == 0,
                          "output %d differs on a second run (B %d, in %d, out %d)", t, B, in, out);
                gbuf_free(again[t]);
            }
        }
        free(chk);
        gbuf_t *all[] = {&gx, &gW, &gb, &gdy, &gy, &gdW, &gdb, &gdx};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) gbuf_free(all[i]);
    }

    char what[96];
    const int K[4] = {in + 1, B, B, out};
    const size_t n[4] = {ny, nw, (size_t)out, nx};
    static const char *names[4] = {"y", "dW", "db", "dx"};
    for (int t = 0; t < 4; t++) {
        snprintf(what, sizeof what, "%s (B %d, in %d, out %d)", names[t], B, in, out);
        expect_finite(res[1][t], n[t], what);
        expect_close(&st[t], res[1][t], res[0][t], n[t], 1e-5 * sqrt((double)K[t]), 1e-4, NULL,
                     what);
        st[t].n_cases++;
        free(res[0][t]);
        free(res[1][t]);
    }
    free(x);
    free(W);
    free(b);
    free(dy);
    free(junk);
}

Test(cuda, linear)
{
    NEED_GPU();
    static const int Bs[] = {1, 7, 33, 130};
    static const int dims[] = {1, 5, 31, 100, 257, 784};
    stat_t st[4] = {{.op = "linear_fwd y"}, {.op = "linear_bwd dW"}, {.op = "linear_bwd db"},
                    {.op = "linear_bwd dx"}};
    uint64_t seed = 1;
    for (size_t i = 0; i < 4; i++)
        for (size_t j = 0; j < 6; j++)
            for (size_t k = 0; k < 6; k++) linear_case(Bs[i], dims[j], dims[k], seed++, st);
    /* a long reduction over the batch for db and dW */
    linear_case(4099, 3, 33, seed++, st);
    for (int t = 0; t < 4; t++) stat_print(&st[t]);
}

/* ---- relu ---- */

/* relu_fwd and relu_bwd: exact, bit for bit (one comparison per element on
 * both sides), out of place and in place. */
static void relu_case(const float *x, const float *dy, size_t n, stat_t *sf, stat_t *sb,
                      int check_finite)
{
    float *res[2][4]; /* [cpu, gpu][y, dx, y in place, dx in place] */
    psw_backend_t *bes[2] = {cpu, gpu};
    float *junk = floats(n);
    for (size_t i = 0; i < n; i++) junk[i] = 123.0f + (float)(i % 7);
    for (int k = 0; k < 2; k++) {
        psw_backend_t *be = bes[k];
        gbuf_t gx = gbuf_new(be, x, n * 4), gdy = gbuf_new(be, dy, n * 4);
        gbuf_t gy = gbuf_new(be, junk, n * 4), gdx = gbuf_new(be, junk, n * 4);
        gbuf_t gz = gbuf_new(be, x, n * 4), gdz = gbuf_new(be, dy, n * 4);
        be->relu_fwd(be, gy.p, gx.p, n);
        be->relu_bwd(be, gdx.p, gdy.p, gy.p, n);
        be->relu_fwd(be, gz.p, gz.p, n);
        be->relu_bwd(be, gdz.p, gdz.p, gz.p, n);
        be->sync(be);
        gbuf_t *outs[4] = {&gy, &gdx, &gz, &gdz};
        static const char *names[4] = {"relu y", "relu dx", "relu y (in place)",
                                       "relu dx (in place)"};
        for (int t = 0; t < 4; t++) {
            res[k][t] = floats(n);
            gbuf_get(outs[t], res[k][t], names[t]);
        }
        float *chk = floats(n);
        gbuf_get(&gx, chk, "relu x");
        cr_expect(memcmp(chk, x, n * 4) == 0, "%s: relu_fwd changed x", be->name);
        gbuf_get(&gdy, chk, "relu dy");
        cr_expect(memcmp(chk, dy, n * 4) == 0, "%s: relu_bwd changed dy", be->name);
        free(chk);
        gbuf_t *all[] = {&gx, &gdy, &gy, &gdx, &gz, &gdz};
        for (size_t i = 0; i < 6; i++) gbuf_free(all[i]);
    }
    for (int t = 0; t < 4; t++) {
        char what[64];
        snprintf(what, sizeof what, "relu output %d (n %zu)", t, n);
        if (check_finite) expect_finite(res[1][t], n, what);
        size_t diff = 0, first = 0;
        for (size_t i = 0; i < n; i++)
            if (memcmp(&res[1][t][i], &res[0][t][i], 4) != 0 && diff++ == 0) first = i;
        cr_expect(diff == 0, "%s: %zu values differ from the CPU, first [%zu]: gpu %g cpu %g", what,
                  diff, first, (double)res[1][t][first], (double)res[0][t][first]);
        stat_t *s = t % 2 ? sb : sf;
        if (check_finite) expect_close(s, res[1][t], res[0][t], n, 0, 0, NULL, what);
        else s->n_bad += diff;
        free(res[0][t]);
        free(res[1][t]);
    }
    sf->n_cases++;
    sb->n_cases++;
    free(junk);
}

Test(cuda, relu)
{
    NEED_GPU();
    stat_t sf = {.op = "relu_fwd"}, sb = {.op = "relu_bwd"};
    /* 3000017 > 8192 blocks * 256 threads: the grid-stride loop goes round */
    static const size_t ns[] = {1, 31, 1000, (1u << 20) + 3, 3000017};
    for (size_t c = 0; c < sizeof ns / sizeof ns[0]; c++) {
        const size_t n = ns[c];
        ps_rng_t r;
        ps_rng_seed(&r, 100 + c, 12);
        float *x = fill_uniform(floats(n), n, -1, 1, &r);
        float *dy = fill_uniform(floats(n), n, -1, 1, &r);
        if (n > 2) {
            x[1] = 0.0f;
            x[2] = -0.0f;
        }
        relu_case(x, dy, n, &sf, &sb, 1);
        free(x);
        free(dy);
    }
    /* special values: still bit for bit the CPU's (NaN -> 0, -0 -> +0) */
    const float sx[] = {0.0f,     -0.0f,     1e-40f, -1e-40f, INFINITY, -INFINITY,
                        NAN,      -NAN,      FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, 1.0f};
    const float sdy[] = {1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 7.0f,
                         8.0f, 9.0f, NAN,  INFINITY, -1.0f, -0.0f};
    relu_case(sx, sdy, sizeof sx / sizeof sx[0], &sf, &sb, 0);
    stat_print(&sf);
    stat_print(&sb);
}

/* ---- embedding bags ---- */

/* embag_fwd and embag_bwd: bit for bit the CPU's (the same additions in the
 * same order on both sides), sum and mean, with rows repeated within and
 * across bags, D not a multiple of a warp, and a batch large enough for
 * the grid-stride loop. */
Test(cuda, embag)
{
    NEED_GPU();
    const int R = 1000, D = 37, F = 5, m = 3;
    const int Bs[] = {1, 64, 20000};
    for (size_t c = 0; c < sizeof Bs / sizeof Bs[0]; c++) {
        const int B = Bs[c];
        const size_t nb = (size_t)B * F, ne = nb * m;
        ps_rng_t r;
        ps_rng_seed(&r, 300 + c, 13);
        float *E = fill_uniform(floats((size_t)R * D), (size_t)R * D, -1, 1, &r);
        float *dy = fill_uniform(floats(nb * D), nb * D, -1, 1, &r);
        uint32_t *ids = malloc(ne * sizeof *ids);
        cr_assert(ids);
        for (size_t e = 0; e < ne; e++) ids[e] = (uint32_t)ps_rng_below(&r, (uint64_t)R / 3); /* repeats */
        for (int mean = 0; mean < 2; mean++) {
            float *res[2][2];
            psw_backend_t *bes[2] = {cpu, gpu};
            for (int k = 0; k < 2; k++) {
                psw_backend_t *be = bes[k];
                float *zero = floats((size_t)R * D);
                memset(zero, 0, (size_t)R * D * sizeof *zero);
                gbuf_t gE = gbuf_new(be, E, (size_t)R * D * 4), gdy = gbuf_new(be, dy, nb * D * 4);
                gbuf_t gids = gbuf_new(be, ids, ne * 4), gy = gbuf_new(be, dy, nb * D * 4);
                gbuf_t gdE = gbuf_new(be, zero, (size_t)R * D * 4);
                be->embag_fwd(be, gy.p, gE.p, gids.p, B, F, m, D, mean);
                be->embag_bwd(be, gdE.p, gdy.p, gids.p, B, F, m, D, mean);
                be->sync(be);
                res[k][0] = floats(nb * D);
                res[k][1] = floats((size_t)R * D);
                gbuf_get(&gy, res[k][0], "embag y");
                gbuf_get(&gdE, res[k][1], "embag dE");
                gbuf_t *all[] = {&gE, &gdy, &gids, &gy, &gdE};
                for (size_t i = 0; i < 5; i++) gbuf_free(all[i]);
                free(zero);
            }
            cr_expect(memcmp(res[0][0], res[1][0], nb * D * 4) == 0, "embag_fwd B %d mean %d: not the CPU's bits", B,
                      mean);
            cr_expect(memcmp(res[0][1], res[1][1], (size_t)R * D * 4) == 0,
                      "embag_bwd B %d mean %d: not the CPU's bits", B, mean);
            for (int k = 0; k < 2; k++) {
                free(res[k][0]);
                free(res[k][1]);
            }
        }
        free(E);
        free(dy);
        free(ids);
    }
    fprintf(stderr, "cuda_ops: embag_fwd/embag_bwd bit for bit against the CPU (B up to 20000, D 37, m 3)\n");
}

/* scatter_rows and gather_rows: the CPU's bytes, and rows not named stay
 * as they were; the byte counters count what crossed the bus. */
Test(cuda, scatter_and_gather_rows)
{
    NEED_GPU();
    const int R = 5000, D = 37;
    const size_t n = 1234;
    ps_rng_t r;
    ps_rng_seed(&r, 77, 5);
    float *E = fill_uniform(floats((size_t)R * D), (size_t)R * D, -1, 1, &r);
    float *vals = fill_uniform(floats(n * D), n * D, -1, 1, &r);
    uint32_t *ids = malloc(n * sizeof *ids);
    cr_assert(ids);
    for (size_t j = 0; j < n; j++) ids[j] = (uint32_t)(j * 4 + (j % 3)); /* distinct, spread */
    float *res[2][2];
    psw_backend_t *bes[2] = {cpu, gpu};
    for (int k = 0; k < 2; k++) {
        psw_backend_t *be = bes[k];
        uint64_t up = be->bytes_up;
        gbuf_t gE = gbuf_new(be, E, (size_t)R * D * 4), gv = gbuf_new(be, vals, n * D * 4),
               gids = gbuf_new(be, ids, n * 4), gout = gbuf_new(be, vals, n * D * 4);
        cr_expect_eq(be->bytes_up - up, (uint64_t)R * D * 4 + 2 * n * D * 4 + n * 4 + 4 * 2 * GUARD_BYTES,
                     "%s: bytes up (4 buffers and their guards)", be->name);
        be->scatter_rows(be, gE.p, gids.p, gv.p, n, D);
        be->zero(be, gv.p, n * D * 4);
        be->gather_rows(be, gout.p, gE.p, gids.p, n, D);
        be->sync(be);
        res[k][0] = floats((size_t)R * D);
        res[k][1] = floats(n * D);
        gbuf_get(&gE, res[k][0], "scatter E");
        gbuf_get(&gout, res[k][1], "gather out");
        gbuf_t *all[] = {&gE, &gv, &gids, &gout};
        for (size_t i = 0; i < 4; i++) gbuf_free(all[i]);
    }
    cr_expect(memcmp(res[0][0], res[1][0], (size_t)R * D * 4) == 0, "scatter_rows: not the CPU's bytes");
    cr_expect(memcmp(res[1][1], vals, n * D * 4) == 0, "gather_rows: not the rows scattered");
    cr_expect(memcmp(res[1][0] + (size_t)R * D - D, E + (size_t)R * D - D, (size_t)D * 4) == 0,
              "a row not named changed");
    for (int k = 0; k < 2; k++) {
        free(res[k][0]);
        free(res[k][1]);
    }
    free(E);
    free(vals);
    free(ids);
    fprintf(stderr, "cuda_ops: scatter_rows/gather_rows against the CPU (%zu of %d rows, D %d)\n", n, R, D);
}

/* ---- softmax cross-entropy ---- */

/* Per-sample loss (xent on one row at a time, B = 1): atol 1e-6 * sqrt(C)
 * (log of a sum of C exps in another order), rtol 1e-5. The batch loss sum:
 * the sum of those tolerances. correct: exact (argmax compares the same input
 * floats on both sides). dlogits: |err| <= |scale| * (1e-7 + 1e-5 * (p + onehot)),
 * i.e. rtol 1e-5 relative to the magnitudes of the two terms, since p - 1
 * cancels when p is near 1. With dlogits NULL the loss is the same bit for
 * bit, and on the GPU dlogits may alias logits. */
static void xent_case(int B, int C, float spread, uint64_t seed, stat_t *sl, stat_t *sd,
                      stat_t *ss)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 13);
    const size_t n = (size_t)B * C;
    float *lg = fill_uniform(floats(n), n, -spread, spread, &r);
    int32_t *lab = calloc((size_t)B, sizeof(int32_t));
    cr_assert_not_null(lab);
    for (int i = 0; i < B; i++) lab[i] = (int32_t)ps_rng_below(&r, (uint64_t)C);
    float *junk = fill_uniform(floats(n), n, 50, 60, &r);
    const float scale = 1.0f / (float)B;

    float *dl[2], *per[2];
    double loss[2];
    int64_t correct[2];
    psw_backend_t *bes[2] = {cpu, gpu};
    for (int k = 0; k < 2; k++) {
        psw_backend_t *be = bes[k];
        gbuf_t glg = gbuf_new(be, lg, n * 4), glab = gbuf_new(be, lab, (size_t)B * 4);
        gbuf_t gd = gbuf_new(be, junk, n * 4);
        loss[k] = 0.25; /* xent adds to what is there */
        correct[k] = 2;
        be->xent(be, gd.p, glg.p, glab.p, B, C, scale, &loss[k], &correct[k]);
        loss[k] -= 0.25;
        correct[k] -= 2;
        double loss2 = 0;
        int64_t correct2 = 0;
        be->xent(be, NULL, glg.p, glab.p, B, C, scale, &loss2, &correct2);
        cr_expect(loss2 == loss[k], "%s: loss %.17g without dlogits, %.17g with (B %d, C %d)",
                  be->name, loss2, loss[k], B, C);
        cr_expect(correct2 == correct[k], "%s: correct differs without dlogits", be->name);
        per[k] = floats((size_t)B);
        for (int i = 0; i < B; i++) {
            double li = 0;
            int64_t ci = 0;
            be->xent(be, NULL, (float *)glg.p + (size_t)i * C, (int32_t *)glab.p + i, 1, C, scale,
                     &li, &ci);
            per[k][i] = (float)li; /* exact: a float widened to double */
        }
        dl[k] = floats(n);
        gbuf_get(&gd, dl[k], "dlogits");
        float *chk = floats(n);
        gbuf_get(&glg, chk, "logits");
        cr_expect(memcmp(chk, lg, n * 4) == 0, "%s: xent changed the logits", be->name);
        if (be == gpu) {
            /* dlogits == logits */
            gbuf_t ga = gbuf_new(be, lg, n * 4);
            double la = 0;
            int64_t ca = 0;
            be->xent(be, ga.p, ga.p, glab.p, B, C, scale, &la, &ca);
            gbuf_get(&ga, chk, "dlogits (aliased)");
            cr_expect(memcmp(chk, dl[k], n * 4) == 0, "aliased dlogits differ (B %d, C %d)", B, C);
            cr_expect(la == loss[k] && ca == correct[k], "aliased xent: loss/correct differ");
            gbuf_free(&ga);
        }
        free(chk);
        gbuf_free(&glg);
        gbuf_free(&glab);
        gbuf_free(&gd);
    }

    char what[64];
    snprintf(what, sizeof what, "loss (B %d, C %d, spread %g)", B, C, (double)spread);
    const double atol_l = 1e-6 * sqrt((double)C);
    expect_finite(per[1], (size_t)B, what);
    expect_close(sl, per[1], per[0], (size_t)B, atol_l, 1e-5, NULL, what);
    double tol_sum = 0;
    for (int i = 0; i < B; i++) tol_sum += atol_l + 1e-5 * fabs((double)per[0][i]);
    const double err_sum = fabs(loss[1] - loss[0]);
    cr_expect(err_sum <= tol_sum, "%s sum: gpu %.12g cpu %.12g (tol %.3g)", what, loss[1], loss[0],
              tol_sum);
    ss->max_abs = fmax(ss->max_abs, err_sum);
    ss->max_rel = fmax(ss->max_rel, err_sum / fmax(fabs(loss[0]), atol_l));
    ss->worst = fmax(ss->worst, err_sum / tol_sum);
    ss->n_values++;
    ss->n_bad += !(err_sum <= tol_sum);
    ss->n_cases++;
    cr_expect(correct[1] == correct[0], "%s: correct gpu %lld cpu %lld", what,
              (long long)correct[1], (long long)correct[0]);

    snprintf(what, sizeof what, "dlogits (B %d, C %d, spread %g)", B, C, (double)spread);
    double *terms = calloc(n, sizeof(double));
    cr_assert_not_null(terms);
    for (size_t i = 0; i < n; i++) {
        const int onehot = (int)(i % (size_t)C) == lab[i / (size_t)C];
        const double p = dl[0][i] / scale + onehot; /* the CPU's softmax */
        terms[i] = fabs(scale) * (fabs(p) + onehot);
    }
    expect_finite(dl[1], n, what);
    expect_close(sd, dl[1], dl[0], n, 1e-7 * fabs(scale), 1e-5, terms, what);
    sl->n_cases++;
    sd->n_cases++;
    free(terms);
    for (int k = 0; k < 2; k++) {
        free(dl[k]);
        free(per[k]);
    }
    free(lg);
    free(lab);
    free(junk);
}

Test(cuda, xent)
{
    NEED_GPU();
    stat_t sl = {.op = "xent loss"}, ss = {.op = "xent loss sum"}, sd = {.op = "xent dlogits"};
    static const int Bs[] = {1, 7, 33, 130};
    static const int Cs[] = {1, 2, 5, 10, 31, 33, 100, 257};
    uint64_t seed = 1;
    for (size_t i = 0; i < 4; i++)
        for (size_t j = 0; j < 8; j++) {
            xent_case(Bs[i], Cs[j], 1.0f, seed++, &sl, &sd, &ss);
            xent_case(Bs[i], Cs[j], 5.0f, seed++, &sl, &sd, &ss);
        }
    /* large logits: max subtraction keeps exp finite */
    xent_case(7, 5, 200.0f, seed++, &sl, &sd, &ss);
    xent_case(7, 257, 200.0f, seed++, &sl, &sd, &ss);
    xent_case(1000, 10, 20.0f, seed++, &sl, &sd, &ss);
    stat_print(&sl);
    stat_print(&ss);
    stat_print(&sd);
}

/* argmax is the first maximum, across warp lanes and within one lane's
 * columns (lane k owns k, k+32, ...): exact, and the same as the CPU. */
Test(cuda, xent_ties)
{
    NEED_GPU();
    enum { C = 100, B = 9 };
    float *lg = floats((size_t)B * C);
    int32_t lab[B];
    int want = 0;
    for (int i = 0; i < B * C; i++) lg[i] = -1.0f - (float)(i % 13) * 0.125f;
    /* 0, 1: all equal -> column 0 */
    for (int j = 0; j < C; j++) lg[0 * C + j] = lg[1 * C + j] = 0.5f;
    lab[0] = 0, want++;
    lab[1] = 64;
    /* 2, 3: maxima at 33 and 65, one lane */
    lg[2 * C + 33] = lg[2 * C + 65] = lg[3 * C + 33] = lg[3 * C + 65] = 5.0f;
    lab[2] = 33, want++;
    lab[3] = 65;
    /* 4, 5: maxima at 31 and 32, lanes 31 and 0 */
    lg[4 * C + 31] = lg[4 * C + 32] = lg[5 * C + 31] = lg[5 * C + 32] = 5.0f;
    lab[4] = 31, want++;
    lab[5] = 32;
    /* 6, 7: -0 at 0 and +0 at 40 compare equal */
    lg[6 * C + 0] = lg[7 * C + 0] = -0.0f;
    lg[6 * C + 40] = lg[7 * C + 40] = 0.0f;
    lab[6] = 40;
    lab[7] = 0, want++;
    /* 8: the maximum in the last column */
    lg[8 * C + 99] = 3.0f;
    lab[8] = 99, want++;
    for (int k = 0; k < 2; k++) {
        psw_backend_t *be = k ? gpu : cpu;
        gbuf_t glg = gbuf_new(be, lg, sizeof(float) * B * C), glab = gbuf_new(be, lab, sizeof lab);
        double loss = 0;
        int64_t correct = 0;
        be->xent(be, NULL, glg.p, glab.p, B, C, 1.0f, &loss, &correct);
        cr_expect(correct == want, "%s: correct %lld, want %d", be->name, (long long)correct, want);
        for (int i = 0; i < B; i++) {
            int64_t ci = 0;
            be->xent(be, NULL, (float *)glg.p + (size_t)i * C, (int32_t *)glab.p + i, 1, C, 1.0f,
                     &loss, &ci);
            const int first = i == 0 || i == 2 || i == 4 || i == 7 || i == 8;
            cr_expect(ci == first, "%s: row %d (label %d): correct %lld", be->name, i, lab[i],
                      (long long)ci);
        }
        gbuf_free(&glg);
        gbuf_free(&glab);
    }
    free(lg);
}

/* A label out of range is a fatal error of the worker: exit 1 with a
 * file:line message, found without reading outside the logits. Run in a
 * child process that has not touched CUDA before (a CUDA context does not
 * survive fork), hence a suite without the init; exit 77 there means skip. */
static void bad_label_child(void)
{
    char err[512] = "";
    const psw_cuda_plugin_t *p = psw_cuda_load(err, sizeof err);
    if (!p) {
        fprintf(stderr, "%s", err);
        _exit(77);
    }
    const int n = p->device_count(err, sizeof err);
    if (n < 1) {
        fprintf(stderr, "%s", n < 0 ? err : "0 devices visible");
        _exit(77);
    }
    psw_backend_t *be = p->backend_new(0, err, sizeof err);
    if (!be) {
        fprintf(stderr, "backend_new(0): %s", err);
        _exit(3);
    }
    const float lg[6] = {1, 2, 3, 4, 5, 6};
    const int32_t lab[2] = {0, 3}; /* 3 of 3 classes */
    gbuf_t glg = gbuf_new(be, lg, sizeof lg), glab = gbuf_new(be, lab, sizeof lab);
    double loss = 0;
    int64_t correct = 0;
    be->xent(be, NULL, glg.p, glab.p, 2, 3, 1.0f, &loss, &correct);
    fprintf(stderr, "xent returned");
    _exit(4);
}

Test(cuda_fatal, xent_bad_label_exits_1)
{
    int fd[2];
    cr_assert_eq(pipe(fd), 0);
    const pid_t pid = fork();
    cr_assert_geq(pid, 0, "fork");
    if (pid == 0) {
        close(fd[0]);
        dup2(fd[1], STDERR_FILENO);
        bad_label_child();
    }
    close(fd[1]);
    char msg[2048];
    size_t len = 0;
    ssize_t got;
    while ((got = read(fd[0], msg + len, sizeof msg - 1 - len)) > 0) len += (size_t)got;
    msg[len] = '\0';
    close(fd[0]);
    int st = 0;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77) SKIP_NO_GPU("no CUDA device: %s", msg);
    cr_expect(WIFEXITED(st) && WEXITSTATUS(st) == 1, "child: status 0x%x, stderr: %s", st, msg);
    cr_expect(strstr(msg, "psw_cuda: ") && strstr(msg, "out of range"), "message: %s", msg);
    fprintf(stderr, "cuda_ops: bad label -> exit 1: %s", msg);
}

/* ---- a training step ---- */

/* CPU forward, to count what could make the backends disagree beyond
 * rounding: hidden pre-activations within 1e-5 of 0 (a ReLU kink) and
 * samples whose two largest logits are within 1e-4 (argmax near-ties). */
static void near_kinks_and_ties(const ps_layout_t *l, const float *params, const float *x, int B,
                                int *kinks, int *ties)
{
    *kinks = *ties = 0;
    float *a = floats((size_t)B * l->sizes[0]);
    memcpy(a, x, (size_t)B * l->sizes[0] * sizeof(float));
    for (int i = 0; i < l->n_layers; i++) {
        const size_t nz = (size_t)B * l->sizes[i + 1];
        float *z = floats(nz);
        cpu->linear_fwd(cpu, z, a, params + l->t[2 * i].offset, params + l->t[2 * i + 1].offset,
                        B, l->sizes[i], l->sizes[i + 1]);
        if (i < l->n_layers - 1) {
            for (size_t j = 0; j < nz; j++) *kinks += fabsf(z[j]) < 1e-5f;
            cpu->relu_fwd(cpu, z, z, nz);
        } else {
            const int C = l->sizes[i + 1];
            for (int s = 0; s < B; s++) {
                float m1 = -INFINITY, m2 = -INFINITY;
                for (int j = 0; j < C; j++) {
                    const float v = z[(size_t)s * C + j];
                    if (v > m1) m2 = m1, m1 = v;
                    else if (v > m2) m2 = v;
                }
                *ties += C > 1 && m1 - m2 < 1e-4f;
            }
        }
        free(a);
        a = z;
    }
    free(a);
}

/* psw_model on both backends, same layout, parameters and batch: loss (the
 * per-sample tolerance of the forward, 1e-5 per sample + 1e-5 relative),
 * correct (exact unless near-ties), and every gradient tensor with atol
 * 1e-5 * max|tensor| and rtol 1e-4 (the errors of three layers of float
 * GEMMs, in another order, relative to the tensor's scale). */
Test(cuda, model_train_step)
{
    NEED_GPU();
    enum { MAXB = 64, IN = 784, C = 10 };
    const int sizes[] = {IN, 257, 100, C};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, sizes, 4), 0);
    float *params = floats(l.n_params);
    ps_model_init_params(&l, params, 2024);
    ps_rng_t r;
    ps_rng_seed(&r, 77, 14);
    for (int k = 1; k < l.n_tensors; k += 2) /* non-zero biases */
        fill_uniform(params + l.t[k].offset, l.t[k].numel, -0.1f, 0.1f, &r);
    float *x = fill_uniform(floats((size_t)MAXB * IN), (size_t)MAXB * IN, 0, 1, &r);
    int32_t y[MAXB];
    for (int i = 0; i < MAXB; i++) y[i] = (int32_t)ps_rng_below(&r, C);

    psw_model_t *m[2] = {psw_model_new(cpu, &l, MAXB), psw_model_new(gpu, &l, MAXB)};
    cr_assert(m[0] && m[1]);
    float *g[2] = {floats(l.n_params), floats(l.n_params)};
    stat_t sg = {.op = "model grads"}, sls = {.op = "model loss"};
    static const int steps[] = {MAXB, 37, MAXB};
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        const int B = steps[s];
        int kinks, ties;
        near_kinks_and_ties(&l, params, x, B, &kinks, &ties);
        /* A property of the fixed inputs (CPU only): a pre-activation this
         * close to 0 could flip sign on the GPU and change a gradient. */
        cr_assert(kinks == 0, "fixture: %d pre-activations within 1e-5 of 0, change the seed",
                  kinks);
        double loss[2] = {0, 0}, eval[2] = {0, 0};
        int64_t correct[2] = {0, 0};
        for (int k = 0; k < 2; k++) {
            psw_model_set_params(m[k], params);
            psw_model_train_step(m[k], x, y, B, &loss[k], &correct[k], NULL, NULL);
            psw_model_get_grads(m[k], g[k]);
            psw_model_eval(m[k], x, y, B, &eval[k], NULL);
            cr_expect(eval[k] == loss[k], "%s: eval loss %.17g, train_step %.17g",
                      k ? "gpu" : "cpu", eval[k], loss[k]);
        }
        const double tol = 1e-5 * B + 1e-5 * fabs(loss[0]), err = fabs(loss[1] - loss[0]);
        cr_expect(err <= tol, "step %zu (B %d): loss gpu %.12g cpu %.12g (tol %.3g)", s, B, loss[1],
                  loss[0], tol);
        sls.max_abs = fmax(sls.max_abs, err);
        sls.max_rel = fmax(sls.max_rel, err / fabs(loss[0]));
        sls.worst = fmax(sls.worst, err / tol);
        sls.n_values++;
        sls.n_bad += !(err <= tol);
        sls.n_cases++;
        cr_expect(llabs(correct[1] - correct[0]) <= ties,
                  "step %zu (B %d): correct gpu %lld cpu %lld (%d near-ties)", s, B,
                  (long long)correct[1], (long long)correct[0], ties);
        for (int t = 0; t < l.n_tensors; t++) {
            const ps_tensor_info_t *ti = &l.t[t];
            const float *gc = g[0] + ti->offset, *gg = g[1] + ti->offset;
            double mx = 0;
            for (size_t j = 0; j < ti->numel; j++) mx = fmax(mx, fabs((double)gc[j]));
            char what[64];
            snprintf(what, sizeof what, "step %zu (B %d) grad %s", s, B, ti->name);
            expect_finite(gg, ti->numel, what);
            cr_expect(mx > 0, "%s: all zero on the CPU", what);
            expect_close(&sg, gg, gc, ti->numel, 1e-5 * mx, 1e-4, NULL, what);
        }
        sg.n_cases++;
        /* the next step starts from other parameters */
        for (size_t j = 0; j < l.n_params; j++) params[j] -= 0.1f * g[0][j];
    }
    stat_print(&sls);
    stat_print(&sg);
    for (int k = 0; k < 2; k++) {
        psw_model_destroy(&m[k]);
        free(g[k]);
    }
    free(params);
    free(x);
}

/* ---- memory ---- */

Test(cuda, alloc_is_zeroed_and_aligned)
{
    NEED_GPU();
    static const size_t sizes[] = {0, 1, 3, 64, 1000, (1u << 20) + 1};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        unsigned char *p = gpu->alloc(gpu, sizes[k]);
        cr_assert_not_null(p, "alloc(%zu)", sizes[k]);
        cr_expect((uintptr_t)p % 256 == 0, "alloc(%zu) at %p", sizes[k], (void *)p);
        unsigned char *h = malloc(sizes[k] + 1);
        cr_assert_not_null(h);
        memset(h, 0xff, sizes[k] + 1);
        gpu->download(gpu, h, p, sizes[k]);
        size_t nz = 0;
        for (size_t i = 0; i < sizes[k]; i++) nz += h[i] != 0;
        cr_expect(nz == 0, "alloc(%zu): %zu bytes not zero", sizes[k], nz);
        free(h);
        gpu->free(gpu, p);
        unsigned char *ph = gpu->host_alloc(gpu, sizes[k]);
        cr_assert_not_null(ph, "host_alloc(%zu)", sizes[k]);
        memset(ph, 0x5a, sizes[k]);
        gpu->host_free(gpu, ph);
    }
    gpu->free(gpu, NULL);
    cr_expect(gpu->host_visible == 0, "CUDA buffers are not host memory");
    cr_expect_str_eq(gpu->name, "cuda");
}

/* The source of an upload is the caller's again when upload returns, even
 * while the stream is busy and for uploads larger than a staging slot. */
Test(cuda, upload_source_is_free_on_return)
{
    NEED_GPU();
    /* keep the stream busy: 4 GEMMs of 2 * 2048^3 flops, about 1 ms */
    enum { N = 2048 };
    gbuf_t bx = gbuf_new(gpu, NULL, 4u * N * N), bw = gbuf_new(gpu, NULL, 4u * N * N);
    gbuf_t bb = gbuf_new(gpu, NULL, 4u * N), by = gbuf_new(gpu, NULL, 4u * N * N);
    for (int i = 0; i < 4; i++) gpu->linear_fwd(gpu, by.p, bx.p, bw.p, bb.p, N, N, N);

    const size_t big = (5u << 20) / 4 + 3; /* floats: more than two 2 MiB slots */
    enum { SMALL = 1000, NSMALL = 40 };
    ps_rng_t r;
    ps_rng_seed(&r, 5, 15);
    float *want = fill_uniform(floats(big), big, -1, 1, &r);
    float *src = floats(big);
    gbuf_t gbig = gbuf_new(gpu, NULL, big * 4), gsmall = gbuf_new(gpu, NULL, 4u * SMALL * NSMALL);
    memcpy(src, want, big * 4);
    gpu->upload(gpu, gbig.p, src, big * 4);
    memset(src, 0xff, big * 4);
    for (int i = 0; i < NSMALL; i++) { /* one host buffer, rewritten each time */
        for (int j = 0; j < SMALL; j++) src[j] = (float)(i * SMALL + j);
        gpu->upload(gpu, (float *)gsmall.p + (size_t)i * SMALL, src, 4u * SMALL);
    }
    memset(src, 0xff, 4u * SMALL);
    float *got = floats(big);
    gbuf_get(&gbig, got, "big upload");
    cr_expect(memcmp(got, want, big * 4) == 0, "big upload: data differs");
    gbuf_get(&gsmall, got, "small uploads");
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)SMALL * NSMALL; i++) bad += got[i] != (float)i;
    cr_expect(bad == 0, "small uploads: %zu values differ", bad);
    free(want);
    free(src);
    free(got);
    gbuf_t *all[] = {&bx, &bw, &bb, &by, &gbig, &gsmall};
    for (size_t i = 0; i < 6; i++) gbuf_free(all[i]);
}

/* download_async waits for the work queued before it, tickets are small
 * integers, and 64 copies can be in flight at once, round after round. */
Test(cuda, download_async_round_trip)
{
    NEED_GPU();
    enum { PER = 4099, MAXT = 64, ROUNDS = 3 };
    const size_t n = (size_t)PER * MAXT;
    ps_rng_t r;
    ps_rng_seed(&r, 9, 16);
    float *x = fill_uniform(floats(n), n, -1, 1, &r);
    float *want = floats(n);
    for (size_t i = 0; i < n; i++) want[i] = x[i] > 0 ? x[i] : 0.0f;
    gbuf_t gx = gbuf_new(gpu, x, n * 4);
    float *h = gpu->host_alloc(gpu, n * 4);
    cr_assert_not_null(h);
    enum { N = 1024 }; /* a GEMM of 2 * 1024^3 flops ahead of the relu */
    gbuf_t bx = gbuf_new(gpu, NULL, 4u * N * N), bw = gbuf_new(gpu, NULL, 4u * N * N);
    gbuf_t bb = gbuf_new(gpu, NULL, 4u * N), by = gbuf_new(gpu, NULL, 4u * N * N);
    for (int round = 0; round < ROUNDS; round++) {
        memset(h, 0xff, n * 4);
        gbuf_t gy = gbuf_new(gpu, NULL, n * 4);
        /* queued, likely not finished: the copies must wait for it */
        gpu->linear_fwd(gpu, by.p, bx.p, bw.p, bb.p, N, N, N);
        gpu->relu_fwd(gpu, gy.p, gx.p, n);
        int t[MAXT];
        for (int k = 0; k < MAXT; k++) {
            t[k] = gpu->download_async(gpu, h + (size_t)k * PER, (float *)gy.p + (size_t)k * PER,
                                       PER * 4);
            cr_expect(t[k] >= 0 && t[k] < 1024, "ticket %d", t[k]);
            for (int j = 0; j < k; j++) cr_expect(t[j] != t[k], "ticket %d handed out twice", t[k]);
        }
        for (int k = MAXT - 1; k >= 0; k--) gpu->wait(gpu, t[k]);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += memcmp(&h[i], &want[i], 4) != 0;
        cr_expect(bad == 0, "round %d: %zu values differ", round, bad);
        gbuf_free(&gy);
    }
    /* 0 bytes is a valid copy */
    const int t0 = gpu->download_async(gpu, h, gx.p, 0);
    gpu->wait(gpu, t0);
    gpu->host_free(gpu, h);
    gbuf_free(&gx);
    gbuf_t *all[] = {&bx, &bw, &bb, &by};
    for (size_t i = 0; i < 4; i++) gbuf_free(all[i]);
    free(x);
    free(want);
    fprintf(stderr, "cuda_ops: download_async %d rounds of %d tickets ok\n", ROUNDS, MAXT);
}
