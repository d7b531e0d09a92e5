/* test_safetensors.c - common/ps_safetensors.c: files written and read back
 * bit-exact, F16 and BF16 read into f32 exactly, and hostile headers
 * refused with a message; common/ps_weights_st.c: a built-in model's
 * weights through safetensors and back (no process: the format alone). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_safetensors.h"
#include "ps_weights_st.h"

static char path[256];

static void setup(void)
{
    snprintf(path, sizeof path, "/tmp/psd-st-%d.safetensors", (int)getpid());
}

static void teardown(void) { unlink(path); }

/* A file of header text hdr (its length as N) and data bytes. */
static void write_raw(const char *hdr, const void *data, size_t dlen)
{
    FILE *f = fopen(path, "wb");
    cr_assert(f);
    uint64_t n = strlen(hdr);
    fwrite(&n, 8, 1, f);
    fwrite(hdr, 1, strlen(hdr), f);
    if (dlen) fwrite(data, 1, dlen, f);
    cr_assert_eq(fclose(f), 0);
}

/* Load path; expect failure with `want` in the message. */
static void refused(const char *want)
{
    ps_st_file_t f;
    float *v = (float *)1;
    char err[512] = "";
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), -1, "loaded, expected: %s", want);
    cr_assert_null(v);
    cr_assert_eq(f.n, 0);
    cr_assert(strstr(err, want), "message \"%s\" does not say \"%s\"", err, want);
}

TestSuite(safetensors, .init = setup, .fini = teardown);

Test(safetensors, a_written_file_reads_back_bit_exact_with_its_metadata)
{
    float a[6] = {1.0f, -2.5f, 3e-39f /* subnormal */, INFINITY, -0.0f, 1e30f}, b[1] = {42.0f};
    float c[0 + 1] = {7};
    uint64_t sa[2] = {2, 3}, sb[0 + 1] = {1}, sc[1] = {0};
    ps_st_out_t t[3] = {{"layer.0.weight", 2, sa, a}, {"a \"quoted\\\" name\n", 1, sb, b}, {"empty", 1, sc, c}};
    const char *mk[2] = {"run_id", "step"}, *mv[2] = {"00ab", "12"};
    char err[512];
    cr_assert_eq(ps_st_save(path, t, 3, mk, mv, 2, err, sizeof err), 0, "%s", err);
    ps_st_file_t f;
    float *v;
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), 0, "%s", err);
    cr_assert_eq(f.n, 3);
    cr_assert_eq(f.data_off % 8, 0, "the data starts 8-byte aligned");
    const ps_st_tensor_t *w = ps_st_find(&f, "layer.0.weight");
    cr_assert(w && w->dtype == PS_ST_F32 && w->ndim == 2 && w->shape[0] == 2 && w->shape[1] == 3 && w->numel == 6);
    const ps_st_tensor_t *q = ps_st_find(&f, "a \"quoted\\\" name\n");
    cr_assert(q && q->numel == 1, "a name with quotes, a backslash and a newline comes back whole");
    cr_assert(ps_st_find(&f, "empty") && ps_st_find(&f, "empty")->numel == 0);
    /* values in data order: the file's order is the order written */
    cr_assert_eq(memcmp(v, a, sizeof a), 0, "every bit of every float");
    cr_assert_eq(memcmp(v + 6, b, sizeof b), 0);
    cr_assert_eq(f.n_meta, 2);
    cr_assert_str_eq(f.meta_key[0], "run_id");
    cr_assert_str_eq(f.meta_val[1], "12");
    free(v);
    ps_st_free(&f);
}

