/* test_tensors.c - the model as a table of named tensors: model.tensors in
 * the config (parsed, refused, written back), the counter-based inits (a
 * piece alone gives the whole's values), the built-in models' tables and
 * weights unchanged bit for bit, 64-bit sizes (a 2^31+1-float tensor's
 * layout, pieces, chunks and frame checks without allocating it), the table
 * on the wire (packed, refused when hostile) and in weights files (format
 * 3, safetensors) and back. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "ps_config.h"
#include "ps_model.h"
#include "ps_rng.h"
#include "ps_table.h"
#include "ps_weights.h"
#include "ps_weights_st.h"
#include "ps_wire.h"

static const char *yaml_ok = "model:\n"
                             "  kind: tensors\n"
                             "  tensors:\n"
                             "    - {name: conv1.weight, shape: [32, 1, 5, 5], init: kaiming_uniform}\n"
                             "    - {name: conv1.bias, shape: [32], init: zeros}\n"
                             "    - {name: emb.weight, shape: [1000, 16], init: \"normal:0.02\", kind: sparse_rows}\n"
                             "    - name: scale\n"
                             "      shape: []\n"
                             "      init: \"constant:0.5\"\n"
                             "data: {train_size: 1000, test_size: 100}\n";

static void load_ok(ps_config_t *c, const char *y)
{
    char err[512];
    ps_config_defaults(c);
    cr_assert_eq(ps_config_load_string(c, y, strlen(y), "t.yaml", err, sizeof err), 0, "%s", err);
    cr_assert_eq(ps_config_validate(c, err, sizeof err), 0, "%s", err);
}

Test(tensors, a_config_table_is_read_and_written_back)
{
    ps_config_t c, d;
    load_ok(&c, yaml_ok);
    cr_assert_eq(c.kind, PS_MODEL_TENSORS);
    cr_assert_eq(c.n_tensors, 4);
    cr_expect_str_eq(c.tensors[0].name, "conv1.weight");
    cr_expect_eq(c.tensors[0].ndim, 4);
    cr_expect_eq(c.tensors[0].shape[3], 5);
    cr_expect_eq(c.tensors[0].init.kind, PS_INIT_KAIMING_UNIFORM);
    cr_expect_eq(c.tensors[2].kind, PS_TENSOR_ROWS);
    cr_expect(c.tensors[2].init.kind == PS_INIT_NORMAL && c.tensors[2].init.value == 0.02);
    cr_expect_eq(c.tensors[3].ndim, 0);
    cr_expect(c.tensors[3].init.value == 0.5);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_eq(ps_config_write_yaml(&c, f), 0);
    fclose(f);
    load_ok(&d, text);
    cr_expect_eq(c.n_tensors, d.n_tensors);
    cr_expect_eq(memcmp(d.tensors, c.tensors, (size_t)c.n_tensors * sizeof *c.tensors), 0, "the table reads back the same:\n%s", text);
    cr_expect_eq(ps_config_hash(&c), ps_config_hash(&d));
    d.tensors[1].shape[0] = 33;
    cr_expect_neq(ps_config_hash(&c), ps_config_hash(&d), "the table is in the hash");
    free(text);
    ps_config_free(&c);
    ps_config_free(&d);
    /* an MLP's hash does not see the new keys */
    ps_config_t m1, m2;
    ps_config_defaults(&m1);
    ps_config_defaults(&m2);
    m2.train_size = 5;
    cr_expect_eq(ps_config_hash(&m1), ps_config_hash(&m2));
}

