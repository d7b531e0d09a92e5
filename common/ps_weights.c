#include "ps_weights.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "ps_safetensors.h"
#include "ps_table.h"
#include "ps_util.h"

static void put_u32(uint8_t **p, uint32_t v)
{
    for (int i = 0; i < 4; i++) *(*p)++ = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t **p, uint64_t v)
{
    for (int i = 0; i < 8; i++) *(*p)++ = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_u64(const uint8_t *p) { return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32; }

/* format 2 (a model with an embedding table) adds u64 rows, u32 dim, u32 0 */
static size_t header_len(int n_sizes, int table) { return 4 + 4 + 4 + 4u * (size_t)n_sizes + 4 + 8 + 8 + 4 + 4 + (table ? 16 : 0); }

/* a run of the file written, and its CRC-32 */
typedef struct {
    uint64_t at, len;
    uint32_t crc;
} seg_t;

struct ps_weights_writer {
    ps_atomic_t file;
    bool st; /* a safetensors file: no CRC at the end */
    const ps_layout_t *l;
    uint64_t base[PS_MAX_TENSORS + 1]; /* where each tensor's floats start in the file; [n]: the CRC */
    seg_t *seg;
    size_t n_seg, cap_seg;
};

static int add_seg(ps_weights_writer_t *w, uint64_t at, const void *p, size_t len)
{
    if (w->n_seg == w->cap_seg) {
        size_t cap = w->cap_seg ? 2 * w->cap_seg : 64;
        seg_t *g = realloc(w->seg, cap * sizeof *g);
        if (!g) return -ENOMEM;
        w->seg = g;
        w->cap_seg = cap;
    }
    int rc = ps_pwrite_all(w->file.fd, p, len, at);
    if (rc == 0) w->seg[w->n_seg++] = (seg_t){at, len, (uint32_t)crc32_z(0L, p, len)};
    return rc;
}

static int seg_cmp(const void *a, const void *b)
{
    const seg_t *x = a, *y = b;
    return x->at < y->at ? -1 : x->at > y->at;
}

/* The safetensors header of l's tensors and meta (ps_weights_st.h's
 * metadata). 0, or -1. */
static int st_header(const ps_layout_t *l, const ps_weights_meta_t *meta, uint8_t **hdr, size_t *len, char *err,
                     size_t errlen)
{
    const int n = ps_layout_ntab(l);
    ps_st_out_t *t = malloc((size_t)n * sizeof *t);
    if (!t) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int i = 0; i < n; i++) {
        const ps_tensor_info_t *ti = ps_layout_tensor(l, i);
        t[i] = (ps_st_out_t){ti->name, ti->ndim, ti->shape, NULL};
    }
    char run[24], step[24], epoch[16];
    snprintf(run, sizeof run, "%016" PRIx64, meta->run_id);
    snprintf(step, sizeof step, "%" PRIu64, meta->step);
    snprintf(epoch, sizeof epoch, "%u", meta->epoch + 1);
    const char *mk[5] = {"format", "run_id", "step", "epoch", "activation"};
    const char *mv[5] = {"psd", run, step, epoch, "relu"};
    int rc = ps_st_header(t, (size_t)n, mk, mv, l->n_sizes ? 5 : 4, hdr, len, err, errlen);
    free(t);
    return rc;
}

static bool is_st(const char *path)
{
    size_t n = strlen(path), k = strlen(".safetensors");
    return n > k && strcmp(path + n - k, ".safetensors") == 0;
}

/* psd's header of l's weights (formats 1 to 3) into a new buffer. 0, or -1. */
static int psd_header(const ps_layout_t *l, const ps_weights_meta_t *meta, uint8_t **out, size_t *len)
{
    int table = l->table >= 0;
    uint8_t *tb = NULL;
    size_t tlen = 0;
    if (l->n_sizes == 0 && ps_table_pack(l, &tb, &tlen) != 0) return -1;
    uint8_t *hdr = malloc(64 + 4 * (PS_MAX_LAYERS + 1) + tlen), *p = hdr;
    if (!hdr) {
        free(tb);
        return -1;
    }
    memcpy(p, "PSDW", 4);
    p += 4;
    if (l->n_sizes == 0) { /* format 3: any table */
        put_u32(&p, PS_WEIGHTS_FORMAT_TENSORS);
        put_u32(&p, (uint32_t)tlen);
        memcpy(p, tb, tlen);
        p += tlen;
        free(tb);
    } else {
        put_u32(&p, table ? PS_WEIGHTS_FORMAT_TABLE : PS_WEIGHTS_FORMAT);
        put_u32(&p, (uint32_t)l->n_sizes);
        for (int i = 0; i < l->n_sizes; i++) put_u32(&p, (uint32_t)l->sizes[i]);
        put_u32(&p, 0); /* relu */
    }
    put_u64(&p, meta->run_id);
    put_u64(&p, meta->step);
    put_u32(&p, meta->epoch);
    put_u32(&p, 0);
    if (table && l->n_sizes) {
        put_u64(&p, (uint64_t)l->t[l->table].rows);
        put_u32(&p, (uint32_t)l->t[l->table].cols);
        put_u32(&p, 0);
    }
    *out = hdr;
    *len = (size_t)(p - hdr);
    return 0;
}

