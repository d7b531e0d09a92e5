/* psd_optim.h - server-side optimizers, LR schedules and global-norm clipping.
 *
 * The optimizer is shaped as reduce -> global scale -> apply per chunk:
 * the caller reduces gradients into g, computes the global squared norm with
 * psd_sumsq over every chunk, turns it into a scale with psd_clip_scale, then
 * calls psd_optim_apply on each chunk (any split of the arrays gives the same
 * result, element by element). Semantics follow PyTorch's SGD/Adam/AdamW/Adagrad. */
#ifndef PSD_OPTIM_H
#define PSD_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "ps_config.h"

/* The element-wise loops of a step (optimizers, the reduction) are also built
 * for AVX2, and the CPU picks at load time (an ifunc): about 1.6 times the
 * SSE2 baseline's speed on a pass over 4 MiB held in cache. The same bits in both:
 * ISO C mode contracts no multiply-add into an FMA (and the avx2 target has
 * none), and IEEE add, multiply, divide and square root round alike in any
 * vector width. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PSD_VEC __attribute__((target_clones("avx2", "default")))
#else
#define PSD_VEC
#endif

typedef struct {
    ps_opt_kind_t kind;
    float momentum;     /* sgd */
    int nesterov;       /* sgd */
    float weight_decay; /* L2 (sgd, adam) or decoupled (adamw) */
    float beta1, beta2, eps;
} psd_optim_t;

/* Copy the optimizer part of a config. */
void psd_optim_from_config(psd_optim_t *o, const ps_config_t *c);

/* Set the momentum a OneCycleLR cycles for the next steps: SGD's
 * momentum, Adam's and AdamW's beta1. 0, or -1 (adagrad, or m not in
 * [0, 1)). */
int psd_optim_set_momentum(psd_optim_t *o, double m);

/* Number of float state slots per parameter: sgd 1 (momentum buffer; 0 if
 * momentum == 0), adam/adamw 2 (m, v), adagrad 1 (sum of squares). */
int psd_optim_slots(const psd_optim_t *o);

/* One update of n parameters.
 *   w_old (n)  weights of the current version (read)
 *   w_new (n)  weights of the next version (written; may equal w_old)
 *   g (n)      averaged gradient (read), multiplied by gscale before use
 *   s0, s1 (n) state slots (momentum buffer / Adam m, v / Adagrad sum); unused ones may be NULL
 *   lr         learning rate for this step
 *   t          1-based step count (Adam bias correction)
 * State slots start at zero. */
void psd_optim_apply(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                     float gscale, float *s0, float *s1, size_t n, double lr, uint64_t t);

/* The largest magnitudes a step met: max |g| of the gradient it read and
 * max |w| of the weights it wrote (the L-infinity norms), as the bits of
 * the float |x| (psd_amax_value turns them back into it): integer maxima,
 * exact in any order, so the same for any split of the work. Bits above
 * 0x7f800000 (+inf) are NaN: the norm is finite iff the bits are below it. */
typedef struct {
    uint32_t g, w;
} psd_amax_t;
#define PSD_AMAX_INF 0x7f800000u

/* psd_optim_apply that also takes the largest magnitudes of g (as read,
 * before gscale) and of w_new into *amax (each the max of what it held
 * and this call's): folded into the update's loop, the update's bits are
 * those of psd_optim_apply. */
void psd_optim_apply_amax(const psd_optim_t *o, const float *w_old, float *w_new, const float *g,
                          float gscale, float *s0, float *s1, size_t n, double lr, uint64_t t, psd_amax_t *amax);

/* max |x[i]| over n floats as psd_amax_t bits (0 for n == 0), and the float those bits are. */
uint32_t psd_amax_bits(const float *x, size_t n);
float psd_amax_value(uint32_t bits);

/* Sum of squares in double precision: element i goes to partial sum
 * (lane) i % PSD_SUMSQ_LANES, and the lanes are added up in a fixed tree
 * (psd_sumsq_lanes), so the result depends only on the values and their
 * positions: zeros anywhere add nothing. */
#define PSD_SUMSQ_LANES 16
double psd_sumsq(const float *g, size_t n);
double psd_sumsq_lanes(double lane[PSD_SUMSQ_LANES]); /* the lanes' total (lane[] is overwritten) */

/* Global-norm clipping factor (PyTorch clip_grad_norm_): given the total
 * squared norm of the whole gradient, returns max_norm/(norm+1e-6) when that
 * is below 1, else 1. max_norm <= 0 means no clipping (returns 1). */
float psd_clip_scale(double total_sumsq, double max_norm);

/* Learning rate for the step that starts at progress p (epochs completed,
 * fractional: step_index / steps_per_epoch), given steps_per_epoch (> 0) and
 * the config's schedule, base lr, epochs and warm-up. */
double psd_sched_lr(const ps_config_t *c, double p, double steps_per_epoch);

#endif
