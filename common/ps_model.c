/* ps_model.c - parameter layout of an MLP and its seeded initialisation. */
#include "ps_model.h"

#include <assert.h>
#include <math.h>
#include <stdint.h>
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

int ps_layout_init_specs(ps_layout_t *l, const ps_tensor_spec_t *specs, int n, char *err, size_t errlen)
{
    assert(l);
    if (ps_tensors_check(specs, n, err, errlen) != 0) return -1;
    memset(l, 0, sizeof(*l));
    l->table = -1;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        const ps_tensor_spec_t *sp = &specs[i];
        const size_t len = strlen(sp->name);
        const uint64_t numel = ps_shape_numel(sp->ndim, sp->shape);
        ps_tensor_info_t *t = &l->t[i];
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
        if (sp->kind == PS_TENSOR_ROWS && l->table < 0) l->table = i;
        /* n_params ends at the last tensor: no trailing padding. */
        l->n_params = off + t->numel;
        off = round_up(off + t->numel, PS_TENSOR_ALIGN);
    }
    l->n_tensors = n;
    return 0;
}

int ps_layout_same_table(const ps_layout_t *a, const ps_layout_t *b, char *why, size_t n)
{
    return ps_layout_same_table_as(a, b, "here", "there", why, n);
}

int ps_layout_same_table_as(const ps_layout_t *a, const ps_layout_t *b, const char *an, const char *bn, char *why,
                            size_t n)
{
    for (int t = 0; t < a->n_tensors && t < b->n_tensors; t++) {
        const ps_tensor_info_t *x = &a->t[t], *y = &b->t[t];
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
    if (a->n_tensors != b->n_tensors) {
        int t = a->n_tensors < b->n_tensors ? a->n_tensors : b->n_tensors;
        snprintf(why, n, "%d tensors %s, %d %s (the first one missing: %s)", a->n_tensors, an, b->n_tensors, bn,
                 a->n_tensors > t ? a->t[t].name : b->t[t].name);
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
    if (ps_layout_init_specs(l, sp, n, err, sizeof err) != 0) return -1;
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

void ps_model_init_pieces(const ps_layout_t *l, float *params, uint64_t seed, const ps_piece_t *own)
{
    assert(l && params);
    for (int k = 0; k < l->n_tensors; k++) {
        const ps_tensor_info_t *w = &l->t[k];
        const size_t from = own ? own[k].off : 0, to = own ? own[k].off + own[k].n : w->numel;
        float *p = params + w->offset;
        if (to <= from) continue;
        if (w->init.kind != PS_INIT_HE) {
            ps_tensor_init_values(&w->init, w->ndim, w->shape, k, seed, from, to, p + from);
            continue;
        }
        ps_rng_t r;
        ps_rng_seed(&r, seed, PS_INIT_STREAM + (uint64_t)k);
        /* He-uniform: Var = bound^2 / 3 = 2 / fan_in. The stream is drawn
         * from the tensor's first float on, whatever part is written. */
        const float bound = (float)sqrt(6.0 / (double)w->cols);
        for (size_t j = 0; j < from; j++) (void)ps_rng_next(&r);
        for (size_t j = from; j < to; j++) p[j] = (2.0f * ps_rng_uniform(&r) - 1.0f) * bound;
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
    if (l->table < 0 || p->t != l->table) return 0;
    size_t D = (size_t)l->t[l->table].cols;
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
        if (!ps_piece_rows(l, &p[l->table], &r0, &r1)) return 0;
    }
    return 1;
}
