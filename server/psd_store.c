#include "psd_store.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <sys/mman.h>
#include <unistd.h>
#include "ps_pool.h"
#include "ps_shm.h"
#include "ps_util.h"
#include "ps_wire.h"

#include <zlib.h>

/* Zeroed floats from the kernel: pages a shard never touches (the parts
 * other shards own) take no memory. */
static size_t floats_bytes(size_t n) { return ps_shm_round(n > 0 ? n * sizeof(float) : 1); }

static float *alloc_floats(size_t n)
{
    void *p = mmap(NULL, floats_bytes(n), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void free_floats(float *p, size_t n)
{
    if (p) munmap(p, floats_bytes(n));
}

int psd_store_init(psd_store_t *s, const ps_layout_t *l, const psd_optim_t *opt, uint64_t seed)
{
    return psd_store_init_part(s, l, opt, seed, 0, 1);
}

int psd_store_init_part(psd_store_t *s, const ps_layout_t *l, const psd_optim_t *opt, uint64_t seed, int k, int n)
{
    memset(s, 0, sizeof *s);
    s->layout = *l;
    s->opt = *opt;
    if (n > 1) ps_shard_pieces(l, k, n, s->own);
    else
        for (int t = 0; t < l->n_tensors; t++) s->own[t] = (ps_piece_t){.t = t, .off = 0, .n = l->t[t].numel};
    s->grad = alloc_floats(l->n_params);
    int slots = psd_optim_slots(opt);
    if (slots >= 1) s->s0 = alloc_floats(l->n_params);
    if (slots >= 2) s->s1 = alloc_floats(l->n_params);
    psd_arena_t *a = &s->arenas[0];
    a->w = alloc_floats(l->n_params);
    s->n_arenas = 1;
    if (!s->grad || !a->w || (slots >= 1 && !s->s0) || (slots >= 2 && !s->s1)) {
        psd_store_deinit(s);
        return -ENOMEM;
    }
    /* one chunk per tensor on this thread until psd_store_set_parallel */
    if (psd_store_set_parallel(s, 1, (size_t)1 << 40) != 0) {
        psd_store_deinit(s);
        return -ENOMEM;
    }
    if (n > 1) ps_model_init_pieces(l, a->w, seed, s->own); /* the rest: zero pages never taken */
    else ps_model_init_params(l, a->w, seed);
    atomic_store(&a->refs, 1);
    a->version = 0;
    s->cur = a;
    return 0;
}

/* The items of the dense step: all of them, or, when sparse-rows tensors
 * are stepped lazily, all but theirs, which go last (wherever they are in
 * the layout: items are independent ranges, their order is the pool's only). */
static void dense_part(psd_store_t *s)
{
    s->step_items = s->n_items;
    if (!s->n_lazy) return;
    int k = 0;
    for (int i = 0; i < s->n_items; i++) /* the dense items first, in order; then the tables' */
        if (!(s->lazy_mask & (1ull << s->items[i].t))) {
            psd_chunk_t c = s->items[i];
            memmove(&s->items[k + 1], &s->items[k], (size_t)(i - k) * sizeof c);
            s->items[k++] = c;
        }
    s->step_items = k;
}

/* Items of chunk c: floats [o, o + PSD_ITEM_FLOATS) of it, the last shorter. */
static int chunk_items(const psd_chunk_t *c) { return (int)((c->n + PSD_ITEM_FLOATS - 1) / PSD_ITEM_FLOATS); }

/* Floats in chunk c's item from float o on: PSD_ITEM_FLOATS, the last shorter. */
static size_t item_floats(const psd_chunk_t *c, size_t o) { return c->n - o < PSD_ITEM_FLOATS ? c->n - o : PSD_ITEM_FLOATS; }

/* floats [o, o + n) of chunk c as a unit of its own (o: whole norm blocks in) */
static psd_chunk_t sub_chunk(const psd_chunk_t *c, size_t o, size_t n)
{
    return (psd_chunk_t){.t = c->t, .off = c->off + o, .n = n, .blk = c->blk + o / PSD_NORM_BLOCK, .rel = c->rel + o};
}

int psd_store_set_parallel(psd_store_t *s, int threads, size_t chunk_bytes)
{
    const ps_layout_t *l = &s->layout;
    size_t cf = ps_chunk_floats(chunk_bytes), nb = ps_layout_blocks(l);
    int n = 0;
    for (int t = 0; t < l->n_tensors; t++) n = ps_piece_chunks(&s->own[t], cf, NULL, n);
    psd_chunk_t *ch = calloc((size_t)(n ? n : 1), sizeof *ch);
    double *bq = calloc(nb ? nb : 1, sizeof *bq);
    ps_piece_t *pc = calloc((size_t)(n ? n : 1), sizeof *pc);
    struct ps_pool *pool = threads > 1 ? ps_pool_new(threads) : NULL;
    if (!ch || !bq || !pc || (threads > 1 && !pool)) {
        free(ch);
        free(bq);
        free(pc);
        ps_pool_free(&pool);
        return -ENOMEM;
    }
    int k = 0, ni = 0;
    for (int t = 0; t < l->n_tensors; t++) k = ps_piece_chunks(&s->own[t], cf, pc, k);
    for (int i = 0; i < n; i++) {
        const ps_piece_t *p = &pc[i];
        ch[i] = (psd_chunk_t){.t = p->t, .off = l->t[p->t].offset + p->off, .n = p->n,
                              .blk = ps_layout_first_block(l, p->t) + p->off / PSD_NORM_BLOCK,
                              .rel = p->off - s->own[p->t].off};
        ni += chunk_items(&ch[i]);
    }
    free(pc);
    psd_chunk_t *it = calloc((size_t)(ni ? ni : 1), sizeof *it);
    if (!it) {
        free(ch);
        free(bq);
        ps_pool_free(&pool);
        return -ENOMEM;
    }
    ni = 0;
    for (int i = 0; i < n; i++)
        for (size_t o = 0; o < ch[i].n; o += PSD_ITEM_FLOATS)
            it[ni++] = sub_chunk(&ch[i], o, item_floats(&ch[i], o));
    free(s->chunks);
    free(s->items);
    free(s->blk_sq);
    ps_pool_free(&s->pool);
    s->threads = threads;
    s->chunk_bytes = chunk_bytes;
    s->chunks = ch;
    s->n_chunks = n;
    s->items = it;
    s->n_items = ni;
    s->blk_sq = bq;
    s->n_blk = nb;
    s->pool = pool;
    dense_part(s);
    return 0;
}

/* Lazy table j's merge made again with room for max_entries from max_k. */
static int lazy_room(psd_store_t *s, int j, size_t max_entries, int max_k)
{
    psd_rows_t r;
    if (psd_rows_init(&r, (size_t)s->layout.t[s->lazy_t[j]].cols, max_entries, max_k) != 0) return -ENOMEM;
    psd_rows_deinit(&s->rows[j]);
    s->rows[j] = r;
    return 0;
}

int psd_store_lazy_table(psd_store_t *s, size_t max_entries, int max_k)
{
    const ps_layout_t *l = &s->layout;
    int n = 0, at[PS_MAX_TENSORS];
    for (int t = 0; t < l->n_tensors; t++) {
        size_t r0, r1;
        if (l->t[t].kind != PS_TENSOR_ROWS) continue;
        if (!ps_piece_rows(l, &s->own[t], &r0, &r1)) return -EINVAL;
        at[n++] = t;
    }
    if (n == 0) return -EINVAL;
    for (int j = 0; j < n; j++) {
        s->lazy_t[j] = at[j];
        if (lazy_room(s, j, max_entries, max_k) != 0) return -ENOMEM; /* the tables before keep their room */
        s->lazy_mask |= 1ull << at[j];
        if (j >= s->n_lazy) s->n_lazy = j + 1;
    }
    dense_part(s);
    return 0;
}

int psd_store_rows_room(psd_store_t *s, int k, const psd_rowgrad_t *rows, int max_k)
{
    for (int j = 0; j < s->n_lazy; j++) {
        size_t total = 0, have = s->rows[j].max_entries;
        for (int c = 0; c < k; c++) total += rows[(size_t)j * (size_t)k + (size_t)c].n;
        if ((total > have || k > s->rows[j].max_k) &&
            lazy_room(s, j, total > 2 * have ? total : 2 * have, max_k > k ? max_k : k) != 0)
            return -ENOMEM;
    }
    return 0;
}

int psd_store_groups(psd_store_t *s, const ps_group_t *groups, int n)
{
    psd_groups_deinit(&s->groups);
    return psd_groups_init(&s->groups, &s->layout, s->opt.weight_decay, groups, n);
}

void psd_store_deinit(psd_store_t *s)
{
    psd_groups_deinit(&s->groups);
    ps_pool_free(&s->pool);
    free(s->chunks);
    free(s->items);
    free(s->blk_sq);
    if (s->shm_base) { /* the fds are set only with shm_base */
        munmap(s->shm_base, PSD_MAX_ARENAS * s->shm_slot_floats * sizeof(float));
        close(s->shm_fd);
        close(s->shm_ro_fd);
    } else {
        for (int i = 0; i < s->n_arenas; i++) free_floats(s->arenas[i].w, s->layout.n_params);
    }
    for (int i = 0; i < s->n_arenas; i++) free(s->arenas[i].w16);
    free_floats(s->grad, s->layout.n_params);
    free_floats(s->s0, s->layout.n_params);
    free_floats(s->s1, s->layout.n_params);
    for (int j = 0; j < s->n_lazy; j++) psd_rows_deinit(&s->rows[j]);
    memset(s, 0, sizeof *s);
}

int psd_store_own(psd_store_t *s, int k, int n)
{
    const ps_layout_t *l = &s->layout;
        ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(l, k, n, p);
    memcpy(s->own, p, sizeof p);
    /* give back the pages of arena 0 outside the owned pieces (the
     * initial weights of other shards' parts) */
    long pg = sysconf(_SC_PAGESIZE);
    size_t page = pg > 0 ? (size_t)pg : 4096, from = 0;
    for (int t = 0; t <= l->n_tensors; t++) {
        size_t to = t < l->n_tensors ? l->t[t].offset + p[t].off : l->n_params;
        size_t a = (from * sizeof(float) + page - 1) / page * page, b = to * sizeof(float) / page * page;
        if (b > a) madvise((char *)s->arenas[0].w + a, b - a, MADV_DONTNEED);
        if (t < l->n_tensors) from = l->t[t].offset + p[t].off + p[t].n;
    }
    return psd_store_set_parallel(s, s->threads > 0 ? s->threads : 1, s->chunk_bytes);
}

void psd_store_load_part(psd_store_t *s, const float *w, const float *const slots[2], uint32_t n_slots)
{
    for (int t = 0; t < s->layout.n_tensors; t++) {
        size_t at = s->layout.t[t].offset + s->own[t].off, bytes = s->own[t].n * sizeof(float);
        memcpy(s->cur->w + at, w + at, bytes);
        if (n_slots >= 1) memcpy(s->s0 + at, slots[0] + at, bytes);
        if (n_slots >= 2) memcpy(s->s1 + at, slots[1] + at, bytes);
    }
}

int psd_store_share(psd_store_t *s)
{
    if (s->shm_base) return 0;
    if (s->n_arenas != 1) return -EBUSY;
    size_t slot = ps_shm_round(s->layout.n_params * sizeof(float)), bytes = slot * PSD_MAX_ARENAS;
    int fd = ps_shm_memfd("psd-weights", bytes, 0);
    if (fd < 0) return fd;
    int ro = ps_shm_reopen_ro(fd);
    void *base = ro < 0 ? MAP_FAILED : mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int e = ro < 0 ? ro : -errno;
        if (ro >= 0) close(ro);
        close(fd);
        return e;
    }
    float *w0 = base;
    memcpy(w0, s->arenas[0].w, s->layout.n_params * sizeof(float));
    free_floats(s->arenas[0].w, s->layout.n_params);
    s->arenas[0].w = w0;
    s->shm_base = base;
    s->shm_slot_floats = slot / sizeof(float);
    s->shm_fd = fd;
    s->shm_ro_fd = ro;
    return 0;
}

uint32_t psd_store_current_crc(psd_store_t *s)
{
    psd_arena_t *a = s->cur;
    if (a->crc_of != a->version + 1) {
        a->crc = ps_layout_crc32(&s->layout, a->w);
        a->crc_of = a->version + 1;
    }
    return a->crc;
}

/* A frame of floats [p->off, p->off + p->n) of tensor p->t of arena a (f32),
 * or of its bfloat16 copy w16, holding a reference on a. */
static ps_frame_t piece_frame(const psd_store_t *s, psd_arena_t *a, const uint16_t *w16, const ps_piece_t *p)
{
    const ps_tensor_info_t *ti = &s->layout.t[p->t];
    size_t at = ti->offset + p->off;
    atomic_fetch_add_explicit(&a->refs, 1, memory_order_relaxed);
    return (ps_frame_t){.data = w16 ? (const void *)(w16 + at) : (const void *)(a->w + at),
                        .nbytes = (w16 ? 2 : 4) * p->n, .ffn = psd_store_frame_free, .hint = a, .id = (uint32_t)p->t,
                        .dtype = w16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32, .rows = ti->rows,
                        .cols = ti->ndim >= 2 ? ti->cols : 0, .offset = p->off};
}

int psd_store_frames(psd_store_t *s, const uint16_t *w16, ps_frame_t *fr, uint32_t *crc)
{
    uLong c = crc32(0L, Z_NULL, 0);
    int n = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) {
        if (s->own[t].n == 0) continue;
        fr[n] = piece_frame(s, s->cur, w16, &s->own[t]);
        if (crc) c = crc32_z(c, fr[n].data, fr[n].nbytes);
        n++;
    }
    if (crc) *crc = (uint32_t)c;
    return n;
}