Test(tensors, a_bad_table_is_refused_with_the_tensor_named)
{
    static const struct {
        const char *yaml, *want;
        int checked; /* 0: refused as read; 1: read, refused by the check after (ps_config_validate) */
    } bad[] = {
        {"model: {kind: tensors, tensors: [{name: a, shape: [2]}, {name: a, shape: [3]}]}", "also tensor 0's", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [2, 0]}]}", "dimension '0'", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [2], init: gauss}]}", "unknown init 'gauss'", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [2], init: normal}]}", "needs a parameter", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [2], init: \"normal:-1\"}]}", ">= 0", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [2], kind: sparse}]}", "dense or sparse_rows", 0},
        {"model: {kind: tensors, tensors: [{name: a}]}", "needs a name and a shape", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [1, 2, 3, 4, 5, 6, 7, 8, 9]}]}", "more than 8", 0},
        {"model: {kind: tensors, tensors: [{name: a, shape: [2], size: 3}]}", "unknown field 'size'", 0},
        {"model: {kind: tensors, tensors: {name: a}}", "expected a list of tensors", 0},
        {"model: {kind: tensors, tensors: [{name: e, shape: [9], kind: sparse_rows}]}\n"
         "data: {train_size: 1, test_size: 1}",
         "tensor e: sparse rows need", 1},
        {"model: {kind: tensors, tensors: [{name: e, shape: [9]}]}\ndata: {val_fraction: 0.1, val_size: 5}",
         "give one of them", 1},
        {"model: {kind: tensors, tensors: [{name: e, shape: [9]}]}\ntrain: {keep_best: {metric: val_mae!}}",
         "is not a validation metric", 1},
        {"model: {kind: tensors, tensors: [{name: e, shape: [9]}]}\ntrain: {early_stop: {metric: val_auc}}",
         "is not a validation metric", 1},
        {"model: {kind: tensors}\ndata: {train_size: 1, test_size: 1}", "model.tensors lists the tensors", 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ps_config_t c;
        char err[512] = "";
        ps_config_defaults(&c);
        int rc = ps_config_load_string(&c, bad[i].yaml, strlen(bad[i].yaml), "t.yaml", err, sizeof err);
        cr_expect_eq(rc, bad[i].checked ? 0 : -1, "%s: %s", bad[i].yaml, err);
        if (rc == 0) cr_expect_eq(ps_config_validate(&c, err, sizeof err), -1, "%s", bad[i].yaml);
        cr_expect(strstr(err, bad[i].want), "%s -> %s", bad[i].yaml, err);
        ps_config_free(&c);
    }
    char err[256];
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(ps_config_set(&c, "model.tensors", "a:3", err, sizeof err), -1);
    cr_expect(strstr(err, "config file"), "%s", err);
}

/* tensor k of l's table, to change (ps_layout_tensor's, writable) */
static ps_tensor_info_t *tab_at(ps_layout_t *l, int k) { return l->tab ? &l->tab[k] : &l->t[k]; }

Test(tensors, inits_are_counter_based_and_follow_torch_fans)
{
    ps_config_t c;
    load_ok(&c, yaml_ok);
    ps_layout_t l;
    cr_assert_eq(ps_config_layout(&c, &l), 0);
    float *a = calloc(l.n_params, sizeof *a), *b = calloc(l.n_params, sizeof *b);
    cr_assert(a && b);
    ps_model_init_params(&l, a, 7);
    /* every tensor drawn in two pieces, each alone: the same bits */
    ps_piece_t own[PS_MAX_TENSORS];
    for (int t = 0; t < l.n_tensors; t++) own[t] = (ps_piece_t){t, 0, l.t[t].numel / 3};
    ps_model_init_pieces(&l, b, 7, own);
    for (int t = 0; t < l.n_tensors; t++) own[t] = (ps_piece_t){t, l.t[t].numel / 3, l.t[t].numel - l.t[t].numel / 3};
    ps_model_init_pieces(&l, b, 7, own);
    cr_expect_eq(memcmp(a, b, l.n_params * sizeof *a), 0, "pieces alone give the whole's values");
    /* kaiming_uniform of [32, 1, 5, 5]: fan_in 25, bound sqrt(6/25) */
    const float *w = a + ps_layout_tensor(&l, 0)->offset;
    double bound = sqrt(6.0 / 25.0), mx = 0;
    for (size_t i = 0; i < ps_layout_tensor(&l, 0)->numel; i++) mx = fmax(mx, fabs(w[i]));
    cr_expect(mx <= bound && mx > 0.9 * bound, "max |w| %g, bound %g", mx, bound);
    const float *e = a + ps_layout_tensor(&l, 2)->offset;
    double s = 0, ss = 0;
    for (size_t i = 0; i < ps_layout_tensor(&l, 2)->numel; i++) s += e[i], ss += (double)e[i] * e[i];
    double mean = s / 16000, sd = sqrt(ss / 16000 - mean * mean);
    cr_expect(fabs(mean) < 0.002 && fabs(sd - 0.02) < 0.001, "normal:0.02 gave mean %g sd %g", mean, sd);
    cr_expect(a[ps_layout_tensor(&l, 3)->offset] == 0.5f);
    for (size_t i = 0; i < 32; i++) cr_expect(a[ps_layout_tensor(&l, 1)->offset + i] == 0.0f);
    ps_model_init_params(&l, b, 8);
    cr_expect_neq(memcmp(a + ps_layout_tensor(&l, 0)->offset, b + ps_layout_tensor(&l, 0)->offset, 100 * sizeof *a), 0,
                  "another seed, other values");
    free(a);
    free(b);
    ps_layout_free(&l);
    ps_config_free(&c);
}