ps_weights_writer_t *ps_weights_begin(const char *path, const ps_layout_t *l, const ps_weights_meta_t *meta,
                                      char *err, size_t errlen)
{
    uint8_t *hdr;
    size_t hlen;
    const bool st = is_st(path);
    if (st ? st_header(l, meta, &hdr, &hlen, err, errlen) != 0 : psd_header(l, meta, &hdr, &hlen) != 0) {
        if (!st) snprintf(err, errlen, "%s: out of memory", path);
        return NULL;
    }
    ps_weights_writer_t *w = calloc(1, sizeof *w);
    int rc = w ? ps_atomic_open(&w->file, path) : -ENOMEM;
    if (rc != 0) {
        snprintf(err, errlen, "%s: cannot write: %s", path, strerror(-rc));
        free(w);
        free(hdr);
        return NULL;
    }
    w->l = l;
    w->st = st;
    w->base[0] = hlen;
    for (int t = 0; t < l->n_tensors; t++) w->base[t + 1] = w->base[t] + 4 * (uint64_t)l->t[t].numel;
    rc = add_seg(w, 0, hdr, hlen);
    free(hdr);
    if (rc != 0) {
        snprintf(err, errlen, "%s: cannot write: %s", path, strerror(-rc));
        ps_weights_abort(w);
        return NULL;
    }
    return w;
}

int ps_weights_put(ps_weights_writer_t *w, int t, uint64_t off, const float *src, size_t n, char *err,
                   size_t errlen)
{
    if (t < 0 || t >= w->l->n_tensors || off > w->l->t[t].numel || n > w->l->t[t].numel - off) {
        snprintf(err, errlen, "%s: floats [%llu, +%zu) of tensor %d are not in the model", w->file.path,
                 (unsigned long long)off, n, t);
        return -1;
    }
    int rc = n ? add_seg(w, w->base[t] + 4 * off, src, 4 * n) : 0; /* x86-64/arm64: little-endian */
    if (rc != 0) {
        snprintf(err, errlen, "%s: cannot write: %s", w->file.path, strerror(-rc));
        return -1;
    }
    return 0;
}

int ps_weights_commit(ps_weights_writer_t *w, char *err, size_t errlen)
{
    const uint64_t end = w->base[w->l->n_tensors];
    qsort(w->seg, w->n_seg, sizeof *w->seg, seg_cmp);
    uLong crc = 0;
    uint64_t at = 0;
    size_t i = 0;
    for (; i < w->n_seg && w->seg[i].at == at; i++) { /* stops at a gap or an overlap */
        crc = i ? crc32_combine64(crc, w->seg[i].crc, (z_off64_t)w->seg[i].len) : w->seg[i].crc;
        at += w->seg[i].len;
    }
    if (at != end || i != w->n_seg) {
        snprintf(err, errlen, "%s: the pieces written cover bytes [0, %llu) of %llu, not each once",
                 w->file.path, (unsigned long long)at, (unsigned long long)end);
        ps_weights_abort(w);
        return -1;
    }
    uint8_t tail[4], *q = tail;
    put_u32(&q, (uint32_t)crc);
    char path[4096];
    snprintf(path, sizeof path, "%s", w->file.path);
    int rc = w->st ? 0 : ps_pwrite_all(w->file.fd, tail, sizeof tail, end);
    if (rc != 0) {
        ps_weights_abort(w);
    } else {
        rc = ps_atomic_commit(&w->file);
        free(w->seg);
        free(w);
    }
    if (rc != 0) {
        snprintf(err, errlen, "%s: cannot write: %s", path, strerror(-rc));
        return -1;
    }
    return 0;
}

void ps_weights_abort(ps_weights_writer_t *w)
{
    if (!w) return;
    ps_atomic_abort(&w->file);
    free(w->seg);
    free(w);
}

