/* test_ckpt.c - psd_ckpt: round trip, copy-on-write snapshot consistency,
 * pruning, corrupt/truncated/garbage files and SIGKILL at random moments.
 *
 * Each test works in its own mkdtemp directory under /tmp, removed at the
 * end. Values are compared bit for bit (the file stores the floats as is). */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "ps_table.h"
#include "psd_ckpt.h"
#include "psd_store.h"
#include "ps_wire.h"

#define CHUNK_BYTES ((uint64_t)1 << 20)
#define HDR_LEN 232
#define HDR_LEN_V1 216 /* format 1: no table shape */
/* header offsets (psd_ckpt.c meta_pack) */
#define OFF_TRAIN_COUNT 120
#define OFF_N_SIZES 128
#define OFF_SIZES 132
#define OFF_N_PARAMS 208
#define OFF_TABLE_ROWS 216
#define OFF_TABLE_DIM 224

/* ---- helpers ---------------------------------------------------------- */

static char g_dir[64];

static void dir_setup(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/psd_ckpt_test_XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir), "mkdtemp: %s", strerror(errno));
}

static void dir_teardown(void)
{
    DIR *d = opendir(g_dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (unlinkat(dirfd(d), e->d_name, 0) != 0) unlinkat(dirfd(d), e->d_name, AT_REMOVEDIR);
    }
    closedir(d);
    rmdir(g_dir);
}

/* Log lines from psd_ckpt_load_newest. */
static char g_log[32][PATH_MAX + 320];
static int g_nlog;

static void log_line(const char *line)
{
    if (g_nlog < 32) snprintf(g_log[g_nlog], sizeof g_log[0], "%s", line);
    g_nlog++;
}

static int log_mentions(const char *what)
{
    for (int i = 0; i < g_nlog && i < 32; i++)
        if (strstr(g_log[i], what)) return 1;
    return 0;
}

static void store_make(psd_store_t *s, const int *sizes, int n_sizes)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, sizes, n_sizes), 0);
    psd_optim_t o;
    memset(&o, 0, sizeof o);
    o.kind = PS_OPT_ADAM;
    o.beta1 = 0.9f;
    o.beta2 = 0.999f;
    o.eps = 1e-8f;
    cr_assert_eq(psd_store_init(s, &l, &o, 42), 0);
    cr_assert(s->s0 && s->s1);
}

/* Exact in float for the ranges used: (k % 4096) * 1024 + (i % 1021) < 2^23. */
static float pat(uint64_t k, size_t i, int which)
{
    float v = (float)(k % 4096) * 1024.0f + (float)(i % 1021);
    return which == 0 ? v : which == 1 ? v + 0.5f : -v;
}

static void fill(float *a, size_t n, uint64_t k, int which)
{
    for (size_t i = 0; i < n; i++) a[i] = pat(k, i, which);
}

/* First index where a differs from the pattern, or n. */
static size_t check_pat(const float *a, size_t n, uint64_t k, int which)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != pat(k, i, which)) return i;
    return n;
}

/* A store of sizes (3 layers) whose weights and slots hold pattern k */
static size_t store_filled(psd_store_t *s, const int *sizes, uint64_t k)
{
    store_make(s, sizes, 3);
    size_t n = s->layout.n_params;
    fill(s->cur->w, n, k, 0);
    fill(s->s0, n, k, 1);
    fill(s->s1, n, k, 2);
    return n;
}

/* psd shard k of n's part of an arena (ps_shard_pieces): the floats it owns */
static uint64_t part_floats(const psd_store_t *s, int k, int n, bool *mine)
{
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, k, n, p);
    memset(mine, 0, s->layout.n_params * sizeof *mine);
    uint64_t total = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) {
        for (size_t i = 0; i < p[t].n; i++) mine[s->layout.t[t].offset + p[t].off + i] = true;
        total += p[t].n;
    }
    return total;
}

/* First index where a loaded arena is not want inside the part (mine) or
 * not zero outside it, or n. */
static size_t check_part(const float *got, const float *want, const bool *mine, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (mine[i] ? memcmp(&got[i], &want[i], sizeof(float)) != 0 : got[i] != 0.0f) return i;
    return n;
}

/* Bytes of the run block (format 6) of a meta whose run part is zero:
 * sizes 24, data_id 4, two empty bests 2 x 36, best_version 8, the four
 * ending counts 32, the empty offered optimizer 4. */
#define RUN_LEN0 144

/* Bytes a file of format 6 holds between its header and the seen bitmap:
 * the tensor table's length field and the packed table of the store's
 * layout, then the run block's (zero run part: meta_make's). */
static size_t tbl_len(const psd_store_t *s)
{
    uint8_t *b;
    size_t n;
    cr_assert_eq(ps_table_pack(&s->layout, &b, &n), 0);
    free(b);
    return 4 + n + 4 + RUN_LEN0;
}

static void meta_make(psd_ckpt_meta_t *m, const psd_store_t *s, uint64_t step, uint64_t train_count)
{
    memset(m, 0, sizeof *m);
    m->table_crc = psd_ckpt_table_crc(&s->layout); /* what a read gives back */
    m->run_id = 0x1122334455667788ULL;
    m->config_hash = 0xdeadbeefcafef00dULL;
    m->seed = 1234567;
    m->step = step;
    m->version = step + 1000;
    m->epoch = 3;
    m->epoch_done = 1;
    m->epoch_step = 77;
    m->steps_per_epoch = 117.25;
    m->ep_loss = 0.123456789;
    m->ep_correct = 5000;
    m->ep_samples = 6000;
    m->train_s_total = 98.765;
    m->samples_total = 1ULL << 40;
    m->lr = 3e-4;
    m->train_count = train_count;
    m->n_sizes = s->layout.n_sizes;
    for (int i = 0; i < s->layout.n_sizes; i++) m->sizes[i] = s->layout.sizes[i];
    m->opt_kind = PS_OPT_ADAM;
    m->n_slots = 2;
    m->shard = 0; /* one psd: the whole arenas (roundtrip_every_field: a shard's part) */
    m->shards = 1;
    m->n_params = s->layout.n_params;
    for (int k = 0; k < 4; k++) m->run.ended[k] = (uint64_t)k + 1; /* the workers' endings so far */
}

static uint8_t *seen_make(uint64_t train_count, uint64_t k)
{
    size_t nb = (size_t)((train_count + 7) / 8);
    uint8_t *b = malloc(nb ? nb : 1);
    cr_assert_not_null(b);
    for (size_t j = 0; j < nb; j++) b[j] = (uint8_t)(k * 31 + j * 7);
    return b;
}

/* Write one checkpoint synchronously. Returns psd_ckpt_end's rc. */
static int ckpt_write(psd_store_t *s, const psd_ckpt_meta_t *m, const uint8_t *seen, int keep,
                      uint64_t *peak, uint64_t *bytes, char *path, size_t pathlen)
{
    psd_ckpt_writer_t *wr;
    int rc = psd_ckpt_begin(&wr, g_dir, keep, m, seen, s);
    if (rc != 0) return rc;
    while (!psd_ckpt_done(wr)) usleep(1000);
    double secs;
    uint64_t pk, by;
    rc = psd_ckpt_end(&wr, path, pathlen, &secs, bytes ? bytes : &by, peak ? peak : &pk);
    cr_assert_null(wr);
    cr_assert_geq(secs, 0.0);
    return rc;
}

typedef struct {
    psd_ckpt_meta_t meta;
    uint8_t *seen;
    float *w, *slots[2];
    char path[PATH_MAX];
    char err[512];
} loaded_t;

static int load(loaded_t *L)
{
    memset(L, 0, sizeof *L);
    g_nlog = 0;
    return psd_ckpt_load_newest(g_dir, 0, &L->meta, &L->seen, &L->w, L->slots, L->path, sizeof L->path,
                                log_line, L->err, sizeof L->err);
}

static void loaded_free(loaded_t *L)
{
    free(L->seen);
    free(L->w);
    free(L->slots[0]);
    free(L->slots[1]);
    memset(L, 0, sizeof *L);
}

static void ckpt_name(char *buf, size_t n, uint64_t step)
{
    snprintf(buf, n, "%s/ckpt-%012llu.psdc", g_dir, (unsigned long long)step);
}

