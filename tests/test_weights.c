/* The weights file: save/load round trip, rejection of damaged files, and
 * the file written piece by piece (psd shards' parts fetched in chunks). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_model.h"
#include "ps_weights.h"

static char dir[64], path[128], path2[128], tmp[160];

static void setup(void)
{
    snprintf(dir, sizeof dir, "/tmp/psd-weights-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/w.bin", dir);
    snprintf(path2, sizeof path2, "%s/w2.bin", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
}

static void teardown(void)
{
    unlink(path);
    unlink(path2);
    unlink(tmp);
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

/* a model of three psd shards' parts (norm blocks of 16384 floats): MLP
 * 300-100-10 and a 2000 x 8 table */
static float *make_big(ps_layout_t *l)
{
    cr_assert_eq(ps_layout_init_table(l, (int[]){300, 100, 10}, 3, 2000, 8), 0);
    float *p = malloc(l->n_params * sizeof *p);
    for (size_t i = 0; i < l->n_params; i++) p[i] = (float)i * 0.5f - 7.0f;
    return p;
}

static char *slurp_file(const char *f, long *n)
{
    FILE *fp = fopen(f, "rb");
    cr_assert_not_null(fp, "%s", f);
    fseek(fp, 0, SEEK_END);
    *n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *b = malloc((size_t)*n);
    cr_assert_eq(fread(b, 1, (size_t)*n, fp), (size_t)*n);
    fclose(fp);
    return b;
}

/* chunks of `chunk` floats of every shard's part (ps_part_range), as pieces of tensors */
typedef struct {
    ps_piece_t pc[4096];
    int n;
} chunks_t;

static void chunk_parts(const ps_layout_t *l, int shards, uint64_t chunk, chunks_t *c)
{
    c->n = 0;
    uint64_t total = 0;
    for (int k = 0; k < shards; k++) {
        ps_piece_t part[PS_MAX_TENSORS], r[PS_MAX_TENSORS];
        ps_shard_pieces(l, k, shards, part);
        uint64_t size = ps_part_size(part, l->n_tensors);
        total += size;
        cr_assert_eq(ps_part_range(part, l->n_tensors, size, 1, r), 0, "a range past the part is none of it");
        cr_assert_eq(ps_part_range(part, l->n_tensors, 0, size + 1, r), 0, "a range longer than the part");
        cr_assert_eq(ps_part_range(part, l->n_tensors, 0, 0, r), 0, "an empty range");
        uint64_t at = 0;
        int t_next = 0;
        size_t off_next = 0;
        for (uint64_t from = 0; from < size; from += chunk) {
            uint64_t count = size - from < chunk ? size - from : chunk, got = 0;
            int n = ps_part_range(part, l->n_tensors, from, count, r);
            cr_assert_gt(n, 0);
            for (int i = 0; i < n; i++) { /* in order, inside the part's pieces, each following the last */
                cr_assert(r[i].t >= t_next && r[i].n > 0);
                if (r[i].t == t_next && at > 0) cr_assert_eq(r[i].off, off_next);
                else cr_assert_eq(r[i].off, part[r[i].t].off, "a tensor's piece is entered at its start");
                cr_assert_leq(r[i].off + r[i].n, part[r[i].t].off + part[r[i].t].n);
                t_next = r[i].t;
                off_next = r[i].off + r[i].n;
                got += r[i].n;
                at += r[i].n;
                cr_assert_lt(c->n, 4096);
                c->pc[c->n++] = r[i];
            }
            cr_assert_eq(got, count, "the range's pieces hold exactly its floats");
        }
        cr_assert_eq(at, size);
    }
    uint64_t floats = 0; /* n_params counts the padding between tensors too */
    for (int t = 0; t < l->n_tensors; t++) floats += l->t[t].numel;
    cr_assert_eq(total, floats, "the shards' parts are the whole model");
}

static ps_weights_writer_t *begin(const ps_layout_t *l)
{
    char err[256];
    ps_weights_meta_t meta = {.run_id = 0xabcdef, .step = 1234, .epoch = 7};
    ps_weights_writer_t *w = ps_weights_begin(path2, l, &meta, err, sizeof err);
    cr_assert_not_null(w, "%s", err);
    return w;
}

