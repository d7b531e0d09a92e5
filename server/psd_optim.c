/* psd_optim.c - server-side optimizers, LR schedules and global-norm clipping.
 *
 * Per-element math is in float, one simple loop per optimizer branch with no
 * cross-element dependence (but the integer maxima of psd_amax_t, the same in
 * any order), so gcc can vectorise it and any split of the arrays into chunks
 * gives bit-identical results. Scalars that depend only on the step (bias
 * corrections, decay factors) are computed once in double. */
#include "psd_optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_assert.h"
#include "ps_tsched.h"

#define PSD_ASSERT PS_ASSERT

void psd_optim_from_config(psd_optim_t *o, const ps_config_t *c)
{
    PSD_ASSERT(o && c);
    o->kind = c->opt;
    o->momentum = (float)c->momentum;
    o->nesterov = c->nesterov ? 1 : 0;
    o->weight_decay = (float)c->weight_decay;
    o->beta1 = (float)c->beta1;
    o->beta2 = (float)c->beta2;
    o->eps = (float)c->eps;
    ps_tsched_t ts;
    char err[256];
    double m; /* OneCycleLR's cycle_momentum: torch starts at max_momentum (and SGD then has a buffer) */
    if (c->sched == PS_SCHED_TORCH && ps_tsched_parse(c->sched_torch, &ts, err, sizeof err) == 0 &&
        (m = ps_tsched_cycled_momentum(&ts)) >= 0)
        psd_optim_set_momentum(o, m);
}

int psd_optim_set_momentum(psd_optim_t *o, double m)
{
    if (!(m >= 0 && m < 1) || o->kind == PS_OPT_ADAGRAD) return -1;
    if (o->kind == PS_OPT_SGD) o->momentum = (float)m;
    else o->beta1 = (float)m;
    return 0;
}

int psd_optim_slots(const psd_optim_t *o)
{
    PSD_ASSERT(o);
    switch (o->kind) {
    case PS_OPT_SGD: return o->momentum > 0.0f ? 1 : 0;
    case PS_OPT_ADAM:
    case PS_OPT_ADAMW: return 2;
    case PS_OPT_ADAGRAD: return 1;
    }
    PSD_ASSERT(!"unknown optimizer kind");
    return 0;
}

/* |x| as bits (psd_amax_t): an integer max of these is the largest magnitude,
 * exact in any order, and vectorises (a float max or sum would not, without
 * reassociating). */
static inline uint32_t abs_bits(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b & 0x7fffffffu;
}

static inline uint32_t max_u32(uint32_t a, uint32_t b) { return a > b ? a : b; }

/* w_new may alias w_old, so no restrict on the weights; gcc versions the
 * loops with a runtime overlap check. Each loop also takes the largest
 * magnitude of the gradient it reads (ga) and of the weights it writes (wa):
 * two integer maxima in registers, the same bits of everything else. */
PSD_VEC static void sgd_apply(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                      float gscale, float *buf, size_t n, float lr, psd_amax_t *am)
{
    const float wd = o->weight_decay, mu = o->momentum;
    uint32_t ga = 0, wa = 0;
    if (mu > 0.0f && o->nesterov) {
        for (size_t i = 0; i < n; i++) {
            float gp = gscale * g[i] + wd * w_old[i];
            float b = mu * buf[i] + gp;
            buf[i] = b;
            float wn = w_old[i] - lr * (gp + mu * b);
            w_new[i] = wn;
            ga = max_u32(ga, abs_bits(g[i]));
            wa = max_u32(wa, abs_bits(wn));
        }
    } else if (mu > 0.0f) {
        for (size_t i = 0; i < n; i++) {
            float gp = gscale * g[i] + wd * w_old[i];
            float b = mu * buf[i] + gp;
            buf[i] = b;
            float wn = w_old[i] - lr * b;
            w_new[i] = wn;
            ga = max_u32(ga, abs_bits(g[i]));
            wa = max_u32(wa, abs_bits(wn));
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            float gp = gscale * g[i] + wd * w_old[i];
            float wn = w_old[i] - lr * gp;
            w_new[i] = wn;
            ga = max_u32(ga, abs_bits(g[i]));
            wa = max_u32(wa, abs_bits(wn));
        }
    }
    am->g = max_u32(am->g, ga);
    am->w = max_u32(am->w, wa);
}

/* Adam (L2 weight decay folded into the gradient) and AdamW (decoupled:
 * w' = w * (1 - lr*wd) before the Adam step). */
