/* psd_ckpt.h - crash-consistent checkpoints of a run, written in the
 * background without doubling psd's memory.
 *
 * File DIR/ckpt-<step, 12 digits>.psdc, format PSD_CKPT_FORMAT, little-endian:
 *   "PSDC" u32 format  psd_ckpt_meta_t fields (fixed order, see psd_ckpt.c)
 *   format 5: u32 len, len bytes of the tensor table (ps_table.h)
 *   seen bitmap (ceil(train_count/8) bytes)
 *   weights arena, then each optimizer slot arena: the floats the file holds
 *   of each (format 4): one psd's whole arena (n_params floats); a psd
 *   shard's part only, its pieces of the tensors (ps_shard_pieces) one after
 *   the other (files of format 1 to 3 held whole arenas, shards too)
 *   u64 total length  u32 CRC-32 (zlib) of every byte before it
 * Written to a temp file, fsync'ed, renamed, directory fsync'ed; the newest
 * `keep` files are kept.
 *
 * Background write: psd_ckpt_begin() captures the metadata, takes a reference
 * on the (immutable) weights arena and starts a thread. The optimizer slots
 * change in place every step, so they are saved copy-on-write: before the
 * step updates slot floats [off, off+n), psd calls psd_ckpt_before_update(),
 * which copies the chunks the writer has not saved yet (1 MiB chunks) to the
 * side. Extra memory is at most the chunks updated before the writer reached
 * them (reported as peak_extra_bytes). */
#ifndef PSD_CKPT_H
#define PSD_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "ps_config.h"
#include "ps_data.h"
#include "ps_model.h"
#include "psd_best.h"
#include "psd_store.h"

/* 6: the run block after the table: u32 length, then the run's data (its
 * sizes, held-out count and fingerprint) and its best epoch and early
 * stopping state (psd_ckpt_run_t); files of 5 and older have none (zeros).
 * 5: the model's tensor table (ps_table.h) after the fixed header: u32
 * length, then its bytes (any model: model.kind tensors has no layer
 * sizes); 4: a psd shard's file holds its part only; 3 added the psd shard
 * layout, 2 the embedding table's shape. Files of 4 to 1 are still read
 * (their table is the one their sizes make). */
#define PSD_CKPT_FORMAT 6u

/* Format 6: what a run knows of its data and its best epoch (psd_valid.c). */
typedef struct {
    uint64_t train_size, test_size; /* 0: not known (a file of format 5 or older) */
    uint64_t n_val;                 /* held-out samples */
    char data_id[PS_DATA_ID_MAX + 1];
    psd_best_t keep, stop;          /* train.keep_best, train.early_stop: metric and state */
    uint64_t best_version;          /* keep's best epoch's weights version */
    uint64_t ended[4];              /* workers whose run ended: left, failed, lost, refused (psd_core.h's
                                     * wend_t order, from 1); after best_version, absent (zeros) in
                                     * files written before them: the block is read to its length */
    char offer[PS_OFFER_MAX + 1];   /* model.kind from_worker: the optimizer the first worker offered (YAML,
                                     * ps_config_adopt), "" = none; after ended, absent in older files */
} psd_ckpt_run_t;

typedef struct {
    uint64_t run_id, config_hash, seed;
    uint64_t step;          /* optimizer steps applied in the run */
    uint64_t version;       /* weight version */
    uint32_t epoch;         /* epoch in progress (0-based) */
    uint32_t epoch_done;    /* 1: that epoch is complete, validation included */
    uint64_t epoch_step;    /* steps applied in that epoch */
    double steps_per_epoch; /* schedule position: p = epoch + epoch_step / steps_per_epoch */
    double ep_loss;         /* that epoch's training statistics so far */
    uint64_t ep_correct, ep_samples;
    double train_s_total;   /* training seconds in the run so far */
    uint64_t samples_total;
    double lr;
    uint64_t train_count;   /* bits in seen */
    int n_sizes;
    int sizes[PS_MAX_LAYERS + 1];
    uint32_t opt_kind;
    uint32_t n_slots;       /* 0, 1 or 2 optimizer slot arenas */
    uint64_t n_params;      /* floats per arena (layout n_params) */
    uint64_t table_rows;    /* embedding table E (model.kind: ctr), 0: none */
    uint32_t table_dim;
    /* the part of the parameters the file holds: psd shard `shard` of
     * `shards` (1: one psd, the whole model; a writer's 0 is taken for 1);
     * read as 0 from files of format 1 and 2, which do not say */
    uint32_t shard, shards;
    uint64_t keep_step; /* not written: the writer's pruning keeps this step's file too (0: none) */
    /* format 5: the tensor table. Writing: taken from the store's layout.
     * Reading: the CRC-32 of its bytes (that of the table the sizes make
     * for older formats), what a resume compares with its own table's. */
    uint32_t table_crc;
    psd_ckpt_run_t run; /* format 6 */
} psd_ckpt_meta_t;

