/* ps_model.c - parameter layout of an MLP and its seeded initialisation. */
#include "ps_model.h"

#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include <zlib.h>

#include "ps_rng.h"

/* Tensors start on 64-byte boundaries so that every backend can use aligned
 * vector loads on any tensor of the arena. */
#define PS_TENSOR_ALIGN 16 /* floats */

/* Stream ids of the per-tensor generators: stream = PS_INIT_STREAM + tensor
 * index, so that a tensor's values do not depend on the sizes of the others. */
#define PS_INIT_STREAM 0x1417

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* The tensor info of spec sp at offset off (floats). */
static void info_of(ps_tensor_info_t *t, const ps_tensor_spec_t *sp, size_t off)
{
    const size_t len = strlen(sp->name);
    const uint64_t numel = ps_shape_numel(sp->ndim, sp->shape);
    memset(t, 0, sizeof *t);
    memcpy(t->name, sp->name, len + 1);
    t->ndim = sp->ndim;
    memcpy(t->shape, sp->shape, sizeof t->shape);
    for (int d = sp->ndim; d < PS_MAX_DIMS; d++) t->shape[d] = 0;
    t->kind = sp->kind;
    t->init = sp->init;
    t->numel = (size_t)numel;
    t->rows = sp->ndim ? sp->shape[0] : 1;
    t->cols = numel / t->rows;
    t->offset = off;
}

/* Whether tensor i may share a unit: small and dense. */
static bool packable(const ps_tensor_spec_t *sp, uint64_t small)
{
    return sp->kind == PS_TENSOR_DENSE && ps_shape_numel(sp->ndim, sp->shape) < small;
}

/* The units of specs[0..n) packed with these limits (unit[i]: tensor i's),
 * and how many. */
static int units_of(const ps_tensor_spec_t *specs, int n, uint64_t small, uint64_t most, int *unit)
{
    int u = -1;
    uint64_t in = 0; /* floats in unit u, when it packs */
    bool open = false;
    for (int i = 0; i < n; i++) {
        const uint64_t numel = ps_shape_numel(specs[i].ndim, specs[i].shape);
        if (!packable(&specs[i], small)) {
            unit[i] = ++u;
            open = false;
            continue;
        }
        if (!open || in + numel > most) {
            ++u;
            in = 0;
            open = true;
        }
        unit[i] = u;
        in += numel;
    }
    return u + 1;
}

/* pack: small tensors share units (general tables); else one a unit. */
static int lay_out(ps_layout_t *l, const ps_tensor_spec_t *specs, int n, bool pack, char *err, size_t errlen)
{
    assert(l);
    if (ps_tensors_check(specs, n, err, errlen) != 0) return -1;
    memset(l, 0, sizeof(*l));
    l->table = -1;
    int *unit = malloc((size_t)n * sizeof *unit), nu = n;
    if (!unit) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    if (pack) {
        /* as few units as fit: larger limits until they do (a model of
         * more than ~60 tensors of PS_PACK_SMALL floats or more packs
         * large ones too) */
        for (uint64_t small = PS_PACK_SMALL, most = PS_PACK_UNIT;; small *= 2, most *= 2)
            if ((nu = units_of(specs, n, small, most, unit)) <= PS_MAX_TENSORS) break;
    } else {
        if (n > PS_MAX_TENSORS) {
            free(unit);
            snprintf(err, errlen, "a built-in model of %d tensors (1 to %d)", n, PS_MAX_TENSORS);
            return -1;
        }
        for (int i = 0; i < n; i++) unit[i] = i;
    }
    if (nu < n && !(l->tab = calloc((size_t)n, sizeof *l->tab))) {
        free(unit);
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const int u = unit[i];
        ps_tensor_info_t *ut = &l->t[u];
        if (i == 0 || unit[i - 1] != u) { /* a new unit: at a 64-byte boundary */
            off = round_up(off, PS_TENSOR_ALIGN);
            info_of(ut, &specs[i], off);
            ut->first = i;
        }
        ut->count++;
        if (l->tab) {
            info_of(&l->tab[i], &specs[i], off);
            l->tab[i].unit = u;
        } else {
            ut->unit = u;
        }
        if (ut->count > 1) { /* packed: the unit is the run of floats, named after its first tensor */
            ut->numel += l->tab[i].numel;
            ut->ndim = 1;
            ut->shape[0] = ut->numel;
            ut->rows = ut->numel; /* a vector: rows = shape[0] */
            ut->cols = 1;
            ut->init = (ps_init_t){PS_INIT_ZEROS, 0};
            snprintf(ut->name, sizeof ut->name, "%.200s and %d more", specs[ut->first].name, ut->count - 1);
        }
        if (specs[i].kind == PS_TENSOR_ROWS && l->table < 0) l->table = u;
        off += ps_shape_numel(specs[i].ndim, specs[i].shape);
        l->n_params = off; /* n_params ends at the last tensor: no trailing padding */
    }
    free(unit);
    l->n_tensors = nu;
    l->n_tab = n;
    return 0;
}

