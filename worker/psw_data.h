/* psw_data.h - a labelled image set in memory and batch assembly. */
#ifndef PSW_DATA_H
#define PSW_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "ps_idx.h"

typedef struct {
    ps_idx_t images; /* (count, rows, cols) bytes */
    ps_idx_t labels; /* (count) bytes */
    size_t count;    /* samples, after the limit */
    size_t dim;      /* pixels per sample */
    float scale, shift; /* x = pixel * scale + shift */
} psw_data_t;

/* Load images + labels, check that they agree (count, labels < n_classes),
 * limit to the first `limit` samples if limit > 0. 0, or -1 + message. */
int psw_data_load(psw_data_t *d, const char *images, const char *labels, size_t limit,
                  int n_classes, double mean, double std, char *err, size_t errlen);
void psw_data_deinit(psw_data_t *d);

/* x (B, dim) floats and y (B) labels of samples ids[0..B). ids < count. */
void psw_data_gather(const psw_data_t *d, const uint32_t *ids, int B, float *x, int32_t *y);
/* Same for the consecutive samples [first, first + B). */
void psw_data_slice(const psw_data_t *d, size_t first, int B, float *x, int32_t *y);

#endif
