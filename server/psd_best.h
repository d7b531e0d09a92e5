/* psd_best.h - the best epoch by a validation metric, and when a run stops
 * improving (train.keep_best, train.early_stop). Pure bookkeeping: the
 * caller feeds each epoch's figure and acts on the answers (writes the
 * weights, ends the run); its state goes into checkpoints as it is. */
#ifndef PSD_BEST_H
#define PSD_BEST_H

#include <stdbool.h>
#include <stdint.h>

#include "ps_config.h"

typedef struct {
    char metric[48];    /* "": off */
    bool max;           /* larger is better */
    double min_delta;   /* an improvement is by more than this */
    int patience;       /* epochs without one before psd_best_stop (early_stop) */
    /* state */
    bool has;           /* an epoch was scored */
    double best;        /* its figure */
    uint32_t epoch;     /* 1-based epoch of best */
    uint32_t bad;       /* epochs since the last improvement */
} psd_best_t;

/* Off when metric is "" or NULL; mode auto: max for val_acc and val_auc. */
void psd_best_init(psd_best_t *b, const char *metric, ps_best_mode_t mode, double min_delta, int patience);
static inline bool psd_best_on(const psd_best_t *b) { return b->metric[0] != '\0'; }
/* Epoch's figure v: true when it is the best so far (the first finite one
 * is; NaN never is). */
bool psd_best_update(psd_best_t *b, uint32_t epoch, double v);
/* patience epochs went by without an improvement. */
static inline bool psd_best_stop(const psd_best_t *b) { return b->patience > 0 && b->bad >= (uint32_t)b->patience; }

#endif