/* The built-in weights exactly as before the table: He-uniform from a
 * xoshiro stream per weight tensor (stream 0x1417 + index), zero biases. */
static uint32_t old_init_crc(const int *sizes, int n_sizes, uint64_t seed)
{
    uLong crc = crc32(0L, Z_NULL, 0);
    for (int i = 0; i + 1 < n_sizes; i++) {
        size_t n = (size_t)sizes[i] * (size_t)sizes[i + 1];
        float *w = malloc(n * sizeof *w), *b = calloc((size_t)sizes[i + 1], sizeof *b);
        ps_rng_t r;
        ps_rng_seed(&r, seed, 0x1417 + (uint64_t)(2 * i));
        const float bound = (float)sqrt(6.0 / (double)sizes[i]);
        for (size_t j = 0; j < n; j++) w[j] = (2.0f * ps_rng_uniform(&r) - 1.0f) * bound;
        crc = crc32_z(crc, (const Bytef *)w, n * sizeof *w);
        crc = crc32_z(crc, (const Bytef *)b, (size_t)sizes[i + 1] * sizeof *b);
        free(w);
        free(b);
    }
    return (uint32_t)crc;
}

Test(tensors, the_built_in_models_are_tables_with_their_old_weights)
{
    int sizes[] = {784, 512, 256, 10};
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, sizes, 4), 0);
    cr_expect_str_eq(l.t[0].name, "fc1.weight");
    cr_expect_eq(l.t[0].ndim, 2);
    cr_expect_eq(l.t[0].shape[0], 512);
    cr_expect_eq(l.t[0].shape[1], 784);
    cr_expect_str_eq(l.t[5].name, "fc3.bias");
    cr_expect_eq(l.t[5].ndim, 1);
    float *p = malloc(l.n_params * sizeof *p);
    ps_model_init_params(&l, p, 42);
    cr_expect_eq(ps_layout_crc32(&l, p), old_init_crc(sizes, 4, 42), "seed 42: the weights of before, bit for bit");
    free(p);
}