Test(safetensors, f16_and_bf16_become_the_floats_they_stand_for)
{
    /* F16: 1, -2, 65504 (max), 2^-24 (smallest subnormal), 2^-14 (smallest normal), inf, 0x7e00 NaN, -0 */
    const uint16_t h[8] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x0400, 0x7C00, 0x7E00, 0x8000};
    /* BF16: 1, -2, 3.140625, inf */
    const uint16_t bf[4] = {0x3F80, 0xC000, 0x4049, 0x7F80};
    uint8_t data[24];
    memcpy(data, h, 16);
    memcpy(data + 16, bf, 8);
    const char *hdr = "{\"h\":{\"dtype\":\"F16\",\"shape\":[8],\"data_offsets\":[0,16]},"
                      "\"b\":{\"dtype\":\"BF16\",\"shape\":[2,2],\"data_offsets\":[16,24]}}";
    write_raw(hdr, data, sizeof data);
    ps_st_file_t f;
    float *v;
    char err[512];
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), 0, "%s", err);
    const float want[7] = {1.0f, -2.0f, 65504.0f, 5.9604644775390625e-08f, 6.103515625e-05f, INFINITY};
    for (int i = 0; i < 6; i++) cr_assert_eq(v[i], want[i], "F16 %04x: %g, want %g", h[i], v[i], want[i]);
    cr_assert(isnan(v[6]));
    cr_assert(v[7] == 0 && signbit(v[7]), "-0 stays -0");
    cr_assert_eq(v[8], 1.0f);
    cr_assert_eq(v[9], -2.0f);
    cr_assert_eq(v[10], 3.140625f);
    cr_assert_eq(v[11], INFINITY);
    free(v);
    ps_st_free(&f);
}

Test(safetensors, every_f16_value_converts_exactly)
{
    /* against the compiler's own half type where it has one; else against the formula */
    for (uint32_t x = 0; x < 65536; x++) {
        uint16_t h = (uint16_t)x;
        ps_st_tensor_t t = {.dtype = PS_ST_F16, .numel = 1};
        float got;
        ps_st_to_f32(&t, (const uint8_t *)&h, &got);
        int e = (h >> 10) & 31, m = h & 1023;
        double want = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexp(m, -24) : ldexp(1024 + m, e - 25);
        if (h & 0x8000) want = -want;
        if (isnan(want)) cr_assert(isnan(got), "%04x", h);
        else cr_assert_eq(got, (float)want, "%04x: %.9g, want %.9g", h, got, want);
    }
}

Test(safetensors, hostile_headers_are_refused_with_a_reason)
{
    const uint8_t four[4] = {0};
    write_raw("", NULL, 0);
    refused("header length 0");
    /* a length beyond the file */
    FILE *fp = fopen(path, "wb");
    uint64_t big = 1000;
    fwrite(&big, 8, 1, fp);
    fputs("{}", fp);
    fclose(fp);
    refused("runs past the end of the file");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}", four, 4);
    refused("'}' expected");
    write_raw("{\"x\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", four, 4);
    refused("tensor x is F64");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", four, 4);
    refused("2 elements of 4 bytes, but data_offsets span 4 bytes");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", four, 4);
    refused("a hole or an overlap");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", four, 4);
    refused("a hole or an overlap");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", four, 4);
    fp = fopen(path, "ab");
    fputc(0, fp); /* a byte no tensor covers */
    fclose(fp);
    refused("the tensors hold 4 bytes of data, the file has 5");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", four, 4);
    refused("more than 2^61 elements");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}", four, 4);
    refused("tensor x comes twice");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", four, 4);
    refused("non-negative integer");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}", four, 4);
    refused("field \"extra\"");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}junk", four, 4);
    refused("bytes after the header's JSON object");
    write_raw("{\"x\\ud800\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", four, 4);
    refused("lone surrogate");
    write_raw("{\"__metadata__\":{\"k\":1},\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", four, 4);
    refused("'\"' expected");
    char name[400];
    memset(name, 'n', sizeof name);
    name[sizeof name - 1] = '\0';
    char hdr[600];
    snprintf(hdr, sizeof hdr, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", name);
    write_raw(hdr, four, 4);
    refused("longer than");
    refused("a tensor's name");
    write_raw("{\"x\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", four, 4);
    refused("more than 8 numbers");
    /* an empty model is a file, not an error */
    write_raw("{}", NULL, 0);
    ps_st_file_t f;
    float *v;
    char err[512];
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), 0, "%s", err);
    cr_assert_eq(f.n, 0);
    free(v);
    ps_st_free(&f);
    unlink(path);
    refused("cannot open");
}

