/* store_step - the cost of psd's step alone (psd_store_step: reduce and
 * optimizer, no network), for the tables bench/tables.sh trains and the
 * optimizers, with and without optimizer groups. Not a test.
 *
 *   build/store_step [ROUNDS] [STEPS]      (default 7 rounds of 200 steps)
 *
 * Tables (4 MiB of floats each): "one" one tensor [1048576]; "t300" 299
 * small tensors of assorted shapes and a last large one, packed into units
 * (ps_model.h), as bench/tables.sh's. Each is stepped by one contributor
 * of weight 1 (applied straight from its gradient) and by two (reduced
 * first), on one thread, with sgd+momentum and adamw, without groups and
 * with groups that cut the packed units at every bias ("*.bias" wd 0,
 * "t1*" lr_scale 2). Prints the median microseconds of a step per round
 * set, rounds alternating the cases (this VM has slow and fast spells). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "ps_model.h"
#include "ps_util.h"
#include "psd_store.h"

#define NT 300

static int table_specs(ps_tensor_spec_t *sp, bool many)
{
    static const struct {
        int ndim;
        uint64_t d[4];
    } shapes[6] = {{2, {32, 64}}, {1, {64}}, {1, {1}}, {2, {64, 128}}, {1, {128}}, {4, {3, 3, 16, 16}}};
    const int n = many ? NT : 1;
    uint64_t total = 0;
    memset(sp, 0, (size_t)n * sizeof *sp);
    for (int i = 0; i < n; i++) {
        ps_tensor_spec_t *t = &sp[i];
        if (i == n - 1) { /* the last one makes 1M floats in all */
            snprintf(t->name, sizeof t->name, "w");
            t->ndim = 1;
            t->shape[0] = ((uint64_t)1 << 20) - total;
            break;
        }
        /* the vectors are named biases: the groups cut the packed units at each */
        const int j = i % 6;
        snprintf(t->name, sizeof t->name, shapes[j].ndim == 1 ? "t%d.bias" : "t%d.weight", i);
        t->ndim = shapes[j].ndim;
        memcpy(t->shape, shapes[j].d, sizeof shapes[j].d);
        total += ps_shape_numel(t->ndim, t->shape);
    }
    return n;
}

static double run_case(const ps_layout_t *l, ps_opt_kind_t kind, bool groups, int k, int steps)
{
    ps_config_t c;
    ps_config_defaults(&c);
    c.opt = kind;
    c.momentum = 0.9;
    c.weight_decay = 1e-4;
    psd_optim_t o;
    psd_optim_from_config(&o, &c);
    psd_store_t s;
    if (psd_store_init(&s, l, &o, 1) != 0) return -1;
    ps_group_t g[2];
    ps_group_clear(&g[0]);
    ps_group_clear(&g[1]);
    strcpy(g[0].match, "*.bias");
    g[0].has_wd = true;
    strcpy(g[1].match, "t1*");
    g[1].lr_scale = 2;
#ifndef STORE_STEP_NO_GROUPS
    if (groups && psd_store_groups(&s, g, 2) != 0) return -1;
#else
    (void)groups;
#endif
    float *grad = malloc(2 * l->n_params * sizeof *grad);
    if (!grad) return -1;
    for (size_t i = 0; i < 2 * l->n_params; i++) grad[i] = (float)((i * 2654435761u) % 1000) * 1e-6f;
    const void *gp[2][PS_MAX_TENSORS];
    for (int j = 0; j < 2; j++)
        for (int t = 0; t < l->n_tensors; t++) gp[j][t] = grad + j * l->n_params + l->t[t].offset;
    const double w1[1] = {1.0}, w2[2] = {0.5, 0.5};
    double t0 = ps_now();
    for (int i = 0; i < steps; i++) psd_store_step(&s, k, (const void *const(*)[PS_MAX_TENSORS])gp, NULL, k == 1 ? w1 : w2, 0, 1e-3);
    double us = (ps_now() - t0) / steps * 1e6;
    free(grad);
    psd_store_deinit(&s);
    return us;
}

int main(int argc, char **argv)
{
    const int rounds = argc > 1 ? atoi(argv[1]) : 7, steps = argc > 2 ? atoi(argv[2]) : 200;
    static ps_tensor_spec_t sp[NT];
    ps_layout_t lay[2];
    char err[256];
    for (int m = 0; m < 2; m++) {
        int n = table_specs(sp, m == 1);
        if (ps_layout_init_specs(&lay[m], sp, n, err, sizeof err) != 0) {
            fprintf(stderr, "store_step: %s\n", err);
            return 1;
        }
    }
    static const char *const tname[2] = {"one", "t300"};
    static const ps_opt_kind_t kinds[2] = {PS_OPT_SGD, PS_OPT_ADAMW};
    static const char *const kname[2] = {"sgd+mom", "adamw"};
    enum { NCASE = 2 * 2 * 2 * 2 };
    double *us = calloc((size_t)rounds * NCASE, sizeof *us);
    if (!us) return 1;
    for (int r = 0; r < rounds; r++)
        for (int c = 0; c < NCASE; c++) {
            const int m = c & 1, kd = (c >> 1) & 1, k = ((c >> 2) & 1) + 1, gr = (c >> 3) & 1;
            us[c * rounds + r] = run_case(&lay[m], kinds[kd], gr, k, steps);
            if (us[c * rounds + r] < 0) {
                fprintf(stderr, "store_step: out of memory\n");
                return 1;
            }
        }
    printf("%-6s %-8s %-7s %-7s %s\n", "table", "opt", "contrib", "groups", "median us/step (4 MiB, 1 thread)");
    for (int c = 0; c < NCASE; c++) {
        const int m = c & 1, kd = (c >> 1) & 1, k = ((c >> 2) & 1) + 1, gr = (c >> 3) & 1;
        qsort(us + c * rounds, (size_t)rounds, sizeof *us, bench_cmp_double);
        printf("%-6s %-8s %-7d %-7s %.1f\n", tname[m], kname[kd], k, gr ? "yes" : "no", us[c * rounds + rounds / 2]);
    }
    free(us);
    for (int m = 0; m < 2; m++) ps_layout_free(&lay[m]);
    return 0;
}