/* The CRC-32 of l's packed table (ps_table_pack), as meta.table_crc. */
uint32_t psd_ckpt_table_crc(const ps_layout_t *l);

/* The model (tensor table) of the newest valid checkpoint in dir of run
 * run_id (0: any run), and the optimizer its first worker offered (into
 * offer, PS_OFFER_MAX + 1 bytes, "" = none): how a model.kind from_worker
 * run resumes without a worker offering them. 0, or -1 with a message. */
int psd_ckpt_newest_layout(const char *dir, uint64_t run_id, ps_layout_t *l, char *offer, char *err, size_t errlen);

/* A whole model's checkpoint file read for export: its layout (from its
 * table, or its sizes) and weights arena (*weights, caller frees). Files of
 * a psd shard (a part) are refused. 0, or -1 with a message. */
int psd_ckpt_read_weights(const char *path, ps_layout_t *l, float **weights, psd_ckpt_meta_t *meta, char *err,
                          size_t errlen);

typedef struct psd_ckpt_writer psd_ckpt_writer_t;

/* Start writing a checkpoint of the store's current state to dir. seen is
 * copied (meta->train_count bits); meta must match the store (n_params, and
 * n_slots of its s0/s1). The store's current arena stays referenced and its
 * slots borrowed until psd_ckpt_end. keep: checkpoints to keep, the newest
 * (<= 0: all). Returns 0, or -errno (nothing started).
 *
 * It installs itself as the store's copy-on-write hook
 * (store->before_update = psd_ckpt_hook, before_update_ud = the writer);
 * psd_ckpt_end removes it. */
int psd_ckpt_begin(psd_ckpt_writer_t **wr, const char *dir, int keep, const psd_ckpt_meta_t *meta,
                   const uint8_t *seen, psd_store_t *store);

/* Main thread, before the optimizer updates slot floats [off, off+n): copy
 * the not yet saved chunks aside. Cheap once the slots are written. */
void psd_ckpt_before_update(psd_ckpt_writer_t *wr, size_t off, size_t n);

/* psd_ckpt_before_update with psd_store_t's before_update signature (ud: the
 * writer, or NULL). */
void psd_ckpt_hook(void *ud, size_t off, size_t n);

/* 1 when the writer is finished (then call psd_ckpt_end), else 0. */
int psd_ckpt_done(psd_ckpt_writer_t *wr);

/* Join the writer, release everything. Returns 0 or -errno of the write;
 * fills path (may be NULL), seconds, bytes written and the peak extra memory
 * of the copy-on-write. */
int psd_ckpt_end(psd_ckpt_writer_t **wr, char *path, size_t pathlen, double *seconds, uint64_t *bytes,
                 uint64_t *peak_extra_bytes);

/* Load the newest valid checkpoint in dir of run run_id (0: of any run).
 * Corrupt or truncated files, and files of another run (their header's run
 * id, read before the rest), are skipped, each reported through the log
 * callback (one line each, naming the file and the reason: both run ids for
 * another run's). On success returns 0 with new buffers (caller frees
 * with free()): seen (train_count bits), weights and slots (n_params floats
 * each, zero where the file holds nothing: another psd shard's part; slots[i]
 * NULL for i >= n_slots), and the chosen file's path.
 * Returns -1 with a message if no valid checkpoint is there. */
typedef void (*psd_ckpt_log_fn)(const char *line);
int psd_ckpt_load_newest(const char *dir, uint64_t run_id, psd_ckpt_meta_t *meta, uint8_t **seen, float **weights,
                         float *slots[2], char *path, size_t pathlen, psd_ckpt_log_fn log, char *err,
                         size_t errlen);

/* Load the checkpoint of exactly `step` in dir (psd shards resuming at a
 * step every shard has), of run run_id (0: any): 0, or -1 with a message
 * (missing, corrupt, another run's). seen may be NULL (not wanted). */
int psd_ckpt_load_step(const char *dir, uint64_t run_id, uint64_t step, psd_ckpt_meta_t *meta, uint8_t **seen,
                       float **weights, float *slots[2], char *path, size_t pathlen, char *err, size_t errlen);

/* The most checkpoint steps psd shards compare when they resume: more than
 * a run keeps (checkpoint.keep, and the newest step every shard has), so
 * every file counts. */
#define PSD_RESUME_STEPS_MAX 1024
_Static_assert(PSD_RESUME_STEPS_MAX > PS_CKPT_KEEP_MAX + 1, "shards resuming must see every checkpoint a run keeps");

/* The steps of the checkpoint files in dir up to at_most, newest first, at
 * most max of them (by name: a file is read only when loaded). */
size_t psd_ckpt_steps(const char *dir, uint64_t at_most, uint64_t *steps, size_t max);

/* Tests (--x-slow-ckpt-ms): every writer waits ms before its rename. */
void psd_ckpt_test_delay(int ms);

#endif