int psd_store_range_frames(psd_store_t *s, uint64_t from, uint64_t count, ps_frame_t *fr)
{
    ps_piece_t r[PS_MAX_TENSORS];
    int n = ps_part_range(s->own, s->layout.n_tensors, from, count, r);
    for (int i = 0; i < n; i++) fr[i] = piece_frame(s, s->cur, NULL, &r[i]);
    return n;
}

psd_arena_t *psd_store_ref_current(psd_store_t *s)
{
    atomic_fetch_add_explicit(&s->cur->refs, 1, memory_order_relaxed);
    return s->cur;
}

void psd_store_frame_free(void *data, void *hint)
{
    (void)data;
    psd_arena_t *a = hint;
    atomic_fetch_sub_explicit(&a->refs, 1, memory_order_release);
}

/* An arena no frame references, for the next version. */
static psd_arena_t *free_arena(psd_store_t *s)
{
    for (int i = 0; i < s->n_arenas; i++) {
        psd_arena_t *a = &s->arenas[i];
        if (a != s->cur && atomic_load_explicit(&a->refs, memory_order_acquire) == 0) return a;
    }
    if (s->n_arenas == PSD_MAX_ARENAS) return NULL;
    psd_arena_t *a = &s->arenas[s->n_arenas];
    a->w = s->shm_base ? s->shm_base + (size_t)s->n_arenas * s->shm_slot_floats : alloc_floats(s->layout.n_params);
    if (!a->w) return NULL;
    atomic_store(&a->refs, 0);
    s->n_arenas++;
    return a;
}

