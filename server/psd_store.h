/* psd_store.h - the parameter store: master fp32 weights in versioned
 * arenas, the gradient accumulator and the optimizer state.
 *
 * A version is an arena laid out by ps_layout_t. Pull replies send frames
 * that point into the current version's arena (no copies) and hold a
 * reference each; while anything references the current version the next
 * one is built out of place in an arena nobody references, so replies in
 * flight are never overwritten. When nothing does (the usual case in
 * synchronous training over the wire: every reply was sent before the
 * pushes came back), the step updates the current arena in place. */
#ifndef PSD_STORE_H
#define PSD_STORE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ps_model.h"
#include "psd_groups.h"
#include "psd_optim.h"
#include "psd_rows.h"
#include "ps_wire.h"

#define PSD_MAX_ARENAS 8
#define PSD_NORM_BLOCK PS_NORM_BLOCK
#define PSD_ITEM_FLOATS (2 * PSD_NORM_BLOCK) /* 128 KiB of a tensor: the step's unit of work on the pool */

struct ps_pool;

/* A unit of a step's parallel work: floats [off, off+n) of tensor t. */
typedef struct {
    int t;
    size_t off, n;   /* absolute offset in the layout, count */
    size_t blk;      /* its first norm block */
    size_t rel;      /* its first float in a contributor's piece of tensor t */
} psd_chunk_t;

typedef struct psd_arena {
    atomic_int refs;    /* frames in flight + 1 while current */
    uint64_t version;
    float *w;           /* n_params floats */
    uint64_t crc_of;    /* version + 1 whose CRC-32 `crc` is (0: none yet) */
    uint32_t crc;
    uint16_t *w16;      /* bfloat16 copy for the wire (train.wire_weights: bf16), or NULL */
    uint64_t w16_of;    /* version + 1 w16 holds (0: none yet) */
} psd_arena_t;

typedef struct {
    ps_layout_t layout;
    psd_optim_t opt;
    psd_groups_t groups; /* optimizer.groups' spans (psd_store_groups); span NULL: none, every float takes opt */
    psd_arena_t arenas[PSD_MAX_ARENAS];
    int n_arenas;
    psd_arena_t *cur;
    float *grad;        /* reduced gradient (n_params) */
    float *s0, *s1;     /* optimizer slots (n_params) or NULL */
    uint64_t steps;     /* optimizer steps applied */
    uint64_t in_place;  /* versions made by updating the current arena in place (nothing referenced it) */
    double step_s;      /* seconds spent reducing and applying (the step's pool runs), all steps */
    /* the last step's largest magnitudes (psd_amax_t bits) of the gradient
     * applied and of the weights written, the parts this store stepped:
     * taken in the optimizer's loop, merged once per work item */
    _Atomic uint32_t amax_g, amax_w;
    /* called before the optimizer updates slot floats [off, off+n) (a
     * checkpoint being written saves them copy-on-write); may be NULL */
    void (*before_update)(void *ud, size_t off, size_t n);
    void *before_update_ud;
    /* parallel steps (psd_store_set_parallel): chunks of every tensor */
    struct ps_pool *pool;
    int threads;
    size_t chunk_bytes;
    ps_piece_t own[PS_MAX_TENSORS]; /* the part this store steps (psd --shard): whole tensors by default */
    psd_chunk_t *chunks;
    int n_chunks;
    /* the chunks cut into the pool's work items (PSD_ITEM_FLOATS at most,
     * whole norm blocks): a 4 MiB chunk is a few items, so the threads
     * share even one chunk's work evenly */
    psd_chunk_t *items;
    int n_items, step_items;
    double *blk_sq;     /* squared norm of each norm block */
    size_t n_blk;
    /* the sparse-rows tensors stepped row by row (psd_store_lazy_table):
     * the dense step runs the first step_items items (those before the
     * tables'); rows[j] merges the rows of unit lazy_t[j] (units in
     * layout order), whose norm blocks come from them */
    int n_lazy;
    uint64_t lazy_mask; /* the units lazy_t[0, n_lazy) */
    int lazy_t[PS_MAX_TENSORS];
    psd_rows_t rows[PS_MAX_TENSORS];
    /* shared arenas (psd_store_share): slot i of one memfd is arena i */
    float *shm_base;
    size_t shm_slot_floats;
    int shm_fd, shm_ro_fd; /* the memfd, and a read-only fd of it for workers */
} psd_store_t;

/* Allocate and initialise weights from seed (version 0). 0 or -ENOMEM. */
int psd_store_init(psd_store_t *s, const ps_layout_t *l, const psd_optim_t *opt, uint64_t seed);
/* The same for psd shard k of n (n > 1): it owns only its pieces
 * (ps_shard_pieces, as psd_store_own) and only those are initialised and
 * take memory; n <= 1 is psd_store_init. */
