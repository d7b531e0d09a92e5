/* psd_ckpt.c - crash-consistent background checkpoints (format in psd_ckpt.h).
 *
 * Threads: the writer thread streams the file; the main thread (the one that
 * runs psd_store_step) calls psd_ckpt_before_update. They share the per-chunk
 * state of the optimizer slots, under wr->mu:
 *   LIVE    the writer has not reached the chunk; the slot memory still holds
 *           the snapshot values (the main thread must not change it before
 *           copying it aside)
 *   COPIED  the main thread copied the snapshot values to side[s][c]; it may
 *           change the slot memory; the writer writes (and frees) the copy
 *   SAVED   the writer has the chunk's snapshot values (in its bounce buffer
 *           or written); the main thread may change the slot memory
 * The weights arena needs none of this: a referenced arena is never reused
 * by psd_store_step (see psd_store.h). */
#include "psd_ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "ps_assert.h"
#include "ps_table.h"
#include "ps_util.h"

/* Arenas are written as the host's floats; the format is little-endian. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "psd_ckpt assumes a little-endian host");

#define CKPT_CHUNK_FLOATS ((size_t)262144) /* 1 MiB copy-on-write unit */
#define CKPT_CHUNK_BYTES (CKPT_CHUNK_FLOATS * sizeof(float))
#define CKPT_RUN_MAX (1024 + 4 + PS_OFFER_MAX) /* the run block's bytes, at most (format 6) */
#define CKPT_HDR_LEN 232                   /* "PSDC", format, meta (see meta_pack) */
#define CKPT_HDR_LEN_V1 216                /* format 1: no table shape */
#define CKPT_TRAILER_LEN 12                /* u64 length, u32 CRC */
#define CKPT_MAX_TRAIN ((uint64_t)1 << 32) /* bits in seen */
#define CKPT_MAX_SIZE (1 << 20)            /* units per layer */
#define CKPT_IO_BYTES ((size_t)1 << 20)    /* read/write unit */

enum { CHUNK_LIVE = 0, CHUNK_COPIED, CHUNK_SAVED };

/* A run of an arena's floats that the file holds: [off, off + n) */
typedef struct {
    uint64_t off, n;
} span_t;

/* The floats of each arena the file holds, in order (format 4): a psd
 * shard's pieces of the tensors (ps_shard_pieces), one psd's whole arena;
 * files of format 1 to 3 hold whole arenas. Returns how many spans, with
 * *total their floats (total may be NULL). */
static int part_spans(const psd_ckpt_meta_t *m, const ps_layout_t *l, uint32_t format, span_t out[PS_MAX_TENSORS],
                      uint64_t *total)
{
    int k = 0;
    uint64_t sum = 0;
    if (format < 4 || m->shards <= 1) {
        out[k++] = (span_t){0, m->n_params};
        sum = m->n_params;
    } else {
        ps_piece_t p[PS_MAX_TENSORS];
        ps_shard_pieces(l, (int)m->shard, (int)m->shards, p);
        for (int t = 0; t < l->n_tensors; t++)
            if (p[t].n) {
                out[k++] = (span_t){l->t[t].offset + p[t].off, p[t].n};
                sum += p[t].n;
            }
    }
    if (total) *total = sum;
    return k;
}

struct psd_ckpt_writer {
    uint8_t *table; /* the layout's packed table (format 5) */
    size_t table_len;
    uint8_t run[CKPT_RUN_MAX]; /* the run block (format 6) */
    size_t run_len;
    char *dir;
    int keep;
    psd_ckpt_meta_t meta;
    uint8_t *seen;        /* copy, seen_bytes */
    size_t seen_bytes;
    psd_arena_t *arena;   /* referenced weights (n_params floats) */
    span_t spans[PS_MAX_TENSORS]; /* what of each arena the file holds (part_spans) */
    int n_spans;
    float *slot[2];       /* the store's live slots (borrowed) */
    psd_store_t *store;   /* whose copy-on-write hook this writer is, until psd_ckpt_end */
    size_t n_chunks;      /* per slot */
    float *bounce;        /* writer's copy of a LIVE chunk (CKPT_CHUNK_BYTES) */
    double t_begin;

    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t saved_cv;    /* a chunk became SAVED, or the writer stopped */
    /* under mu: */
    uint8_t *state[2];          /* n_chunks each */
    float **side[2];            /* n_chunks each; COPIED chunks' snapshot values */
    uint64_t extra, peak_extra; /* bytes: side buffers + bounce */
    /* 1 once no chunk is LIVE (every slot chunk saved, or the writer
     * stopped): before_update's lock-free fast path */
    atomic_int settled;
    atomic_int done;

    /* results, written by the writer thread before done */
    int rc;
    double seconds;
    uint64_t bytes;
    char path[PATH_MAX];
};

/* ---- header ----------------------------------------------------------- */

static uint8_t *put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
    return p + 4;
}

static uint8_t *put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
    return p + 8;
}

static uint8_t *put_f64(uint8_t *p, double d)
{
    uint64_t v;
    memcpy(&v, &d, sizeof v);
    return put_u64(p, v);
}

static const uint8_t *get_u32(const uint8_t *p, uint32_t *v)
{
    *v = 0;
    for (int i = 0; i < 4; i++) *v |= (uint32_t)p[i] << (8 * i);
    return p + 4;
}

static const uint8_t *get_u64(const uint8_t *p, uint64_t *v)
{
    *v = 0;
    for (int i = 0; i < 8; i++) *v |= (uint64_t)p[i] << (8 * i);
    return p + 8;
}

static const uint8_t *get_f64(const uint8_t *p, double *d)
{
    uint64_t v;
    p = get_u64(p, &v);
    memcpy(d, &v, sizeof v);
    return p;
}

/* The run block (format 6): u64 train_size, test_size, n_val; u32 length
 * and the bytes of data_id; keep then stop: u32 metric length, its bytes,
 * u32 flags (1: max, 2: has), f64 min_delta, best, u32 patience, epoch,
 * bad; u64 best_version. */
static uint8_t *put_str(uint8_t *p, const char *s)
{
    size_t n = strlen(s);
    p = put_u32(p, (uint32_t)n);
    memcpy(p, s, n);
    return p + n;
}