Test(tensors, a_tensor_of_2_to_the_31_plus_1_floats_has_64_bit_sizes)
{
    const uint64_t big = (1ull << 31) + 1;
    ps_tensor_spec_t sp[3] = {{.name = "small", .ndim = 1, .shape = {3}},
                              {.name = "big", .ndim = 1, .shape = {big}},
                              {.name = "tail", .ndim = 2, .shape = {2, 5}}};
    ps_layout_t l;
    char err[256];
    cr_assert_eq(ps_layout_init_specs(&l, sp, 3, err, sizeof err), 0, "%s", err);
    cr_expect_eq(l.t[1].numel, big);
    cr_expect_eq(l.t[1].offset, 16);
    cr_expect_eq(l.t[2].offset, 16 + big + 15);
    cr_expect_eq(l.n_params, 16 + big + 15 + 10);
    /* two shards: the big tensor split at a norm block, both pieces over 2^30 */
    ps_piece_t p0[PS_MAX_TENSORS], p1[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 0, 2, p0);
    ps_shard_pieces(&l, 1, 2, p1);
    cr_expect_eq(p0[1].off, 0);
    cr_expect_eq(p0[1].n + p1[1].n, big);
    cr_expect_eq(p1[1].off, p0[1].n);
    cr_expect_eq(p1[1].off % PS_NORM_BLOCK, 0);
    cr_expect(p0[1].n > (1ull << 29) && p1[1].n > (1ull << 29));
    cr_expect_eq(p1[1].off + p1[1].n, big, "the second piece ends past 2^31");
    cr_expect_eq(ps_part_size(p0, 3) + ps_part_size(p1, 3), 3 + big + 10);
    ps_piece_t whole[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 0, 1, whole);
    cr_expect_eq(whole[1].n, big, "one psd: the whole tensor as one piece");
    /* chunks of 4 MiB: the last one of the big tensor holds its last float */
    size_t cf = ps_chunk_floats(4u << 20);
    int k = ps_chunk_find(&l, cf, 1, (big - 1) / cf * cf, big - (big - 1) / cf * cf);
    cr_expect_eq(k, 1 + (int)((big - 1) / cf));
    /* a frame of its last 16 floats: offset past 2^31, checked, nothing allocated */
    Psd__TensorDesc d = PSD__TENSOR_DESC__INIT;
    uint64_t shape[1] = {big};
    d.dtype = PSD__DTYPE__DT_F32;
    d.shape = shape;
    d.n_shape = 1;
    d.offset = big - 16;
    d.nbytes = 16 * 4;
    cr_expect_eq(ps_desc_check(&d, 64, err, sizeof err), 0, "%s", err);
    d.offset = big - 15;
    cr_expect_eq(ps_desc_check(&d, 64, err, sizeof err), -1, "one float past the end");
    cr_expect(strstr(err, "outside shape"), "%s", err);
    /* and the table of it on the wire */
    uint8_t *b;
    size_t n;
    cr_assert_eq(ps_table_pack(&l, &b, &n), 0);
    ps_layout_t back;
    cr_assert_eq(ps_table_unpack(b, n, &back, err, sizeof err), 0, "%s", err);
    cr_expect(ps_layout_same_table(&l, &back, err, sizeof err), "%s", err);
    cr_expect_eq(back.n_params, l.n_params);
    free(b);
}

Test(tensors, a_hostile_table_is_refused)
{
    ps_tensor_spec_t sp[2] = {{.name = "a", .ndim = 2, .shape = {3, 4}}, {.name = "b", .ndim = 1, .shape = {2}}};
    ps_layout_t l, back;
    char err[256];
    cr_assert_eq(ps_layout_init_specs(&l, sp, 2, err, sizeof err), 0, "%s", err);
    uint8_t *b;
    size_t n;
    cr_assert_eq(ps_table_pack(&l, &b, &n), 0);
    for (size_t cut = 0; cut < n; cut++) /* every truncation: refused or a smaller table, never a crash */
        if (ps_table_unpack(b, cut, &back, err, sizeof err) == 0) {
            cr_expect_lt(ps_layout_ntab(&back), 2);
            ps_layout_free(&back);
        }
    for (size_t i = 0; i < n; i++) { /* every byte flipped */
        b[i] ^= 0xff;
        if (ps_table_unpack(b, n, &back, err, sizeof err) == 0) ps_layout_free(&back);
        b[i] ^= 0xff;
    }
    free(b);
    ps_layout_free(&l);
    sp[1] = sp[0]; /* the same name twice */
    cr_expect_eq(ps_layout_init_specs(&l, sp, 2, err, sizeof err), -1);
    cr_expect(strstr(err, "also tensor 0's"), "%s", err);
    ps_layout_t a2;
    sp[1] = (ps_tensor_spec_t){.name = "b", .ndim = 1, .shape = {3}};
    cr_assert_eq(ps_layout_init_specs(&a2, sp, 2, err, sizeof err), 0);
    sp[1].shape[0] = 4;
    cr_assert_eq(ps_layout_init_specs(&back, sp, 2, err, sizeof err), 0);
    cr_expect(!ps_layout_same_table(&a2, &back, err, sizeof err));
    cr_expect(strstr(err, "tensor 1 (b): shape [3] here, [4] there"), "%s", err);
    ps_layout_free(&a2);
    ps_layout_free(&back);
}

