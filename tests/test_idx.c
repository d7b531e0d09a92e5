/* test_idx.c - ps_idx_load on the real Fashion-MNIST files and on crafted
 * good and bad files (raw and gzipped) in a per-test mkdtemp directory. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "ps_idx.h"

#define FMNIST_DIR "/usr/share/datasets/fashion-mnist"

static char tmpdir[64];

static void setup(void)
{
    strcpy(tmpdir, "/tmp/test_idx.XXXXXX");
    cr_assert_not_null(mkdtemp(tmpdir), "mkdtemp failed");
}

static void teardown(void)
{
    DIR *d = opendir(tmpdir);
    if (!d) return;
    struct dirent *e;
    char p[PATH_MAX];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", tmpdir, e->d_name);
        if (unlink(p) != 0) rmdir(p);
    }
    closedir(d);
    rmdir(tmpdir);
}

TestSuite(idx, .init = setup, .fini = teardown);

/* ---- helpers -------------------------------------------------------------- */

/* Path of name inside tmpdir; a few rotating buffers. */
static const char *tpath(const char *name)
{
    static char bufs[4][PATH_MAX];
    static int k;
    char *b = bufs[k++ & 3];
    snprintf(b, PATH_MAX, "%s/%s", tmpdir, name);
    return b;
}

static const char *write_raw(const char *name, const void *bytes, size_t len)
{
    const char *p = tpath(name);
    FILE *f = fopen(p, "wb");
    cr_assert_not_null(f, "fopen %s", p);
    cr_assert_eq(fwrite(bytes, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
    return p;
}

static const char *write_gz(const char *name, const void *bytes, size_t len)
{
    const char *p = tpath(name);
    gzFile gz = gzopen(p, "wb");
    cr_assert_not_null(gz, "gzopen %s", p);
    if (len) cr_assert_eq(gzwrite(gz, bytes, (unsigned)len), (int)len);
    cr_assert_eq(gzclose(gz), Z_OK);
    return p;
}

static void *read_all(const char *p, size_t *len)
{
    FILE *f = fopen(p, "rb");
    cr_assert_not_null(f);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert_geq(n, 0);
    rewind(f);
    unsigned char *b = malloc((size_t)n + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* An IDX image: header (magic 00 00 type ndim, big-endian dims) + data.
 * Returns its length in buf (caller's, large enough). */
static size_t make_idx(unsigned char *buf, int type, int ndim, const uint32_t *dims,
                       const unsigned char *data, size_t data_len)
{
    size_t n = 0;
    buf[n++] = 0;
    buf[n++] = 0;
    buf[n++] = (unsigned char)type;
    buf[n++] = (unsigned char)ndim;
    for (int i = 0; i < ndim; i++) {
        buf[n++] = (unsigned char)(dims[i] >> 24);
        buf[n++] = (unsigned char)(dims[i] >> 16);
        buf[n++] = (unsigned char)(dims[i] >> 8);
        buf[n++] = (unsigned char)dims[i];
    }
    if (data_len) memcpy(buf + n, data, data_len);
    return n + data_len;
}

/* Load must fail: -1, data NULL, message naming the path and containing
 * what (case-sensitive substring). out starts as garbage on purpose. */
static void expect_fail(const char *path, int expect_ndim, const char *what)
{
    ps_idx_t out;
    memset(&out, 0xA5, sizeof out);
    char err[512];
    strcpy(err, "unset");
    int rc = ps_idx_load(&out, path, expect_ndim, err, sizeof err);
    cr_expect_eq(rc, -1, "%s: expected failure, got %d", path, rc);
    cr_expect_null(out.data, "%s: data not NULL on failure", path);
    cr_expect_eq(out.ndim, 0);
    cr_expect_eq(out.count, 0);
    cr_expect(strstr(err, path) != NULL, "message lacks path: '%s'", err);
    cr_expect(strstr(err, what) != NULL, "message lacks '%s': '%s'", what, err);
    ps_idx_deinit(&out);
}

static unsigned char seq[64];

static void fill_seq(void)
{
    for (size_t i = 0; i < sizeof seq; i++) seq[i] = (unsigned char)(i * 7 + 3);
}

/* ---- good files ----------------------------------------------------------- */

static void check_good(const char *path)
{
    ps_idx_t m;
    char err[512] = "";
    int rc = ps_idx_load(&m, path, 3, err, sizeof err);
    cr_assert_eq(rc, 0, "load %s: %s", path, err);
    cr_expect_eq(m.ndim, 3);
    cr_expect_eq(m.dims[0], 3u);
    cr_expect_eq(m.dims[1], 2u);
    cr_expect_eq(m.dims[2], 4u);
    cr_expect_eq(m.dims[3], 0u);
    cr_expect_eq(m.count, 3u);
    cr_expect_eq(m.item, 8u);
    cr_assert_not_null(m.data);
    cr_expect_arr_eq(m.data, seq, 24);
    ps_idx_deinit(&m);
    cr_expect_null(m.data);
    ps_idx_deinit(&m); /* twice is safe */
}

Test(idx, good_raw)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){3, 2, 4}, seq, 24);
    check_good(write_raw("good.idx", buf, n));
}

Test(idx, good_gzip)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){3, 2, 4}, seq, 24);
    check_good(write_gz("good.idx.gz", buf, n));
}

