/* ps_weights.h - the trained-weights file (docs/weights-format.md).
 *
 * Little-endian:
 *   "PSDW"  u32 format (1)  u32 n_sizes  u32 sizes[n_sizes]  u32 activation (0 relu)
 *   u64 run_id  u64 step  u32 epoch  u32 reserved (0)
 *   format 2 only: u64 table_rows  u32 table_dim  u32 reserved (0)
 * format 3 (any table): "PSDW" u32 3  u32 len  len bytes of the table
 *   (ps_table.h)  u64 run_id  u64 step  u32 epoch  u32 reserved (0)
 * then, every format:
 *   for each tensor W0, b0, W1, b1, ..., E: its floats, row-major, no padding
 *   u32 CRC-32 (zlib) of every byte before it. */
#ifndef PS_WEIGHTS_H
#define PS_WEIGHTS_H

#include <stddef.h>
#include <stdint.h>

#include "ps_model.h"

#define PS_WEIGHTS_FORMAT 1u       /* an MLP */
#define PS_WEIGHTS_FORMAT_TABLE 2u /* an MLP and an embedding table (model.kind ctr) */
#define PS_WEIGHTS_FORMAT_TENSORS 3u /* any table of named tensors (model.kind tensors) */

typedef struct {
    uint64_t run_id;
    uint64_t step;
    uint32_t epoch;
} ps_weights_meta_t;

/* Write atomically (temp file, fsync, rename). params is a layout arena.
 * A path ending in ".safetensors" gets a safetensors file (the table's
 * names and shapes, F32, ps_weights_st.h's metadata) instead of psd's
 * format, here and by the writer below. 0, or -1 with a message. */
int ps_weights_save(const char *path, const ps_layout_t *l, const float *params,
                    const ps_weights_meta_t *meta, char *err, size_t errlen);

/* The same file written piece by piece, in any order, as the pieces come
 * (psd shards: each part fetched in chunks, never the whole model in one
 * process's memory). ps_weights_begin opens PATH.tmp and writes the header;
 * ps_weights_put writes floats [off, off + n) of tensor t; ps_weights_commit
 * checks that the pieces cover every tensor exactly once, writes the CRC
 * (combined from the pieces', nothing is read back) and renames the file
 * over PATH; ps_weights_abort removes it. Commit and abort free w. NULL or
 * -1 with a message. */
typedef struct ps_weights_writer ps_weights_writer_t;
ps_weights_writer_t *ps_weights_begin(const char *path, const ps_layout_t *l, const ps_weights_meta_t *meta,
                                      char *err, size_t errlen);
int ps_weights_put(ps_weights_writer_t *w, int t, uint64_t off, const float *src, size_t n, char *err,
                   size_t errlen);
int ps_weights_commit(ps_weights_writer_t *w, char *err, size_t errlen);
void ps_weights_abort(ps_weights_writer_t *w);

/* Read and check (magic, format, sizes, length, CRC). On success *params is a
 * new arena laid out by *l (caller frees with free()). 0, or -1 + message. */
int ps_weights_load(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta,
                    char *err, size_t errlen);

/* Two weights files hold the same model: the same layout, step and epoch,
 * and every byte of every tensor (the run id aside: two runs of one config
 * differ in it only). 1 same, 0 not (why names the first difference), -1
 * when one cannot be read (why says so). The comparison the tests and
 * bench/same_weights.sh use. */
int ps_weights_same(const char *a, const char *b, char *why, size_t n);

#endif