Test(tensors, any_table_goes_through_weights_files_and_safetensors)
{
    ps_config_t c;
    load_ok(&c, yaml_ok);
    ps_layout_t l, l2;
    cr_assert_eq(ps_config_layout(&c, &l), 0);
    float *p = malloc(l.n_params * sizeof *p), *q = NULL;
    ps_model_init_params(&l, p, 3);
    char path[128], err[512];
    ps_weights_meta_t meta = {.run_id = 0xabc, .step = 77, .epoch = 2}, m2;
    for (int st = 0; st < 2; st++) {
        snprintf(path, sizeof path, "/tmp/psd-tt-%d.%s", (int)getpid(), st ? "safetensors" : "bin");
        cr_assert_eq(ps_weights_save(path, &l, p, &meta, err, sizeof err), 0, "%s", err);
        cr_assert_eq(ps_weights_load_any(path, &l2, &q, &m2, err, sizeof err), 0, "%s", err);
        if (st) tab_at(&l2, 2)->kind = PS_TENSOR_ROWS; /* safetensors holds names and shapes, not how a tensor is stepped */
        cr_expect(ps_layout_same_table(&l, &l2, err, sizeof err), "%s", err);
        cr_expect_eq(ps_layout_crc32(&l, p), ps_layout_crc32(&l2, q), "the same floats");
        cr_expect_eq(m2.step, 77);
        cr_expect_eq(m2.epoch, 2);
        cr_expect_eq(m2.run_id, 0xabc);
        free(q);
        ps_layout_free(&l2);
        unlink(path);
    }
    free(p);
    ps_layout_free(&l);
    ps_config_free(&c);
}

Test(tensors, model_init_gives_the_files_values_and_refuses_a_misfit)
{
    ps_config_t c;
    load_ok(&c, yaml_ok);
    ps_layout_t l, fl;
    cr_assert_eq(ps_config_layout(&c, &l), 0);
    float *p = malloc(l.n_params * sizeof *p), *q = calloc(l.n_params, sizeof *q);
    ps_model_init_params(&l, p, 3);
    char path[128], err[512];
    snprintf(path, sizeof path, "/tmp/psd-ti-%d.safetensors", (int)getpid());
    ps_weights_meta_t meta = {0};
    cr_assert_eq(ps_weights_save(path, &l, p, &meta, err, sizeof err), 0, "%s", err);
    cr_assert_eq(ps_st_init_values(path, &l, q, NULL, err, sizeof err), 0, "%s", err);
    cr_expect_eq(ps_layout_crc32(&l, p), ps_layout_crc32(&l, q));
    cr_assert_eq(ps_layout_from_st(path, &fl, err, sizeof err), 0, "%s", err);
    cr_expect_eq(tab_at(&fl, 2)->kind, PS_TENSOR_DENSE, "safetensors does not say how a tensor is stepped");
    tab_at(&fl, 2)->kind = PS_TENSOR_ROWS;
    cr_expect(ps_layout_same_table(&l, &fl, err, sizeof err), "the file's own table: %s", err);
    c.tensors[0].shape[0] = 16; /* the config says another shape */
    ps_layout_t other;
    cr_assert_eq(ps_config_layout(&c, &other), 0);
    cr_expect_eq(ps_st_init_values(path, &other, q, NULL, err, sizeof err), -1);
    cr_expect(strstr(err, "conv1.weight has shape [32, 1, 5, 5], the run's model [16, 1, 5, 5]"), "%s", err);
    unlink(path);
    free(p);
    free(q);
    ps_layout_free(&l);
    ps_layout_free(&fl);
    ps_layout_free(&other);
    ps_config_free(&c);
}

/* n specs of assorted shapes: mostly small ones (1 element, vectors,
 * matrices), every 500th over PS_PACK_SMALL floats, tensor 7 sparse rows */