static uint8_t *file_read(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(sz > 0 ? (size_t)sz : 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)sz, f), (size_t)sz);
    fclose(f);
    *len = (size_t)sz;
    return b;
}

static void file_write(const char *path, const void *b, size_t len)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "%s: %s", path, strerror(errno));
    cr_assert_eq(fwrite(b, 1, len, f), len);
    cr_assert_eq(fclose(f), 0);
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* A file image of format 6 as one of format 4: the table and the run block cut out. */
static void drop_table(uint8_t *img, size_t *len, size_t tbl)
{
    memmove(img + HDR_LEN, img + HDR_LEN + tbl, *len - HDR_LEN - tbl);
    *len -= tbl;
    put32(img + 4, 4);
}


static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Make the trailer of a file image consistent (length and CRC), so that only
 * the sanity checks can reject it. */
static void fix_trailer(uint8_t *b, size_t len)
{
    put64(b + len - 12, len - 12);
    put32(b + len - 4, (uint32_t)crc32(0, b, (uInt)(len - 4)));
}

static int count_files(const char *prefix, const char *suffix)
{
    DIR *d = opendir(g_dir);
    cr_assert_not_null(d);
    struct dirent *e;
    int n = 0;
    size_t lp = strlen(prefix), ls = strlen(suffix);
    while ((e = readdir(d)) != NULL) {
        size_t ln = strlen(e->d_name);
        if (ln >= lp + ls && !strncmp(e->d_name, prefix, lp) && !strcmp(e->d_name + ln - ls, suffix))
            n++;
    }
    closedir(d);
    return n;
}

static const int small_sizes[] = {300, 700, 10};   /* 217714 floats: one chunk */
static const int big_sizes[] = {2000, 2000, 10};   /* 4022010 floats: 16 chunks */

/* ---- round trip ------------------------------------------------------- */

Test(ckpt, roundtrip_every_field, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    store_make(&s, small_sizes, 3);
    size_t n = s.layout.n_params;
    fill(s.s0, n, 5, 1);
    fill(s.s1, n, 5, 2);
    psd_ckpt_meta_t m;
    meta_make(&m, &s, 5, 1003); /* not a multiple of 8 */
    uint8_t *seen = seen_make(1003, 5);
    char path[PATH_MAX], want[PATH_MAX];
    uint64_t peak, bytes;
    cr_assert_eq(ckpt_write(&s, &m, seen, 3, &peak, &bytes, path, sizeof path), 0);
    ckpt_name(want, sizeof want, 5);
    cr_expect_str_eq(path, want);
    struct stat st;
    cr_assert_eq(stat(want, &st), 0);
    cr_expect_eq((uint64_t)st.st_size, bytes);
    cr_expect_eq(bytes, HDR_LEN + tbl_len(&s) + 126 + 3 * n * 4 + 12);
    cr_expect_leq(peak, CHUNK_BYTES, "no modification: at most the bounce buffer, got %llu",
                  (unsigned long long)peak);
    cr_expect_eq(count_files(".ckpt-", ".tmp"), 0);
    cr_expect_eq(atomic_load(&s.cur->refs), 1, "arena reference released");

    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(g_nlog, 0);
    cr_expect_str_eq(L.path, want);
    cr_expect_eq(L.meta.run_id, m.run_id);
    cr_expect_eq(L.meta.config_hash, m.config_hash);
    cr_expect_eq(L.meta.seed, m.seed);
    cr_expect_eq(L.meta.step, m.step);
    cr_expect_eq(L.meta.version, m.version);
    cr_expect_eq(L.meta.epoch, m.epoch);
    cr_expect_eq(L.meta.epoch_done, m.epoch_done);
    cr_expect_eq(L.meta.epoch_step, m.epoch_step);
    cr_expect(L.meta.steps_per_epoch == m.steps_per_epoch);
    cr_expect(L.meta.ep_loss == m.ep_loss);
    cr_expect_eq(L.meta.ep_correct, m.ep_correct);
    cr_expect_eq(L.meta.ep_samples, m.ep_samples);
    cr_expect(L.meta.train_s_total == m.train_s_total);
    cr_expect_eq(L.meta.samples_total, m.samples_total);
    cr_expect(L.meta.lr == m.lr);
    cr_expect_eq(L.meta.train_count, m.train_count);
    cr_expect_eq(L.meta.n_sizes, m.n_sizes);
    cr_expect_arr_eq(L.meta.sizes, m.sizes, sizeof m.sizes);
    cr_expect_eq(L.meta.opt_kind, m.opt_kind);
    cr_expect_eq(L.meta.n_slots, m.n_slots);
    cr_expect_eq(L.meta.n_params, m.n_params);
    cr_expect_eq(L.meta.shard, 0);
    cr_expect_eq(L.meta.shards, 1);
    cr_expect_eq(memcmp(&L.meta, &m, sizeof m), 0, "whole struct");
    cr_expect_eq(memcmp(L.seen, seen, 126), 0, "seen bitmap");
    cr_expect_eq(memcmp(L.w, s.cur->w, n * 4), 0, "weights");
    cr_expect_eq(memcmp(L.slots[0], s.s0, n * 4), 0, "slot 0");
    cr_expect_eq(memcmp(L.slots[1], s.s1, n * 4), 0, "slot 1");
    loaded_free(&L);
    free(seen);
    psd_store_deinit(&s);
}

/* A psd shard's file holds its part only (format 4), pieces of several
 * tensors one after the other; it loads as whole arenas with the part in
 * place and zeros elsewhere. A format 3 file of a shard (whole arenas)
 * still loads. */
Test(ckpt, a_shard_file_holds_its_part_only, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    size_t n = store_filled(&s, small_sizes, 8);
    bool *mine = malloc(n * sizeof *mine);
    cr_assert_not_null(mine);
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s.layout, 2, 3, p);
    int spans = 0;
    for (int t = 0; t < s.layout.n_tensors; t++) spans += p[t].n > 0;
    cr_assert_eq(spans, 4, "shard 2 of 3 holds pieces of 4 tensors");
    const uint64_t part = part_floats(&s, 2, 3, mine);
    cr_assert(part > 0 && part < n / 2);
    psd_ckpt_meta_t m;
    meta_make(&m, &s, 8, 1003);
    m.shard = 2;
    m.shards = 3;
    uint8_t *seen = seen_make(1003, 8);
    char path[PATH_MAX];
    uint64_t bytes;
    cr_assert_eq(ckpt_write(&s, &m, seen, 3, NULL, &bytes, path, sizeof path), 0);
    cr_expect_eq(bytes, HDR_LEN + tbl_len(&s) + 126 + 3 * part * 4 + 12, "the part's floats only: %llu bytes",
                 (unsigned long long)bytes);
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(memcmp(&L.meta, &m, sizeof m), 0, "whole struct");
    cr_expect_eq(memcmp(L.seen, seen, 126), 0, "seen bitmap");
    size_t iw = check_part(L.w, s.cur->w, mine, n), i0 = check_part(L.slots[0], s.s0, mine, n),
           i1 = check_part(L.slots[1], s.s1, mine, n);
    cr_expect(iw == n && i0 == n && i1 == n, "the part in place, zeros elsewhere: first wrong float %zu %zu %zu", iw,
              i0, i1);
    loaded_free(&L);

    /* format 3: the same shard's file with whole arenas */
    m.shard = 0;
    m.shards = 1;
    cr_assert_eq(ckpt_write(&s, &m, seen, 3, NULL, NULL, path, sizeof path), 0);
    size_t len;
    uint8_t *img = file_read(path, &len);
    drop_table(img, &len, tbl_len(&s));
    put32(img + 4, 3);
    put32(img + HDR_LEN - 4, 3u << 16 | 2u);
    fix_trailer(img, len);
    file_write(path, img, len);
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(L.meta.shard, 2);
    cr_expect_eq(L.meta.shards, 3);
    cr_expect_eq(memcmp(L.w, s.cur->w, n * 4), 0, "format 3 weights, whole");
    cr_expect_eq(memcmp(L.slots[1], s.s1, n * 4), 0, "format 3 slot 1, whole");
    loaded_free(&L);
    /* the same bytes called format 4 are too long for shard 2's part */
    put32(img + 4, 4);
    fix_trailer(img, len);
    file_write(path, img, len);
    cr_assert_neq(load(&L), 0, "a whole-arena file taken as a shard's part");
    cr_expect(log_mentions("header says"), "%s", g_nlog ? g_log[0] : "");
    loaded_free(&L);
    free(img);
    free(seen);
    free(mine);
    psd_store_deinit(&s);
}