int psd_store_init_part(psd_store_t *s, const ps_layout_t *l, const psd_optim_t *opt, uint64_t seed, int k, int n);
void psd_store_deinit(psd_store_t *s);

/* Step with optimizer groups (optimizer.groups) from now on: each tensor
 * takes the weight decay and lr scale of the first of groups[0, n) that
 * matches its name (psd_groups.h), the rest opt's and 1; n == 0: none.
 * Any number of times (psd shards: each its part, alike). 0 or -ENOMEM
 * (no groups then). */
int psd_store_groups(psd_store_t *s, const ps_group_t *groups, int n);

/* Split steps into chunks of about chunk_bytes (rounded up to whole norm
 * blocks; a tensor is at least one chunk) run on `threads` threads (including
 * the caller). The results are bit-identical for any chunk size and thread
 * count. Until this call (psd_store_init sets it up so): one thread, one
 * chunk per tensor. 0 or -ENOMEM. */
int psd_store_set_parallel(psd_store_t *s, int threads, size_t chunk_bytes);

/* Own only the pieces of shard k of n (ps_shard_pieces): steps reduce and
 * apply those, contributors' gradients are those pieces (not whole
 * tensors), and the memory of the rest is given back. Before the first
 * step. 0 or -ENOMEM. */
int psd_store_own(psd_store_t *s, int k, int n);

/* A checkpoint's state into the current version and the optimizer slots:
 * the pieces this store owns (own[]) of whole arenas w and slots[0, n_slots)
 * (n_params floats each); the rest of the store is not touched, nor made
 * resident. */
void psd_store_load_part(psd_store_t *s, const float *w, const float *const slots[2], uint32_t n_slots);

/* Move the arenas into one memfd of PSD_MAX_ARENAS page-aligned slots
 * (memory is taken only as slots are used), so that workers on this host
 * can map the versions read-only (s->shm_ro_fd). Call before the first
 * step. 0 or -errno (the arenas stay where they were). */
int psd_store_share(psd_store_t *s);
/* Slot of an arena in the shared region. */
static inline int psd_store_slot(const psd_store_t *s, const psd_arena_t *a) { return (int)(a - s->arenas); }

/* Take a reference on the current arena for a frame sent by ZeroMQ;
 * psd_store_frame_free is the matching zmq free callback (any thread). */
psd_arena_t *psd_store_ref_current(psd_store_t *s);
void psd_store_frame_free(void *data, void *hint);

/* CRC-32 of the current version's tensors in layout order (computed once
 * per version): what a worker must receive for that version. */
uint32_t psd_store_current_crc(psd_store_t *s);

/* The current version as bfloat16 (computed once per version, on the step's
 * threads), laid out like the weights; NULL if out of memory. Frames
 * pointing into it take a reference on the current arena like f32 ones. */
const uint16_t *psd_store_current_bf16(psd_store_t *s);

/* Frames of the current version's owned pieces (whole tensors for one
 * psd), as f32 or from w16 (psd_store_current_bf16) when not NULL, each
 * holding a reference on the current arena (sent without copying). With
 * crc: the CRC-32 of the frames' bytes in order. Returns the frame count. */
int psd_store_frames(psd_store_t *s, const uint16_t *w16, ps_frame_t *fr, uint32_t *crc);

/* Frames of floats [from, from + count) of the current version's owned
 * pieces taken as one run (ps_part_range), f32, each holding a reference on
 * the current arena. Returns the frame count: 0 when the range is empty or
 * not inside the part. */
int psd_store_range_frames(psd_store_t *s, uint64_t from, uint64_t count, ps_frame_t *fr);

/* One synchronous step. grads[k][t] is tensor t of contributor k (borrowed):
 * floats, or bfloat16 where bf16 (may be NULL) has bf16[k] set; weight[k]
 * its share of the batch (sum 1); contributors are reduced in the
 * order given. Clipping by clip_norm (<= 0: off), then the optimizer with lr
 * writes a new version, which becomes current. Returns the gradient's global
 * norm before clipping (0 without clipping: then no norm is computed), or -1
 * if no arena could be allocated. */
double psd_store_step(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS],
                      const uint8_t *bf16, const double *weight, double clip_norm, double lr);

/* Step every sparse-rows tensor of the layout lazily from now on (one
 * psd, or a psd shard whose pieces of them are whole rows: after
 * psd_store_own): s->lazy_t[j] is the unit of the j-th, in layout order.
 * Each step merges the contributors' row gradients of each (psd_rows_merge:
 * room for max_entries entries a table from up to max_k contributors; ids
 * of the table, in the piece owned) and updates only those rows and their
 * optimizer state (psd_rows.h); the dense step leaves them out. Called
 * again with more room, it grows. 0, -EINVAL (no sparse-rows tensor, or a
 * piece that is not whole rows) or -ENOMEM. */