static ps_tensor_spec_t *assorted(int n, uint64_t *total)
{
    ps_tensor_spec_t *sp = calloc((size_t)n, sizeof *sp);
    cr_assert(sp);
    *total = 0;
    for (int k = 0; k < n; k++) {
        snprintf(sp[k].name, sizeof sp[k].name, "layers.%d.%s", k / 4, (const char *[]){"weight", "bias", "norm", "scale"}[k % 4]);
        if (k % 500 == 499) sp[k].ndim = 1, sp[k].shape[0] = PS_PACK_SMALL + 3 + (uint64_t)k;
        else if (k % 4 == 0) sp[k].ndim = 2, sp[k].shape[0] = 8 + k % 5, sp[k].shape[1] = 3 + k % 7;
        else if (k % 4 == 3) sp[k].ndim = 0;
        else sp[k].ndim = 1, sp[k].shape[0] = 1 + (uint64_t)(k % 11);
        if (k == 7) sp[k].ndim = 2, sp[k].shape[0] = 100, sp[k].shape[1] = 4, sp[k].kind = PS_TENSOR_ROWS;
        sp[k].init = (ps_init_t){k % 3 ? PS_INIT_NORMAL : PS_INIT_KAIMING_UNIFORM, 0.02};
        *total += ps_shape_numel(sp[k].ndim, sp[k].shape);
    }
    return sp;
}