/* A shard that owns nothing of a tiny model (16 shards of 3-2: 8 floats, one
 * norm block, all shard 0's): its file is a header, seen bits and trailer;
 * its writer has nothing to save copy-on-write, and a step during the write
 * does not wait; it loads as zeros. */
Test(ckpt, a_shard_that_owns_nothing_writes_an_empty_part, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    store_make(&s, (const int[]){3, 2}, 2);
    size_t n = s.layout.n_params;
    fill(s.s0, n, 3, 1);
    fill(s.s1, n, 3, 2);
    bool *mine = malloc(n * sizeof *mine);
    cr_assert_not_null(mine);
    cr_assert_eq(part_floats(&s, 15, 16, mine), 0);
    psd_ckpt_meta_t m;
    meta_make(&m, &s, 3, 20);
    m.shard = 15;
    m.shards = 16;
    uint8_t *seen = seen_make(20, 3);
    psd_ckpt_writer_t *wr;
    cr_assert_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, seen, &s), 0);
    psd_ckpt_before_update(wr, 0, n); /* nothing of it is the file's: returns at once */
    uint64_t bytes, peak;
    char path[PATH_MAX];
    while (!psd_ckpt_done(wr)) usleep(1000);
    cr_assert_eq(psd_ckpt_end(&wr, path, sizeof path, NULL, &bytes, &peak), 0);
    cr_expect_eq(bytes, HDR_LEN + tbl_len(&s) + 3 + 12);
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(L.meta.shard, 15);
    for (size_t i = 0; i < n; i++)
        cr_assert(L.w[i] == 0.0f && L.slots[0][i] == 0.0f && L.slots[1][i] == 0.0f, "float %zu", i);
    loaded_free(&L);
    free(mine);
    free(seen);
    psd_store_deinit(&s);
}

/* A model with an embedding table (format 2 carries its shape), and a
 * format 1 file (no table) written by an older psd still loads. */
Test(ckpt, table_shape_and_format_1, .init = dir_setup, .fini = dir_teardown)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, (const int[]){32, 16, 2}, 3, 5000, 8), 0);
    psd_optim_t o;
    memset(&o, 0, sizeof o);
    o.kind = PS_OPT_ADAGRAD;
    o.eps = 1e-8f;
    psd_store_t s;
    cr_assert_eq(psd_store_init(&s, &l, &o, 42), 0);
    size_t n = l.n_params;
    fill(s.s0, n, 4, 1);
    psd_ckpt_meta_t m;
    meta_make(&m, &s, 4, 100);
    m.opt_kind = PS_OPT_ADAGRAD;
    m.n_slots = 1;
    m.table_rows = 5000;
    m.table_dim = 8;
    uint8_t *seen = seen_make(100, 4);
    char path[PATH_MAX];
    cr_assert_eq(ckpt_write(&s, &m, seen, 3, NULL, NULL, path, sizeof path), 0);
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(L.meta.table_rows, 5000);
    cr_expect_eq(L.meta.table_dim, 8);
    cr_expect_eq(memcmp(&L.meta, &m, sizeof m), 0, "whole struct");
    cr_expect_eq(memcmp(L.w, s.cur->w, n * 4), 0, "weights with the table");
    loaded_free(&L);
    /* without its table shape the parameter count does not add up */
    m.table_rows = 0;
    m.table_dim = 0;
    psd_ckpt_writer_t *wr;
    cr_expect_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, seen, &s), -EINVAL);
    free(seen);
    psd_store_deinit(&s);

    /* format 1: a format 2 file of an MLP, its table fields cut out */
    store_make(&s, small_sizes, 3);
    meta_make(&m, &s, 6, 1003);
    seen = seen_make(1003, 6);
    cr_assert_eq(ckpt_write(&s, &m, seen, 3, NULL, NULL, path, sizeof path), 0);
    size_t len;
    uint8_t *img = file_read(path, &len);
    drop_table(img, &len, tbl_len(&s));
    uint8_t *v1 = malloc(len - 16);
    cr_assert_not_null(v1);
    memcpy(v1, img, HDR_LEN_V1);
    memcpy(v1 + HDR_LEN_V1, img + HDR_LEN, len - HDR_LEN);
    put32(v1 + 4, 1);
    fix_trailer(v1, len - 16);
    unlink(path);
    char p7[PATH_MAX];
    ckpt_name(p7, sizeof p7, 7);
    file_write(p7, v1, len - 16);
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_str_eq(L.path, p7);
    m.shard = m.shards = 0; /* format 1 does not say */
    memset(m.run.ended, 0, sizeof m.run.ended); /* nor has it a run block */
    cr_expect_eq(memcmp(&L.meta, &m, sizeof m), 0, "format 1 header");
    cr_expect_eq(memcmp(L.w, s.cur->w, s.layout.n_params * 4), 0, "format 1 weights");
    cr_expect_eq(memcmp(L.slots[1], s.s1, s.layout.n_params * 4), 0, "format 1 slot 1");
    loaded_free(&L);
    free(img);
    free(v1);
    free(seen);
    psd_store_deinit(&s);
}

Test(ckpt, one_slot_and_no_slots, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    store_make(&s, small_sizes, 3);
    size_t n = s.layout.n_params;
    fill(s.s0, n, 9, 1);
    psd_ckpt_meta_t m;
    for (uint32_t slots = 0; slots <= 1; slots++) {
        meta_make(&m, &s, 10 + slots, 0); /* train_count 0: empty bitmap */
        m.n_slots = slots;
        uint64_t peak;
        cr_assert_eq(ckpt_write(&s, &m, NULL, 5, &peak, NULL, NULL, 0), 0);
        cr_expect_eq(peak, slots ? CHUNK_BYTES : 0);
        loaded_t L;
        cr_assert_eq(load(&L), 0, "%s", L.err);
        cr_expect_eq(L.meta.n_slots, slots);
        cr_expect_eq(L.meta.train_count, 0);
        cr_expect_eq(memcmp(L.w, s.cur->w, n * 4), 0);
        cr_expect_null(L.slots[1]);
        if (slots)
            cr_expect_eq(memcmp(L.slots[0], s.s0, n * 4), 0);
        else
            cr_expect_null(L.slots[0]);
        loaded_free(&L);
    }
    psd_store_deinit(&s);
}

Test(ckpt, begin_rejects_mismatched_meta, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    store_make(&s, small_sizes, 3);
    psd_ckpt_meta_t m;
    psd_ckpt_writer_t *wr = (psd_ckpt_writer_t *)&m;
    meta_make(&m, &s, 1, 8);
    m.n_params++;
    cr_expect_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, (const uint8_t *)"x", &s), -EINVAL);
    cr_expect_null(wr);
    meta_make(&m, &s, 1, 8);
    m.n_slots = 3;
    cr_expect_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, (const uint8_t *)"x", &s), -EINVAL);
    meta_make(&m, &s, 1, 8);
    cr_expect_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, NULL, &s), -EINVAL, "bitmap missing");
    const uint32_t shard_fields[][2] = {{3, 0}, {1, 1}, {3, 3}, {0, 17}};
    for (size_t k = 0; k < sizeof shard_fields / sizeof shard_fields[0]; k++) {
        meta_make(&m, &s, 1, 8);
        m.shard = shard_fields[k][0];
        m.shards = shard_fields[k][1];
        cr_expect_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, (const uint8_t *)"x", &s), -EINVAL, "shard %u of %u",
                     m.shard, m.shards);
    }
    cr_expect_eq(atomic_load(&s.cur->refs), 1);
    /* a directory that does not exist: started, fails in the writer */
    meta_make(&m, &s, 1, 8);
    cr_assert_eq(psd_ckpt_begin(&wr, "/nonexistent/psd", 3, &m, (const uint8_t *)"x", &s), 0);
    char path[64] = "junk";
    cr_expect_eq(psd_ckpt_end(&wr, path, sizeof path, NULL, NULL, NULL), -ENOENT);
    cr_expect_str_eq(path, "");
    cr_expect_eq(atomic_load(&s.cur->refs), 1);
    psd_store_deinit(&s);
}