/* One step's work, shared by the pool's threads. Contributor k's gradient
 * of tensor t is grads[k][t]; in a streamed step (train.stream) that of
 * the j-th chunk of ids is src[j * n + k] instead (the chunk alone). */
typedef struct {
    psd_store_t *s;
    psd_arena_t *next;
    int n;
    const void *const (*grads)[PS_MAX_TENSORS];
    const int *ids;
    const void *const *src;
    const uint8_t *bf16;
    const double *weight;
    float scale;
    double lr;
    bool clip;
    bool add;          /* psd_store_fold: onto the sum so far (else the first contributor sets it) */
} step_t;

/* Contributor k's gradient for chunk c from its first element: in the
 * contributor's wire type (f32, or bf16 where st->bf16[k]). */
static const void *contrib(const step_t *st, int j, const psd_chunk_t *c, int k)
{
    if (st->src) return st->src[(size_t)j * (size_t)st->n + (size_t)k];
    size_t es = st->bf16 && st->bf16[k] ? 2 : 4;
    return (const char *)st->grads[k][c->t] + c->rel * es;
}

/* acc[0, n) = sum_k weight[k] * g_k over elements [o, o + n) of chunk c
 * (the j-th of the step's work), in the contributors' order (the same
 * arithmetic for any split of the range) */