int ps_layout_init_specs(ps_layout_t *l, const ps_tensor_spec_t *specs, int n, char *err, size_t errlen)
{
    return lay_out(l, specs, n, true, err, errlen);
}

void ps_layout_free(ps_layout_t *l)
{
    free(l->tab);
    l->tab = NULL;
}

int ps_layout_copy(ps_layout_t *dst, const ps_layout_t *src)
{
    *dst = *src;
    if (!src->tab) return 0;
    if (!(dst->tab = malloc((size_t)src->n_tab * sizeof *dst->tab))) return -1;
    memcpy(dst->tab, src->tab, (size_t)src->n_tab * sizeof *dst->tab);
    return 0;
}

void ps_unit_tensors(const ps_layout_t *l, int u, size_t from, size_t n,
                     void (*f)(const ps_tensor_info_t *t, int k, size_t off, size_t n, void *arg), void *arg)
{
    const ps_tensor_info_t *ut = &l->t[u];
    for (int k = ut->first; k < ut->first + ut->count; k++) {
        const ps_tensor_info_t *t = ps_layout_tensor(l, k);
        const size_t at = t->offset - ut->offset, lo = from > at ? from : at,
                     hi = from + n < at + t->numel ? from + n : at + t->numel;
        if (lo < hi) f(t, k, lo - at, hi - lo, arg);
    }
}

int ps_layout_same_table(const ps_layout_t *a, const ps_layout_t *b, char *why, size_t n)
{
    return ps_layout_same_table_as(a, b, "here", "there", why, n);
}

int ps_layout_same_table_as(const ps_layout_t *a, const ps_layout_t *b, const char *an, const char *bn, char *why,
                            size_t n)
{
    const int na = ps_layout_ntab(a), nb = ps_layout_ntab(b);
    for (int t = 0; t < na && t < nb; t++) {
        const ps_tensor_info_t *x = ps_layout_tensor(a, t), *y = ps_layout_tensor(b, t);
        char sx[256], sy[256];
        ps_shape_str(x->ndim, x->shape, sx, sizeof sx);
        ps_shape_str(y->ndim, y->shape, sy, sizeof sy);
        if (strcmp(x->name, y->name) != 0) {
            snprintf(why, n, "tensor %d: named %s %s, %s %s", t, x->name, an, y->name, bn);
            return 0;
        }
        if (strcmp(sx, sy) != 0) {
            snprintf(why, n, "tensor %d (%s): shape %s %s, %s %s", t, x->name, sx, an, sy, bn);
            return 0;
        }
        if (x->kind != y->kind) {
            snprintf(why, n, "tensor %d (%s): %s %s, %s %s", t, x->name, x->kind == PS_TENSOR_ROWS ? "sparse rows" : "dense",
                     an, y->kind == PS_TENSOR_ROWS ? "sparse rows" : "dense", bn);
            return 0;
        }
    }
    if (na != nb) {
        int t = na < nb ? na : nb;
        snprintf(why, n, "%d tensors %s, %d %s (the first one missing: %s)", na, an, nb, bn,
                 na > t ? ps_layout_tensor(a, t)->name : ps_layout_tensor(b, t)->name);
        return 0;
    }
    return 1;
}

int ps_layout_init_table(ps_layout_t *l, const int *sizes, int n_sizes, uint64_t table_rows, int table_dim)
{
    assert(l);
    if (n_sizes < 2 || n_sizes > PS_MAX_LAYERS + 1 || !sizes) return -1;
    for (int i = 0; i < n_sizes; i++)
        if (sizes[i] < 1) return -1;
    if (table_rows && (table_dim < 1 || table_rows > (uint64_t)INT32_MAX / (uint64_t)table_dim)) return -1;
    ps_tensor_spec_t sp[PS_MAX_TENSORS];
    int n = 0;
    memset(sp, 0, sizeof sp);
    for (int i = 0; i + 1 < n_sizes; i++) {
        snprintf(sp[n].name, sizeof sp[n].name, "fc%d.weight", i + 1);
        sp[n].ndim = 2;
        sp[n].shape[0] = (uint64_t)sizes[i + 1];
        sp[n].shape[1] = (uint64_t)sizes[i];
        sp[n++].init.kind = PS_INIT_HE;
        snprintf(sp[n].name, sizeof sp[n].name, "fc%d.bias", i + 1);
        sp[n].ndim = 1;
        sp[n].shape[0] = (uint64_t)sizes[i + 1];
        sp[n++].init.kind = PS_INIT_ZEROS;
    }
    if (table_rows) {
        snprintf(sp[n].name, sizeof sp[n].name, "embedding.weight");
        sp[n].ndim = 2;
        sp[n].shape[0] = table_rows;
        sp[n].shape[1] = (uint64_t)table_dim;
        sp[n].kind = PS_TENSOR_ROWS;
        sp[n++].init.kind = PS_INIT_HE;
    }
    char err[320];
    if (lay_out(l, sp, n, false, err, sizeof err) != 0) return -1;
    l->n_sizes = n_sizes;
    for (int i = 0; i < n_sizes; i++) l->sizes[i] = sizes[i];
    l->n_layers = n_sizes - 1;
    return 0;
}

