/* ps_idx.h - IDX file reader (the MNIST format), gzipped or raw.
 *
 * Format: big-endian magic 0x00 0x00 TYPE NDIM, then NDIM big-endian uint32
 * dimensions, then the data. Only TYPE 0x08 (unsigned byte) is accepted. */
#ifndef PS_IDX_H
#define PS_IDX_H

#include <stddef.h>
#include <stdint.h>

#define PS_IDX_MAX_DIMS 4

typedef struct {
    int ndim;
    uint32_t dims[PS_IDX_MAX_DIMS];
    size_t count;   /* dims[0] */
    size_t item;    /* product of dims[1..]: bytes per item (1 for labels) */
    uint8_t *data;  /* count * item bytes; owned, freed by ps_idx_deinit */
} ps_idx_t;

/* Read a whole IDX file (gzip detected from content, via zlib). Checks the
 * magic, type, number of dimensions (expect_ndim, or any 1..4 if 0), that no
 * dimension is zero, that the product does not overflow or exceed 1 GiB, that
 * the data is exactly as long as the header says (truncated or trailing bytes
 * are errors). Returns 0, or -1 with a one-line message in err naming the
 * file. On error *out is left empty (data NULL). */
int ps_idx_load(ps_idx_t *out, const char *path, int expect_ndim, char *err, size_t errlen);

/* Free the data; safe on a zeroed or already deinit'ed struct. */
void ps_idx_deinit(ps_idx_t *idx);

#endif