int ps_weights_save(const char *path, const ps_layout_t *l, const float *params,
                    const ps_weights_meta_t *meta, char *err, size_t errlen)
{
    ps_weights_writer_t *w = ps_weights_begin(path, l, meta, err, errlen);
    if (!w) return -1;
    for (int t = 0; t < l->n_tensors; t++)
        if (ps_weights_put(w, t, 0, params + l->t[t].offset, l->t[t].numel, err, errlen) != 0) {
            ps_weights_abort(w);
            return -1;
        }
    return ps_weights_commit(w, err, errlen);
}

/* The tensors after the header's hlen bytes into arena, and the CRC-32 of
 * all the file's bytes before it checked. 0, or -1 with a message. */
static int read_tensors(FILE *f, const ps_layout_t *l, float *arena, size_t hlen, char *err, size_t errlen,
                        const char *path)
{
    uint8_t *head = malloc(hlen);
    if (!head || fseek(f, 0, SEEK_SET) != 0 || fread(head, 1, hlen, f) != hlen) {
        free(head);
        goto io;
    }
    uLong crc = crc32_z(0L, head, hlen);
    free(head);
    for (int t = 0; t < l->n_tensors; t++) { /* x86-64/arm64: little-endian */
        float *dst = arena + l->t[t].offset;
        if (fread(dst, sizeof(float), l->t[t].numel, f) != l->t[t].numel) goto io;
        crc = crc32_z(crc, (const Bytef *)dst, 4 * l->t[t].numel);
    }
    uint8_t tail[4];
    if (fread(tail, 1, 4, f) != 4) goto io;
    if ((uint32_t)crc != get_u32(tail)) {
        snprintf(err, errlen, "%s: checksum mismatch (corrupt or truncated file)", path);
        return -1;
    }
    return 0;
io:
    snprintf(err, errlen, "%s: read error: %s", path, strerror(errno ? errno : EIO));
    return -1;
}

int ps_weights_load(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta,
                    char *err, size_t errlen)
{
    int rc = -1;
    float *arena = NULL;
    *params = NULL;
    memset(l, 0, sizeof *l);
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "%s: %s", path, strerror(errno));
        return -1;
    }
    if (fseek(f, 0, SEEK_END) != 0) goto io;
    long flen = ftell(f);
    if (flen < 0 || fseek(f, 0, SEEK_SET) != 0) goto io;
    if (flen < 16 || flen > (1L << 34)) {
        snprintf(err, errlen, "%s: not a psd weights file (%ld bytes)", path, flen);
        goto out;
    }
    /* the header, then the tensors read straight into the arena (the model
     * is in memory once), the CRC computed as they come */
    uint8_t buf[64 + 4 * (PS_MAX_LAYERS + 1)];
    size_t len = (size_t)flen, got = len < sizeof buf ? len : sizeof buf;
    if (fread(buf, 1, got, f) != got) goto io;
    if (memcmp(buf, "PSDW", 4) != 0) {
        snprintf(err, errlen, "%s: not a psd weights file (bad magic)", path);
        goto out;
    }
    uint32_t format = get_u32(buf + 4);
    size_t hlen;
    if (format == PS_WEIGHTS_FORMAT_TENSORS) { /* the table, then as the others */
        uint32_t tlen = get_u32(buf + 8);
        if (len < 12 + (size_t)tlen + 24 + 4 || tlen > (64u << 20)) {
            snprintf(err, errlen, "%s: truncated header", path);
            goto out;
        }
        uint8_t *tb = malloc(tlen + 24 ? tlen + 24 : 1);
        if (!tb || fseek(f, 12, SEEK_SET) != 0 || fread(tb, 1, tlen + 24, f) != tlen + 24) {
            free(tb);
            goto io;
        }
        char why[400];
        int bad = ps_table_unpack(tb, tlen, l, why, sizeof why);
        if (bad) snprintf(err, errlen, "%s: %s", path, why);
        meta->run_id = get_u64(tb + tlen);
        meta->step = get_u64(tb + tlen + 8);
        meta->epoch = get_u32(tb + tlen + 16);
        free(tb);
        if (bad) goto out;
        hlen = 12 + (size_t)tlen + 24;
        goto body;
    }
    if (format != PS_WEIGHTS_FORMAT && format != PS_WEIGHTS_FORMAT_TABLE) {
        snprintf(err, errlen, "%s: weights format %u, this psd reads %u to %u", path, format, PS_WEIGHTS_FORMAT,
                 PS_WEIGHTS_FORMAT_TENSORS);
        goto out;
    }
    int table = format == PS_WEIGHTS_FORMAT_TABLE;
    uint32_t n_sizes = get_u32(buf + 8);
    if (n_sizes < 2 || n_sizes > PS_MAX_LAYERS + 1 || len < header_len((int)n_sizes, table) + 4) {
        snprintf(err, errlen, "%s: bad layer count %u or truncated header", path, n_sizes);
        goto out;
    }
    int sizes[PS_MAX_LAYERS + 1];
    for (uint32_t i = 0; i < n_sizes; i++) {
        uint32_t s = get_u32(buf + 12 + 4 * i);
        if (s < 1 || s > (1u << 20)) {
            snprintf(err, errlen, "%s: bad layer size %u", path, s);
            goto out;
        }
        sizes[i] = (int)s;
    }
    const uint8_t *p = buf + 12 + 4 * n_sizes;
    uint64_t rows = table ? get_u64(p + 28) : 0;
    uint32_t dim = table ? get_u32(p + 36) : 0;
    if (table && (rows < 1 || dim < 1 || dim > 4096 || get_u32(p + 40) != 0)) {
        snprintf(err, errlen, "%s: bad embedding table shape %llu x %u", path, (unsigned long long)rows, dim);
        goto out;
    }
    if (ps_layout_init_table(l, sizes, (int)n_sizes, rows, (int)dim) != 0) {
        snprintf(err, errlen, "%s: bad layer sizes", path);
        goto out;
    }
    if (get_u32(p) != 0) {
        snprintf(err, errlen, "%s: unknown activation %u", path, get_u32(p));
        goto out;
    }
    meta->run_id = get_u64(p + 4);
    meta->step = get_u64(p + 12);
    meta->epoch = get_u32(p + 20);
    p += table ? 44 : 28;
    hlen = (size_t)(p - buf);
