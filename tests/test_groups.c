/* test_groups.c - optimizer groups (optimizer.groups) in psd's step: each
 * tensor stepped with its own weight decay and lr against a plain loop of
 * PyTorch's formulas per tensor, packed units whose tensors fall into
 * different groups included; the spans; the same bits for any split of
 * the step (threads, chunks, two passes with clipping, streamed). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps_model.h"
#include "ps_rng.h"
#include "psd_store.h"

/* Packed: a.weight .. c.weight share one unit of ~80K floats (each under
 * PS_PACK_SMALL), so the step's work items (PSD_ITEM_FLOATS) and chunks
 * cut it, and the groups cut it again at every bias and norm; "big" is a
 * unit alone. */
static const struct {
    const char *name;
    int ndim;
    uint64_t d[2];
} specs_def[] = {
    {"a.weight", 2, {200, 200}}, {"a.bias", 1, {200}}, {"norm.weight", 1, {200}}, {"b.weight", 2, {150, 200}},
    {"b.bias", 1, {150}},        {"c.weight", 2, {100, 100}}, {"big", 1, {70000}},
};
#define NT ((int)(sizeof specs_def / sizeof specs_def[0]))

static void layout(ps_layout_t *l)
{
    ps_tensor_spec_t sp[NT];
    memset(sp, 0, sizeof sp);
    for (int i = 0; i < NT; i++) {
        strcpy(sp[i].name, specs_def[i].name);
        sp[i].ndim = specs_def[i].ndim;
        memcpy(sp[i].shape, specs_def[i].d, sizeof specs_def[i].d);
        sp[i].init = (ps_init_t){PS_INIT_UNIFORM, 0.5};
    }
    char err[256];
    cr_assert_eq(ps_layout_init_specs(l, sp, NT, err, sizeof err), 0, "%s", err);
    cr_assert_eq(l->n_tensors, 2, "the small tensors pack into one unit");
}

/* biases and norms without weight decay, norms and big at other rates */
static int groups(ps_group_t *g)
{
    for (int i = 0; i < 3; i++) ps_group_clear(&g[i]);
    strcpy(g[0].match, "*.bias");
    g[0].has_wd = true;
    g[0].weight_decay = 0;
    strcpy(g[1].match, "norm*");
    g[1].has_wd = true;
    g[1].weight_decay = 0;
    g[1].lr_scale = 3;
    strcpy(g[2].match, "big");
    g[2].lr_scale = 0.5;
    return 3;
}

/* seeded values in (-scale, scale) */
static void fill(float *x, size_t n, uint64_t seed, float scale)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, 5);
    for (size_t i = 0; i < n; i++) x[i] = (ps_rng_uniform(&r) * 2.0f - 1.0f) * scale;
}