static uint8_t *put_best(uint8_t *p, const psd_best_t *b)
{
    p = put_str(p, b->metric);
    p = put_u32(p, (b->max ? 1u : 0u) | (b->has ? 2u : 0u));
    p = put_f64(p, b->min_delta);
    p = put_f64(p, b->best);
    p = put_u32(p, (uint32_t)b->patience);
    p = put_u32(p, b->epoch);
    return put_u32(p, b->bad);
}

static size_t run_pack(uint8_t b[CKPT_RUN_MAX], const psd_ckpt_run_t *r)
{
    uint8_t *p = b;
    p = put_u64(p, r->train_size);
    p = put_u64(p, r->test_size);
    p = put_u64(p, r->n_val);
    p = put_str(p, r->data_id);
    p = put_best(p, &r->keep);
    p = put_best(p, &r->stop);
    p = put_u64(p, r->best_version);
    for (int k = 0; k < 4; k++) p = put_u64(p, r->ended[k]);
    p = put_str(p, r->offer);
    PS_ASSERT((size_t)(p - b) <= CKPT_RUN_MAX);
    return (size_t)(p - b);
}

/* A string of at most max bytes at *p (end: the block's end), NUL-terminated into out. */
static bool get_str(const uint8_t **p, const uint8_t *end, char *out, size_t max)
{
    uint32_t n;
    if (end - *p < 4) return false;
    *p = get_u32(*p, &n);
    if (n > max || (size_t)(end - *p) < n || memchr(*p, 0, n)) return false;
    memcpy(out, *p, n);
    out[n] = '\0';
    *p += n;
    return true;
}

static bool get_best(const uint8_t **p, const uint8_t *end, psd_best_t *b)
{
    uint32_t flags, patience;
    if (!get_str(p, end, b->metric, sizeof b->metric - 1) || end - *p < 4 + 8 + 8 + 4 + 4 + 4) return false;
    *p = get_u32(*p, &flags);
    *p = get_f64(*p, &b->min_delta);
    *p = get_f64(*p, &b->best);
    *p = get_u32(*p, &patience);
    *p = get_u32(*p, &b->epoch);
    *p = get_u32(*p, &b->bad);
    b->max = flags & 1u;
    b->has = (flags & 2u) != 0;
    b->patience = (int)(patience & 0x7fffffffu);
    return flags <= 3;
}

static bool run_unpack(psd_ckpt_run_t *r, const uint8_t *b, size_t n)
{
    const uint8_t *p = b, *end = b + n;
    memset(r, 0, sizeof *r);
    if (n < 24) return false;
    p = get_u64(p, &r->train_size);
    p = get_u64(p, &r->test_size);
    p = get_u64(p, &r->n_val);
    if (!get_str(&p, end, r->data_id, PS_DATA_ID_MAX) || !get_best(&p, end, &r->keep) ||
        !get_best(&p, end, &r->stop) || end - p < 8)
        return false;
    p = get_u64(p, &r->best_version);
    for (int k = 0; k < 4 && end - p >= 8; k++) p = get_u64(p, &r->ended[k]); /* absent before them: zeros */
    if (end - p >= 4 && !get_str(&p, end, r->offer, PS_OFFER_MAX)) return false; /* absent before it: "" */
    return r->n_val <= r->train_size;
}

/* The header, CKPT_HDR_LEN bytes. The field order is the file format: change
 * it only with PSD_CKPT_FORMAT. sizes[] is always written in full (unused
 * entries zero), so the header has a fixed length. */
static void meta_pack(uint8_t b[CKPT_HDR_LEN], const psd_ckpt_meta_t *m)
{
    uint8_t *p = b;
    memcpy(p, "PSDC", 4);
    p += 4;
    p = put_u32(p, PSD_CKPT_FORMAT);
    p = put_u64(p, m->run_id);
    p = put_u64(p, m->config_hash);
    p = put_u64(p, m->seed);
    p = put_u64(p, m->step);
    p = put_u64(p, m->version);
    p = put_u32(p, m->epoch);
    p = put_u32(p, m->epoch_done);
    p = put_u64(p, m->epoch_step);
    p = put_f64(p, m->steps_per_epoch);
    p = put_f64(p, m->ep_loss);
    p = put_u64(p, m->ep_correct);
    p = put_u64(p, m->ep_samples);
    p = put_f64(p, m->train_s_total);
    p = put_u64(p, m->samples_total);
    p = put_f64(p, m->lr);
    p = put_u64(p, m->train_count);
    p = put_u32(p, (uint32_t)m->n_sizes);
    for (int i = 0; i < PS_MAX_LAYERS + 1; i++)
        p = put_u32(p, i < m->n_sizes ? (uint32_t)m->sizes[i] : 0);
    p = put_u32(p, m->opt_kind);
    p = put_u32(p, m->n_slots);
    p = put_u64(p, m->n_params);
    p = put_u64(p, m->table_rows);
    p = put_u32(p, m->table_dim);
    const uint32_t shards = m->shards ? m->shards : 1; /* 0: one psd */
    PS_ASSERT(shards <= 0xffff && m->shard < shards);
    p = put_u32(p, shards << 16 | m->shard); /* format 3 */
    PS_ASSERT(p - b == CKPT_HDR_LEN);
}

/* Length of the header of a file whose first 8 bytes are b, 0 if unknown. */
static size_t hdr_len(const uint8_t b[8])
{
    uint32_t format;
    get_u32(b + 4, &format);
    if (memcmp(b, "PSDC", 4) != 0) return 0;
    return format >= 2 && format <= PSD_CKPT_FORMAT ? CKPT_HDR_LEN : format == 1 ? CKPT_HDR_LEN_V1 : 0;
}

/* Parse and sanity-check a header (hdr_len(b) bytes): its format and model
 * layout too. NULL, or the reason it is unusable. */