PSD_VEC static void reduce_range(const step_t *st, int j, const psd_chunk_t *c, size_t o, size_t n, float *acc)
{
    for (int k = 0; k < st->n; k++) {
        const float wk = (float)st->weight[k];
        if (st->bf16 && st->bf16[k]) {
            const uint16_t *h = (const uint16_t *)contrib(st, j, c, k) + o;
            if (k == 0 && !st->add)
                for (size_t i = 0; i < n; i++) acc[i] = wk * ps_bf16_to_f32(h[i]);
            else
                for (size_t i = 0; i < n; i++) acc[i] += wk * ps_bf16_to_f32(h[i]);
            continue;
        }
        const float *g = (const float *)contrib(st, j, c, k) + o;
        if (k == 0 && !st->add)
            for (size_t i = 0; i < n; i++) acc[i] = wk * g[i];
        else
            for (size_t i = 0; i < n; i++) acc[i] += wk * g[i];
    }
}

/* grad = the reduced gradient over floats [o, o + n) of chunk c (the j-th
 * of the work; o: whole norm blocks in), and their block norms (clipping) */
static void reduce_part(step_t *st, int j, const psd_chunk_t *c, size_t o, size_t n)
{
    psd_store_t *s = st->s;
    float *acc = s->grad + c->off;
    reduce_range(st, j, c, o, n, acc + o);
    for (size_t e = o + n, b = c->blk + o / PSD_NORM_BLOCK; o < e; o += PSD_NORM_BLOCK, b++)
        s->blk_sq[b] = psd_sumsq(acc + o, e - o < PSD_NORM_BLOCK ? e - o : PSD_NORM_BLOCK);
}