Test(idx, good_any_ndim)
{
    fill_seq();
    unsigned char buf[256];
    /* labels: ndim 1, item 1; expect_ndim 0 accepts any 1..4 */
    size_t n = make_idx(buf, 0x08, 1, (const uint32_t[]){5}, seq, 5);
    const char *p = write_gz("labels.gz", buf, n);
    ps_idx_t m;
    char err[256] = "";
    cr_assert_eq(ps_idx_load(&m, p, 0, err, sizeof err), 0, "%s", err);
    cr_expect_eq(m.ndim, 1);
    cr_expect_eq(m.count, 5u);
    cr_expect_eq(m.item, 1u);
    cr_expect_arr_eq(m.data, seq, 5);
    ps_idx_deinit(&m);
    cr_assert_eq(ps_idx_load(&m, p, 1, err, sizeof err), 0, "%s", err);
    ps_idx_deinit(&m);

    /* 4 dimensions: 2x1x3x2 */
    n = make_idx(buf, 0x08, 4, (const uint32_t[]){2, 1, 3, 2}, seq, 12);
    p = write_raw("four.idx", buf, n);
    cr_assert_eq(ps_idx_load(&m, p, 0, err, sizeof err), 0, "%s", err);
    cr_expect_eq(m.ndim, 4);
    cr_expect_eq(m.count, 2u);
    cr_expect_eq(m.item, 6u);
    cr_expect_eq(m.dims[3], 2u);
    cr_expect_arr_eq(m.data, seq, 12);
    ps_idx_deinit(&m);
}

Test(idx, deinit_zeroed_and_null)
{
    ps_idx_t m;
    memset(&m, 0, sizeof m);
    ps_idx_deinit(&m);
    ps_idx_deinit(&m);
    ps_idx_deinit(NULL);
}

/* ---- the real data --------------------------------------------------------- */

static void load_real(const char *name, int ndim, size_t count, size_t item)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", FMNIST_DIR, name);
    if (access(path, R_OK) != 0) cr_skip_test("%s not present", path);
    ps_idx_t m;
    char err[512] = "";
    cr_assert_eq(ps_idx_load(&m, path, ndim, err, sizeof err), 0, "%s", err);
    cr_expect_eq(m.ndim, ndim);
    cr_expect_eq(m.count, count);
    cr_expect_eq(m.item, item);
    cr_expect_eq(m.dims[0], (uint32_t)count);
    if (ndim == 3) {
        cr_expect_eq(m.dims[1], 28u);
        cr_expect_eq(m.dims[2], 28u);
        /* not all zero: some pixel is lit */
        size_t lit = 0;
        for (size_t i = 0; i < count * item; i++) lit += m.data[i] != 0;
        cr_expect_gt(lit, count);
    } else {
        size_t bad = 0, per_class[10] = {0};
        for (size_t i = 0; i < count; i++) {
            if (m.data[i] >= 10) bad++;
            else per_class[m.data[i]]++;
        }
        cr_expect_eq(bad, 0u, "%zu labels >= 10", bad);
        /* Fashion-MNIST is balanced: count/10 of each class */
        for (int k = 0; k < 10; k++) cr_expect_eq(per_class[k], count / 10, "class %d", k);
    }
    ps_idx_deinit(&m);
}

Test(idx, fmnist_train_images) { load_real("train-images-idx3-ubyte.gz", 3, 60000, 784); }
Test(idx, fmnist_train_labels) { load_real("train-labels-idx1-ubyte.gz", 1, 60000, 1); }
Test(idx, fmnist_test_images) { load_real("t10k-images-idx3-ubyte.gz", 3, 10000, 784); }
Test(idx, fmnist_test_labels) { load_real("t10k-labels-idx1-ubyte.gz", 1, 10000, 1); }