static const char *header_unpack(psd_ckpt_meta_t *m, uint32_t *format_out, ps_layout_t *lp,
                                 const uint8_t b[CKPT_HDR_LEN], const uint8_t *table, size_t table_len)
{
    const uint8_t *p = b + 8;
    uint32_t format, n_sizes, sizes[PS_MAX_LAYERS + 1], reserved = 0;
    if (memcmp(b, "PSDC", 4) != 0) return "bad magic";
    get_u32(b + 4, &format);
    if (!hdr_len(b)) return "unknown format version";
    memset(m, 0, sizeof *m);
    p = get_u64(p, &m->run_id);
    p = get_u64(p, &m->config_hash);
    p = get_u64(p, &m->seed);
    p = get_u64(p, &m->step);
    p = get_u64(p, &m->version);
    p = get_u32(p, &m->epoch);
    p = get_u32(p, &m->epoch_done);
    p = get_u64(p, &m->epoch_step);
    p = get_f64(p, &m->steps_per_epoch);
    p = get_f64(p, &m->ep_loss);
    p = get_u64(p, &m->ep_correct);
    p = get_u64(p, &m->ep_samples);
    p = get_f64(p, &m->train_s_total);
    p = get_u64(p, &m->samples_total);
    p = get_f64(p, &m->lr);
    p = get_u64(p, &m->train_count);
    p = get_u32(p, &n_sizes);
    for (int i = 0; i < PS_MAX_LAYERS + 1; i++) p = get_u32(p, &sizes[i]);
    p = get_u32(p, &m->opt_kind);
    p = get_u32(p, &m->n_slots);
    p = get_u64(p, &m->n_params);
    if (format >= 2) {
        p = get_u64(p, &m->table_rows);
        p = get_u32(p, &m->table_dim);
        p = get_u32(p, &reserved);
    }
    PS_ASSERT((size_t)(p - b) == hdr_len(b));
    if (format >= 3) { /* the shard layout */
        m->shards = reserved >> 16;
        m->shard = reserved & 0xffff;
        if (m->shards < 1 || m->shards > PS_MAX_SHARDS || m->shard >= m->shards) return "bad psd shard fields";
    } else if (reserved != 0) {
        return "bad reserved field";
    }

    ps_layout_t *const l = lp;
    char why[400];
    if (format >= 5 && ps_table_unpack(table, table_len, l, why, sizeof why) != 0) return "bad tensor table";
    if (format >= 5 && n_sizes == 0) { /* any table: it is the model */
        for (uint32_t i = 0; i < PS_MAX_LAYERS + 1; i++)
            if (sizes[i] != 0) return "bad layer size";
        uint64_t rows = l->table >= 0 ? (uint64_t)l->t[l->table].rows : 0, dim = l->table >= 0 ? l->t[l->table].cols : 0;
        if (l->n_params != m->n_params || m->table_rows != rows || m->table_dim != dim)
            return "parameter count does not match the tensor table";
        goto checked;
    }
    if (n_sizes < 2 || n_sizes > PS_MAX_LAYERS + 1) return "bad layer count";
    for (uint32_t i = 0; i < PS_MAX_LAYERS + 1; i++) {
        if (i < n_sizes && (sizes[i] < 1 || sizes[i] > CKPT_MAX_SIZE)) return "bad layer size";
        if (i >= n_sizes && sizes[i] != 0) return "bad layer size";
    }
    m->n_sizes = (int)n_sizes;
    for (uint32_t i = 0; i < n_sizes; i++) m->sizes[i] = (int)sizes[i];
    ps_layout_t bl;
    if (m->table_rows > UINT32_MAX || m->table_dim > 4096 || (m->table_rows && !m->table_dim) ||
        ps_layout_init_table(&bl, m->sizes, m->n_sizes, m->table_rows, (int)m->table_dim) != 0 ||
        bl.n_params != m->n_params)
        return "parameter count does not match the layer sizes";
    if (format >= 5 && !ps_layout_same_table(&bl, l, why, sizeof why)) return "its tensor table is not its sizes'";
    ps_layout_free(l);
    *l = bl;
checked:
    if (m->n_slots > 2) return "bad optimizer slot count";
    if (m->train_count > CKPT_MAX_TRAIN) return "bad training set size";
    *format_out = format;
    m->table_crc = psd_ckpt_table_crc(l);
    return NULL;
}

/* header_unpack into l_out (its own: ps_layout_free), nothing kept on failure */
static const char *meta_unpack(psd_ckpt_meta_t *m, uint32_t *format_out, ps_layout_t *l_out,
                               const uint8_t b[CKPT_HDR_LEN], const uint8_t *table, size_t table_len)
{
    ps_layout_t l = {0};
    const char *why = header_unpack(m, format_out, &l, b, table, table_len);
    if (why) ps_layout_free(&l);
    else *l_out = l;
    return why;
}

uint32_t psd_ckpt_table_crc(const ps_layout_t *l)
{
    uint8_t *b;
    size_t n;
    if (ps_table_pack(l, &b, &n) != 0) return 0;
    uint32_t crc = (uint32_t)crc32(crc32(0, Z_NULL, 0), b, (uInt)n);
    free(b);
    return crc;
}

/* File length implied by a (checked) header of hlen bytes whose arenas hold
 * part floats each. */
static uint64_t file_len(const psd_ckpt_meta_t *m, size_t hlen, uint64_t part)
{
    return hlen + (m->train_count + 7) / 8 + (1 + (uint64_t)m->n_slots) * part * sizeof(float) + CKPT_TRAILER_LEN;
}

/* ---- names ------------------------------------------------------------ */

/* Parse "<prefix><digits><suffix>" exactly; 1 with *step, else 0. */
static int parse_name(const char *name, const char *prefix, const char *suffix, uint64_t *step)
{
    size_t lp = strlen(prefix), ls = strlen(suffix), ln = strlen(name);
    if (ln <= lp + ls || strncmp(name, prefix, lp) != 0 || strcmp(name + ln - ls, suffix) != 0)
        return 0;
    uint64_t v = 0;
    size_t nd = ln - lp - ls;
    if (nd > 19) return 0; /* no overflow */
    for (size_t i = lp; i < lp + nd; i++) {
        if (name[i] < '0' || name[i] > '9') return 0;
        v = v * 10 + (uint64_t)(name[i] - '0');
    }
    *step = v;
    return 1;
}

typedef struct {
    uint64_t step;
    char name[256];
} ckpt_ent_t;

static int ent_cmp_desc(const void *a, const void *b)
{
    const ckpt_ent_t *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? 1 : -1;
    return strcmp(y->name, x->name);
}

/* The ckpt-*.psdc names in dir, newest (highest step) first; caller frees
 * *ents. With tmp_other, also unlinks .ckpt-*.psdc.tmp files of other
 * steps than it (left by a killed writer). 0 or -errno. */