/* the optimizer o with rate lr over floats [off, off + n) of the layout */
static void apply_floats(const step_t *st, const psd_optim_t *o, size_t off, size_t n, const float *g, double lr,
                         psd_amax_t *am)
{
    psd_store_t *s = st->s;
    psd_optim_apply_amax(o, s->cur->w + off, st->next->w + off, g, st->scale, s->s0 ? s->s0 + off : NULL,
                         s->s1 ? s->s1 + off : NULL, n, lr, s->steps, am);
}

/* the optimizer over elements [o, o + n) of chunk c, from g: their
 * gradient; the largest magnitudes met go into *am. With groups, cut at
 * the spans the range meets (one call where it meets one). */
static void apply_range(const step_t *st, const psd_chunk_t *c, size_t o, size_t n, const float *g, psd_amax_t *am)
{
    psd_store_t *s = st->s;
    const size_t off = c->off + o;
    if (!s->groups.span) {
        apply_floats(st, &s->opt, off, n, g, st->lr, am);
        return;
    }
    const size_t u0 = s->layout.t[c->t].offset, at = off - u0;
    int a, b;
    psd_groups_range(&s->groups, c->t, at, n, &a, &b);
    psd_optim_t opt = s->opt;
    for (int i = a; i < b; i++) {
        const psd_span_t *sp = &s->groups.span[i];
        const size_t lo = sp->begin > at ? sp->begin : at, hi = sp->end < at + n ? sp->end : at + n;
        opt.weight_decay = sp->weight_decay;
        apply_floats(st, &opt, u0 + lo, hi - lo, g + (lo - at), st->lr * sp->lr_scale, am);
    }
}

/* A task's largest magnitudes into the step's (any thread; once per work
 * item: a max is the same in any order) */
static void amax_merge(_Atomic uint32_t *to, uint32_t v)
{
    uint32_t cur = atomic_load_explicit(to, memory_order_relaxed);
    while (v > cur && !atomic_compare_exchange_weak_explicit(to, &cur, v, memory_order_relaxed, memory_order_relaxed)) {
        /* cur is what another thread put there: try again while v is larger */
    }
}

static void amax_add(psd_store_t *s, const psd_amax_t *am)
{
    amax_merge(&s->amax_g, am->g);
    amax_merge(&s->amax_w, am->w);
}

/* Without clipping: reduce and apply floats [o, o + n) of chunk c (the j-th
 * of the work) in one pass. The sum of a few thousand elements goes through
 * a scratch buffer that stays in the core's L1 cache, not through the
 * gradient array (which would be written and read back from memory); no
 * norm is computed (nothing needs it). */
#define FUSE_FLOATS 2048
static void fused_part(const step_t *st, int j, const psd_chunk_t *c, size_t o, size_t n)
{
    psd_amax_t am = {0, 0};
    if (st->n == 1 && st->weight[0] == 1.0 && !(st->bf16 && st->bf16[0])) {
        /* one f32 contributor of weight 1: its gradient is the sum (1.0f * g
         * is g, bit for bit); applied straight from it */
        apply_range(st, c, o, n, (const float *)contrib(st, j, c, 0) + o, &am);
        amax_add(st->s, &am);
        return;
    }
    _Alignas(64) float acc[FUSE_FLOATS];
    for (size_t e = o + n; o < e; o += FUSE_FLOATS) {
        size_t m = e - o < FUSE_FLOATS ? e - o : FUSE_FLOATS;
        reduce_range(st, j, c, o, m, acc);
        apply_range(st, c, o, m, acc, &am);
    }
    amax_add(st->s, &am);
}