PSD_VEC static void adam_apply(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                       float gscale, float *m, float *v, size_t n, double lr, uint64_t t, psd_amax_t *am)
{
    const int decoupled = o->kind == PS_OPT_ADAMW;
    const float b1 = o->beta1, b2 = o->beta2, eps = o->eps;
    const float c1 = 1.0f - b1, c2 = 1.0f - b2;
    /* bias corrections in double: 1 - beta^t loses precision in float for
     * beta close to 1 and small t. */
    const double bc1 = 1.0 - pow((double)b1, (double)t);
    const double bc2 = 1.0 - pow((double)b2, (double)t);
    const float inv_bc1 = (float)(1.0 / bc1);
    const float inv_bc2 = (float)(1.0 / bc2);
    const float lrf = (float)lr;
    uint32_t ga = 0, wa = 0;

    if (decoupled) {
        const float decay = (float)(1.0 - lr * (double)o->weight_decay);
        for (size_t i = 0; i < n; i++) {
            float gp = gscale * g[i];
            float mi = b1 * m[i] + c1 * gp;
            float vi = b2 * v[i] + c2 * (gp * gp);
            m[i] = mi;
            v[i] = vi;
            float mhat = mi * inv_bc1, vhat = vi * inv_bc2;
            float wn = w_old[i] * decay - lrf * mhat / (sqrtf(vhat) + eps);
            w_new[i] = wn;
            ga = max_u32(ga, abs_bits(g[i]));
            wa = max_u32(wa, abs_bits(wn));
        }
    } else {
        const float wd = o->weight_decay;
        for (size_t i = 0; i < n; i++) {
            float gp = gscale * g[i] + wd * w_old[i];
            float mi = b1 * m[i] + c1 * gp;
            float vi = b2 * v[i] + c2 * (gp * gp);
            m[i] = mi;
            v[i] = vi;
            float mhat = mi * inv_bc1, vhat = vi * inv_bc2;
            float wn = w_old[i] - lrf * mhat / (sqrtf(vhat) + eps);
            w_new[i] = wn;
            ga = max_u32(ga, abs_bits(g[i]));
            wa = max_u32(wa, abs_bits(wn));
        }
    }
    am->g = max_u32(am->g, ga);
    am->w = max_u32(am->w, wa);
}

/* Adagrad (PyTorch's, lr_decay 0, initial accumulator 0): the sum of the
 * squared gradients scales each element's step. A zero gradient leaves the
 * element and its sum exactly as they were (the sparse rows rely on it). */
PSD_VEC static void adagrad_apply(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                          float gscale, float *sum, size_t n, float lr, psd_amax_t *am)
{
    const float wd = o->weight_decay, eps = o->eps;
    uint32_t ga = 0, wa = 0;
    for (size_t i = 0; i < n; i++) {
        float gp = gscale * g[i] + wd * w_old[i];
        float si = sum[i] + gp * gp;
        sum[i] = si;
        float wn = w_old[i] - lr * gp / (sqrtf(si) + eps);
        w_new[i] = wn;
        ga = max_u32(ga, abs_bits(g[i]));
        wa = max_u32(wa, abs_bits(wn));
    }
    am->g = max_u32(am->g, ga);
    am->w = max_u32(am->w, wa);
}

void psd_optim_apply_amax(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                          float gscale, float *s0, float *s1, size_t n, double lr, uint64_t t, psd_amax_t *amax)
{
    PSD_ASSERT(o && amax);
    if (n == 0) return;
    PSD_ASSERT(w_old && w_new && g);
    switch (o->kind) {
    case PS_OPT_SGD:
        PSD_ASSERT(o->momentum <= 0.0f || s0);
        sgd_apply(o, w_old, w_new, g, gscale, s0, n, (float)lr, amax);
        return;
    case PS_OPT_ADAM:
    case PS_OPT_ADAMW:
        PSD_ASSERT(s0 && s1 && t >= 1);
        adam_apply(o, w_old, w_new, g, gscale, s0, s1, n, lr, t, amax);
        return;
    case PS_OPT_ADAGRAD:
        PSD_ASSERT(s0);
        adagrad_apply(o, w_old, w_new, g, gscale, s0, n, (float)lr, amax);
        return;
    }
    PSD_ASSERT(!"unknown optimizer kind");
}

void psd_optim_apply(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                     float gscale, float *s0, float *s1, size_t n, double lr, uint64_t t)
{
    psd_amax_t am = {0, 0};
    psd_optim_apply_amax(o, w_old, w_new, g, gscale, s0, s1, n, lr, t, &am);
}

