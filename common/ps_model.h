/* ps_model.h - parameter layout of an MLP and its seeded initialisation.
 * Shared by psd (master weights), pworker (replica) and the weights file. */
#ifndef PS_MODEL_H
#define PS_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "ps_config.h"
#include "ps_tensor.h"

/* The run's model is a table of named tensors (a "layout"): the built-in
 * MLP and click-through models are tables psd builds from model.layers and
 * ctr.*, a general run's comes from model.tensors, a safetensors file or
 * the first worker. Master copies are f32, one arena, each tensor at a
 * 64-byte boundary. */
typedef struct {
    char name[PS_NAME_MAX + 1];
    int ndim;
    uint64_t shape[PS_MAX_DIMS];
    ps_tensor_kind_t kind;
    ps_init_t init;
    uint64_t rows, cols; /* as a matrix: rows = shape[0] (1 for a scalar), cols = numel / rows */
    size_t offset;       /* in floats, from the start of the arena */
    size_t numel;
    int unit;            /* a tensor of the table: the unit holding it */
    int first, count;    /* a unit: the tensors of the table it holds, [first, first + count) */
} ps_tensor_info_t;

/* Units. What travels and is stepped is a unit: one tensor, or a run of
 * small dense tensors of the table packed one after the other with no gap
 * between them (a general table: tensors under PS_PACK_SMALL floats, up to
 * PS_PACK_UNIT floats a unit), so that a model of hundreds of small
 * tensors costs a few frames. Frames, pieces, chunks, push masks, norm
 * blocks, shared memory and checkpoints see units only (t[], n_tensors,
 * at most PS_MAX_TENSORS); names, shapes and inits are the table's
 * (ps_layout_ntab, ps_layout_tensor). A unit starts on a 64-byte boundary;
 * the file formats hold the units' floats one after the other, which is
 * the table's tensors one after the other. The built-in models never pack:
 * each tensor is its unit, as before. */
#define PS_PACK_SMALL (1u << 16) /* floats: a tensor this big or bigger is a unit alone */
#define PS_PACK_UNIT (1u << 20)  /* floats: a unit of packed tensors at most (at first: see ps_layout_init_specs) */

typedef struct {
    int n_sizes;      /* the built-in models: their MLP's sizes; 0 for a general table */
    int sizes[PS_MAX_LAYERS + 1];
    int n_layers;     /* n_sizes - 1 */
    int n_tensors;    /* units; built-in: 2 * n_layers: fc1.weight, fc1.bias, ..., then the table if there is one */
    int table;        /* the unit of the first tensor of kind PS_TENSOR_ROWS (the click-through table), -1: none */
    ps_tensor_info_t t[PS_MAX_TENSORS];
    size_t n_params;
    /* the table's tensors where units pack several (owned: ps_layout_free;
     * a copy by value is a view that must not outlive it); NULL: t[] are
     * the table's tensors, one a unit */
    int n_tab;
    ps_tensor_info_t *tab;
} ps_layout_t;

/* Units of sparse-rows tensors (each a unit alone): l->table is the first. */
static inline int ps_layout_sparse_units(const ps_layout_t *l)
{
    int n = 0;
    for (int u = 0; u < l->n_tensors; u++) n += l->t[u].kind == PS_TENSOR_ROWS;
    return n;
}

/* Tensors of the table, and tensor k of it (any layout). */
static inline int ps_layout_ntab(const ps_layout_t *l) { return l->tab ? l->n_tab : l->n_tensors; }
static inline const ps_tensor_info_t *ps_layout_tensor(const ps_layout_t *l, int k)
{
    return l->tab ? &l->tab[k] : &l->t[k];
}

/* The model's parameters: the floats of the table's tensors (n_params,
 * the floats laid out, also counts the gaps before units). */
static inline size_t ps_layout_numel(const ps_layout_t *l)
{
    size_t n = 0;
    for (int k = 0; k < ps_layout_ntab(l); k++) n += ps_layout_tensor(l, k)->numel;
    return n;
}

/* Lay out a table of n tensors in order, packing small dense tensors into
 * units (as few as fit PS_MAX_TENSORS). 0, or -1 with a message naming the
 * tensor that does not fit (no tensors or more than PS_MAX_TABLE, an
 * empty, too long or repeated name, a dimension 0 or too many, too many
 * elements, a sparse-rows tensor of fewer than 2 dimensions), or out of
 * memory. The layout owns what it allocates: ps_layout_free. */
int ps_layout_init_specs(ps_layout_t *l, const ps_tensor_spec_t *specs, int n, char *err, size_t errlen);
/* Free what l owns (safe on a zeroed or built-in layout, and twice). */
void ps_layout_free(ps_layout_t *l);
/* A deep copy of src into dst (dst owns its own). 0 or -1 (out of memory). */
int ps_layout_copy(ps_layout_t *dst, const ps_layout_t *src);


/* Two tables alike (names, shapes, kinds, order): 1, or 0 with why naming
 * the first difference ("tensor 3 (fc2.weight): shape [10, 256] here, [10,
 * 128] there"). */
int ps_layout_same_table(const ps_layout_t *a, const ps_layout_t *b, char *why, size_t n);
/* The same, a and b called an and bn ("in this worker's", "in the run's"). */
int ps_layout_same_table_as(const ps_layout_t *a, const ps_layout_t *b, const char *an, const char *bn, char *why,
                            size_t n);

/* The built-in MLP: fc{i+1}.weight (sizes[i+1], sizes[i]) then fc{i+1}.bias
 * (sizes[i+1]) for each layer (torch.nn.Linear's names and shapes), weights
 * PS_INIT_HE, biases zeros. Returns 0, or -1 when n_sizes is out of range
 * or a size is < 1. */