static psd_optim_t opt_of(ps_opt_kind_t kind, float mom, int nesterov)
{
    return (psd_optim_t){.kind = kind, .momentum = mom, .nesterov = nesterov, .weight_decay = 0.05f,
                         .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
}

#define STEPS 3
#define LR 0.01
static const double wt[2] = {0.625, 0.375};

/* how the store is driven: 0 whole (one contributor), 1 whole (two), 2 two
 * passes with clipping, 3 streamed chunk by chunk */
static void store_run(const psd_optim_t *o, bool with_groups, int how, int threads, size_t chunk_bytes, float *w)
{
    ps_layout_t l;
    layout(&l);
    psd_store_t s;
    cr_assert_eq(psd_store_init(&s, &l, o, 9), 0);
    ps_group_t g[3];
    int ng = groups(g);
    if (with_groups) cr_assert_eq(psd_store_groups(&s, g, ng), 0);
    cr_assert_eq(psd_store_set_parallel(&s, threads, chunk_bytes), 0);
    float *gr = malloc(2 * l.n_params * sizeof *gr);
    int *ids = malloc((size_t)s.n_chunks * sizeof *ids);
    const void **src = malloc(2 * (size_t)s.n_chunks * sizeof *src);
    cr_assert(gr && ids && src);
    const int k = how == 0 ? 1 : 2;
    const double one = 1.0;
    for (uint64_t step = 1; step <= STEPS; step++) {
        fill(gr, 2 * l.n_params, 70 + step, 0.5f);
        const void *gt[2][PS_MAX_TENSORS];
        for (int c = 0; c < 2; c++)
            for (int t = 0; t < l.n_tensors; t++) gt[c][t] = gr + (size_t)c * l.n_params + l.t[t].offset;
        if (how <= 2) {
            cr_assert_geq(psd_store_step(&s, k, (const void *const(*)[PS_MAX_TENSORS])gt, NULL, k == 1 ? &one : wt,
                                         how == 2 ? 1e9 : 0, LR),
                          0);
            continue;
        }
        psd_arena_t *next = psd_store_stream_begin(&s);
        cr_assert_not_null(next);
        for (int j = 0; j < s.n_chunks; j++) {
            ids[j] = s.n_chunks - 1 - j;
            for (int c = 0; c < 2; c++) src[2 * j + c] = gr + (size_t)c * l.n_params + s.chunks[ids[j]].off;
        }
        for (int j = 0; j < s.n_chunks; j++) psd_store_stream_chunks(&s, next, &ids[j], 1, 2, &src[2 * j], NULL, wt, false, LR);
        psd_store_stream_end(&s, next);
    }
    memcpy(w, s.cur->w, l.n_params * sizeof *w);
    free(gr);
    free(ids);
    free(src);
    psd_store_deinit(&s);
    ps_layout_free(&l);
}

/* PyTorch's update of one tensor of n floats with its own wd and lr, step t
 * (1-based), in plain loops: SGD (momentum, Nesterov; L2), Adam (L2),
 * AdamW (decoupled), Adagrad (L2). */
static void torch_step(const psd_optim_t *o, float wd, double lr, uint64_t t, float *w, const float *g, float *s0,
                       float *s1, size_t n)
{
    const float lrf = (float)lr;
    for (size_t i = 0; i < n; i++) {
        switch (o->kind) {
        case PS_OPT_SGD: {
            float d = g[i] + wd * w[i];
            if (o->momentum > 0) {
                s0[i] = o->momentum * s0[i] + d; /* buf starts at 0: the first step's buf is d */
                d = o->nesterov ? d + o->momentum * s0[i] : s0[i];
            }
            w[i] = w[i] - lrf * d;
            break;
        }
        case PS_OPT_ADAM:
        case PS_OPT_ADAMW: {
            float d = g[i];
            if (o->kind == PS_OPT_ADAMW) w[i] = w[i] * (float)(1.0 - lr * (double)wd);
            else d += wd * w[i];
            s0[i] = o->beta1 * s0[i] + (1.0f - o->beta1) * d;
            s1[i] = o->beta2 * s1[i] + (1.0f - o->beta2) * (d * d);
            const float mhat = s0[i] * (float)(1.0 / (1.0 - pow(o->beta1, (double)t)));
            const float vhat = s1[i] * (float)(1.0 / (1.0 - pow(o->beta2, (double)t)));
            w[i] = w[i] - lrf * mhat / (sqrtf(vhat) + o->eps);
            break;
        }
        case PS_OPT_ADAGRAD: {
            const float d = g[i] + wd * w[i];
            s0[i] += d * d;
            w[i] = w[i] - lrf * d / (sqrtf(s0[i]) + o->eps);
            break;
        }
        }
    }
}

/* The reference run: the initial weights, then for each tensor of the
 * table its own wd and lr (by name, written out here, not through the
 * groups' code) over the two contributors' weighted sum. */
static void reference_run(const psd_optim_t *o, float *w)
{
    ps_layout_t l;
    layout(&l);
    psd_store_t s;
    cr_assert_eq(psd_store_init(&s, &l, o, 9), 0);
    memcpy(w, s.cur->w, l.n_params * sizeof *w);
    psd_store_deinit(&s);
    float *gr = malloc(2 * l.n_params * sizeof *gr), *sum = malloc(l.n_params * sizeof *sum),
          *s0 = calloc(l.n_params, sizeof *s0), *s1 = calloc(l.n_params, sizeof *s1);
    cr_assert(gr && sum && s0 && s1);
    for (uint64_t step = 1; step <= STEPS; step++) {
        fill(gr, 2 * l.n_params, 70 + step, 0.5f);
        for (size_t i = 0; i < l.n_params; i++) sum[i] = (float)wt[0] * gr[i] + (float)wt[1] * gr[l.n_params + i];
        for (int k = 0; k < ps_layout_ntab(&l); k++) {
            const ps_tensor_info_t *t = ps_layout_tensor(&l, k);
            const bool bias = strstr(t->name, ".bias") != NULL, norm = strncmp(t->name, "norm", 4) == 0;
            const float wd = bias || norm ? 0.0f : 0.05f;
            const double lr = norm ? 3 * LR : strcmp(t->name, "big") == 0 ? 0.5 * LR : LR;
            torch_step(o, wd, lr, step, w + t->offset, sum + t->offset, s0 + t->offset, s1 + t->offset, t->numel);
        }
    }
    free(gr);
    free(sum);
    free(s0);
    free(s1);
    ps_layout_free(&l);
}

static psd_optim_t opts_all(int i)
{
    switch (i) {
    case 0: return opt_of(PS_OPT_SGD, 0.9f, 0);
    case 1: return opt_of(PS_OPT_SGD, 0.9f, 1);
    case 2: return opt_of(PS_OPT_SGD, 0, 0);
    case 3: return opt_of(PS_OPT_ADAMW, 0, 0);
    case 4: return opt_of(PS_OPT_ADAM, 0, 0);
    default: return opt_of(PS_OPT_ADAGRAD, 0, 0);
    }
}
static const char *const opt_names[] = {"sgd+momentum", "sgd+nesterov", "sgd", "adamw", "adam", "adagrad"};
#define N_OPTS 6

Test(groups, each_tensor_steps_with_its_groups_weight_decay_and_lr_as_pytorch)
{
    ps_layout_t l;
    layout(&l);
    const size_t np = l.n_params;
    float *got = malloc(np * sizeof *got), *exp = malloc(np * sizeof *exp), *plain = malloc(np * sizeof *plain);
    cr_assert(got && exp && plain);
    for (int o = 0; o < N_OPTS; o++) {
        psd_optim_t opt = opts_all(o);
        store_run(&opt, true, 1, 1, (size_t)1 << 40, got);
        reference_run(&opt, exp);
        store_run(&opt, false, 1, 1, (size_t)1 << 40, plain);
        for (int k = 0; k < ps_layout_ntab(&l); k++) {
            const ps_tensor_info_t *t = ps_layout_tensor(&l, k);
            double worst = 0;
            size_t differ = 0;
            for (size_t i = t->offset; i < t->offset + t->numel; i++) {
                const double d = fabs((double)got[i] - (double)exp[i]);
                if (d > 1e-6 * fabs((double)exp[i]) + 1e-9 && d > worst) worst = d;
                differ += got[i] != plain[i];
            }
            cr_expect_eq(worst, 0, "%s, %s: off the reference by %g", opt_names[o], t->name, worst);
            /* every tensor here has a group setting apart from the defaults
             * (c.weight and a.weight: the defaults, the same as without groups) */
            const bool defaults = strcmp(t->name, "a.weight") == 0 || strcmp(t->name, "c.weight") == 0 ||
                                  strcmp(t->name, "b.weight") == 0;
            if (defaults) cr_expect_eq(differ, 0, "%s, %s: the defaults change", opt_names[o], t->name);
            else cr_expect_gt(differ, 0, "%s, %s: its group changes nothing", opt_names[o], t->name);
        }
    }
    free(got);
    free(exp);
    free(plain);
    ps_layout_free(&l);
}

Test(groups, any_split_of_the_step_gives_the_same_bits)
{
    ps_layout_t l;
    layout(&l);
    const size_t np = l.n_params;
    float *a = malloc(np * sizeof *a), *b = malloc(np * sizeof *b);
    cr_assert(a && b);
    for (int o = 0; o < N_OPTS; o++) {
        psd_optim_t opt = opts_all(o);
        store_run(&opt, true, 1, 1, (size_t)1 << 40, a);
        /* items of 128 KiB on 3 threads, chunks of 64 KiB; clipping that
         * never clips (two passes, scale 1); streamed chunk by chunk */
        const int hows[3][2] = {{1, 3}, {2, 2}, {3, 1}};
        for (int h = 0; h < 3; h++) {
            store_run(&opt, true, hows[h][0], hows[h][1], 65536, b);
            cr_expect_eq(memcmp(a, b, np * sizeof *a), 0, "%s: way %d gives other bits", opt_names[o], hows[h][0]);
        }
    }
    free(a);
    free(b);
    ps_layout_free(&l);
}

Test(groups, spans_cut_units_only_where_the_settings_change)
{
    ps_layout_t l;
    layout(&l);
    ps_group_t g[3];
    int n = groups(g);
    psd_groups_t sp;
    cr_assert_eq(psd_groups_init(&sp, &l, 0.05f, g, n), 0);
    /* unit 0: a.weight | a.bias norm.weight (wd 0, but lr x1 then x3) | b.weight | b.bias | c.weight */
    cr_assert_eq(sp.first[1] - sp.first[0], 6);
    cr_expect_eq(sp.span[0].begin, 0);
    cr_expect_eq(sp.span[0].end, 40000);
    cr_expect_eq(sp.span[1].weight_decay, 0.0f);
    cr_expect_eq(sp.span[2].lr_scale, 3.0);
    cr_expect_eq(sp.span[5].end, l.t[0].numel);
    cr_assert_eq(sp.first[2] - sp.first[1], 1);
    cr_expect_eq(sp.span[sp.first[1]].lr_scale, 0.5);
    int a, b;
    psd_groups_range(&sp, 0, 39990, 20, &a, &b); /* the end of a.weight and the start of a.bias */
    cr_expect(a == 0 && b == 2, "[%d, %d)", a, b);
    psd_groups_range(&sp, 0, 40000, 1, &a, &b);
    cr_expect(a == 1 && b == 2, "[%d, %d)", a, b);
    psd_groups_deinit(&sp);
    /* a group no tensor takes, or the defaults again: one span a unit */
    strcpy(g[0].match, "nothing*");
    g[0].weight_decay = 0.05;
    cr_assert_eq(psd_groups_init(&sp, &l, 0.05f, g, 1), 0);
    cr_expect_eq(sp.first[1] - sp.first[0], 1);
    cr_expect_eq(sp.first[2] - sp.first[1], 1);
    psd_groups_deinit(&sp);
    cr_assert_eq(psd_groups_init(&sp, &l, 0.05f, g, 0), 0);
    cr_expect_null(sp.span, "no groups: the plain path");
    ps_layout_free(&l);
}

static char said[8][1400];
static bool said_warn[8];
static int n_said;

static void say(void *ud, bool warn, const char *line)
{
    (void)ud;
    cr_assert_lt(n_said, 8);
    said_warn[n_said] = warn;
    snprintf(said[n_said++], sizeof said[0], "%s", line);
}

Test(groups, the_log_names_what_each_group_got_and_warns_of_one_that_got_nothing)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, (const int[]){4, 3, 2, 2}, 4), 0); /* built-in: fc1.weight, fc1.bias, ... */
    ps_group_t g[2];
    ps_group_clear(&g[0]);
    ps_group_clear(&g[1]);
    strcpy(g[0].match, "*.bias");
    strcpy(g[1].match, "embed.*");
    n_said = 0;
    psd_groups_describe(&l, g, 2, say, NULL);
    cr_assert_eq(n_said, 3);
    cr_expect_str_eq(said[0], "optimizer.groups: 3 of 6 tensors take the defaults: fc1.weight, fc2.weight, fc3.weight");
    cr_expect_not(said_warn[0]);
    cr_expect_str_eq(said[1], "optimizer.groups[0] (*.bias): 3 tensors: fc1.bias, fc2.bias, fc3.bias");
    cr_expect_str_eq(said[2], "optimizer.groups[1] (embed.*) matches none of the model's 6 tensors");
    cr_expect(said_warn[2]);
}