Test(tensors, a_table_of_thousands_of_tensors_packs_small_ones_into_units)
{
    const int n = 5000;
    uint64_t total;
    ps_tensor_spec_t *sp = assorted(n, &total);
    ps_layout_t l;
    char err[512];
    cr_assert_eq(ps_layout_init_specs(&l, sp, n, err, sizeof err), 0, "%s", err);
    cr_expect_eq(ps_layout_ntab(&l), n);
    cr_expect(l.n_tensors > 10 && l.n_tensors <= PS_MAX_TENSORS, "%d units", l.n_tensors);
    uint64_t sum = 0;
    for (int u = 0; u < l.n_tensors; u++) { /* units: runs of tensors in order, one piece, 64-byte aligned */
        const ps_tensor_info_t *ut = &l.t[u];
        cr_expect_eq(ut->offset % 16, 0);
        cr_expect_eq(u ? l.t[u - 1].first + l.t[u - 1].count : 0, ut->first);
        size_t at = ut->offset;
        for (int k = ut->first; k < ut->first + ut->count; k++) {
            const ps_tensor_info_t *t = ps_layout_tensor(&l, k);
            cr_expect_eq(t->unit, u);
            cr_expect_eq(t->offset, at, "tensor %d packed right after the one before it", k);
            at += t->numel;
            sum += t->numel;
            if (ut->count > 1) cr_expect(t->kind == PS_TENSOR_DENSE && t->numel < PS_PACK_SMALL);
        }
        cr_expect_eq(at, ut->offset + ut->numel);
    }
    cr_expect_eq(sum, total);
    cr_expect_eq(l.table, ps_layout_tensor(&l, 7)->unit, "the sparse tensor is a unit alone");
    cr_expect_eq(l.t[l.table].count, 1);
    cr_expect_eq(l.t[l.table].kind, PS_TENSOR_ROWS);
    cr_expect_eq(l.t[ps_layout_tensor(&l, 499)->unit].count, 1, "a large tensor is a unit alone");
    /* inits follow the table's tensors (keyed by their index), whatever the units and pieces */
    float *a = calloc(l.n_params, sizeof *a), *b = calloc(l.n_params, sizeof *b);
    cr_assert(a && b);
    ps_model_init_params(&l, a, 11);
    for (int k = 0; k < 3; k++) {
        ps_piece_t own[PS_MAX_TENSORS];
        ps_shard_pieces(&l, k, 3, own);
        ps_model_init_pieces(&l, b, 11, own);
    }
    cr_expect_eq(memcmp(a, b, l.n_params * sizeof *a), 0, "three shards' pieces drawn alone give the whole");
    const ps_tensor_info_t *t9 = ps_layout_tensor(&l, 1234);
    float *v = malloc(t9->numel * sizeof *v);
    ps_tensor_init_values(&t9->init, t9->ndim, t9->shape, 1234, 11, 0, t9->numel, v);
    cr_expect_eq(memcmp(v, a + t9->offset, t9->numel * sizeof *v), 0, "tensor 1234's values are its own draw");
    free(v);
    /* the table on the wire and in weights files, both formats */
    uint8_t *tb;
    size_t tlen;
    cr_assert_eq(ps_table_pack(&l, &tb, &tlen), 0);
    ps_layout_t back;
    cr_assert_eq(ps_table_unpack(tb, tlen, &back, err, sizeof err), 0, "%s", err);
    cr_expect(ps_layout_same_table(&l, &back, err, sizeof err), "%s", err);
    cr_expect_eq(back.n_tensors, l.n_tensors);
    for (int u = 0; u < l.n_tensors; u++) /* the same units from the same table (inits do not travel) */
        cr_expect(back.t[u].offset == l.t[u].offset && back.t[u].numel == l.t[u].numel &&
                      back.t[u].first == l.t[u].first && back.t[u].count == l.t[u].count && back.t[u].kind == l.t[u].kind,
                  "unit %d", u);
    free(tb);
    ps_layout_free(&back);
    for (int st = 0; st < 2; st++) {
        char path[128];
        ps_layout_t l2;
        float *q = NULL;
        ps_weights_meta_t meta = {.step = 5}, m2;
        snprintf(path, sizeof path, "/tmp/psd-tk-%d.%s", (int)getpid(), st ? "safetensors" : "bin");
        cr_assert_eq(ps_weights_save(path, &l, a, &meta, err, sizeof err), 0, "%s", err);
        cr_assert_eq(ps_weights_load_any(path, &l2, &q, &m2, err, sizeof err), 0, "%s", err);
        if (st) ((ps_tensor_info_t *)ps_layout_tensor(&l2, 7))->kind = PS_TENSOR_ROWS; /* not in safetensors */
        cr_expect(ps_layout_same_table(&l, &l2, err, sizeof err), "%s", err);
        for (int k = 0; k < n; k += 97) {
            const ps_tensor_info_t *x = ps_layout_tensor(&l, k), *y = ps_layout_tensor(&l2, k);
            cr_expect_eq(memcmp(a + x->offset, q + y->offset, x->numel * sizeof *a), 0, "tensor %d read back", k);
        }
        free(q);
        ps_layout_free(&l2);
        unlink(path);
    }
    /* a name given twice among thousands, named; more than PS_MAX_TABLE refused */
    snprintf(sp[4000].name, sizeof sp[4000].name, "%s", sp[12].name);
    cr_expect_eq(ps_tensors_check(sp, n, err, sizeof err), -1);
    cr_expect(strstr(err, "tensor 4000: the name layers.3.weight is also tensor 12's"), "%s", err);
    cr_expect_eq(ps_layout_init_specs(&back, sp, PS_MAX_TABLE + 1, err, sizeof err), -1);
    free(a);
    free(b);
    free(sp);
    ps_layout_free(&l);
}

Test(tensors, a_table_of_more_large_tensors_than_units_packs_them_too)
{
    ps_tensor_spec_t *sp = calloc(200, sizeof *sp);
    for (int k = 0; k < 200; k++) {
        snprintf(sp[k].name, sizeof sp[k].name, "big%d", k);
        sp[k].ndim = 1;
        sp[k].shape[0] = PS_PACK_SMALL + (uint64_t)k;
    }
    ps_layout_t l;
    char err[256];
    cr_assert_eq(ps_layout_init_specs(&l, sp, 200, err, sizeof err), 0, "%s", err);
    cr_expect(l.n_tensors <= PS_MAX_TENSORS, "%d units", l.n_tensors);
    cr_expect_eq(ps_layout_ntab(&l), 200);
    ps_layout_t c;
    cr_assert_eq(ps_layout_copy(&c, &l), 0);
    ps_layout_free(&l);
    cr_assert(c.tab && c.n_tab == 200);
    cr_expect_str_eq(c.tab[199].name, "big199", "a copy owns its own table");
    ps_layout_free(&c);
    free(sp);
}