body:;
    size_t numel = 0;
    for (int t = 0; t < l->n_tensors; t++) numel += l->t[t].numel;
    if (len - 4 - hlen != 4 * numel) {
        snprintf(err, errlen, "%s: %zu bytes of weights, its model needs %zu", path, len - 4 - hlen, 4 * numel);
        goto out;
    }
    arena = calloc(l->n_params ? l->n_params : 1, sizeof(float));
    if (!arena) {
        snprintf(err, errlen, "%s: out of memory", path);
        goto out;
    }
    if (read_tensors(f, l, arena, hlen, err, errlen, path) != 0) goto out;
    *params = arena;
    arena = NULL;
    rc = 0;
    goto out;
io:
    snprintf(err, errlen, "%s: read error: %s", path, strerror(errno ? errno : EIO));
out:
    if (f) fclose(f);
    free(arena);
    if (rc != 0) ps_layout_free(l);
    return rc;
}

int ps_weights_same(const char *a, const char *b, char *why, size_t n)
{
    ps_layout_t la = {0}, lb = {0};
    float *pa = NULL, *pb = NULL;
    ps_weights_meta_t ma, mb;
    int same = -1;
    if (ps_weights_load(a, &la, &pa, &ma, why, n) != 0 || ps_weights_load(b, &lb, &pb, &mb, why, n) != 0) goto out;
    same = 0;
    if (la.n_tensors != lb.n_tensors || la.n_params != lb.n_params || la.n_sizes != lb.n_sizes ||
        memcmp(la.sizes, lb.sizes, sizeof la.sizes) != 0 || la.table != lb.table) {
        snprintf(why, n, "other models: %zu and %zu parameters in %d and %d tensors", la.n_params, lb.n_params,
                 la.n_tensors, lb.n_tensors);
        goto out;
    }
    if (ma.step != mb.step || ma.epoch != mb.epoch) {
        snprintf(why, n, "other points of a run: step %llu epoch %u and step %llu epoch %u",
                 (unsigned long long)ma.step, ma.epoch, (unsigned long long)mb.step, mb.epoch);
        goto out;
    }
    if (!ps_layout_same_table(&la, &lb, why, n)) goto out;
    for (int t = 0; t < ps_layout_ntab(&la); t++) {
        const ps_tensor_info_t *ti = ps_layout_tensor(&la, t);
        const float *x = pa + ti->offset, *y = pb + ti->offset;
        if (memcmp(x, y, ti->numel * sizeof(float)) != 0) {
            size_t i = 0;
            while (memcmp(&x[i], &y[i], sizeof(float)) == 0) i++;
            snprintf(why, n, "tensor %s differs first at element %zu: %.9g and %.9g", ti->name, i, (double)x[i],
                     (double)y[i]);
            goto out;
        }
    }
    same = 1;
out:
    free(pa);
    free(pb);
    ps_layout_free(&la);
    ps_layout_free(&lb);
    return same;
}