/* A pool run of the step's work (reduce, apply), its time counted in step_s. */
static void step_run(psd_store_t *s, int n, void (*fn)(void *, int), void *arg)
{
    double t0 = ps_now();
    ps_pool_for(s->pool, n, fn, arg);
    s->step_s += ps_now() - t0;
}

/* the tasks of whole steps: item i of the store (contributors' tensors in grads) */
static void reduce_task(void *arg, int i)
{
    step_t *st = arg;
    const psd_chunk_t *c = &st->s->items[i];
    fused_part(st, i, c, 0, c->n);
}

static void norm_task(void *arg, int i)
{
    step_t *st = arg;
    const psd_chunk_t *c = &st->s->items[i];
    reduce_part(st, i, c, 0, c->n);
}

static void fold_task(void *arg, int i)
{
    step_t *st = arg;
    const psd_chunk_t *c = &st->s->items[i];
    reduce_range(st, i, c, 0, c->n, st->s->grad + c->off);
}

void psd_store_fold(psd_store_t *s, const void *const (*grads)[PS_MAX_TENSORS], const uint8_t *bf16, double weight,
                    bool add)
{
    step_t st = {.s = s, .n = 1, .grads = grads, .bf16 = bf16, .weight = &weight, .scale = 1.0f, .add = add};
    step_run(s, s->step_items, fold_task, &st);
}

static void apply_task(void *arg, int i)
{
    step_t *st = arg;
    const psd_chunk_t *c = &st->s->items[i];
    psd_amax_t am = {0, 0};
    apply_range(st, c, 0, c->n, st->s->grad + c->off, &am);
    amax_add(st->s, &am);
}

typedef struct {
    psd_store_t *s;
    psd_arena_t *a;
} conv_t;

static void bf16_task(void *arg, int i)
{
    conv_t *cv = arg;
    const psd_chunk_t *c = &cv->s->items[i];
    ps_f32_to_bf16_n(cv->a->w16 + c->off, cv->a->w + c->off, c->n);
}

const uint16_t *psd_store_current_bf16(psd_store_t *s)
{
    psd_arena_t *a = s->cur;
    if (a->w16_of == a->version + 1) return a->w16;
    if (!a->w16) {
        a->w16 = calloc(s->layout.n_params ? s->layout.n_params : 1, sizeof *a->w16); /* padding stays 0 */
        if (!a->w16) return NULL;
    }
    conv_t cv = {s, a};
    ps_pool_for(s->pool, s->n_items, bf16_task, &cv);
    a->w16_of = a->version + 1;
    return a->w16;
}

/* The owned part's squared norms into s->blk_sq (psd_store_reduce_rows) */
static void psd_store_reduce(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS], const uint8_t *bf16,
                             const double *weight)
{
    step_t st = {.s = s, .n = n, .grads = grads, .bf16 = bf16, .weight = weight, .scale = 1.0f};
    step_run(s, s->step_items, norm_task, &st);
}

/* Each lazy table's norm blocks (the piece this store owns) from its
 * merged rows: zero but where rows were touched */
static void table_norms(psd_store_t *s)
{
    const ps_layout_t *l = &s->layout;
    for (int j = 0; j < s->n_lazy; j++) {
        const int t = s->lazy_t[j];
        const ps_piece_t *own = &s->own[t];
        double *blk = s->blk_sq + ps_layout_first_block(l, t);
        for (size_t o = own->off; o < own->off + own->n; o += PSD_NORM_BLOCK) blk[o / PSD_NORM_BLOCK] = 0;
        psd_rows_norms(&s->rows[j], blk);
    }
}

/* Merge each lazy table's rows (rows[j * n + k]: contributor k's of table
 * j; NULL: none touched). 0, or -2 when they hold more than there is room for. */
static int merge_rows(psd_store_t *s, int n, const double *weight, const psd_rowgrad_t *rows)
{
    for (int j = 0; j < s->n_lazy; j++) {
        s->rows[j].n_ids = 0;
        if (rows && psd_rows_merge(&s->rows[j], n, rows + (size_t)j * (size_t)n, weight,
                                   s->layout.t[s->lazy_t[j]].rows) != 0)
            return -2;
    }
    return 0;
}