/* ---- copy-on-write ---------------------------------------------------- */

/* The slots change right after begin: the file must hold the values of the
 * moment of begin. The last slot chunk is touched first: the writer saves it
 * last (after ~48 MB), so it is certainly copied aside. */
Test(ckpt, cow_snapshot_is_consistent, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    size_t n = store_filled(&s, big_sizes, 1);
    psd_ckpt_meta_t m;
    meta_make(&m, &s, 1, 100);
    uint8_t *seen = seen_make(100, 1);
    psd_ckpt_writer_t *wr;
    cr_assert_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, seen, &s), 0);
    /* the copied bitmap is the writer's: changing ours must not matter */
    memset(seen, 0xff, 13);
    for (int step = 2; step <= 4; step++) {
        psd_ckpt_before_update(wr, n - 1, 1);
        psd_ckpt_before_update(wr, 0, n);
        fill(s.s0, n, (uint64_t)step, 1);
        fill(s.s1, n, (uint64_t)step, 2);
    }
    uint64_t peak, bytes;
    double secs;
    cr_assert_eq(psd_ckpt_end(&wr, NULL, 0, &secs, &bytes, &peak), 0);
    cr_expect_gt(peak, CHUNK_BYTES, "side copies were made: peak %llu", (unsigned long long)peak);
    cr_expect_leq(peak, 2 * 16 * CHUNK_BYTES + CHUNK_BYTES);
    cr_expect_eq(check_pat(s.s0, n, 4, 1), n, "the live slots keep the new values");

    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(check_pat(L.w, n, 1, 0), n);
    size_t i0 = check_pat(L.slots[0], n, 1, 1), i1 = check_pat(L.slots[1], n, 1, 2);
    cr_expect_eq(i0, n, "slot 0 differs from the snapshot at %zu", i0);
    cr_expect_eq(i1, n, "slot 1 differs from the snapshot at %zu", i1);
    uint8_t *want = seen_make(100, 1);
    cr_expect_eq(memcmp(L.seen, want, 13), 0);
    free(want);
    loaded_free(&L);
    free(seen);
    psd_store_deinit(&s);
}

/* The real path: psd_store_step calls the hook per tensor while the writer
 * runs; the file holds the state of the moment of begin: of one psd, or the
 * part of a psd shard (the chunks before and after it are not its). */
static void steps_during_write(int shard, int n_shards)
{
    psd_store_t s;
    store_make(&s, big_sizes, 3);
    size_t n = s.layout.n_params;
    float *g = malloc(n * sizeof(float));
    cr_assert_not_null(g);
    for (size_t i = 0; i < n; i++) g[i] = (float)((int)(i % 17) - 8) * 1e-3f;
    const void *gt[1][PS_MAX_TENSORS];
    for (int t = 0; t < s.layout.n_tensors; t++) gt[0][t] = g + s.layout.t[t].offset;
    const void *const(*grads)[PS_MAX_TENSORS] = (const void *const(*)[PS_MAX_TENSORS])gt;
    const double weight[1] = {1.0};
    /* two steps so that the slots are not zero */
    for (int k = 0; k < 2; k++) cr_assert_geq(psd_store_step(&s, 1, grads, NULL, weight, 0, 1e-2), 0);
    float *w0 = malloc(n * 4), *m0 = malloc(n * 4), *v0 = malloc(n * 4);
    cr_assert(w0 && m0 && v0);
    memcpy(w0, s.cur->w, n * 4);
    memcpy(m0, s.s0, n * 4);
    memcpy(v0, s.s1, n * 4);

    psd_ckpt_meta_t m;
    meta_make(&m, &s, 2, 0);
    m.shard = (uint32_t)shard;
    m.shards = (uint32_t)n_shards;
    psd_ckpt_writer_t *wr;
    cr_assert_eq(psd_ckpt_begin(&wr, g_dir, 3, &m, NULL, &s), 0);
    s.before_update = psd_ckpt_hook;
    s.before_update_ud = wr;
    int steps = 0;
    while (!psd_ckpt_done(wr) || steps < 3) {
        cr_assert_geq(psd_store_step(&s, 1, grads, NULL, weight, 0, 1e-2), 0);
        steps++;
    }
    s.before_update = NULL;
    s.before_update_ud = NULL;
    uint64_t peak;
    cr_assert_eq(psd_ckpt_end(&wr, NULL, 0, NULL, NULL, &peak), 0);
    cr_expect_neq(memcmp(s.s0, m0, n * 4), 0, "the steps changed the slots");
    cr_log_info("%d steps during the write, peak extra %llu bytes", steps, (unsigned long long)peak);

    bool *mine = malloc(n * sizeof *mine);
    cr_assert_not_null(mine);
    part_floats(&s, shard, n_shards, mine);
    if (n_shards == 1) /* one psd's file holds the alignment gaps too */
        for (size_t i = 0; i < n; i++) mine[i] = true;
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(check_part(L.w, w0, mine, n), n, "weights of begin (shard %d of %d)", shard, n_shards);
    cr_expect_eq(check_part(L.slots[0], m0, mine, n), n, "m of begin (shard %d of %d)", shard, n_shards);
    cr_expect_eq(check_part(L.slots[1], v0, mine, n), n, "v of begin (shard %d of %d)", shard, n_shards);
    loaded_free(&L);
    free(mine);
    free(w0);
    free(m0);
    free(v0);
    free(g);
    psd_store_deinit(&s);
}

Test(ckpt, store_steps_during_write, .init = dir_setup, .fini = dir_teardown) { steps_during_write(0, 1); }

Test(ckpt, a_shard_steps_during_its_write, .init = dir_setup, .fini = dir_teardown) { steps_during_write(1, 3); }

#if !defined(__SANITIZE_ADDRESS__)
/* No memory for a side copy: before_update waits for the writer instead.
 * In a child, under an address-space limit (not with ASan, which reserves
 * terabytes and dies on allocation failure). */
Test(ckpt, cow_without_memory_waits, .init = dir_setup, .fini = dir_teardown)
{
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        psd_store_t s;
        ps_layout_t l;
        psd_optim_t o = {.kind = PS_OPT_ADAM, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
        if (ps_layout_init(&l, big_sizes, 3) || psd_store_init(&s, &l, &o, 1)) _exit(10);
        size_t n = l.n_params;
        fill(s.s0, n, 1, 1);
        fill(s.s1, n, 1, 2);
        psd_ckpt_meta_t m;
        meta_make(&m, &s, 1, 0);
        psd_ckpt_writer_t *wr;
        struct rlimit old, lim;
        getrlimit(RLIMIT_AS, &old);
        if (psd_ckpt_begin(&wr, g_dir, 3, &m, NULL, &s)) _exit(12);
        /* the writer thread and its bounce buffer exist: no room for copies */
        long pages = 0;
        FILE *f = fopen("/proc/self/statm", "r");
        if (!f || fscanf(f, "%ld", &pages) != 1) _exit(11);
        fclose(f);
        lim = old;
        lim.rlim_cur = (rlim_t)pages * (rlim_t)sysconf(_SC_PAGESIZE) + (256u << 10);
        if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(13);
        /* use up what the heap still has free, so that no 1 MiB copy fits */
        void *hold[64];
        int nhold = 0;
        while (nhold < 64 && (hold[nhold] = malloc(CHUNK_BYTES)) != NULL) nhold++;
        int limited = nhold < 64;
        psd_ckpt_before_update(wr, 0, n); /* waits chunk by chunk */
        fill(s.s0, n, 2, 1);
        fill(s.s1, n, 2, 2);
        while (nhold > 0) free(hold[--nhold]);
        setrlimit(RLIMIT_AS, &old);
        uint64_t peak;
        if (psd_ckpt_end(&wr, NULL, 0, NULL, NULL, &peak)) _exit(14);
        if (limited && peak != CHUNK_BYTES) _exit(15); /* no side copy was possible */
        loaded_t L;
        if (load(&L)) _exit(16);
        if (check_pat(L.slots[0], n, 1, 1) != n || check_pat(L.slots[1], n, 1, 2) != n) _exit(17);
        _exit(limited ? 0 : 20);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st), "child died of signal %d", WTERMSIG(st));
    cr_expect(WEXITSTATUS(st) == 0 || WEXITSTATUS(st) == 20, "child exit %d", WEXITSTATUS(st));
    if (WEXITSTATUS(st) == 20) cr_log_warn("address-space limit did not make malloc fail; path not exercised");
}
#endif

