/* The weights file: save/load round trip and rejection of damaged files. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_model.h"
#include "ps_weights.h"

static char dir[64], path[128];

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/psd-weights-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/w.bin", dir);
}

static void teardown(void)
{
    unlink(path);
    rmdir(dir);
}

TestSuite(weights, .init = setup, .fini = teardown);

static int with_table; /* the tests run again on a model with an embedding table (format 2) */

static float *make(ps_layout_t *l)
{
    int sizes[] = {6, 4, 3};
    cr_assert_eq(ps_layout_init_table(l, sizes, 3, with_table ? 9 : 0, 3), 0);
    float *p = calloc(l->n_params, sizeof *p);
    ps_model_init_params(l, p, 99);
    for (int t = 1; t < l->n_tensors; t += 2)
        for (size_t i = 0; i < l->t[t].numel; i++) p[l->t[t].offset + i] = 0.25f * (float)i;
    return p;
}

static void save(const ps_layout_t *l, const float *p)
{
    char err[256];
    ps_weights_meta_t meta = {.run_id = 0xabcdef, .step = 1234, .epoch = 7};
    cr_assert_eq(ps_weights_save(path, l, p, &meta, err, sizeof err), 0, "%s", err);
}

static void round_trip(void)
{
    ps_layout_t l, l2;
    float *p = make(&l), *q = NULL;
    save(&l, p);
    ps_weights_meta_t meta;
    char err[256];
    cr_assert_eq(ps_weights_load(path, &l2, &q, &meta, err, sizeof err), 0, "%s", err);
    cr_assert_eq(l2.n_params, l.n_params);
    cr_assert_eq(l2.n_sizes, 3);
    cr_assert_eq(l2.n_tensors, l.n_tensors);
    cr_assert_eq(l2.table, l.table);
    cr_assert_eq(meta.run_id, 0xabcdef);
    cr_assert_eq(meta.step, 1234);
    cr_assert_eq(meta.epoch, 7);
    for (int t = 0; t < l.n_tensors; t++)
        cr_assert_arr_eq(q + l.t[t].offset, p + l.t[t].offset, 4 * l.t[t].numel);
    free(p);
    free(q);
}

static void expect_load_fails(const char *what)
{
    ps_layout_t l;
    float *q = (float *)1;
    ps_weights_meta_t meta;
    char err[256] = "";
    cr_assert_eq(ps_weights_load(path, &l, &q, &meta, err, sizeof err), -1, "%s accepted", what);
    cr_assert_null(q);
    cr_assert(strstr(err, path) != NULL, "%s: message names the file: %s", what, err);
}

static long file_size(void)
{
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n;
}

Test(weights, round_trip) { round_trip(); }

Test(weights, round_trip_with_a_table)
{
    with_table = 1;
    round_trip();
    FILE *f = fopen(path, "rb");
    unsigned char h[8];
    cr_assert_eq(fread(h, 1, 8, f), 8);
    fclose(f);
    cr_expect_eq(h[4], PS_WEIGHTS_FORMAT_TABLE, "a model with a table is format 2");
}

static void damaged(void)
{
    ps_layout_t l;
    float *p = make(&l);
    save(&l, p);
    long n = file_size();
    /* every truncation */
    for (long cut = 0; cut < n; cut += (cut < 64 ? 1 : 37)) {
        cr_assert_eq(truncate(path, cut), 0);
        expect_load_fails("truncated");
        save(&l, p);
    }
    /* one flipped bit anywhere */
    for (long at = 0; at < n; at += 7) {
        FILE *f = fopen(path, "r+b");
        fseek(f, at, SEEK_SET);
        int c = fgetc(f);
        fseek(f, at, SEEK_SET);
        fputc(c ^ 0x10, f);
        fclose(f);
        expect_load_fails("bit flip");
        save(&l, p);
    }
    /* trailing garbage */
    FILE *f = fopen(path, "ab");
    fputs("xx", f);
    fclose(f);
    expect_load_fails("trailing bytes");
    unlink(path);
    expect_load_fails("missing");
    free(p);
}

Test(weights, damaged_files_are_rejected) { damaged(); }

Test(weights, damaged_files_with_a_table_are_rejected)
{
    with_table = 1;
    damaged();
}
