/* psd_hold.h - the parameter holder: a psd's piece of every tensor (its
 * psd_store_t: all of them for one psd, ps_shard_pieces for a psd shard)
 * and its contributors' pushes. Shard 0 (psd_push.c, psd_step.c) and the
 * other psd shards (psd_shard.c) hold their parameters through these
 * functions alone, so that every shard count takes the same steps:
 *
 *   psd_push_take     a PUSH's frames checked and kept (tensor pieces, the
 *                     table's rows, the rows its next batch reads)
 *   psd_want_take     a PULL's (or PUSH's) list of table rows wanted
 *   psd_hold_gather   the contributors of a step, in rank order, into the
 *                     step's gradient pointers and table rows
 *   psd_hold_step     the step (or, with clipping across shards, its
 *                     reduction first: psd_store_apply finishes it)
 *   psd_hold_frames   the current version's frames
 *   psd_hold_reply    a weights reply's frames (whole, bf16, or the table's
 *                     rows asked for)
 *
 * Who decides what is the caller's: who may push, which pushes make a step,
 * when. Ownership: psd_hold_t belongs to its psd's loop thread, as do the
 * psd_push_t's (one per contributor slot) it lends row buffers to. The
 * store is the caller's; the holder only points at it. */
#ifndef PSD_HOLD_H
#define PSD_HOLD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "ps_config.h"
#include "ps_wire.h"
#include "psd_rows.h"
#include "psd_store.h"

/* One contributor's push in progress (its frames kept as received until
 * the step) and the table rows its next reply brings. */
typedef struct {
    zmq_msg_t grad[PS_MAX_TENSORS];
    uint64_t frames;   /* tensors whose grad[] holds a frame */
    uint64_t mask;     /* tensors received so far: frames, rows, shared memory */
    uint64_t shm;      /* of which in the contributor's shared region (shard 0) */
    uint64_t rows;     /* units whose gradient came as rows (in sp[]) */
    psd_rowbuf_t *sp[PS_MAX_TENSORS]; /* sp[j]: its rows of the store's lazy table j (store->lazy_t[j]),
                                       * lent by the holder until released; NULL: none */
    psd_want_t want;   /* the rows its next reply brings (has), Push/Pull.want_rows */
} psd_push_t;

typedef struct {
    psd_store_t *store;
    const ps_layout_t *layout;
    bool sharded;      /* a piece of a run of psd shards: rows of its piece, none maybe */
    bool wire_bf16;    /* train.wire_gradients: bf16 (the wire; shared memory is f32) */
    bool wire_w16;     /* train.wire_weights: bf16 */
    bool table_on_psd; /* replies bring the table's rows asked for, never the table */
    bool verify;       /* --x-verify-weights: replies carry the CRC of what they send */
    uint64_t all;      /* tensors with a piece here */
    size_t batch_rows; /* the most rows of the piece of the table one batch may read (a want list's limit) */
    size_t room_rows;  /* the rows a batch reads, as room is made for them (grows past it on demand) */
    const char *rows_limit; /* what sets batch_rows, for the refusal ("train.batch_size x ctr.fields x ...") */
    size_t piece_rows; /* the rows of the piece of the table (0: none) */
    int max_k;         /* contributors a step may have */
    int n_sparse;      /* sparse-rows units of the layout */
    psd_rowbuf_t **sp_free; /* row buffers not lent (max_k x n_sparse room) */
    int n_sp_free, n_sp;
    /* a step's contributors (psd_hold_gather), max_k rows: made once */
    const void *(*g)[PS_MAX_TENSORS];
    uint8_t *bf16;
    psd_rowgrad_t *rg; /* rg[j * k + c]: contributor c's rows of lazy table j (n_sparse x max_k) */
} psd_hold_t;

/* What a taken push brought, for the caller's counters. */
typedef struct {
    uint64_t mask;        /* tensors of this message */
    uint64_t bytes;       /* bytes of its gradient frames */
    uint64_t want_bytes;  /* and of the list of rows wanted */
    bool row_push;        /* a sparse-rows tensor came as rows */
    size_t rows;          /* how many, of all of them (none maybe, on a shard) */
} psd_took_t;