/* ---- pruning ---------------------------------------------------------- */

/* psd shards: the newest step every shard confirmed stays, whatever
 * `keep` says (a shard failing to write would otherwise leave no step in
 * common once shard 0 pruned it). */
Test(ckpt, keep_step_is_never_pruned, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    store_make(&s, small_sizes, 3);
    for (uint64_t step = 1; step <= 6; step++) {
        psd_ckpt_meta_t m;
        meta_make(&m, &s, step, 0);
        m.keep_step = 2;
        cr_assert_eq(ckpt_write(&s, &m, NULL, 2, NULL, NULL, NULL, 0), 0);
    }
    char p[PATH_MAX];
    for (uint64_t step = 1; step <= 6; step++) {
        ckpt_name(p, sizeof p, step);
        cr_expect_eq(access(p, F_OK) == 0, step == 2 || step >= 5, "step %llu", (unsigned long long)step);
    }
    psd_store_deinit(&s);
}

Test(ckpt, keep_newest, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    store_make(&s, small_sizes, 3);
    /* a stale temp file of an old step (a killed writer); a temp file and a
     * checkpoint of a newer step (left when the run resumed at an older one) */
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s/.ckpt-%012d.psdc.tmp", g_dir, 2);
    file_write(p, "partial", 7);
    snprintf(p, sizeof p, "%s/.ckpt-%012d.psdc.tmp", g_dir, 99);
    file_write(p, "partial", 7);
    ckpt_name(p, sizeof p, 99);
    file_write(p, "a step the run went back from", 29);
    snprintf(p, sizeof p, "%s/other-file", g_dir);
    file_write(p, "x", 1);
    for (uint64_t step = 1; step <= 5; step++) {
        psd_ckpt_meta_t m;
        meta_make(&m, &s, step, 0);
        cr_assert_eq(ckpt_write(&s, &m, NULL, 3, NULL, NULL, NULL, 0), 0);
    }
    cr_expect_eq(count_files("ckpt-", ".psdc"), 3);
    for (uint64_t step = 1; step <= 5; step++) {
        ckpt_name(p, sizeof p, step);
        cr_expect_eq(access(p, F_OK) == 0, step >= 3, "step %llu", (unsigned long long)step);
    }
    cr_expect_eq(count_files(".ckpt-", ".psdc.tmp"), 0, "no temp file is left");
    ckpt_name(p, sizeof p, 99);
    cr_expect_neq(access(p, F_OK), 0, "the checkpoint above the steps written is no longer one");
    strcat(p, ".superseded");
    cr_expect_eq(access(p, F_OK), 0, "it is kept as NAME.superseded");
    snprintf(p, sizeof p, "%s/other-file", g_dir);
    cr_expect_eq(access(p, F_OK), 0, "unrelated files are left alone");
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(L.meta.step, 5);
    loaded_free(&L);
    psd_store_deinit(&s);
}

/* ---- corruption ------------------------------------------------------- */

/* Steps 1 and 2 with distinct contents; returns the image of step 2. */
static uint8_t *two_ckpts(psd_store_t *s, size_t *len)
{
    store_make(s, small_sizes, 3);
    for (uint64_t step = 1; step <= 2; step++) {
        fill(s->s0, s->layout.n_params, step, 1);
        fill(s->s1, s->layout.n_params, step, 2);
        psd_ckpt_meta_t m;
        meta_make(&m, s, step, 64);
        uint8_t *seen = seen_make(64, step);
        cr_assert_eq(ckpt_write(s, &m, seen, 5, NULL, NULL, NULL, 0), 0);
        free(seen);
    }
    char p[PATH_MAX];
    ckpt_name(p, sizeof p, 2);
    return file_read(p, len);
}

static void expect_fallback_to_1(const char *what)
{
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s: %s", what, L.err);
    cr_expect_eq(L.meta.step, 1, "%s", what);
    cr_expect_eq(check_pat(L.slots[0], L.meta.n_params, 1, 1), L.meta.n_params, "%s", what);
    cr_expect_eq(g_nlog, 1, "%s: %d log lines", what, g_nlog);
    cr_expect(log_mentions("ckpt-000000000002.psdc"), "%s: log: %s", what, g_nlog ? g_log[0] : "");
    cr_expect(log_mentions("trying an older one"), "%s", what);
    loaded_free(&L);
}

Test(ckpt, flipped_byte_falls_back, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    size_t len;
    uint8_t *img = two_ckpts(&s, &len);
    char p[PATH_MAX];
    ckpt_name(p, sizeof p, 2);
    const size_t offs[] = {0, 5, 30, OFF_N_SIZES, HDR_LEN + 3, len / 2, len - 13, len - 12, len - 5,
                           len - 1};
    for (size_t k = 0; k < sizeof offs / sizeof offs[0]; k++) {
        img[offs[k]] ^= 0x10;
        file_write(p, img, len);
        char what[64];
        snprintf(what, sizeof what, "byte %zu flipped", offs[k]);
        expect_fallback_to_1(what);
        img[offs[k]] ^= 0x10;
    }
    file_write(p, img, len);
    loaded_t L;
    cr_assert_eq(load(&L), 0);
    cr_expect_eq(L.meta.step, 2, "restored file is valid again");
    loaded_free(&L);
    free(img);
    psd_store_deinit(&s);
}

Test(ckpt, truncated_falls_back, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    size_t len;
    uint8_t *img = two_ckpts(&s, &len);
    char p[PATH_MAX];
    ckpt_name(p, sizeof p, 2);
    const size_t cuts[] = {0, 1, 100, HDR_LEN, HDR_LEN + 8, len / 2, len - 12, len - 4, len - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        file_write(p, img, cuts[k]);
        char what[64];
        snprintf(what, sizeof what, "truncated to %zu", cuts[k]);
        expect_fallback_to_1(what);
    }
    /* appended bytes */
    uint8_t *longer = calloc(1, len + 1);
    memcpy(longer, img, len);
    file_write(p, longer, len + 1);
    expect_fallback_to_1("one byte appended");
    free(longer);
    free(img);
    psd_store_deinit(&s);
}

Test(ckpt, all_corrupt_fails, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    size_t len;
    uint8_t *img = two_ckpts(&s, &len);
    char p[PATH_MAX];
    for (uint64_t step = 1; step <= 2; step++) {
        size_t flen;
        ckpt_name(p, sizeof p, step);
        uint8_t *f = file_read(p, &flen);
        f[flen / 3] ^= 1;
        file_write(p, f, flen);
        free(f);
    }
    loaded_t L;
    cr_expect_eq(load(&L), -1);
    cr_expect(strstr(L.err, "no valid checkpoint in"), "%s", L.err);
    cr_expect(strstr(L.err, g_dir), "%s", L.err);
    cr_expect(strstr(L.err, "2 rejected"), "%s", L.err);
    cr_expect_eq(g_nlog, 2);
    cr_expect(log_mentions("ckpt-000000000002.psdc") && log_mentions("ckpt-000000000001.psdc"));
    cr_expect_null(L.w);
    free(img);
    psd_store_deinit(&s);
}

Test(ckpt, empty_or_missing_dir_fails, .init = dir_setup, .fini = dir_teardown)
{
    loaded_t L;
    cr_expect_eq(load(&L), -1);
    cr_expect(strstr(L.err, "no valid checkpoint in"), "%s", L.err);
    cr_expect(strstr(L.err, "0 rejected"), "%s", L.err);
    cr_expect_eq(g_nlog, 0);
    /* names that are not checkpoints are not even looked at */
    char p[PATH_MAX];
    const char *names[] = {"ckpt-.psdc", "ckpt-12a.psdc", "ckpt-000000000001.psdc.bak",
                           "xckpt-000000000001.psdc", ".ckpt-000000000001.psdc.tmp"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/%s", g_dir, names[i]);
        file_write(p, "PSDC", 4);
    }
    cr_expect_eq(load(&L), -1);
    cr_expect_eq(g_nlog, 0);
    memset(&L, 0, sizeof L);
    cr_expect_eq(psd_ckpt_load_newest("/nonexistent/psd", 0, &L.meta, &L.seen, &L.w, L.slots, NULL, 0,
                                      NULL, L.err, sizeof L.err),
                 -1);
    cr_expect(strstr(L.err, "/nonexistent/psd"), "%s", L.err);
}