int ps_layout_init(ps_layout_t *l, const int *sizes, int n_sizes)
{
    return ps_layout_init_table(l, sizes, n_sizes, 0, 0);
}

int ps_config_layout(const ps_config_t *c, ps_layout_t *l)
{
    char err[400];
    if (c->kind == PS_MODEL_TENSORS) return ps_layout_init_specs(l, c->tensors, c->n_tensors, err, sizeof err);
    return c->kind == PS_MODEL_CTR ? ps_layout_init_table(l, c->sizes, c->n_sizes, (uint64_t)c->ctr_rows, c->ctr_dim)
                                   : ps_layout_init(l, c->sizes, c->n_sizes);
}

void ps_model_init_params(const ps_layout_t *l, float *params, uint64_t seed)
{
    assert(l && params);
    /* Zeroes the padding between tensors. */
    memset(params, 0, l->n_params * sizeof(float));
    ps_model_init_pieces(l, params, seed, NULL);
}

typedef struct {
    float *params;
    uint64_t seed;
} init_arg_t;

/* Floats [off, off + n) of tensor k of the table (t) as its init says. */
static void init_range(const ps_tensor_info_t *w, int k, size_t off, size_t n, void *arg)
{
    const init_arg_t *a = arg;
    const size_t from = off, to = off + n;
    float *p = a->params + w->offset;
    if (w->init.kind != PS_INIT_HE) {
        ps_tensor_init_values(&w->init, w->ndim, w->shape, k, a->seed, from, to, p + from);
        return;
    }
    ps_rng_t r;
    ps_rng_seed(&r, a->seed, PS_INIT_STREAM + (uint64_t)k);
    /* He-uniform: Var = bound^2 / 3 = 2 / fan_in. The stream is drawn
     * from the tensor's first float on, whatever part is written. */
    const float bound = (float)sqrt(6.0 / (double)w->cols);
    for (size_t j = 0; j < from; j++) (void)ps_rng_next(&r);
    for (size_t j = from; j < to; j++) p[j] = (2.0f * ps_rng_uniform(&r) - 1.0f) * bound;
}

void ps_model_init_pieces(const ps_layout_t *l, float *params, uint64_t seed, const ps_piece_t *own)
{
    assert(l && params);
    init_arg_t a = {params, seed};
    for (int u = 0; u < l->n_tensors; u++) {
        const size_t from = own ? own[u].off : 0, to = own ? own[u].off + own[u].n : l->t[u].numel;
        if (to > from) ps_unit_tensors(l, u, from, to - from, init_range, &a);
    }
}

uint32_t ps_layout_crc32(const ps_layout_t *l, const float *params)
{
    uLong crc = crc32(0L, Z_NULL, 0);
    for (int t = 0; t < l->n_tensors; t++)
        crc = crc32_z(crc, (const Bytef *)(params + l->t[t].offset), sizeof(float) * l->t[t].numel);
    return (uint32_t)crc;
}

size_t ps_layout_first_block(const ps_layout_t *l, int t)
{
    size_t b = 0;
    for (int i = 0; i < t && i < l->n_tensors; i++) b += (l->t[i].numel + PS_NORM_BLOCK - 1) / PS_NORM_BLOCK;
    return b;
}

size_t ps_layout_blocks(const ps_layout_t *l) { return ps_layout_first_block(l, l->n_tensors); }

size_t ps_chunk_floats(size_t chunk_bytes)
{
    size_t cf = (chunk_bytes / sizeof(float) + PS_NORM_BLOCK - 1) / PS_NORM_BLOCK * PS_NORM_BLOCK;
    return cf ? cf : PS_NORM_BLOCK;
}

int ps_piece_chunks(const ps_piece_t *p, size_t cf, ps_piece_t *out, int k)
{
    size_t end = p->off + p->n;
    for (size_t o = p->off; o < end; o += cf, k++)
        if (out) out[k] = (ps_piece_t){.t = p->t, .off = o, .n = end - o < cf ? end - o : cf};
    return k;
}