int ps_layout_init(ps_layout_t *l, const int *sizes, int n_sizes);

/* The same, then an embedding table "embedding.weight" (table_rows,
 * table_dim), sparse rows, as tensor 2 * n_layers (table_rows 0: none, as ps_layout_init). The MLP's tensors
 * keep their indices; E's rows are the row ids of embedding bags. -1 when a
 * size is out of range or the table has more than INT32_MAX floats. */
int ps_layout_init_table(ps_layout_t *l, const int *sizes, int n_sizes, uint64_t table_rows, int table_dim);

/* The layout a config trains: its MLP, and with model.kind ctr the
 * embedding table (ctr.rows x ctr.dim); with model.kind tensors the table
 * model.tensors lists (one read from model.init's file: ps_run_layout).
 * 0, or -1 as ps_layout_init_table. */
int ps_config_layout(const ps_config_t *c, ps_layout_t *l);

/* A unit's floats [from, from + n) (n > 0) as pieces of the table's tensors in it:
 * calls f(tensor, its first float, count, arg) for each, in order. */
void ps_unit_tensors(const ps_layout_t *l, int u, size_t from, size_t n,
                     void (*f)(const ps_tensor_info_t *t, int k, size_t off, size_t n, void *arg), void *arg);

/* Every tensor's initial values as its init says, drawn from seed only
 * (same seed -> same bits). Padding between tensors is zeroed. */
void ps_model_init_params(const ps_layout_t *l, float *params, uint64_t seed);

/* The gradient's norm is summed per block of this many floats (blocks start
 * at each tensor's first element), then over the blocks in layout order:
 * the same bits for any chunking and any number of psd shards. */
#define PS_NORM_BLOCK 16384
#define PS_MAX_SHARDS 16

/* A piece of a tensor: floats [off, off + n) of tensor t (n may be 0). */
typedef struct {
    int t;
    size_t off, n;
} ps_piece_t;

/* The part of the parameters psd shard k of n owns (psd --shard k/n): the
 * norm blocks whose first float lies in [k, k+1) * n_params / n, which is at
 * most one piece of each tensor: out[t] for every tensor t (n = 0 where the
 * shard has none of it). Workers and shards compute it alike. */
void ps_shard_pieces(const ps_layout_t *l, int k, int n, ps_piece_t out[PS_MAX_TENSORS]);

/* A shard's part as one run of floats: its pieces (one per tensor, as
 * ps_shard_pieces gives them) one after the other in tensor order.
 * ps_part_size: how many floats. ps_part_range: the floats [from, from +
 * count) of that run as pieces of tensors, in order, into out; returns how
 * many (0 when the range is empty or does not lie inside the part). */
uint64_t ps_part_size(const ps_piece_t part[PS_MAX_TENSORS], int n_tensors);
int ps_part_range(const ps_piece_t part[PS_MAX_TENSORS], int n_tensors, uint64_t from, uint64_t count,
                  ps_piece_t out[PS_MAX_TENSORS]);

/* The rows a piece of a sparse-rows tensor (any of them, not only
 * l->table) holds whole: 1 with [*r0, *r1) when the piece is whole rows
 * (always when the tensor's width divides PS_NORM_BLOCK; an empty piece
 * holds none), 0 when a row straddles its ends or the piece is not of a
 * sparse-rows tensor. */
int ps_piece_rows(const ps_layout_t *l, const ps_piece_t *p, size_t *r0, size_t *r1);

/* ps_model_init_params' values written only inside the pieces own[t] (one
 * per tensor, ps_shard_pieces: a psd shard's part); the rest of params is
 * not touched (pages a shard never takes), padding included. NULL: every
 * tensor whole. */
void ps_model_init_pieces(const ps_layout_t *l, float *params, uint64_t seed, const ps_piece_t *own);

/* 1 when the layout has a table and every piece of every sparse-rows
 * tensor among n shards is whole rows (ps_piece_rows): their rows then go
 * to the shard owning them, and each shard steps its rows lazily; 0
 * otherwise. */
int ps_shards_table_rows(const ps_layout_t *l, int n);

/* Blocks of the layout in order, and the first block of tensor t. */
size_t ps_layout_blocks(const ps_layout_t *l);
size_t ps_layout_first_block(const ps_layout_t *l, int t);

/* Chunks (server.chunk_bytes): every tensor in chunks of cf floats (whole
 * norm blocks; the last chunk of a tensor shorter), numbered in layout
 * order. psd steps chunk by chunk, and with train.stream the wire carries
 * them: workers and psd compute the same numbering. */
size_t ps_chunk_floats(size_t chunk_bytes);
/* The chunks of tensor piece p (from its first float on), appended to out
 * from index k (out may be NULL: counted only). Returns the index after
 * the last. */
int ps_piece_chunks(const ps_piece_t *p, size_t cf, ps_piece_t *out, int k);
/* Chunks of the whole layout: the count (out NULL) or out filled. */
int ps_layout_chunks(const ps_layout_t *l, size_t cf, ps_piece_t *out);
/* Index of the chunk that is floats [off, off+n) of tensor t, or -1 if that
 * is no chunk of the layout. */
int ps_chunk_find(const ps_layout_t *l, size_t cf, int t, size_t off, size_t n);

/* CRC-32 (zlib) of the tensors at params, in layout order, padding
 * excluded: what psd --x-verify-weights promises a worker receives. */
uint32_t ps_layout_crc32(const ps_layout_t *l, const float *params);

#endif
