/* ps_tsched.h - PyTorch's learning-rate schedulers as psd runs them
 * (schedule.name: torch, schedule.torch: the scheduler's constructor text).
 *
 * A torch scheduler counts its own steps: the k-th call of sched.step()
 * (k from 0, once a batch or once an epoch: schedule.interval) sets the
 * learning rate of what follows. psd computes the same rate from k in
 * closed form, in double, as torch's _get_closed_form_lr does (torch's
 * chained form multiplies the previous rate: equal up to double rounding).
 *
 * The text is the constructor's call with keyword arguments and without
 * the optimizer, e.g.
 *   StepLR(step_size=30, gamma=0.1)
 *   SequentialLR(schedulers=[LinearLR(start_factor=0.1, total_iters=100),
 *                            CosineAnnealingLR(T_max=400)], milestones=[100])
 * Arguments left out take torch's defaults. Rates are relative to the base
 * learning rate (optimizer.lr; for OneCycleLR its max_lr), but for
 * CosineAnnealingLR's eta_min, which is a rate.
 *
 * Owns nothing: a ps_tsched_t is a value, parsed from the text each time
 * it is needed (psd_optim.c keeps one for the run). */
#ifndef PS_TSCHED_H
#define PS_TSCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PS_TSCHED_TEXT_MAX 2048 /* bytes of schedule.torch */
#define PS_TSCHED_PHASES_MAX 8  /* schedulers in a SequentialLR */
#define PS_TSCHED_MILESTONES_MAX 64

typedef enum {
    PS_TS_STEP = 0,  /* StepLR(step_size, gamma=0.1) */
    PS_TS_MULTISTEP, /* MultiStepLR(milestones, gamma=0.1) */
    PS_TS_EXP,       /* ExponentialLR(gamma) */
    PS_TS_CONSTANT,  /* ConstantLR(factor=1/3, total_iters=5) */
    PS_TS_LINEAR,    /* LinearLR(start_factor=1/3, end_factor=1, total_iters=5) */
    PS_TS_COSINE,    /* CosineAnnealingLR(T_max, eta_min=0) */
    PS_TS_ONECYCLE,  /* OneCycleLR(total_steps | epochs + steps_per_epoch, pct_start=0.3, anneal_strategy='cos',
                      * cycle_momentum=True, base_momentum=0.85, max_momentum=0.95, div_factor=25,
                      * final_div_factor=1e4, three_phase=False) */
} ps_ts_kind_t;

typedef struct {
    ps_ts_kind_t kind;
    double gamma;
    int64_t step_size;
    int n_milestones; /* MultiStepLR: sorted, repeats count twice (as torch's Counter) */
    int64_t milestones[PS_TSCHED_MILESTONES_MAX];
    double factor, start_factor, end_factor;
    int64_t total_iters;
    double t_max, eta_min;
    int64_t total_steps;
    double pct_start, div_factor, final_div_factor, base_momentum, max_momentum;
    bool cycle_momentum, three_phase, anneal_linear;
} ps_ts_phase_t;

typedef struct {
    int n;                                       /* 1, or a SequentialLR's schedulers */
    ps_ts_phase_t ph[PS_TSCHED_PHASES_MAX];
    int64_t milestones[PS_TSCHED_PHASES_MAX - 1]; /* SequentialLR: n - 1, increasing */
} ps_tsched_t;

/* Parse a constructor text. 0, or -1 with a one-line message naming what
 * is wrong and what psd runs. */
int ps_tsched_parse(const char *text, ps_tsched_t *s, char *err, size_t errlen);

/* The rate after k scheduler steps (k >= 0) for base rate lr; *momentum
 * (may be NULL) gets the cycled momentum (OneCycleLR with cycle_momentum:
 * SGD's momentum or Adam's beta1), or -1 when nothing is cycled. */
double ps_tsched_lr(const ps_tsched_t *s, int64_t k, double lr, double *momentum);

/* OneCycleLR with cycle_momentum anywhere in s: its max_momentum (the
 * momentum torch sets at construction), else -1. */
double ps_tsched_cycled_momentum(const ps_tsched_t *s);

/* A phase's eta_min (CosineAnnealingLR) is not 0: the rate is then not a
 * multiple of the base rate (groups with another lr_scale cannot follow). */
bool ps_tsched_has_floor(const ps_tsched_t *s);

#endif