static int list_ckpts(const char *dir, ckpt_ent_t **ents, size_t *n, const uint64_t *tmp_other)
{
    DIR *d = opendir(dir);
    ckpt_ent_t *v = NULL;
    size_t len = 0, cap = 0;
    int rc = 0;
    if (!d) {
        rc = -errno;
        goto out;
    }
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        uint64_t step;
        if (tmp_other && parse_name(e->d_name, ".ckpt-", ".psdc.tmp", &step) && step != *tmp_other) {
            (void)unlinkat(dirfd(d), e->d_name, 0);
            continue;
        }
        if (!parse_name(e->d_name, "ckpt-", ".psdc", &step) || strlen(e->d_name) >= sizeof v->name)
            continue;
        if (len == cap) {
            size_t ncap = cap ? 2 * cap : 16;
            ckpt_ent_t *nv = realloc(v, ncap * sizeof *nv);
            if (!nv) {
                rc = -ENOMEM;
                goto out;
            }
            v = nv;
            cap = ncap;
        }
        v[len].step = step;
        snprintf(v[len].name, sizeof v[len].name, "%s", e->d_name);
        len++;
    }
    if (len > 1) qsort(v, len, sizeof *v, ent_cmp_desc);
out:
    if (d) closedir(d);
    if (rc != 0) {
        free(v);
        v = NULL;
        len = 0;
    }
    *ents = v;
    *n = len;
    return rc;
}

static int fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    int rc = fsync(fd) != 0 ? -errno : 0;
    close(fd);
    return rc;
}

/* ---- writer thread ---------------------------------------------------- */

typedef struct {
    int fd;
    uLong crc;
    uint64_t len;
} ckpt_out_t;

static int out_write(ckpt_out_t *o, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    for (size_t left = n; left > 0;) {
        size_t k = left < CKPT_IO_BYTES ? left : CKPT_IO_BYTES;
        o->crc = crc32(o->crc, p, (uInt)k);
        p += k;
        left -= k;
    }
    o->len += n;
    return ps_write_all(o->fd, buf, n);
}

/* Mark every chunk settled (none LIVE any more), drop the side copies and
 * wake waiters. Called when the writer stops, on success or failure. */
static void settle(psd_ckpt_writer_t *wr)
{
    pthread_mutex_lock(&wr->mu);
    for (uint32_t s = 0; s < wr->meta.n_slots; s++)
        for (size_t c = 0; c < wr->n_chunks; c++) {
            if (wr->side[s][c]) {
                free(wr->side[s][c]);
                wr->side[s][c] = NULL;
            }
            wr->state[s][c] = CHUNK_SAVED;
        }
    wr->extra = 0;
    atomic_store_explicit(&wr->settled, 1, memory_order_release);
    pthread_cond_broadcast(&wr->saved_cv);
    pthread_mutex_unlock(&wr->mu);
}

/* Write what the file holds of floats [off, off + cnt) of an arena, whose
 * values are at src: its spans' parts of them, in order. */
static int write_part(psd_ckpt_writer_t *wr, ckpt_out_t *o, const float *src, uint64_t off, uint64_t cnt)
{
    for (int i = 0; i < wr->n_spans; i++) {
        uint64_t lo = wr->spans[i].off > off ? wr->spans[i].off : off;
        uint64_t hi = wr->spans[i].off + wr->spans[i].n < off + cnt ? wr->spans[i].off + wr->spans[i].n : off + cnt;
        int rc = lo < hi ? out_write(o, src + (lo - off), (size_t)(hi - lo) * sizeof(float)) : 0;
        if (rc != 0) return rc;
    }
    return 0;
}

/* 1 when chunk c holds floats the file holds */
static int chunk_in_part(const psd_ckpt_writer_t *wr, size_t c)
{
    const uint64_t lo = (uint64_t)c * CKPT_CHUNK_FLOATS, hi = lo + CKPT_CHUNK_FLOATS;
    for (int i = 0; i < wr->n_spans; i++)
        if (wr->spans[i].off < hi && wr->spans[i].off + wr->spans[i].n > lo) return 1;
    return 0;
}

/* Write slot s: each chunk's snapshot values, from its side copy if the main
 * thread made one, else from the live memory through the bounce buffer.
 * Chunks outside the part were SAVED from the start. */
static int write_slot(psd_ckpt_writer_t *wr, ckpt_out_t *o, uint32_t s)
{
    const size_t n = wr->meta.n_params;
    for (size_t c = 0; c < wr->n_chunks; c++) {
        size_t off = c * CKPT_CHUNK_FLOATS;
        size_t cnt = n - off < CKPT_CHUNK_FLOATS ? n - off : CKPT_CHUNK_FLOATS;
        float *src;
        pthread_mutex_lock(&wr->mu);
        if (wr->state[s][c] == CHUNK_SAVED) { /* not the file's */
            if (s + 1 == wr->meta.n_slots && c + 1 == wr->n_chunks)
                atomic_store_explicit(&wr->settled, 1, memory_order_release);
            pthread_mutex_unlock(&wr->mu);
            continue;
        }
        if (wr->state[s][c] == CHUNK_COPIED) {
            src = wr->side[s][c];
            wr->side[s][c] = NULL;
        } else {
            /* LIVE: the main thread waits on mu before changing it */
            memcpy(wr->bounce, wr->slot[s] + off, cnt * sizeof(float));
            src = wr->bounce;
        }
        wr->state[s][c] = CHUNK_SAVED;
        if (s + 1 == wr->meta.n_slots && c + 1 == wr->n_chunks)
            atomic_store_explicit(&wr->settled, 1, memory_order_release);
        pthread_cond_broadcast(&wr->saved_cv);
        pthread_mutex_unlock(&wr->mu);

        int rc = write_part(wr, o, src, off, cnt);
        if (src != wr->bounce) {
            free(src);
            pthread_mutex_lock(&wr->mu);
            wr->extra -= CKPT_CHUNK_BYTES;
            pthread_mutex_unlock(&wr->mu);
        }
        if (rc != 0) return rc;
    }
    return 0;
}

/* Keep the newest `keep` checkpoints (and always the one just written). */
/* Keep the newest `keep` checkpoints up to the one written, and that of
 * meta.keep_step. Those of later steps are from before a resume at an
 * older step (the run went back from them): renamed NAME.superseded, which
 * a resume does not take (it would), and kept for whoever wants them. */