Test(ckpt, garbage_files_are_skipped, .init = dir_setup, .fini = dir_teardown)
{
    psd_store_t s;
    size_t len;
    uint8_t *img = two_ckpts(&s, &len);
    drop_table(img, &len, tbl_len(&s)); /* the fixed header's fields, in format 4 */
    char p2[PATH_MAX], p9[PATH_MAX];
    ckpt_name(p2, sizeof p2, 2);
    unlink(p2);
    ckpt_name(p9, sizeof p9, 9);
    uint8_t junk[4096];
    srand(7);
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)rand();

    /* raw garbage of various lengths */
    const size_t lens[] = {0, 3, 100, HDR_LEN + 12, sizeof junk};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        file_write(p9, junk, lens[k]);
        loaded_t L;
        cr_assert_eq(load(&L), 0, "%zu garbage bytes: %s", lens[k], L.err);
        cr_expect_eq(L.meta.step, 1);
        cr_expect_eq(g_nlog, 1);
        cr_expect(log_mentions("ckpt-000000000009.psdc"));
        loaded_free(&L);
    }

    /* valid magic, format and CRC; insane header fields. Only the sanity
     * checks stand between these and a huge allocation or a bad layout. */
    uint8_t hdr[HDR_LEN + 12];
    memcpy(hdr, img, HDR_LEN);
    struct {
        const char *what;
        size_t off;
        uint32_t v32;
        int is64;
        uint64_t v64;
    } bad[] = {
        {"n_sizes huge", OFF_N_SIZES, 1u << 30, 0, 0},
        {"n_sizes 1", OFF_N_SIZES, 1, 0, 0},
        {"n_sizes 18", OFF_N_SIZES, 18, 0, 0},
        {"size 0", OFF_SIZES + 4, 0, 0, 0},
        {"size 2^20+1", OFF_SIZES, (1u << 20) + 1, 0, 0},
        {"size beyond n_sizes", OFF_SIZES + 3 * 4, 5, 0, 0},
        {"n_params wrong", OFF_N_PARAMS, 0, 1, 12345},
        {"train_count 2^40", OFF_TRAIN_COUNT, 0, 1, 1ULL << 40},
        {"n_slots 3", OFF_N_PARAMS - 4, 3, 0, 0},
        {"format 6", 4, 6, 0, 0},
        {"17 psd shards", OFF_TABLE_DIM + 4, 17u << 16, 0, 0},
        {"table rows without a dim", OFF_TABLE_ROWS, 0, 1, 10},
        {"table dim without rows", OFF_TABLE_DIM, 4, 0, 0},
        {"table dim 5000", OFF_TABLE_DIM, 5000, 0, 0},
        {"reserved field set", OFF_TABLE_DIM + 4, 1, 0, 0},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        memcpy(hdr, img, HDR_LEN);
        if (bad[k].is64)
            put64(hdr + bad[k].off, bad[k].v64);
        else
            put32(hdr + bad[k].off, bad[k].v32);
        fix_trailer(hdr, sizeof hdr);
        file_write(p9, hdr, sizeof hdr);
        loaded_t L;
        cr_assert_eq(load(&L), 0, "%s: %s", bad[k].what, L.err);
        cr_expect_eq(L.meta.step, 1, "%s", bad[k].what);
        cr_expect_eq(g_nlog, 1, "%s", bad[k].what);
        cr_log_info("%s -> %s", bad[k].what, g_nlog ? g_log[0] : "(no log)");
        loaded_free(&L);
    }

    /* a consistent header for the largest layout (17 sizes of 2^20: ~2^44
     * floats) on a short file: rejected by size before any allocation */
    memcpy(hdr, img, HDR_LEN);
    int sizes[PS_MAX_LAYERS + 1];
    for (int i = 0; i < PS_MAX_LAYERS + 1; i++) sizes[i] = 1 << 20;
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, sizes, PS_MAX_LAYERS + 1), 0);
    put32(hdr + OFF_N_SIZES, PS_MAX_LAYERS + 1);
    for (int i = 0; i < PS_MAX_LAYERS + 1; i++) put32(hdr + OFF_SIZES + 4 * i, 1u << 20);
    put64(hdr + OFF_N_PARAMS, l.n_params);
    put64(hdr + OFF_TRAIN_COUNT, 1ULL << 32);
    fix_trailer(hdr, sizeof hdr);
    file_write(p9, hdr, sizeof hdr);
    loaded_t L;
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(L.meta.step, 1);
    cr_expect(log_mentions("header says"), "%s", g_nlog ? g_log[0] : "");
    loaded_free(&L);

    /* a directory with a checkpoint's name */
    unlink(p9);
    cr_assert_eq(mkdir(p9, 0755), 0);
    cr_assert_eq(load(&L), 0, "%s", L.err);
    cr_expect_eq(L.meta.step, 1);
    cr_expect_eq(g_nlog, 1);
    loaded_free(&L);
    rmdir(p9);
    free(img);
    psd_store_deinit(&s);
}

/* ---- SIGKILL at random moments ----------------------------------------- */

static const int kill_sizes[] = {2000, 1000, 10}; /* 2011018 floats per arena */
#define KILL_KEEP 2
#define KILL_TRAIN 5000

/* Child: checkpoints steps first, first+1, ... forever; the state of step k
 * is pattern k (weights, slots, bitmap); each write is followed at once by a
 * simulated step (hook + slots to pattern k+1), like psd. Writes a byte to
 * ready_fd after the first checkpoint. Never returns. */
static void kill_child(uint64_t first, int ready_fd)
{
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    psd_store_t s;
    ps_layout_t l;
    psd_optim_t o = {.kind = PS_OPT_ADAM, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f};
    if (ps_layout_init(&l, kill_sizes, 3) || psd_store_init(&s, &l, &o, 1)) _exit(10);
    size_t n = l.n_params;
    for (uint64_t k = first; k < first + 100000; k++) {
        fill(s.cur->w, n, k, 0); /* no checkpoint holds the arena now */
        fill(s.s0, n, k, 1);
        fill(s.s1, n, k, 2);
        psd_ckpt_meta_t m;
        meta_make(&m, &s, k, KILL_TRAIN);
        uint8_t *seen = seen_make(KILL_TRAIN, k);
        psd_ckpt_writer_t *wr;
        if (psd_ckpt_begin(&wr, g_dir, KILL_KEEP, &m, seen, &s)) _exit(11);
        free(seen);
        psd_ckpt_before_update(wr, 0, n);
        fill(s.s0, n, k + 1, 1);
        fill(s.s1, n, k + 1, 2);
        if (psd_ckpt_end(&wr, NULL, 0, NULL, NULL, NULL)) _exit(12);
        if (ready_fd >= 0) {
            if (write(ready_fd, "x", 1) != 1) _exit(13);
            close(ready_fd);
            ready_fd = -1;
        }
    }
    _exit(0);
}