Test(idx, fmnist_wrong_ndim)
{
    const char *p = FMNIST_DIR "/t10k-labels-idx1-ubyte.gz";
    if (access(p, R_OK) != 0) cr_skip_test("%s not present", p);
    expect_fail(p, 3, "1 dimension, expected 3");
}

/* ---- bad files ------------------------------------------------------------ */

Test(idx, missing_file)
{
    expect_fail(tpath("does-not-exist.gz"), 0, "No such file");
}

Test(idx, directory)
{
    const char *p = tpath("adir");
    cr_assert_eq(mkdir(p, 0700), 0);
    expect_fail(p, 0, "read error");
}

Test(idx, empty_file)
{
    expect_fail(write_raw("empty", "", 0), 0, "truncated header");
    expect_fail(write_gz("empty.gz", "", 0), 0, "truncated header");
}

Test(idx, truncated_header)
{
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){3, 2, 4}, NULL, 0);
    /* magic cut short */
    expect_fail(write_raw("h3", buf, 3), 0, "truncated header");
    /* magic whole, dimensions cut short (2 of 3 dims and a byte) */
    expect_fail(write_raw("h13", buf, 13), 0, "truncated header");
    expect_fail(write_gz("h13.gz", buf, 13), 0, "truncated header");
    /* header complete, no data at all */
    expect_fail(write_raw("h16", buf, n), 0, "truncated data (0 of 24");
}

Test(idx, truncated_data)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){3, 2, 4}, seq, 24);
    expect_fail(write_raw("d.idx", buf, n - 1), 3, "truncated data (23 of 24");
    expect_fail(write_gz("d.idx.gz", buf, n - 5), 3, "truncated data (19 of 24");
}

Test(idx, trailing_bytes)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){3, 2, 4}, seq, 25);
    expect_fail(write_raw("t.idx", buf, n), 3, "trailing bytes");
    expect_fail(write_gz("t.idx.gz", buf, n), 3, "trailing bytes");
}

Test(idx, wrong_magic)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 1, (const uint32_t[]){4}, seq, 4);
    buf[0] = 0x01;
    expect_fail(write_raw("m0", buf, n), 0, "bad magic");
    buf[0] = 0x00;
    buf[1] = 0x08;
    expect_fail(write_gz("m1.gz", buf, n), 0, "bad magic");
}

Test(idx, wrong_type)
{
    fill_seq();
    unsigned char buf[256];
    /* 0x0D is float in IDX; 0x09 signed byte */
    size_t n = make_idx(buf, 0x0D, 1, (const uint32_t[]){4}, seq, 16);
    expect_fail(write_raw("f32", buf, n), 0, "unsupported data type 0x0d");
    n = make_idx(buf, 0x09, 1, (const uint32_t[]){4}, seq, 4);
    expect_fail(write_gz("s8.gz", buf, n), 0, "unsupported data type 0x09");
}

Test(idx, zero_dimension)
{
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){2, 0, 2}, NULL, 0);
    expect_fail(write_raw("z1", buf, n), 0, "dimension 1 is zero");
    n = make_idx(buf, 0x08, 1, (const uint32_t[]){0}, NULL, 0);
    expect_fail(write_gz("z0.gz", buf, n), 1, "dimension 0 is zero");
}

Test(idx, bad_ndim)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 0, NULL, NULL, 0);
    expect_fail(write_raw("n0", buf, n), 0, "0 dimensions, supported 1..4");
    n = make_idx(buf, 0x08, 5, (const uint32_t[]){1, 1, 1, 1, 1}, seq, 1);
    expect_fail(write_raw("n5", buf, n), 0, "5 dimensions, supported 1..4");
}

Test(idx, ndim_mismatch)
{
    fill_seq();
    unsigned char buf[256];
    size_t n = make_idx(buf, 0x08, 3, (const uint32_t[]){3, 2, 4}, seq, 24);
    const char *p = write_gz("images.gz", buf, n);
    expect_fail(p, 1, "3 dimensions, expected 1");
    expect_fail(p, 2, "3 dimensions, expected 2");
    n = make_idx(buf, 0x08, 1, (const uint32_t[]){5}, seq, 5);
    expect_fail(write_raw("labels", buf, n), 3, "1 dimension, expected 3");
}