static void prune(psd_ckpt_writer_t *wr, const char *written)
{
    ckpt_ent_t *ents;
    size_t n, kept = 0;
    if (list_ckpts(wr->dir, &ents, &n, &wr->meta.step) != 0) return;
    for (size_t i = 0; i < n; i++) {
        char p[PATH_MAX];
        snprintf(p, sizeof p, "%s/%s", wr->dir, ents[i].name);
        if (strcmp(p, written) == 0 || (ents[i].step < wr->meta.step && kept < (size_t)wr->keep)) {
            kept++;
            continue;
        }
        if (ents[i].step == wr->meta.step || ents[i].step == wr->meta.keep_step) continue;
        if (ents[i].step > wr->meta.step) {
            char q[PATH_MAX + 16];
            snprintf(q, sizeof q, "%s.superseded", p);
            (void)rename(p, q);
        } else {
            (void)unlink(p);
        }
    }
    free(ents);
}

static int test_delay_ms;

void psd_ckpt_test_delay(int ms) { test_delay_ms = ms; }

static void *writer_main(void *arg)
{
    psd_ckpt_writer_t *wr = arg;
    ckpt_out_t o = {.fd = -1, .crc = crc32(0, Z_NULL, 0), .len = 0};
    char tmp[PATH_MAX];
    uint8_t hdr[CKPT_HDR_LEN], trailer[CKPT_TRAILER_LEN];
    int rc = 0;

    snprintf(tmp, sizeof tmp, "%s/.ckpt-%012llu.psdc.tmp", wr->dir, (unsigned long long)wr->meta.step);
    o.fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (o.fd < 0) {
        rc = -errno;
        goto out;
    }
    meta_pack(hdr, &wr->meta);
    if ((rc = out_write(&o, hdr, sizeof hdr)) != 0) goto out;
    uint8_t tl[4];
    put_u32(tl, (uint32_t)wr->table_len);
    if ((rc = out_write(&o, tl, sizeof tl)) != 0 || (rc = out_write(&o, wr->table, wr->table_len)) != 0) goto out;
    put_u32(tl, (uint32_t)wr->run_len);
    if ((rc = out_write(&o, tl, sizeof tl)) != 0 || (rc = out_write(&o, wr->run, wr->run_len)) != 0) goto out;
    if (wr->seen_bytes && (rc = out_write(&o, wr->seen, wr->seen_bytes)) != 0) goto out;
    for (int i = 0; i < wr->n_spans; i++)
        if ((rc = out_write(&o, wr->arena->w + wr->spans[i].off, (size_t)wr->spans[i].n * sizeof(float))) != 0)
            goto out;
    for (uint32_t s = 0; s < wr->meta.n_slots; s++)
        if ((rc = write_slot(wr, &o, s)) != 0) goto out;
    /* the CRC covers the length field too: every byte before the CRC */
    put_u64(trailer, o.len);
    o.crc = crc32(o.crc, trailer, 8);
    put_u32(trailer + 8, (uint32_t)o.crc);
    if ((rc = ps_write_all(o.fd, trailer, sizeof trailer)) != 0) goto out;
    o.len += sizeof trailer;
    if (fsync(o.fd) != 0) {
        rc = -errno;
        goto out;
    }
    int fd = o.fd;
    o.fd = -1;
    if (close(fd) != 0) {
        rc = -errno;
        goto out;
    }
    if (test_delay_ms > 0) { /* --x-slow-ckpt-ms: a slow disk */
        struct timespec ts = {test_delay_ms / 1000, (long)(test_delay_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    }
    if (rename(tmp, wr->path) != 0) {
        rc = -errno;
        goto out;
    }
    /* the rename is durable only once the directory is */
    if ((rc = fsync_dir(wr->dir)) != 0) goto out;
    wr->bytes = o.len;
    prune(wr, wr->path);
out:
    if (o.fd >= 0) close(o.fd);
    if (rc != 0) (void)unlink(tmp); /* ENOENT once renamed */
    settle(wr);
    wr->rc = rc;
    wr->seconds = ps_now() - wr->t_begin;
    atomic_store_explicit(&wr->done, 1, memory_order_release);
    return NULL;
}

/* ---- main-thread API -------------------------------------------------- */

static void writer_free(psd_ckpt_writer_t *wr)
{
    if (!wr) return;
    for (int s = 0; s < 2; s++) {
        if (wr->side[s])
            for (size_t c = 0; c < wr->n_chunks; c++) free(wr->side[s][c]);
        free(wr->side[s]);
        free(wr->state[s]);
    }
    if (wr->arena) psd_store_frame_free(NULL, wr->arena);
    free(wr->bounce);
    free(wr->seen);
    free(wr->dir);
    free(wr->table);
    free(wr);
}

int psd_ckpt_begin(psd_ckpt_writer_t **out, const char *dir, int keep, const psd_ckpt_meta_t *meta,
                   const uint8_t *seen, psd_store_t *store)
{
    psd_ckpt_writer_t *wr = NULL;
    int rc = 0, sync_init = 0;
    ps_layout_t l;
    *out = NULL;
    if (store) l = store->layout;
    if (!dir || !meta || !store || meta->n_slots > 2 || meta->train_count > CKPT_MAX_TRAIN ||
        meta->shards > PS_MAX_SHARDS || meta->shard >= (meta->shards ? meta->shards : 1) ||
        (meta->train_count && !seen) || meta->table_rows > UINT32_MAX ||
        (meta->n_sizes && meta->table_dim > 4096) || meta->n_sizes != l.n_sizes ||
        memcmp(meta->sizes, l.sizes, sizeof l.sizes) != 0 || meta->n_params != l.n_params ||
        meta->table_rows != (l.table >= 0 ? l.t[l.table].rows : 0) ||
        meta->table_dim != (l.table >= 0 ? l.t[l.table].cols : 0) ||
        (meta->n_slots >= 1 && !store->s0) || (meta->n_slots >= 2 && !store->s1)) {
        rc = -EINVAL;
        goto out;
    }
    for (int i = 0; i < meta->n_sizes; i++)
        if (meta->sizes[i] > CKPT_MAX_SIZE) {
            rc = -EINVAL;
            goto out;
        }
    if (!(wr = calloc(1, sizeof *wr))) {
        rc = -ENOMEM;
        goto out;
    }
    wr->t_begin = ps_now();
    wr->keep = keep;
    wr->meta = *meta;
    if (ps_table_pack(&l, &wr->table, &wr->table_len) != 0) {
        rc = -ENOMEM;
        goto out;
    }
    wr->run_len = run_pack(wr->run, &meta->run);
    wr->seen_bytes = (size_t)((meta->train_count + 7) / 8);
    wr->n_chunks = (meta->n_params + CKPT_CHUNK_FLOATS - 1) / CKPT_CHUNK_FLOATS;
    wr->n_spans = part_spans(meta, &l, PSD_CKPT_FORMAT, wr->spans, NULL);
    if ((size_t)snprintf(wr->path, sizeof wr->path, "%s/.ckpt-%012llu.psdc.tmp", dir,
                         (unsigned long long)meta->step) >= sizeof wr->path) {
        rc = -ENAMETOOLONG;
        goto out;
    }
    snprintf(wr->path, sizeof wr->path, "%s/ckpt-%012llu.psdc", dir, (unsigned long long)meta->step);
    if (!(wr->dir = strdup(dir)) || (wr->seen_bytes && !(wr->seen = malloc(wr->seen_bytes)))) {
        rc = -ENOMEM;
        goto out;
    }
    if (wr->seen_bytes) memcpy(wr->seen, seen, wr->seen_bytes);
    wr->slot[0] = store->s0;
    wr->slot[1] = store->s1;
    size_t live = 0;
    for (uint32_t s = 0; s < meta->n_slots; s++) {
        wr->state[s] = calloc(wr->n_chunks ? wr->n_chunks : 1, 1); /* CHUNK_LIVE */
        wr->side[s] = calloc(wr->n_chunks ? wr->n_chunks : 1, sizeof(float *));
        if (!wr->state[s] || !wr->side[s]) {
            rc = -ENOMEM;
            goto out;
        }
        for (size_t c = 0; c < wr->n_chunks; c++) /* a shard's: the rest is not its to save */
            if (chunk_in_part(wr, c)) live++;
            else wr->state[s][c] = CHUNK_SAVED;
    }
    if (meta->n_slots > 0) {
        if (!(wr->bounce = malloc(CKPT_CHUNK_BYTES))) {
            rc = -ENOMEM;
            goto out;
        }
        wr->extra = wr->peak_extra = CKPT_CHUNK_BYTES;
    }
    atomic_init(&wr->settled, live == 0);
    atomic_init(&wr->done, 0);
    if ((rc = -pthread_mutex_init(&wr->mu, NULL)) != 0) goto out;
    if ((rc = -pthread_cond_init(&wr->saved_cv, NULL)) != 0) {
        pthread_mutex_destroy(&wr->mu);
        goto out;
    }
    sync_init = 1;
    wr->arena = psd_store_ref_current(store);
    if ((rc = -pthread_create(&wr->thread, NULL, writer_main, wr)) != 0) goto out;
    wr->store = store; /* the optimizer slots are saved copy-on-write from now on */
    store->before_update = psd_ckpt_hook;
    store->before_update_ud = wr;
    *out = wr;
    wr = NULL;
out:
    if (wr && sync_init) {
        pthread_cond_destroy(&wr->saved_cv);
        pthread_mutex_destroy(&wr->mu);
    }
    writer_free(wr);
    return rc;
}

void psd_ckpt_hook(void *ud, size_t off, size_t n) { psd_ckpt_before_update(ud, off, n); }

void psd_ckpt_before_update(psd_ckpt_writer_t *wr, size_t off, size_t n)
{
    if (!wr || n == 0 || atomic_load_explicit(&wr->settled, memory_order_acquire)) return;
    if (off >= wr->meta.n_params) return;
    if (n > wr->meta.n_params - off) n = wr->meta.n_params - off;
    const size_t c0 = off / CKPT_CHUNK_FLOATS, c1 = (off + n - 1) / CKPT_CHUNK_FLOATS;
    for (uint32_t s = 0; s < wr->meta.n_slots; s++) {
        for (size_t c = c0; c <= c1; c++) {
            pthread_mutex_lock(&wr->mu);
            int live = wr->state[s][c] == CHUNK_LIVE;
            pthread_mutex_unlock(&wr->mu);
            if (!live) continue;
            /* Copy outside the lock: only this thread changes the slots, and
             * the writer only reads them. */
            size_t coff = c * CKPT_CHUNK_FLOATS;
            size_t cnt = wr->meta.n_params - coff < CKPT_CHUNK_FLOATS ? wr->meta.n_params - coff
                                                                      : CKPT_CHUNK_FLOATS;
            float *copy = malloc(CKPT_CHUNK_BYTES);
            if (copy) memcpy(copy, wr->slot[s] + coff, cnt * sizeof(float));
            pthread_mutex_lock(&wr->mu);
            if (wr->state[s][c] == CHUNK_LIVE && copy) {
                wr->side[s][c] = copy;
                wr->state[s][c] = CHUNK_COPIED;
                copy = NULL;
                wr->extra += CKPT_CHUNK_BYTES;
                if (wr->extra > wr->peak_extra) wr->peak_extra = wr->extra;
            }
            /* no memory for a copy: wait until the writer has the chunk */
            while (wr->state[s][c] == CHUNK_LIVE) pthread_cond_wait(&wr->saved_cv, &wr->mu);
            pthread_mutex_unlock(&wr->mu);
            free(copy); /* the writer saved the chunk meanwhile */
        }
    }
}

int psd_ckpt_done(psd_ckpt_writer_t *wr)
{
    return wr && atomic_load_explicit(&wr->done, memory_order_acquire);
}

int psd_ckpt_end(psd_ckpt_writer_t **pwr, char *path, size_t pathlen, double *seconds, uint64_t *bytes,
                 uint64_t *peak_extra_bytes)
{
    psd_ckpt_writer_t *wr = *pwr;
    if (!wr) return -EINVAL;
    if (wr->store && wr->store->before_update_ud == wr) {
        wr->store->before_update = NULL;
        wr->store->before_update_ud = NULL;
    }
    pthread_join(wr->thread, NULL);
    int rc = wr->rc;
    if (path && pathlen) snprintf(path, pathlen, "%s", rc == 0 ? wr->path : "");
    if (seconds) *seconds = wr->seconds;
    if (bytes) *bytes = rc == 0 ? wr->bytes : 0;
    if (peak_extra_bytes) *peak_extra_bytes = wr->peak_extra;
    pthread_cond_destroy(&wr->saved_cv);
    pthread_mutex_destroy(&wr->mu);
    writer_free(wr);
    *pwr = NULL;
    return rc;
}

/* ---- loading ---------------------------------------------------------- */

typedef struct {
    int fd;
    uLong crc;
} ckpt_in_t;

/* Read exactly n bytes into buf, updating the CRC. 0, or a reason. */
static const char *in_read(ckpt_in_t *in, void *buf, size_t n, int crc)
{
    uint8_t *p = buf;
    while (n > 0) {
        size_t k = n < CKPT_IO_BYTES ? n : CKPT_IO_BYTES;
        ssize_t r = read(in->fd, p, k);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return "read error";
        if (r == 0) return "unexpected end of file";
        if (crc) in->crc = crc32(in->crc, p, (uInt)r);
        p += r;
        n -= (size_t)r;
    }
    return NULL;
}

typedef struct {
    psd_ckpt_meta_t meta;
    ps_layout_t layout;
    uint8_t *table; /* format 5: the table's bytes */
    uint8_t *seen;
    float *w, *slots[2];
} ckpt_data_t;

static void data_free(ckpt_data_t *d)
{
    ps_layout_free(&d->layout);
    free(d->table);
    free(d->seen);
    free(d->w);
    free(d->slots[0]);
    free(d->slots[1]);
    memset(d, 0, sizeof *d);
}

/* After the header: the tensor table (format 5 on) into d->table, and the run
 * block (format 6 on) into run, each bounded before it is read; *hlen grows by
 * what they took. NULL, or why the file is unusable. */
static const char *read_blocks(ckpt_in_t *in, uint64_t size, uint32_t format, ckpt_data_t *d, psd_ckpt_run_t *run,
                               size_t *hlen, uint32_t *tlen)
{
    const char *why = NULL;
    if (*hlen && format >= 5) { /* the table: its length bounded by the file's before it is read */
        uint8_t tl[4];
        if ((why = in_read(in, tl, 4, 1)) != NULL) return why;
        get_u32(tl, tlen);
        if ((uint64_t)*tlen > size - *hlen || *tlen > (64u << 20)) return "bad tensor table length";
        if (!(d->table = malloc(*tlen ? *tlen : 1))) return "out of memory";
        if ((why = in_read(in, d->table, *tlen, 1)) != NULL) return why;
        *hlen += 4 + (size_t)*tlen;
    }
    if (*hlen && format >= 6) { /* the run block */
        uint8_t rl[4], rb[CKPT_RUN_MAX];
        uint32_t rlen;
        if ((why = in_read(in, rl, 4, 1)) != NULL) return why;
        get_u32(rl, &rlen);
        if (rlen > CKPT_RUN_MAX) return "bad run block length";
        if ((why = in_read(in, rb, rlen, 1)) != NULL) return why;
        if (!run_unpack(run, rb, rlen)) return "bad run block";
        *hlen += 4 + (size_t)rlen;
    }
    return NULL;
}

/* The file's length against its header's, then its arenas (the sample bitmap, the
 * weights, the optimizer's slots: this file's spans of each) and the trailer's length
 * and CRC. NULL, or why the file is unusable (reason_buf: formatted reasons). */
static const char *read_arenas(ckpt_in_t *in, uint64_t size, size_t hlen, uint32_t format, ckpt_data_t *d,
                               char *reason_buf, size_t reason_len)
{
    const char *why = NULL;
    uint8_t trailer[CKPT_TRAILER_LEN];
    const ps_layout_t l = d->layout;
    span_t spans[PS_MAX_TENSORS];
    uint64_t part;
    const int n_spans = part_spans(&d->meta, &l, format, spans, &part);
    /* Before allocating anything: the header must describe this file. (A
     * shard's file holds a part: the whole arenas allocated below are at most
     * PS_MAX_SHARDS times its floats, only the part's pages touched.) */
    uint64_t want = file_len(&d->meta, hlen, part);
    if (size != want) {
        snprintf(reason_buf, reason_len, "%lld bytes, header says %llu (truncated?)",
                 (long long)size, (unsigned long long)want);
        return reason_buf;
    }
    size_t seen_bytes = (size_t)((d->meta.train_count + 7) / 8);
    size_t arena_bytes = (size_t)d->meta.n_params * sizeof(float);
    /* zeroed where the file holds nothing (another shard's part), and not
     * resident there either (large callocs are fresh pages) */
    d->seen = malloc(seen_bytes ? seen_bytes : 1);
    d->w = calloc(1, arena_bytes);
    for (uint32_t s = 0; s < d->meta.n_slots; s++) d->slots[s] = calloc(1, arena_bytes);
    if (!d->seen || !d->w || (d->meta.n_slots >= 1 && !d->slots[0]) ||
        (d->meta.n_slots >= 2 && !d->slots[1]))
        return "out of memory";
    if ((why = in_read(in, d->seen, seen_bytes, 1)) != NULL) return why;
    for (uint32_t a = 0; a <= d->meta.n_slots; a++) {
        float *dst = a == 0 ? d->w : d->slots[a - 1];
        for (int i = 0; i < n_spans; i++)
            if ((why = in_read(in, dst + spans[i].off, (size_t)spans[i].n * sizeof(float), 1)) != NULL) return why;
    }
    if ((why = in_read(in, trailer, 8, 1)) != NULL) return why;
    if ((why = in_read(in, trailer + 8, 4, 0)) != NULL) return why;
    uint64_t len;
    uint32_t crc;
    get_u64(trailer, &len);
    get_u32(trailer + 8, &crc);
    if (len != want - CKPT_TRAILER_LEN) return "bad length field";
    if (crc != (uint32_t)in->crc) return "checksum mismatch";
    return NULL;
}

/* Read and verify one file. NULL with d filled (caller frees), or the reason
 * it is unusable (d empty). reason_buf holds formatted reasons. run_id: the
 * run the file must be of (0: any); one of another run is unusable, found
 * from its header before its arenas are read. */
static const char *load_one(const char *path, uint64_t run_id, ckpt_data_t *d, char *reason_buf, size_t reason_len)
{
    ckpt_in_t in = {.fd = -1, .crc = crc32(0, Z_NULL, 0)};
    uint8_t hdr[CKPT_HDR_LEN];
    const char *why = NULL;
    struct stat st;
    memset(d, 0, sizeof *d);

    in.fd = open(path, O_RDONLY | O_CLOEXEC);
    if (in.fd < 0 || fstat(in.fd, &st) != 0) {
        snprintf(reason_buf, reason_len, "cannot open: %s", strerror(errno));
        why = reason_buf;
        goto out;
    }
    if (!S_ISREG(st.st_mode)) {
        why = "not a regular file";
        goto out;
    }
    if ((uint64_t)st.st_size < CKPT_HDR_LEN_V1 + CKPT_TRAILER_LEN) {
        snprintf(reason_buf, reason_len, "too short (%lld bytes)", (long long)st.st_size);
        why = reason_buf;
        goto out;
    }
    if ((why = in_read(&in, hdr, 8, 1)) != NULL) goto out;
    size_t hlen = hdr_len(hdr);
    if (hlen && (why = in_read(&in, hdr + 8, hlen - 8, 1)) != NULL) goto out;
    uint32_t format, tlen = 0;
    psd_ckpt_run_t run;
    memset(&run, 0, sizeof run);
    get_u32(hdr + 4, &format);
    if ((why = read_blocks(&in, (uint64_t)st.st_size, format, d, &run, &hlen, &tlen)) != NULL) goto out;
    why = meta_unpack(&d->meta, &format, &d->layout, hdr, d->table, tlen);
    if (!why) d->meta.run = run;
    free(d->table);
    d->table = NULL;
    if (why) goto out;
    if (run_id && d->meta.run_id != run_id) {
        snprintf(reason_buf, reason_len, "it is of run %016" PRIx64 ", not of run %016" PRIx64 " whose checkpoints "
                 "are resumed here", d->meta.run_id, run_id);
        why = reason_buf;
        goto out;
    }
    why = read_arenas(&in, (uint64_t)st.st_size, hlen, format, d, reason_buf, reason_len);
out:
    if (in.fd >= 0) close(in.fd);
    if (why) data_free(d);
    return why;
}

int psd_ckpt_load_step(const char *dir, uint64_t run_id, uint64_t step, psd_ckpt_meta_t *meta, uint8_t **seen,
                       float **weights, float *slots[2], char *path, size_t pathlen, char *err, size_t errlen)
{
    char p[PATH_MAX], reason[256];
    ckpt_data_t d;
    snprintf(p, sizeof p, "%s/ckpt-%012llu.psdc", dir, (unsigned long long)step);
    const char *why = load_one(p, run_id, &d, reason, sizeof reason);
    if (why) {
        ps_set_err(err, errlen, "checkpoint %s: %s", p, why);
        return -1;
    }
    if (seen) *seen = d.seen;
    else free(d.seen);
    *meta = d.meta;
    *weights = d.w;
    slots[0] = d.slots[0];
    slots[1] = d.slots[1];
    ps_layout_free(&d.layout);
    if (path && pathlen) snprintf(path, pathlen, "%s", p);
    return 0;
}

size_t psd_ckpt_steps(const char *dir, uint64_t at_most, uint64_t *steps, size_t max)
{
    ckpt_ent_t *ents = NULL;
    size_t n = 0, k = 0;
    if (list_ckpts(dir, &ents, &n, NULL) != 0) return 0;
    for (size_t i = 0; i < n && k < max; i++)
        if (ents[i].step <= at_most && (k == 0 || steps[k - 1] != ents[i].step)) steps[k++] = ents[i].step;
    free(ents);
    return k;
}

/* The newest file of dir that loads (load_one) into d, of run run_id (0:
 * any), its path into path (pathlen may be 0); the ones rejected on the way
 * reported to log. 0, or -1 with a message. */
static int load_newest(const char *dir, uint64_t run_id, ckpt_data_t *d, char *path, size_t pathlen,
                       psd_ckpt_log_fn log, char *err, size_t errlen)
{
    ckpt_ent_t *ents = NULL;
    size_t n = 0, rejected = 0;
    int rc = -1;
    int lrc = list_ckpts(dir, &ents, &n, NULL);
    if (lrc != 0) {
        ps_set_err(err, errlen, "no valid checkpoint in %s (cannot list it: %s)", dir, strerror(-lrc));
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        char p[PATH_MAX], reason[256], line[PATH_MAX + 320];
        snprintf(p, sizeof p, "%s/%s", dir, ents[i].name);
        const char *why = load_one(p, run_id, d, reason, sizeof reason);
        if (why) {
            rejected++;
            if (log) {
                snprintf(line, sizeof line, "checkpoint %s: %s; trying an older one", p, why);
                log(line);
            }
            continue;
        }
        if (path && pathlen) snprintf(path, pathlen, "%s", p);
        rc = 0;
        goto out;
    }
    ps_set_err(err, errlen, "no valid checkpoint in %s (%zu rejected)", dir, rejected);
out:
    free(ents);
    return rc;
}

int psd_ckpt_load_newest(const char *dir, uint64_t run_id, psd_ckpt_meta_t *meta, uint8_t **seen, float **weights,
                         float *slots[2], char *path, size_t pathlen, psd_ckpt_log_fn log, char *err,
                         size_t errlen)
{
    ckpt_data_t d;
    if (load_newest(dir, run_id, &d, path, pathlen, log, err, errlen) != 0) return -1;
    *meta = d.meta;
    *seen = d.seen;
    *weights = d.w;
    slots[0] = d.slots[0];
    slots[1] = d.slots[1];
    ps_layout_free(&d.layout); /* the caller's layout is checked against meta's table CRC */
    return 0;
}

int psd_ckpt_read_weights(const char *path, ps_layout_t *l, float **weights, psd_ckpt_meta_t *meta, char *err,
                          size_t errlen)
{
    char reason[256];
    ckpt_data_t d;
    const char *why = load_one(path, 0, &d, reason, sizeof reason);
    if (!why && d.meta.shards > 1) why = "it holds one psd shard's part of the model (export the run's weights file)";
    if (why) {
        data_free(&d);
        ps_set_err(err, errlen, "checkpoint %s: %s", path, why);
        return -1;
    }
    *l = d.layout;
    d.layout.tab = NULL; /* moved */
    *weights = d.w;
    *meta = d.meta;
    d.w = NULL;
    data_free(&d);
    return 0;
}

int psd_ckpt_newest_layout(const char *dir, uint64_t run_id, ps_layout_t *l, char *offer, char *err, size_t errlen)
{
    ckpt_data_t d;
    if (load_newest(dir, run_id, &d, NULL, 0, NULL, err, errlen) != 0) return -1;
    if (offer) memcpy(offer, d.meta.run.offer, sizeof d.meta.run.offer);
    *l = d.layout;
    d.layout.tab = NULL; /* moved */
    data_free(&d);
    return 0;
}
