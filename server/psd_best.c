/* psd_best.c - the best epoch and early stopping (psd_best.h). */
#include "psd_best.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void psd_best_init(psd_best_t *b, const char *metric, ps_best_mode_t mode, double min_delta, int patience)
{
    memset(b, 0, sizeof *b);
    snprintf(b->metric, sizeof b->metric, "%s", metric ? metric : "");
    b->max = mode == PS_BEST_MAX ||
             (mode == PS_BEST_AUTO && (strcmp(b->metric, "val_acc") == 0 || strcmp(b->metric, "val_auc") == 0));
    b->min_delta = min_delta;
    b->patience = patience;
}

bool psd_best_update(psd_best_t *b, uint32_t epoch, double v)
{
    bool better = isfinite(v) && (!b->has || (b->max ? v > b->best + b->min_delta : v < b->best - b->min_delta));
    if (better) {
        b->has = true;
        b->best = v;
        b->epoch = epoch;
        b->bad = 0;
    } else {
        b->bad++;
    }
    return better;
}