int psd_store_reduce_rows(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS], const uint8_t *bf16,
                          const double *weight, const psd_rowgrad_t *rows)
{
    if (s->n_lazy) {
        if (merge_rows(s, n, weight, rows) != 0) return -2;
        table_norms(s);
    }
    psd_store_reduce(s, n, grads, bf16, weight);
    return 0;
}

double psd_store_sumsq(const psd_store_t *s)
{
    double sumsq = 0;
    for (size_t b = 0; b < s->n_blk; b++) sumsq += s->blk_sq[b]; /* block order: any chunking, same bits */
    return sumsq;
}

/* The arena the next version goes into: the current one itself when
 * nothing but the store references it (no frame in flight, no worker on
 * shared memory holding it, no checkpoint writing it; only this thread
 * adds references, so the count cannot grow meanwhile): updating in place
 * reads and writes one array instead of reading one and filling another.
 * Otherwise a free one (out of place, as before). NULL if none. */
static psd_arena_t *next_arena(psd_store_t *s)
{
    if (atomic_load_explicit(&s->cur->refs, memory_order_acquire) == 1) return s->cur;
    return free_arena(s);
}

/* the new version becomes current */
static void publish(psd_store_t *s, psd_arena_t *next)
{
    if (next == s->cur) { /* updated in place */
        next->version++;
        s->in_place++;
        return;
    }
    next->version = s->cur->version + 1;
    atomic_fetch_add_explicit(&next->refs, 1, memory_order_relaxed); /* streamed replies may hold some already */
    atomic_fetch_sub_explicit(&s->cur->refs, 1, memory_order_release);
    s->cur = next;
}

/* The next version's arena, the step counted and the optimizer slots
 * about to change: a checkpoint being written saves what it has not
 * written yet (from this thread, before the pool touches them). NULL if no
 * arena is free. */
static psd_arena_t *begin_update(psd_store_t *s)
{
    psd_arena_t *next = next_arena(s);
    if (!next) return NULL;
    s->steps++;
    atomic_store_explicit(&s->amax_g, 0, memory_order_relaxed);
    atomic_store_explicit(&s->amax_w, 0, memory_order_relaxed);
    if (s->before_update) s->before_update(s->before_update_ud, 0, s->layout.n_params);
    return next;
}

/* Each lazy table's step on its merged rows: the untouched rows (of the
 * piece this store owns) of an out-of-place version are copied from the
 * current one */
static void table_apply(psd_store_t *s, psd_arena_t *next, float scale, double lr)
{
    for (int j = 0; j < s->n_lazy; j++) {
        const int t = s->lazy_t[j];
        const ps_tensor_info_t *e = &s->layout.t[t];
        const ps_piece_t *own = &s->own[t];
        const psd_rows_t *r = &s->rows[j];
        if (next != s->cur)
            memcpy(next->w + e->offset + own->off, s->cur->w + e->offset + own->off, own->n * sizeof(float));
        psd_optim_t opt = s->opt;
        double tlr = lr;
        if (s->groups.span) { /* a sparse-rows tensor is a unit alone: one span */
            const psd_span_t *sp = &s->groups.span[s->groups.first[t]];
            opt.weight_decay = sp->weight_decay;
            tlr *= sp->lr_scale;
        }
        psd_rows_apply(r, &opt, next->w + e->offset, s->s0 ? s->s0 + e->offset : NULL,
                       s->s1 ? s->s1 + e->offset : NULL, scale, tlr, s->steps);
        /* the rows stepped, just written (in cache): a pass of their own */
        const size_t dim = r->dim;
        psd_amax_t am = {psd_amax_bits(r->sum, r->n_ids * dim), 0};
        for (size_t i = 0; i < r->n_ids; i++) {
            uint32_t a = psd_amax_bits(next->w + e->offset + (size_t)r->ids[i] * dim, dim);
            if (a > am.w) am.w = a;
        }
        amax_add(s, &am);
    }
}

int psd_store_apply(psd_store_t *s, double sumsq, double clip_norm, double lr)
{
    psd_arena_t *next = begin_update(s);
    if (!next) return -1;
    step_t st = {.s = s, .next = next, .scale = clip_norm > 0.0 ? psd_clip_scale(sumsq, clip_norm) : 1.0f, .lr = lr};
    step_run(s, s->step_items, apply_task, &st);
    table_apply(s, next, st.scale, lr);
    publish(s, next);
    return 0;
}

