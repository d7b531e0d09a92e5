#include "psw_data.h"

#include <stdio.h>
#include <string.h>

int psw_data_load(psw_data_t *d, const char *images, const char *labels, size_t limit,
                  int n_classes, double mean, double std, char *err, size_t errlen)
{
    memset(d, 0, sizeof *d);
    if (ps_idx_load(&d->images, images, 3, err, errlen) != 0) return -1;
    if (ps_idx_load(&d->labels, labels, 1, err, errlen) != 0) goto fail;
    if (d->images.count != d->labels.count) {
        snprintf(err, errlen, "%s has %zu images but %s has %zu labels", images, d->images.count,
                 labels, d->labels.count);
        goto fail;
    }
    d->count = d->images.count;
    if (limit > 0 && limit < d->count) d->count = limit;
    d->dim = d->images.item;
    for (size_t i = 0; i < d->count; i++)
        if (d->labels.data[i] >= n_classes) {
            snprintf(err, errlen, "%s: label %u of sample %zu is not below %d classes", labels,
                     d->labels.data[i], i, n_classes);
            goto fail;
        }
    d->scale = (float)(1.0 / (255.0 * std));
    d->shift = (float)(-mean / std);
    return 0;
fail:
    psw_data_deinit(d);
    return -1;
}

void psw_data_deinit(psw_data_t *d)
{
    ps_idx_deinit(&d->images);
    ps_idx_deinit(&d->labels);
    d->count = 0;
}

static void one(const psw_data_t *d, size_t id, float *x, int32_t *y)
{
    const uint8_t *px = d->images.data + id * d->dim;
    for (size_t j = 0; j < d->dim; j++) x[j] = (float)px[j] * d->scale + d->shift;
    *y = d->labels.data[id];
}

void psw_data_gather(const psw_data_t *d, const uint32_t *ids, int B, float *x, int32_t *y)
{
    for (int b = 0; b < B; b++) one(d, ids[b], x + (size_t)b * d->dim, y + b);
}

void psw_data_slice(const psw_data_t *d, size_t first, int B, float *x, int32_t *y)
{
    for (int b = 0; b < B; b++) one(d, first + (size_t)b, x + (size_t)b * d->dim, y + b);
}
