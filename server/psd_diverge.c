/* psd_diverge.c - see psd_diverge.h. */
#include "psd_diverge.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ps_assert.h"

double psd_diverge_baseline(const psd_diverge_t *d)
{
    if (d->n_base == 0) return NAN;
    double v[PSD_DIVERGE_BASE];
    int n = d->n_base;
    memcpy(v, d->base, (size_t)n * sizeof v[0]);
    for (int i = 1; i < n; i++) /* insertion sort: 20 values at most */
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[(n - 1) / 2];
}

static double window_mean(const psd_diverge_t *d)
{
    double sum = 0;
    for (int i = 0; i < d->n_win; i++) sum += d->win[i];
    return sum / (double)d->n_win;
}

psd_diverge_verdict_t psd_diverge_step(psd_diverge_t *d, double factor, uint64_t step, double loss, double grad_norm,
                                       double weight_norm)
{
    PS_ASSERT(d);
    if (d->first_step == 0) d->first_step = step;
    d->step = step;
    if (!isfinite(grad_norm)) {
        d->value = grad_norm;
        return PSD_DIVERGE_GRAD;
    }
    if (!isfinite(weight_norm)) {
        d->value = weight_norm;
        return PSD_DIVERGE_WEIGHTS;
    }
    if (!isfinite(loss)) {
        d->value = loss;
        return PSD_DIVERGE_LOSS;
    }
    if (loss < 0) d->signed_loss = true;
    d->win[d->win_next] = loss;
    d->win_next = (d->win_next + 1) % PSD_DIVERGE_WINDOW;
    if (d->n_win < PSD_DIVERGE_WINDOW) d->n_win++;

    psd_diverge_verdict_t v = PSD_DIVERGE_OK;
    /* an untrained model's first loss is a fair baseline on its own; a
     * resumed one's needs the whole of it (psd_diverge.h) */
    const int min_base = d->first_step <= 1 ? 1 : PSD_DIVERGE_BASE;
    if (factor > 0 && !d->signed_loss && d->n_base >= min_base) {
        const double b = psd_diverge_baseline(d), mean = window_mean(d);
        if (b > 0 && mean > factor * b) {
            d->value = mean;
            d->baseline = b;
            d->factor = factor;
            d->window = d->n_win;
            v = PSD_DIVERGE_RISE;
        }
    }
    if (d->n_base < PSD_DIVERGE_BASE) d->base[d->n_base++] = loss;
    return v;
}

#define ADVICE "lower optimizer.lr, add warm-up (schedule.warmup_epochs) or clip (optimizer.clip_norm)"

static const char *non_finite(double v) { return isnan(v) ? "NaN" : "infinite"; }

int psd_diverge_message(const psd_diverge_t *d, psd_diverge_verdict_t v, uint32_t epoch, char *buf, size_t n)
{
    PS_ASSERT(d && v != PSD_DIVERGE_OK);
    char at[64];
    snprintf(at, sizeof at, "training diverged at step %" PRIu64 " (epoch %u)", d->step, epoch);
    switch (v) {
    case PSD_DIVERGE_GRAD:
        return snprintf(buf, n, "%s: the gradient's norm is not finite (%s: it holds a NaN or an infinity); " ADVICE,
                        at, non_finite(d->value));
    case PSD_DIVERGE_WEIGHTS:
        return snprintf(buf, n,
                        "%s: the weights' norm is not finite (%s: the update made a NaN or an infinity); " ADVICE, at,
                        non_finite(d->value));
    case PSD_DIVERGE_LOSS:
        return snprintf(buf, n, "%s: the step's mean batch loss is %s; " ADVICE, at, non_finite(d->value));
    case PSD_DIVERGE_RISE:
        return snprintf(buf, n,
                        "%s: the mean loss of the last %d steps, %.4g, is over %g times the loss the run %s at "
                        "(%.4g); " ADVICE "; train.divergence.factor sets the bound (off: no check)",
                        at, d->window, d->value, d->factor, d->first_step <= 1 ? "started" : "resumed", d->baseline);
    case PSD_DIVERGE_OK: break;
    }
    return snprintf(buf, n, "%s", at);
}
