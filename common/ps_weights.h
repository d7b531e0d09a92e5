/* ps_weights.h - the trained-weights file (docs/weights-format.md).
 *
 * Little-endian:
 *   "PSDW"  u32 format (1)  u32 n_sizes  u32 sizes[n_sizes]  u32 activation (0 relu)
 *   u64 run_id  u64 step  u32 epoch  u32 reserved (0)
 *   format 2 only: u64 table_rows  u32 table_dim  u32 reserved (0)
 *   for each tensor W0, b0, W1, b1, ..., E: its floats, row-major, no padding
 *   u32 CRC-32 (zlib) of every byte before it. */
#ifndef PS_WEIGHTS_H
#define PS_WEIGHTS_H

#include <stddef.h>
#include <stdint.h>

#include "ps_model.h"

#define PS_WEIGHTS_FORMAT 1u       /* an MLP */
#define PS_WEIGHTS_FORMAT_TABLE 2u /* an MLP and an embedding table (model.kind ctr) */

typedef struct {
    uint64_t run_id;
    uint64_t step;
    uint32_t epoch;
} ps_weights_meta_t;

/* Write atomically (temp file, fsync, rename). params is a layout arena.
 * 0, or -1 with a message. */
int ps_weights_save(const char *path, const ps_layout_t *l, const float *params,
                    const ps_weights_meta_t *meta, char *err, size_t errlen);

/* Read and check (magic, format, sizes, length, CRC). On success *params is a
 * new arena laid out by *l (caller frees with free()). 0, or -1 + message. */
int ps_weights_load(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta,
                    char *err, size_t errlen);

#endif