Test(ckpt, sigkill_at_random_moments, .init = dir_setup, .fini = dir_teardown, .timeout = 240)
{
    unsigned seed = (unsigned)time(NULL);
    const char *env = getenv("PSD_CKPT_SEED");
    if (env) seed = (unsigned)strtoul(env, NULL, 10);
    fprintf(stderr, "sigkill_at_random_moments: seed %u (PSD_CKPT_SEED to repeat)\n", seed);
    srand(seed);

    uint64_t next = 1, last_loaded = 0;
    int rounds_with_new = 0;
    for (int round = 0; round < 20; round++) {
        int fds[2] = {-1, -1};
        if (round == 0) cr_assert_eq(pipe(fds), 0);
        pid_t pid = fork();
        cr_assert_geq(pid, 0);
        if (pid == 0) {
            if (fds[0] >= 0) close(fds[0]);
            kill_child(next, fds[1]);
        }
        if (round == 0) {
            /* one complete checkpoint before the first kill */
            close(fds[1]);
            char c;
            cr_assert_eq(read(fds[0], &c, 1), 1, "child died before its first checkpoint");
            close(fds[0]);
        }
        useconds_t delay = (useconds_t)(rand() % 300000);
        usleep(delay);
        cr_assert_eq(kill(pid, SIGKILL), 0);
        int st;
        cr_assert_eq(waitpid(pid, &st, 0), pid);
        cr_assert(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "round %d: child exited (%d) first",
                  round, WIFEXITED(st) ? WEXITSTATUS(st) : -1);

        loaded_t L;
        int rc = load(&L);
        cr_assert_eq(rc, 0, "round %d (killed after %u us): %s", round, (unsigned)delay, L.err);
        /* a renamed file is always complete: nothing is ever rejected */
        cr_expect_eq(g_nlog, 0, "round %d: %s", round, g_nlog ? g_log[0] : "");
        uint64_t k = L.meta.step;
        cr_expect_geq(k, last_loaded, "round %d: went back from %llu to %llu", round,
                      (unsigned long long)last_loaded, (unsigned long long)k);
        if (k > last_loaded) rounds_with_new++;
        size_t n = L.meta.n_params;
        cr_expect_eq(L.meta.version, k + 1000);
        cr_expect_eq(L.meta.train_count, KILL_TRAIN);
        uint8_t *want = seen_make(KILL_TRAIN, k);
        cr_expect_eq(memcmp(L.seen, want, (KILL_TRAIN + 7) / 8), 0, "round %d: bitmap", round);
        free(want);
        size_t iw = check_pat(L.w, n, k, 0), i0 = check_pat(L.slots[0], n, k, 1),
               i1 = check_pat(L.slots[1], n, k, 2);
        cr_expect(iw == n && i0 == n && i1 == n,
                  "round %d: step %llu not its own state (w %zu, s0 %zu, s1 %zu of %zu)", round,
                  (unsigned long long)k, iw, i0, i1, n);
        cr_expect_leq(count_files("ckpt-", ".psdc"), KILL_KEEP + 1, "round %d", round);
        last_loaded = k;
        next = k + 1;
        loaded_free(&L);
    }
    cr_log_info("20 kills, newest step %llu, %d rounds added checkpoints",
                (unsigned long long)last_loaded, rounds_with_new);
    fprintf(stderr, "sigkill_at_random_moments: newest step %llu, %d of 20 rounds added one\n",
            (unsigned long long)last_loaded, rounds_with_new);
}

/* Two equal Adam stores of the small model the store tests below use;
 * returns its parameter count. */
static size_t store_pair(psd_store_t *a, psd_store_t *b)
{
    static const int sizes[] = {300, 70, 10};
    store_make(a, sizes, 3);
    store_make(b, sizes, 3);
    return a->layout.n_params;
}

/* The same weights and optimizer state, bit for bit. */
static void assert_same_state(const psd_store_t *a, const psd_store_t *b)
{
    size_t n = a->layout.n_params;
    cr_assert_eq(memcmp(a->cur->w, b->cur->w, n * sizeof(float)), 0);
    cr_assert_eq(memcmp(a->s0, b->s0, n * sizeof(float)), 0);
    cr_assert_eq(memcmp(a->s1, b->s1, n * sizeof(float)), 0);
}

/* Gradients that came as bfloat16 (train.wire_gradients: bf16) are reduced
 * exactly like the floats they stand for; the bfloat16 copy of a version is
 * the rounding of its weights, redone when the version changes. */
Test(store, bf16_gradients_reduce_like_their_float_values)
{
    psd_store_t a, b;
    size_t n = store_pair(&a, &b);
    cr_assert_eq(psd_store_set_parallel(&b, 2, 65536), 0);
    float *g1 = malloc(n * sizeof(float)), *g2 = malloc(n * sizeof(float));
    uint16_t *h2 = malloc(n * sizeof(uint16_t));
    cr_assert(g1 && g2 && h2);
    for (size_t i = 0; i < n; i++) {
        g1[i] = sinf((float)i) * 1e-2f;
        h2[i] = ps_f32_to_bf16(cosf((float)i * 0.37f) * 3e-2f);
        g2[i] = ps_bf16_to_f32(h2[i]);
    }
    const void *fa[2][PS_MAX_TENSORS], *fb[2][PS_MAX_TENSORS];
    for (int t = 0; t < a.layout.n_tensors; t++) {
        size_t o = a.layout.t[t].offset;
        fa[0][t] = fb[0][t] = g1 + o;
        fa[1][t] = g2 + o;
        fb[1][t] = h2 + o;
    }
    const double wt[2] = {0.25, 0.75};
    const uint8_t kinds[2] = {0, 1};
    for (int k = 0; k < 3; k++) {
        cr_assert_geq(psd_store_step(&a, 2, (const void *const(*)[PS_MAX_TENSORS])fa, NULL, wt, 0.5, 1e-2), 0);
        cr_assert_geq(psd_store_step(&b, 2, (const void *const(*)[PS_MAX_TENSORS])fb, kinds, wt, 0.5, 1e-2), 0);
    }
    cr_assert_eq(memcmp(a.cur->w, b.cur->w, n * sizeof(float)), 0, "bf16 rows = their float values");
    const uint16_t *w16 = psd_store_current_bf16(&b);
    cr_assert_not_null(w16);
    for (size_t i = 0; i < n; i++) cr_assert_eq(w16[i], ps_f32_to_bf16(b.cur->w[i]), "element %zu", i);
    cr_assert_geq(psd_store_step(&b, 2, (const void *const(*)[PS_MAX_TENSORS])fb, kinds, wt, 0.5, 1e-2), 0);
    w16 = psd_store_current_bf16(&b);
    for (size_t i = 0; i < n; i++) cr_assert_eq(w16[i], ps_f32_to_bf16(b.cur->w[i]), "new version, element %zu", i);
    free(g1);
    free(g2);
    free(h2);
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}

/* One f32 contributor of weight 1 is applied straight from its gradient (no
 * pass through the accumulator): the same bits as the general path, which a
 * clip norm too large to bite forces. */
Test(store, one_contributor_fast_path_gives_the_same_bits)
{
    psd_store_t a, b;
    size_t n = store_pair(&a, &b);
    cr_assert_eq(psd_store_set_parallel(&a, 2, 65536), 0);
    float *g = malloc(n * sizeof(float));
    cr_assert_not_null(g);
    const void *f[1][PS_MAX_TENSORS];
    for (int t = 0; t < a.layout.n_tensors; t++) f[0][t] = g + a.layout.t[t].offset;
    const double one[1] = {1.0};
    for (int k = 0; k < 3; k++) {
        for (size_t i = 0; i < n; i++) g[i] = sinf((float)(i * (k + 1))) * 1e-2f;
        double na = psd_store_step(&a, 1, (const void *const(*)[PS_MAX_TENSORS])f, NULL, one, 0, 1e-2);
        double nb = psd_store_step(&b, 1, (const void *const(*)[PS_MAX_TENSORS])f, NULL, one, 1e30, 1e-2);
        cr_assert(na == 0 && nb > 0, "norms %g %g (only clipping computes one)", na, nb);
    }
    assert_same_state(&a, &b);
    free(g);
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}

/* Without clipping several contributors are reduced and applied in one pass
 * through a small scratch buffer; with clipping through the gradient array.
 * Same bits either way, for f32 and bf16 contributors, sizes that are not
 * multiples of the scratch buffer, and any chunking and thread count. */
/* Three contributors laid out like the store's model: f32 gradients in g
 * (rows 0 and 2 of 3n floats), bfloat16 in h (row 1); three_fill draws
 * step k's values. */
static const uint8_t three_bf16[3] = {0, 1, 0};
static const double three_wt[3] = {0.5, 0.25, 0.25};

static void three_table(const psd_store_t *a, float *g, uint16_t *h, const void *f[3][PS_MAX_TENSORS])
{
    size_t n = a->layout.n_params;
    for (int t = 0; t < a->layout.n_tensors; t++) {
        f[0][t] = g + a->layout.t[t].offset;
        f[1][t] = h + a->layout.t[t].offset;
        f[2][t] = g + 2 * n + a->layout.t[t].offset;
    }
}

static void three_fill(float *g, uint16_t *h, size_t n, int k)
{
    for (size_t i = 0; i < 3 * n; i++) g[i] = sinf((float)(i * (k + 1)) * 0.37f) * 1e-2f;
    for (size_t i = 0; i < n; i++) h[i] = ps_f32_to_bf16(cosf((float)(i * (k + 3))) * 1e-2f);
}

