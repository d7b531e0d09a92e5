/* psd_diverge.h - is training diverging? A pure check of each step's
 * numbers (no I/O, no clock), so that a run that explodes stops with a
 * reason instead of training on and saving what it made.
 *
 * A step diverged when
 *   - the gradient it applied, or the weights it wrote, hold a NaN or an
 *     infinity (their norms are not finite; psd_store_step_amax), or
 *   - its mean batch loss is not finite, or
 *   - the loss rose far above where training started: the mean of the
 *     step losses of the last PSD_DIVERGE_WINDOW steps (this one included)
 *     is over `factor` times the baseline, the lower median of the losses
 *     of the first PSD_DIVERGE_BASE steps (as many as there are so far,
 *     this one excluded: step 2 is compared with step 1, before an
 *     explosion can reach the baseline). Only for losses that stay >= 0
 *     with a baseline > 0: from the first negative loss on, and while the
 *     baseline is 0, only the checks above apply. factor <= 0: no such check.
 *
 * The steps a detector sees are those of one psd process: after --resume
 * the baseline is made again from the first steps after it. Those losses
 * are a trained model's, whose batches vary far more (relative to their
 * mean) than an untrained model's: there the rise check waits for a whole
 * baseline (PSD_DIVERGE_BASE steps) before it compares.
 *
 * A zeroed psd_diverge_t is a detector that has seen no step. */
#ifndef PSD_DIVERGE_H
#define PSD_DIVERGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PSD_DIVERGE_BASE 20   /* steps whose losses make the baseline */
#define PSD_DIVERGE_WINDOW 20 /* steps the moving mean covers */

typedef enum {
    PSD_DIVERGE_OK = 0,
    PSD_DIVERGE_GRAD,    /* the gradient's norm is not finite */
    PSD_DIVERGE_WEIGHTS, /* the weights' norm is not finite */
    PSD_DIVERGE_LOSS,    /* the step's mean loss is not finite */
    PSD_DIVERGE_RISE,    /* the window's mean loss is over factor x the baseline */
} psd_diverge_verdict_t;

typedef struct {
    uint64_t first_step;            /* the first step seen (0: none yet; > 1: resumed) */
    double base[PSD_DIVERGE_BASE];  /* the first steps' losses, in order */
    int n_base;
    double win[PSD_DIVERGE_WINDOW]; /* the last steps' losses, a ring */
    int n_win, win_next;
    bool signed_loss;               /* a loss < 0 was seen: no rise check from then on */
    /* the numbers of the last verdict other than OK */
    uint64_t step;
    double value;    /* RISE: the window's mean; LOSS: the loss; GRAD, WEIGHTS: the norm */
    double baseline; /* RISE: the baseline */
    double factor;   /* RISE: the factor */
    int window;      /* RISE: steps in the window */
} psd_diverge_t;

/* Step `step` (1-based, of the run) was taken: its mean batch loss and the
 * norms of its gradient and new weights (any finite values where a norm is
 * not known, e.g. 0). Returns its verdict; other than OK, the numbers are in
 * d for psd_diverge_message. */
psd_diverge_verdict_t psd_diverge_step(psd_diverge_t *d, double factor, uint64_t step, double loss, double grad_norm,
                                       double weight_norm);

/* The lower median of the baseline's losses (NAN while it holds none). */
double psd_diverge_baseline(const psd_diverge_t *d);

/* The one-line message of verdict v (not OK) for step d->step in epoch
 * `epoch` (1-based): what diverged, its numbers, and what to change.
 * Returns snprintf's count. */
int psd_diverge_message(const psd_diverge_t *d, psd_diverge_verdict_t v, uint32_t epoch, char *buf, size_t n);

#endif