int psd_store_lazy_table(psd_store_t *s, size_t max_entries, int max_k);

/* Room in the row merges for the k contributors' rows of a step:
 * rows[j * k + c] is contributor c's of lazy table j (n_lazy x k), from up
 * to max_k contributors: each table's grown, by doubling at least, only
 * when a step has more entries than any before. 0 or -ENOMEM. */
int psd_store_rows_room(psd_store_t *s, int k, const psd_rowgrad_t *rows, int max_k);

/* psd_store_step with the lazy tables' gradients as rows: rows[j * n + k]
 * is contributor k's of lazy table j (n_lazy x n; rows may be NULL: no row
 * touched), in the same order and weights as grads. With clipping, the
 * global norm includes the merged rows. Returns as psd_store_step, or -2
 * if the rows hold more entries than psd_store_lazy_table made room for. */
double psd_store_step_rows(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS],
                           const uint8_t *bf16, const double *weight, const psd_rowgrad_t *rows,
                           double clip_norm, double lr);

/* The same step in two halves, for psd shards with clipping: reduce_rows
 * reduces the owned part (the squared norm of each owned block in
 * s->blk_sq; with a lazy table it first merges the rows as step_rows does
 * and takes the table's blocks' norms from them: 0, or -2 as step_rows),
 * then, once the squared norm of the whole gradient is known
 * (psd_store_sumsq over every shard's blocks), apply. apply returns 0, or
 * -1 if no arena. */
int psd_store_reduce_rows(psd_store_t *s, int n, const void *const (*grads)[PS_MAX_TENSORS], const uint8_t *bf16,
                          const double *weight, const psd_rowgrad_t *rows);
double psd_store_sumsq(const psd_store_t *s);
/* One contributor's gradient (grads[0], bf16[0]) times weight into the
 * step's sum (s->grad): the first sets it, the next add (add), with the
 * arithmetic of a step over all of them at once, so that contributors
 * folded one by one in rank order and then stepped as one of weight 1
 * (its gradient s->grad, f32) give the same bits. Dense tensors only. */
void psd_store_fold(psd_store_t *s, const void *const (*grads)[PS_MAX_TENSORS], const uint8_t *bf16, double weight,
                    bool add);
/* The step's sum, laid out as the model (psd_store_fold's). */
static inline const float *psd_store_sum(const psd_store_t *s) { return s->grad; }
int psd_store_apply(psd_store_t *s, double sumsq, double clip_norm, double lr);

/* Streamed steps (train.stream, one psd): the step is taken chunk by chunk
 * (s->chunks) as the contributors' chunks come in, into the arena
 * psd_store_stream_begin returns (the step counted and the slots about to
 * change, as in psd_store_step; NULL if no arena is free), made current by
 * psd_store_stream_end. stream_chunks steps chunks ids[0, m) on the pool:
 * src[j * n + k] is contributor k's gradient of chunk ids[j] (f32, or
 * bfloat16 where bf16[k]), weight[k] its share; the same arithmetic as
 * psd_store_step, so the same bits. With clip the chunks are only reduced
 * (with their block norms); stream_apply then applies every chunk with
 * the global norm (returned). stream_keep: chunk c takes no step (its
 * contributors were lost), the new version keeps its current values.
 * stream_void: no chunk of the step took one (every contributor was lost
 * before any chunk was applied: with clipping, always): it is not counted
 * as an optimizer step (Adam's bias correction goes on from the last real
 * one). tensor_frame: a frame of tensor t of arena a (a reference on a). */
psd_arena_t *psd_store_stream_begin(psd_store_t *s);
void psd_store_stream_chunks(psd_store_t *s, psd_arena_t *next, const int *ids, int m, int n,
                             const void *const *src, const uint8_t *bf16, const double *weight, bool clip, double lr);
double psd_store_stream_apply(psd_store_t *s, psd_arena_t *next, double clip_norm, double lr);
void psd_store_stream_keep(psd_store_t *s, psd_arena_t *next, int c);
void psd_store_stream_void(psd_store_t *s);
void psd_store_stream_end(psd_store_t *s, psd_arena_t *next);
void psd_store_tensor_frame(psd_store_t *s, psd_arena_t *a, int t, ps_frame_t *fr);

/* The last step's L-infinity norms (psd_amax_t bits; psd_optim.h) over what
 * it stepped (the owned part: dense items, and a lazy table's touched
 * rows): max |g| of the averaged gradient before clipping and max |w| of
 * the new weights. From psd_store_step, _step_rows, _apply and
 * psd_store_stream_begin on (chunks kept by stream_keep are not stepped,
 * nor counted). Not finite (>= PSD_AMAX_INF): a NaN or infinity there. */
psd_amax_t psd_store_step_amax(const psd_store_t *s);

#endif