Test(store, fused_reduce_and_apply_gives_the_same_bits)
{
    psd_store_t a, b;
    size_t n = store_pair(&a, &b);
    cr_assert_eq(psd_store_set_parallel(&a, 2, 65536), 0);
    float *g = malloc(3 * n * sizeof(float));
    uint16_t *h = malloc(n * sizeof(uint16_t));
    cr_assert(g && h);
    const void *f[3][PS_MAX_TENSORS];
    three_table(&a, g, h, f);
    for (int k = 0; k < 3; k++) {
        three_fill(g, h, n, k);
        cr_assert_eq(psd_store_step(&a, 3, (const void *const(*)[PS_MAX_TENSORS])f, three_bf16, three_wt, 0, 1e-2), 0);
        cr_assert_gt(psd_store_step(&b, 3, (const void *const(*)[PS_MAX_TENSORS])f, three_bf16, three_wt, 1e30, 1e-2),
                     0);
    }
    assert_same_state(&a, &b);
    free(g);
    free(h);
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}

/* server.grad_room: the contributors folded into the step's sum one by one
 * in rank order (psd_store_fold), then a step on the sum as the one f32
 * contributor of weight 1, give the bits of the step over all of them at
 * once: f32 and bf16 contributors, with clipping and without, any chunking
 * and thread count. */
Test(store, contributors_folded_one_by_one_give_the_same_bits)
{
    for (int clip = 0; clip < 2; clip++) {
        psd_store_t a, b;
        size_t n = store_pair(&a, &b);
        cr_assert_eq(psd_store_set_parallel(&b, 2, 65536), 0);
        float *g = malloc(3 * n * sizeof(float));
        uint16_t *h = malloc(n * sizeof(uint16_t));
        cr_assert(g && h);
        const void *f[3][PS_MAX_TENSORS], *sum[1][PS_MAX_TENSORS];
        three_table(&a, g, h, f);
        for (int t = 0; t < b.layout.n_tensors; t++) sum[0][t] = psd_store_sum(&b) + b.layout.t[t].offset;
        const double one[1] = {1.0};
        const double cn = clip ? 1e-3 : 0; /* (a norm that bites) */
        for (int k = 0; k < 3; k++) {
            three_fill(g, h, n, k);
            double na = psd_store_step(&a, 3, (const void *const(*)[PS_MAX_TENSORS])f, three_bf16, three_wt, cn, 1e-2);
            for (int j = 0; j < 3; j++) /* contributor j alone, as it comes */
                psd_store_fold(&b, (const void *const(*)[PS_MAX_TENSORS])&f[j], &three_bf16[j], three_wt[j], j > 0);
            double nb = psd_store_step(&b, 1, (const void *const(*)[PS_MAX_TENSORS])sum, NULL, one, cn, 1e-2);
            cr_assert(na == nb, "the same norm: %.17g %.17g", na, nb);
        }
        assert_same_state(&a, &b);
        free(g);
        free(h);
        psd_store_deinit(&a);
        psd_store_deinit(&b);
    }
}

/* Streamed steps (train.stream): chunks stepped one batch at a time, in any
 * order, give the bits of the whole step, with clipping (reduce every
 * chunk, then apply with the global norm) and without (each chunk at once);
 * out of place (a reply of the current version in flight) and in place. */
Test(store, streamed_chunks_in_any_order_give_the_same_bits)
{
    for (int clip = 0; clip < 2; clip++) {
        psd_store_t a, b;
        size_t n = store_pair(&a, &b);
        cr_assert_eq(psd_store_set_parallel(&a, 2, 65536), 0);
        cr_assert_eq(psd_store_set_parallel(&b, 2, 65536), 0);
        cr_assert_gt(b.n_chunks, 2, "the model spans several chunks");
        float *g = malloc(3 * n * sizeof(float));
        uint16_t *h = malloc(n * sizeof(uint16_t));
        const void **src = malloc((size_t)b.n_chunks * 3 * sizeof *src);
        int *ids = malloc((size_t)b.n_chunks * sizeof *ids);
        cr_assert(g && h && src && ids);
        const void *f[3][PS_MAX_TENSORS];
        three_table(&a, g, h, f);
        for (int k = 0; k < 4; k++) {
            three_fill(g, h, n, k);
            cr_assert_geq(psd_store_step(&a, 3, (const void *const(*)[PS_MAX_TENSORS])f, three_bf16, three_wt,
                                         clip ? 0.05 : 0, 1e-2), 0);
            psd_arena_t *held = k % 2 ? psd_store_ref_current(&b) : NULL; /* odd steps: out of place */
            psd_arena_t *next = psd_store_stream_begin(&b);
            cr_assert(next && (next == b.cur) == (held == NULL));
            /* the chunks in reverse order, two at a time; each contributor's
             * chunk is its own buffer's piece, as a frame would be */
            for (int c = b.n_chunks - 1; c >= 0; c -= 2) {
                int m = c > 0 ? 2 : 1;
                for (int j = 0; j < m; j++) {
                    const psd_chunk_t *ch = &b.chunks[c - j];
                    ids[j] = c - j;
                    src[j * 3 + 0] = g + ch->off;
                    src[j * 3 + 1] = h + ch->off;
                    src[j * 3 + 2] = g + 2 * n + ch->off;
                }
                psd_store_stream_chunks(&b, next, ids, m, 3, src, three_bf16, three_wt, clip, 1e-2);
            }
            if (clip) psd_store_stream_apply(&b, next, 0.05, 1e-2);
            psd_store_stream_end(&b, next);
            if (held) {
                cr_assert_neq(held, b.cur, "a referenced version is never written");
                psd_store_frame_free(NULL, held);
            }
            cr_assert_eq(b.cur->version, a.cur->version);
            cr_assert_eq(b.steps, a.steps);
        }
        assert_same_state(&a, &b);
        free(g);
        free(h);
        free(src);
        free(ids);
        psd_store_deinit(&a);
        psd_store_deinit(&b);
    }
}

/* With nothing referencing the current version a step updates it in place;
 * a version a frame still references is never written (the next one goes
 * into another arena). Same bits either way. */
Test(store, unreferenced_versions_update_in_place_referenced_ones_never)
{
    psd_store_t a, b;
    size_t n = store_pair(&a, &b);
    float *g = malloc(n * sizeof(float)), *held = malloc(n * sizeof(float));
    cr_assert(g && held);
    const void *f[1][PS_MAX_TENSORS];
    for (int t = 0; t < a.layout.n_tensors; t++) f[0][t] = g + a.layout.t[t].offset;
    const double one[1] = {1.0};
    psd_arena_t *ref = NULL;
    for (int k = 0; k < 4; k++) {
        for (size_t i = 0; i < n; i++) g[i] = sinf((float)(i * (k + 1))) * 1e-2f;
        /* a: a reply of the current version still in flight */
        if (ref) psd_store_frame_free(NULL, ref);
        ref = psd_store_ref_current(&a);
        memcpy(held, ref->w, n * sizeof(float));
        uint64_t v = a.cur->version;
        psd_arena_t *b_before = b.cur;
        cr_assert_geq(psd_store_step(&a, 1, (const void *const(*)[PS_MAX_TENSORS])f, NULL, one, 0, 1e-2), 0);
        cr_assert_geq(psd_store_step(&b, 1, (const void *const(*)[PS_MAX_TENSORS])f, NULL, one, 0, 1e-2), 0);
        cr_assert_neq(a.cur, ref, "a referenced version is not the next one's arena");
        cr_assert_eq(memcmp(held, ref->w, n * sizeof(float)), 0, "a referenced version was written");
        cr_assert_eq(ref->version, v);
        cr_assert_eq(b.cur, b_before, "nothing referenced it: updated in place");
        cr_assert_eq(b.cur->version, v + 1);
        cr_assert_eq(memcmp(a.cur->w, b.cur->w, n * sizeof(float)), 0, "step %d", k);
    }
    psd_store_frame_free(NULL, ref);
    cr_assert_eq(b.n_arenas, 1, "b never needed a second arena");
    free(g);
    free(held);
    psd_store_deinit(&a);
    psd_store_deinit(&b);
}