Test(idx, huge_dims_rejected_before_allocation)
{
    /* None of these files has any data: a loader that allocated first would
     * fail with "truncated data" (or run out of memory), not the size error. */
    unsigned char buf[256];
    const char *what = "too large";
    size_t n;
    /* 4 x 0xffffffff: the product overflows 64 bits */
    n = make_idx(buf, 0x08, 4,
                 (const uint32_t[]){0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, NULL,
                 0);
    expect_fail(write_raw("ovf4", buf, n), 0, what);
    /* 2^16 x 2^16 x 2^16 = 2^48 */
    n = make_idx(buf, 0x08, 3, (const uint32_t[]){65536, 65536, 65536}, NULL, 0);
    expect_fail(write_gz("big3.gz", buf, n), 3, what);
    /* 65536 x 65536 = 4 GiB */
    n = make_idx(buf, 0x08, 2, (const uint32_t[]){65536, 65536}, NULL, 0);
    expect_fail(write_raw("big2", buf, n), 0, what);
    /* 1 GiB + 1 bytes, one dimension */
    n = make_idx(buf, 0x08, 1, (const uint32_t[]){(1u << 30) + 1}, NULL, 0);
    expect_fail(write_raw("big1", buf, n), 1, what);
    /* 1369569 x 28 x 28 = 1 GiB + 272 bytes (1369568 x 784 is 512 below) */
    n = make_idx(buf, 0x08, 3, (const uint32_t[]){1369569, 28, 28}, NULL, 0);
    expect_fail(write_raw("big28", buf, n), 3, what);
    /* small first dimension, huge later ones */
    n = make_idx(buf, 0x08, 4, (const uint32_t[]){1, 1, 0xffffffffu, 2}, NULL, 0);
    expect_fail(write_raw("bigl", buf, n), 0, what);
}

Test(idx, corrupt_gzip_stream)
{
    /* 4000 bytes of varied data so the deflate stream has real content */
    static unsigned char data[4000], buf[4100];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (unsigned char)((i * i) ^ (i >> 3));
    size_t n = make_idx(buf, 0x08, 2, (const uint32_t[]){40, 100}, data, sizeof data);
    const char *good = write_gz("good.gz", buf, n);
    ps_idx_t m;
    char err[512] = "";
    cr_assert_eq(ps_idx_load(&m, good, 2, err, sizeof err), 0, "%s", err);
    ps_idx_deinit(&m);

    size_t len;
    unsigned char *gz = read_all(good, &len);
    cr_assert_gt(len, 40u);

    /* gzip stream cut in half: zlib reports "unexpected end of file" only
     * through gzerror, gzread returns the bytes it had */
    expect_fail(write_raw("half.gz", gz, len / 2), 2, "corrupt gzip stream");

    /* last 4 bytes (ISIZE) and CRC cut off */
    expect_fail(write_raw("notrailer.gz", gz, len - 8), 2, "corrupt gzip stream");

    /* CRC32 in the trailer flipped: data decodes, the check fails */
    unsigned char *c = malloc(len);
    cr_assert_not_null(c);
    memcpy(c, gz, len);
    c[len - 8] ^= 0xff;
    expect_fail(write_raw("badcrc.gz", c, len), 2, "corrupt gzip stream");

    /* garbage in the middle of the deflate data */
    memcpy(c, gz, len);
    for (size_t i = 20; i < 36; i++) c[i] ^= 0x5a;
    expect_fail(write_raw("garbage.gz", c, len), 2, "gzip stream");

    /* a gzip header followed by junk */
    static const unsigned char junk[] = {0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x00, 0x03,
                                         0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    expect_fail(write_raw("junk.gz", junk, sizeof junk), 0, "corrupt gzip stream");
    free(c);
    free(gz);
}

Test(idx, null_err_buffer)
{
    /* err may be NULL or zero length: no crash, still -1 */
    ps_idx_t m;
    cr_expect_eq(ps_idx_load(&m, tpath("nope"), 0, NULL, 0), -1);
    cr_expect_null(m.data);
    char err[4] = "xyz";
    cr_expect_eq(ps_idx_load(&m, tpath("nope"), 0, err, 0), -1);
    cr_expect_str_eq(err, "xyz");
    /* tiny buffer: truncated but terminated */
    cr_expect_eq(ps_idx_load(&m, tpath("nope"), 0, err, sizeof err), -1);
    cr_expect_eq(strlen(err), 3u);
    /* bad expect_ndim is a caller error, reported not crashed */
    char e2[256];
    cr_expect_eq(ps_idx_load(&m, tpath("nope"), 7, e2, sizeof e2), -1);
}