static void put(ps_weights_writer_t *w, const ps_layout_t *l, const float *p, const ps_piece_t *pc)
{
    char err[256];
    cr_assert_eq(ps_weights_put(w, pc->t, pc->off, p + l->t[pc->t].offset + pc->off, pc->n, err, sizeof err), 0,
                 "%s", err);
}

static int exists(const char *f) { return access(f, F_OK) == 0; }

Test(weights, pieces_written_in_any_order_make_the_same_file)
{
    ps_layout_t l;
    float *p = make_big(&l);
    save(&l, p); /* the file written whole, to compare with */
    long na, nb;
    char *a = slurp_file(path, &na), tmp2[160];
    snprintf(tmp2, sizeof tmp2, "%s.tmp", path2);
    static chunks_t c;
    for (int shards = 1; shards <= 3; shards++) {
        chunk_parts(&l, shards, 1001, &c); /* chunks straddling the tensors' ends */
        ps_weights_writer_t *w = begin(&l);
        for (int i = c.n - 1; i >= 0; i -= 2) put(w, &l, p, &c.pc[i]); /* backwards, every other one, */
        for (int i = c.n - 2; i >= 0; i -= 2) put(w, &l, p, &c.pc[i]); /* then the rest */
        char err[256];
        cr_assert_eq(ps_weights_commit(w, err, sizeof err), 0, "%s", err);
        char *b = slurp_file(path2, &nb);
        cr_assert_eq(nb, na);
        cr_assert_arr_eq(b, a, (size_t)na, "%d shards' parts in chunks: the same bytes, CRC included", shards);
        free(b);
        cr_assert_not(exists(tmp2), "the temp file is renamed");
    }
    ps_layout_t l2;
    float *q = NULL;
    ps_weights_meta_t meta;
    char err[256];
    cr_assert_eq(ps_weights_load(path2, &l2, &q, &meta, err, sizeof err), 0, "%s", err);
    for (int t = 0; t < l.n_tensors; t++) cr_assert_arr_eq(q + l.t[t].offset, p + l.t[t].offset, 4 * l.t[t].numel);
    free(q);
    free(a);
    free(p);
}

Test(weights, a_piece_missing_or_written_twice_fails_and_leaves_no_file)
{
    ps_layout_t l;
    float *p = make_big(&l);
    static chunks_t c;
    chunk_parts(&l, 2, 5000, &c);
    char tmp2[160], err[256] = "";
    snprintf(tmp2, sizeof tmp2, "%s.tmp", path2);
    for (int skip = 0; skip < c.n; skip += 3) { /* one piece missing */
        ps_weights_writer_t *w = begin(&l);
        cr_assert(exists(tmp2), "written to a temp file");
        for (int i = 0; i < c.n; i++)
            if (i != skip) put(w, &l, p, &c.pc[i]);
        cr_assert_eq(ps_weights_commit(w, err, sizeof err), -1, "piece %d missing: accepted", skip);
        cr_assert(strstr(err, "not each once") && strstr(err, path2), "%s", err);
        cr_assert(!exists(path2) && !exists(tmp2), "nothing left behind");
    }
    ps_weights_writer_t *w = begin(&l); /* one piece twice */
    for (int i = 0; i < c.n; i++) put(w, &l, p, &c.pc[i]);
    put(w, &l, p, &c.pc[c.n / 2]);
    cr_assert_eq(ps_weights_commit(w, err, sizeof err), -1, "a piece twice: accepted");
    cr_assert(!exists(path2) && !exists(tmp2));
    w = begin(&l); /* overlapping pieces */
    for (int i = 0; i < c.n; i++) put(w, &l, p, &c.pc[i]);
    ps_piece_t half = c.pc[0];
    half.off += half.n / 2;
    half.n = 1;
    put(w, &l, p, &half);
    cr_assert_eq(ps_weights_commit(w, err, sizeof err), -1, "overlapping pieces: accepted");
    cr_assert(!exists(path2) && !exists(tmp2));
    w = begin(&l); /* outside the model, then given up */
    cr_assert_eq(ps_weights_put(w, l.n_tensors, 0, p, 1, err, sizeof err), -1);
    cr_assert_eq(ps_weights_put(w, 0, l.t[0].numel, p, 1, err, sizeof err), -1, "past the tensor's end");
    cr_assert(strstr(err, "not in the model"), "%s", err);
    ps_weights_abort(w);
    cr_assert(!exists(path2) && !exists(tmp2), "abort leaves nothing");
    free(p);
}