double psd_store_step(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS],
                      const uint8_t *bf16, const double *weight, double clip_norm, double lr)
{
    return psd_store_step_rows(s, n, grads, bf16, weight, NULL, clip_norm, lr);
}

double psd_store_step_rows(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS],
                           const uint8_t *bf16, const double *weight, const psd_rowgrad_t *rows,
                           double clip_norm, double lr)
{
    if (clip_norm > 0.0) { /* the global norm first: reduce, then apply */
        if (next_arena(s) == NULL) return -1;
        if (psd_store_reduce_rows(s, n, grads, bf16, weight, rows) != 0) return -2;
        double sumsq = psd_store_sumsq(s);
        return psd_store_apply(s, sumsq, clip_norm, lr) == 0 ? sqrt(sumsq) : -1;
    }
    if (s->n_lazy && merge_rows(s, n, weight, rows) != 0) return -2;
    /* without clipping every chunk is reduced and applied at once (no second pass) */
    psd_arena_t *next = begin_update(s);
    if (!next) return -1;
    step_t st = {.s = s, .next = next, .n = n, .grads = grads, .bf16 = bf16, .weight = weight, .scale = 1.0f,
                 .lr = lr};
    step_run(s, s->step_items, reduce_task, &st);
    table_apply(s, next, 1.0f, lr);
    publish(s, next);
    return 0;
}

/* ---- streamed steps (train.stream) ---------------------------------------- */

psd_arena_t *psd_store_stream_begin(psd_store_t *s) { return begin_update(s); }

/* A streamed run's work: item i of the ready chunks (first[j] is the first
 * item of the j-th), so that even one chunk is shared by the threads. */
#define STREAM_RUN 64
typedef struct {
    step_t st;
    int first[STREAM_RUN + 1];
} stream_run_t;

static void stream_task(void *arg, int i)
{
    stream_run_t *r = arg;
    int j = 0;
    while (r->first[j + 1] <= i) j++;
    const psd_chunk_t *c = &r->st.s->chunks[r->st.ids[j]];
    size_t o = (size_t)(i - r->first[j]) * PSD_ITEM_FLOATS;
    if (r->st.clip) reduce_part(&r->st, j, c, o, item_floats(c, o));
    else fused_part(&r->st, j, c, o, item_floats(c, o));
}

void psd_store_stream_chunks(psd_store_t *s, psd_arena_t *next, const int *ids, int m, int n,
                             const void *const *src, const uint8_t *bf16, const double *weight, bool clip, double lr)
{
    for (int b = 0; b < m; b += STREAM_RUN) { /* STREAM_RUN chunks a run */
        const int k = m - b < STREAM_RUN ? m - b : STREAM_RUN;
        stream_run_t r = {.st = {.s = s, .next = next, .n = n, .ids = ids + b, .src = src + (size_t)b * (size_t)n,
                                 .bf16 = bf16, .weight = weight, .scale = 1.0f, .lr = lr, .clip = clip}};
        for (int j = 0; j < k; j++) r.first[j + 1] = r.first[j] + chunk_items(&s->chunks[ids[b + j]]);
        step_run(s, r.first[k], stream_task, &r);
    }
}

double psd_store_stream_apply(psd_store_t *s, psd_arena_t *next, double clip_norm, double lr)
{
    double sumsq = psd_store_sumsq(s);
    step_t st = {.s = s, .next = next, .scale = psd_clip_scale(sumsq, clip_norm), .lr = lr};
    step_run(s, s->n_items, apply_task, &st);
    return sqrt(sumsq);
}

void psd_store_stream_keep(psd_store_t *s, psd_arena_t *next, int c)
{
    const psd_chunk_t *ch = &s->chunks[c];
    if (next != s->cur) memcpy(next->w + ch->off, s->cur->w + ch->off, ch->n * sizeof(float));
}

void psd_store_stream_void(psd_store_t *s) { s->steps--; }

void psd_store_stream_end(psd_store_t *s, psd_arena_t *next) { publish(s, next); }

psd_amax_t psd_store_step_amax(const psd_store_t *s)
{
    return (psd_amax_t){atomic_load_explicit(&s->amax_g, memory_order_relaxed),
                        atomic_load_explicit(&s->amax_w, memory_order_relaxed)};
}

void psd_store_tensor_frame(psd_store_t *s, psd_arena_t *a, int t, ps_frame_t *fr)
{
    *fr = piece_frame(s, a, NULL, &(ps_piece_t){.t = t, .off = 0, .n = s->layout.t[t].numel});
}