Test(safetensors, names_of_255_bytes_are_whole_and_longer_ones_refused)
{
    char name[257];
    memset(name, 'n', 255);
    strcpy(name + 252, "\xc3\xa9x"); /* ends in a two-byte character: 255 bytes */
    float one = 1;
    uint64_t shape[1] = {1};
    ps_st_out_t t = {name, 1, shape, &one};
    char err[512];
    cr_assert_eq(ps_st_save(path, &t, 1, NULL, NULL, 0, err, sizeof err), 0, "%s", err);
    ps_st_file_t f;
    float *v;
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), 0, "%s", err);
    cr_assert_eq(strlen(f.t[0].name), 255);
    cr_assert_str_eq(f.t[0].name, name);
    free(v);
    ps_st_free(&f);
    /* the same name with its last character escaped (\u00e9 is 2 bytes) and one byte more */
    char hdr[700];
    memset(name, 'n', 254);
    name[254] = '\0';
    snprintf(hdr, sizeof hdr, "{\"%s\\u00e9\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", name);
    write_raw(hdr, &one, 4);
    refused("longer than 255 bytes");
    name[253] = '\0';
    snprintf(hdr, sizeof hdr, "{\"%s\\u00e9\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", name);
    write_raw(hdr, &one, 4);
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), 0, "253 bytes and a 2-byte character: %s", err);
    free(v);
    ps_st_free(&f);
}

/* The built-in models' weights as safetensors (common/ps_weights_st.c). */

Test(safetensors, a_built_in_models_weights_round_trip_through_safetensors)
{
    ps_layout_t l, l2;
    cr_assert_eq(ps_layout_init_table(&l, (const int[]){16, 8, 2}, 3, 50, 4), 0);
    float *p = malloc(l.n_params * sizeof *p), *q = NULL;
    cr_assert(p);
    ps_model_init_params(&l, p, 7);
    ps_weights_meta_t m = {.run_id = 0xabcdef0123456789ull, .step = 321, .epoch = 4}, m2;
    char err[512];
    cr_assert_eq(ps_weights_save_st(path, &l, p, &m, err, sizeof err), 0, "%s", err);
    /* what PyTorch sees: torch.nn's names and shapes */
    ps_st_file_t f;
    float *v;
    cr_assert_eq(ps_st_load(path, &f, &v, err, sizeof err), 0, "%s", err);
    const ps_st_tensor_t *w1 = ps_st_find(&f, "fc1.weight"), *b2 = ps_st_find(&f, "fc2.bias"),
                         *e = ps_st_find(&f, "embedding.weight");
    cr_assert(w1 && w1->ndim == 2 && w1->shape[0] == 8 && w1->shape[1] == 16, "fc1.weight is (out, in)");
    cr_assert(b2 && b2->ndim == 1 && b2->shape[0] == 2);
    cr_assert(e && e->shape[0] == 50 && e->shape[1] == 4);
    free(v);
    ps_st_free(&f);
    cr_assert_eq(ps_weights_load_any(path, &l2, &q, &m2, err, sizeof err), 0, "%s", err);
    cr_assert_eq(l2.n_params, l.n_params);
    cr_assert_eq(l2.table, l.table);
    for (int t = 0; t < l.n_tensors; t++) /* (the arena's alignment gaps are no parameters) */
        cr_assert_eq(memcmp(q + l.t[t].offset, p + l.t[t].offset, l.t[t].numel * sizeof *p), 0,
                     "every bit of tensor %d", t);
    cr_assert(m2.run_id == m.run_id && m2.step == m.step && m2.epoch == m.epoch);
    free(q);
    /* a model that is not a built-in one is refused, naming what does not fit */
    float one = 1;
    uint64_t s1[2] = {3, 5}, s2[2] = {4, 4}, s3[1] = {3};
    ps_st_out_t bad[3] = {{"fc1.weight", 2, s1, p}, {"fc1.bias", 1, s3, p}, {"fc2.weight", 2, s2, p}};
    cr_assert_eq(ps_st_save(path, bad, 3, NULL, NULL, 0, err, sizeof err), 0, "%s", err);
    cr_assert_eq(ps_weights_load_any(path, &l2, &q, &m2, err, sizeof err), -1);
    cr_assert(strstr(err, "fc2.weight is not (out, in)"), "%s", err);
    cr_assert_null(q);
    uint64_t s4[1] = {1};
    ps_st_out_t other[1] = {{"conv1.weight", 1, s4, &one}};
    cr_assert_eq(ps_st_save(path, other, 1, NULL, NULL, 0, err, sizeof err), 0, "%s", err);
    /* another model's tensors: a table of its own, in the file's order */
    cr_assert_eq(ps_weights_load_any(path, &l2, &q, &m2, err, sizeof err), 0, "%s", err);
    cr_expect_eq(l2.n_tensors, 1);
    cr_expect_eq(l2.n_sizes, 0);
    cr_expect_str_eq(l2.t[0].name, "conv1.weight");
    cr_expect(q[0] == one);
    free(q);
    free(p);
}