/* Hold store's pieces (laid out by l) for up to max_k contributors a step.
 * 0 or -ENOMEM. */
int psd_hold_init(psd_hold_t *h, psd_store_t *store, const ps_layout_t *l, const ps_config_t *c, bool sharded,
                  int max_k);
void psd_hold_deinit(psd_hold_t *h);

/* A PUSH's gradient for this holder: each frame a tensor's piece held here
 * (f32, or bfloat16 where bf16), not in p->mask nor in `also` (tensors the
 * caller takes from elsewhere: shared memory); u32 ids then f32 rows of
 * any sparse-rows tensor stepped by rows; with want_rows the last frame lists the
 * rows the reply brings (psd_want_take's rules). Everything is checked
 * before anything is kept: on success the frames move into p (p->frames,
 * p->mask), and *took says what came; -1 (why: the reason, e.g. "of tensor
 * 3: not in the model or already received") leaves p as it was. */
int psd_push_take(psd_hold_t *h, psd_push_t *p, ps_msg_t *m, bool bf16, uint64_t also, psd_took_t *took,
                  char *why, size_t why_len);
/* The list of table rows in m's last frame (a PULL's or a PUSH's with
 * want_rows): strictly increasing rows of the table (of this piece on a
 * shard, none maybe), at most `most`, kept in p->want for the next reply.
 * 0, or -1 (why, p->want not set). */
int psd_want_take(psd_hold_t *h, psd_push_t *p, const ps_msg_t *m, size_t most, char *why, size_t why_len);
/* p's push is gone (applied, stale, its worker lost): frames closed, its
 * row buffer back to the holder. The want list stays. */
void psd_push_release(psd_hold_t *h, psd_push_t *p);
/* p's want list freed (a contributor gone). */
void psd_push_free(psd_push_t *p);

/* The step's contributors p[0..k) in rank order (shm[j]: contributor j's
 * shared gradient region, whose tensors p[j]->shm names, or NULL) into
 * h->g, h->bf16 and, for the tables stepped by rows, h->rg (a piece pushed
 * whole becomes its nonzero rows), with room in the store's merge. 0, or
 * -ENOMEM. */
int psd_hold_gather(psd_hold_t *h, psd_push_t *const *p, const float *const *shm, int k);
/* The step over the gathered contributors with weights wt[0..k): applied
 * (returns the gradient's norm, >= 0), or with reduce_only its reduction
 * only (returns 0; the caller then finishes it with psd_store_apply once
 * the whole gradient's norm is known). -1: no free arena; -2: more table
 * rows than room was made for. */
double psd_hold_step(psd_hold_t *h, int k, const double *wt, double clip_norm, double lr, bool reduce_only);

/* The frames of the current version, whole (references on it), f32 or
 * bfloat16 (wire_w16, f32 if out of memory), small tensors first where
 * there is no table; *crc with verify (else 0). Returns the frame count. */
int psd_hold_frames(psd_hold_t *h, ps_frame_t *fr, uint32_t *crc);
/* A weights reply of the current version over the wire, for contributor p:
 * its frames into fr (PS_MAX_TENSORS room; references on the version, or
 * copies with the table on psd), f32 or bfloat16; the table (the last
 * frame) replaced by the rows p asked for (or none with the table on psd),
 * gathered into p->want.vals. *crc: with verify, the CRC of the whole
 * version sent (0 when rows replace the table); *rows: how many rows
 * replaced it (-1: none did). p's want is used up. Returns the frame count. */
int psd_hold_reply(psd_hold_t *h, psd_push_t *p, ps_frame_t *fr, uint32_t *crc, long *rows);
/* After the reply is sent: a want list longer than a batch's (a validation
 * part's rows, up to the piece's) is not kept for the run. */
void psd_hold_sent(psd_hold_t *h, psd_push_t *p);

#endif