PSD_VEC uint32_t psd_amax_bits(const float *x, size_t n)
{
    PSD_ASSERT(x || n == 0);
    uint32_t a = 0;
    for (size_t i = 0; i < n; i++) a = max_u32(a, abs_bits(x[i]));
    return a;
}

float psd_amax_value(uint32_t bits)
{
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Sixteen partial sums (element i goes to lane i % 16), added up in a fixed
 * tree at the end: independent additions the compiler vectorises, where one
 * running sum waits for the previous addition at every element (it made this
 * the most expensive pass of a step). The order depends only on n, so the
 * result is as reproducible as before. */
double psd_sumsq_lanes(double lane[PSD_SUMSQ_LANES])
{
    for (int w = PSD_SUMSQ_LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) lane[j] += lane[j + w];
    return lane[0];
}

double psd_sumsq(const float *g, size_t n)
{
    PSD_ASSERT(g || n == 0);
    double lane[PSD_SUMSQ_LANES] = {0};
    size_t i = 0;
    for (; i + PSD_SUMSQ_LANES <= n; i += PSD_SUMSQ_LANES)
        for (int j = 0; j < PSD_SUMSQ_LANES; j++) lane[j] += (double)g[i + j] * (double)g[i + j];
    for (int j = 0; i < n; i++, j++) lane[j] += (double)g[i] * (double)g[i];
    return psd_sumsq_lanes(lane);
}

float psd_clip_scale(double total_sumsq, double max_norm)
{
    if (!(max_norm > 0.0)) return 1.0f;
    double coef = max_norm / (sqrt(total_sumsq) + 1e-6);
    return coef < 1.0 ? (float)coef : 1.0f;
}

/* PyTorch OneCycleLR's _annealing_cos: from a at pct 0 to b at pct 1. */
static double cos_anneal(double a, double b, double pct)
{
    if (pct < 0.0) pct = 0.0;
    if (pct > 1.0) pct = 1.0;
    return b + (a - b) / 2.0 * (1.0 + cos(M_PI * pct));
}

static double onecycle_lr(const ps_config_t *c, double s, double spe)
{
    const double total = (double)c->epochs * spe;
    const double initial = c->lr / c->div_factor;
    const double final = initial / c->final_div_factor;
    const double e1 = c->pct_start * total - 1.0;
    const double e2 = total - 1.0;
    if (s <= e1) return cos_anneal(initial, c->lr, e1 > 0.0 ? s / e1 : 1.0);
    /* e1 <= 0: no rising phase; e2 <= e1: the falling phase is empty. */
    double pct = e2 - e1 > 0.0 ? (s - e1) / (e2 - e1) : 1.0;
    return cos_anneal(c->lr, final, pct);
}

double psd_sched_lr(const ps_config_t *c, double p, double steps_per_epoch)
{
    PSD_ASSERT(c && steps_per_epoch > 0.0);
    if (p < 0.0) p = 0.0;
    const double spe = steps_per_epoch;
    const double total_epochs = (double)c->epochs;
    /* p = step/spe comes in as a fraction; snap s back to the integer step it
     * was made from so comparisons at phase boundaries are exact. */
    double s = p * spe;
    double r = nearbyint(s);
    if (fabs(s - r) <= 1e-9 * fmax(1.0, fabs(s))) s = r;

    double base;
    switch (c->sched) {
    case PS_SCHED_CONSTANT: base = c->lr; break;
    case PS_SCHED_STEP:
        base = c->step_epochs > 0.0 ? c->lr * pow(c->gamma, floor(p / c->step_epochs + 1e-9))
                                    : c->lr;
        break;
    case PS_SCHED_COSINE:
        if (total_epochs > 0.0) {
            double q = p < total_epochs ? p : total_epochs;
            base = c->min_lr + (c->lr - c->min_lr) * 0.5 * (1.0 + cos(M_PI * q / total_epochs));
        } else {
            base = c->lr;
        }
        break;
    case PS_SCHED_ONECYCLE: base = onecycle_lr(c, s, spe); break;
    default: PSD_ASSERT(!"unknown schedule kind"); base = c->lr; break;
    }

    /* Linear warm-up over the first W steps: step s gets (s+1)/W, capped at 1
     * for a fractional W. */
    double mult = 1.0;
    const double w_steps = c->warmup_epochs * spe;
    if (w_steps > 0.0 && s < w_steps) {
        mult = (s + 1.0) / w_steps;
        if (mult > 1.0) mult = 1.0;
    }
    return base * mult;
}