int ps_layout_chunks(const ps_layout_t *l, size_t cf, ps_piece_t *out)
{
    int k = 0;
    for (int t = 0; t < l->n_tensors; t++)
        k = ps_piece_chunks(&(ps_piece_t){.t = t, .off = 0, .n = l->t[t].numel}, cf, out, k);
    return k;
}

int ps_chunk_find(const ps_layout_t *l, size_t cf, int t, size_t off, size_t n)
{
    if (t < 0 || t >= l->n_tensors || off % cf != 0 || off >= l->t[t].numel) return -1;
    size_t left = l->t[t].numel - off;
    if (n != (left < cf ? left : cf)) return -1;
    int k = 0;
    for (int i = 0; i < t; i++) k += (int)((l->t[i].numel + cf - 1) / cf);
    return k + (int)(off / cf);
}

/* The owner of the block at float p of the arena: where its first float lies */
static int block_owner(const ps_layout_t *l, size_t p, int n)
{
    return n > 1 ? (int)((unsigned long long)p * (unsigned long long)n / (unsigned long long)l->n_params) : 0;
}

void ps_shard_pieces(const ps_layout_t *l, int k, int n, ps_piece_t out[PS_MAX_TENSORS])
{
    memset(out, 0, PS_MAX_TENSORS * sizeof *out);
    for (int t = 0; t < l->n_tensors; t++) {
        /* owners grow with the block: shard k's blocks are those from the
         * first owned by k or later to the first owned by k + 1 or later
         * (binary searches: a forged header must not cost a loop over
         * 2^30 blocks) */
        const size_t nb = (l->t[t].numel + PS_NORM_BLOCK - 1) / PS_NORM_BLOCK, at = l->t[t].offset;
        size_t first[2];
        for (int e = 0; e < 2; e++) {
            size_t lo = 0, hi = nb; /* the first block whose owner >= k + e */
            while (lo < hi) {
                size_t mid = lo + (hi - lo) / 2;
                if (block_owner(l, at + mid * PS_NORM_BLOCK, n) >= k + e) hi = mid;
                else lo = mid + 1;
            }
            first[e] = lo;
        }
        if (first[0] >= first[1]) {
            out[t] = (ps_piece_t){.t = t, .off = 0, .n = 0};
            continue;
        }
        size_t lo = first[0] * PS_NORM_BLOCK, hi = first[1] * PS_NORM_BLOCK;
        if (hi > l->t[t].numel) hi = l->t[t].numel;
        out[t] = (ps_piece_t){.t = t, .off = lo, .n = hi - lo};
    }
}

uint64_t ps_part_size(const ps_piece_t part[PS_MAX_TENSORS], int n_tensors)
{
    uint64_t n = 0;
    for (int t = 0; t < n_tensors; t++) n += part[t].n;
    return n;
}

int ps_part_range(const ps_piece_t part[PS_MAX_TENSORS], int n_tensors, uint64_t from, uint64_t count,
                  ps_piece_t out[PS_MAX_TENSORS])
{
    uint64_t size = ps_part_size(part, n_tensors);
    if (count == 0 || from > size || count > size - from) return 0;
    int k = 0;
    uint64_t at = 0, end = from + count; /* at: where piece t starts in the run */
    for (int t = 0; t < n_tensors && at < end; at += part[t].n, t++) {
        uint64_t lo = from > at ? from : at, hi = end < at + part[t].n ? end : at + part[t].n;
        if (lo >= hi) continue;
        out[k++] = (ps_piece_t){.t = t, .off = part[t].off + (size_t)(lo - at), .n = (size_t)(hi - lo)};
    }
    return k;
}

int ps_piece_rows(const ps_layout_t *l, const ps_piece_t *p, size_t *r0, size_t *r1)
{
    if (p->t < 0 || p->t >= l->n_tensors || l->t[p->t].kind != PS_TENSOR_ROWS) return 0;
    size_t D = (size_t)l->t[p->t].cols;
    if (D == 0 || p->off % D != 0 || p->n % D != 0) return 0;
    *r0 = p->off / D;
    *r1 = (p->off + p->n) / D;
    return 1;
}

int ps_shards_table_rows(const ps_layout_t *l, int n)
{
    if (l->table < 0 || n < 1) return 0;
    for (int k = 0; k < n; k++) {
        ps_piece_t p[PS_MAX_TENSORS];
        size_t r0, r1;
        ps_shard_pieces(l, k, n, p);
        for (int t = 0; t < l->n_tensors; t++)
            if (l->t[t].kind == PS_TENSOR_ROWS && !ps_piece_rows(l, &p[t], &r0, &r1)) return 0;
    }
    return 1;
}
