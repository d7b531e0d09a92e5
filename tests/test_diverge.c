/* test_diverge.c - psd_diverge: when a run's steps say training diverged,
 * and what psd then says (no process: the pure check). */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "psd_diverge.h"

/* A step with finite norms. */
static psd_diverge_verdict_t step(psd_diverge_t *d, double factor, uint64_t n, double loss)
{
    return psd_diverge_step(d, factor, n, loss, 1.0, 2.0);
}

/* A healthy run's losses: from about ln 10 down to 0.3, each step's batch
 * off by up to +-40% (seeded). */
static double healthy(uint64_t n)
{
    uint64_t z = n * 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ULL;
    double u = (double)(z >> 11) / 9007199254740992.0; /* [0, 1) */
    return (0.3 + 2.0 * exp(-(double)n / 300.0)) * (0.6 + 0.8 * u);
}

Test(diverge, a_healthy_run_never_trips)
{
    psd_diverge_t d = {0};
    for (uint64_t n = 1; n <= 5000; n++) cr_assert_eq(step(&d, 10, n, healthy(n)), PSD_DIVERGE_OK, "step %lu", n);
    cr_expect_eq(d.n_base, PSD_DIVERGE_BASE);
    cr_expect_eq(d.n_win, PSD_DIVERGE_WINDOW);
    /* even with a tight factor: the loss never rises above its start */
    psd_diverge_t e = {0};
    for (uint64_t n = 1; n <= 5000; n++) cr_assert_eq(step(&e, 1.5, n, healthy(n)), PSD_DIVERGE_OK, "step %lu", n);
}

/* Step 2 is compared with step 1 (the step itself is not in its baseline):
 * an explosion at once trips at once, with its numbers. */
Test(diverge, an_explosion_trips_at_the_second_step)
{
    psd_diverge_t d = {0};
    cr_assert_eq(step(&d, 10, 1, 1e30), PSD_DIVERGE_OK, "no baseline for the first step: nothing to compare");
    d = (psd_diverge_t){0};
    cr_assert_eq(step(&d, 10, 1, 2.5), PSD_DIVERGE_OK);
    cr_assert_eq(step(&d, 10, 2, 1e21), PSD_DIVERGE_RISE);
    cr_expect_eq(d.step, 2);
    cr_expect_eq(d.window, 2);
    cr_expect_eq(d.value, (2.5 + 1e21) / 2);
    cr_expect_eq(d.baseline, 2.5);
    cr_expect_eq(d.factor, 10);
    /* the bound is the window's mean: (2.5 + x) / 2 > 25 from x > 47.5 on */
    d = (psd_diverge_t){0};
    step(&d, 10, 1, 2.5);
    cr_expect_eq(step(&d, 10, 2, 47.5), PSD_DIVERGE_OK);
    cr_expect_eq(step(&d, 10, 3, 100), PSD_DIVERGE_RISE, "(2.5 + 47.5 + 100) / 3 = 50 > 10 x 2.5");
}

Test(diverge, the_baseline_is_the_lower_median_of_the_first_steps)
{
    psd_diverge_t d = {0};
    cr_expect(isnan(psd_diverge_baseline(&d)));
    const double first[4] = {3, 1, 2, 9};
    for (int i = 0; i < 4; i++) step(&d, 0, (uint64_t)i + 1, first[i]);
    cr_expect_eq(psd_diverge_baseline(&d), 2.0, "1 2 3 9: the lower of the middle two");
    step(&d, 0, 5, 0.5);
    cr_expect_eq(psd_diverge_baseline(&d), 2.0, "0.5 1 2 3 9");
    /* only the first PSD_DIVERGE_BASE steps: later ones do not move it */
    for (uint64_t n = 6; n <= 100; n++) step(&d, 0, n, 1000.0 + (double)n);
    cr_expect_eq(d.n_base, PSD_DIVERGE_BASE);
    double b = psd_diverge_baseline(&d);
    cr_expect(b > 9 && b < 1100, "median of 5 small losses and 15 large ones: %g", b);
    for (uint64_t n = 101; n <= 200; n++) step(&d, 0, n, 0.001);
    cr_expect_eq(psd_diverge_baseline(&d), b);
}

/* The mean of the last PSD_DIVERGE_WINDOW steps: one outlier is diluted,
 * a rise that stays is not; an outlier leaves the window again. */
Test(diverge, the_window_moves)
{
    psd_diverge_t d = {0};
    uint64_t n = 1;
    for (; n <= 30; n++) cr_assert_eq(step(&d, 10, n, 1.0), PSD_DIVERGE_OK);
    cr_expect_eq(step(&d, 10, n++, 150.0), PSD_DIVERGE_OK, "(19 + 150) / 20 = 8.45: under 10");
    for (int i = 0; i < PSD_DIVERGE_WINDOW - 1; i++)
        cr_expect_eq(step(&d, 10, n++, 1.0), PSD_DIVERGE_OK, "the outlier in the window, not over the bound");
    cr_expect_eq(step(&d, 10, n++, 150.0), PSD_DIVERGE_OK, "the first outlier has left the window");
    cr_expect_eq(step(&d, 10, n++, 150.0), PSD_DIVERGE_RISE, "(18 + 300) / 20 = 15.9");
    cr_expect_eq(d.window, PSD_DIVERGE_WINDOW);
    cr_expect_eq(d.value, (18.0 + 300.0) / 20.0);
    cr_expect_eq(d.baseline, 1.0);
    /* a slow rise trips once its mean gets there */
    d = (psd_diverge_t){0};
    double loss = 1.0;
    psd_diverge_verdict_t v = PSD_DIVERGE_OK;
    for (n = 1; n <= 1000 && v == PSD_DIVERGE_OK; n++, loss *= 1.05) v = step(&d, 10, n, loss);
    cr_expect_eq(v, PSD_DIVERGE_RISE);
    cr_expect(fabs(d.baseline - pow(1.05, 9)) < 1e-12, "the lower median of the first 20: %g", d.baseline);
    cr_expect(d.value > 10.0 * d.baseline && d.value < 10.0 * d.baseline * 1.05, "at the first step over the bound: %g",
              d.value);
}

Test(diverge, off_leaves_only_the_checks_for_nan_and_infinities)
{
    psd_diverge_t d = {0};
    step(&d, 0, 1, 1.0);
    for (uint64_t n = 2; n <= 100; n++) cr_assert_eq(step(&d, 0, n, 1e30), PSD_DIVERGE_OK, "factor 0: off");
    cr_expect_eq(psd_diverge_step(&d, 0, 101, 1.0, NAN, 1.0), PSD_DIVERGE_GRAD);
    cr_expect_eq(psd_diverge_step(&d, -1, 102, 1.0, 1.0, INFINITY), PSD_DIVERGE_WEIGHTS);
    cr_expect_eq(psd_diverge_step(&d, 0, 103, INFINITY, 1.0, 1.0), PSD_DIVERGE_LOSS);
}

Test(diverge, nan_and_infinities_trip_at_once_first_the_gradient)
{
    psd_diverge_t d = {0};
    cr_expect_eq(psd_diverge_step(&d, 10, 1, 2.3, NAN, NAN), PSD_DIVERGE_GRAD, "even at the first step");
    cr_expect_eq(d.step, 1);
    cr_expect(isnan(d.value));
    cr_expect_eq(psd_diverge_step(&d, 10, 2, NAN, -INFINITY, 1.0), PSD_DIVERGE_GRAD);
    cr_expect_eq(psd_diverge_step(&d, 10, 3, NAN, 1.0, INFINITY), PSD_DIVERGE_WEIGHTS);
    cr_expect(isinf(d.value));
    cr_expect_eq(psd_diverge_step(&d, 10, 4, NAN, 1.0, 1.0), PSD_DIVERGE_LOSS);
    cr_expect_eq(psd_diverge_step(&d, 10, 5, -INFINITY, 1.0, 1.0), PSD_DIVERGE_LOSS);
    cr_expect_eq(d.n_base, 0, "no step that tripped went into the baseline");
    cr_expect_eq(d.n_win, 0);
    /* huge but finite norms are not divergence by themselves */
    cr_expect_eq(psd_diverge_step(&d, 10, 6, 2.3, 3e38, 3e38), PSD_DIVERGE_OK);
}

/* Losses that can be zero or negative (user metrics): a ratio to the start
 * means nothing there, only the non-finite checks apply. */
Test(diverge, losses_at_or_below_zero_get_only_the_nan_checks)
{
    psd_diverge_t d = {0};
    step(&d, 10, 1, 0.0);
    for (uint64_t n = 2; n <= 50; n++) cr_assert_eq(step(&d, 10, n, 5.0), PSD_DIVERGE_OK, "baseline 0");
    d = (psd_diverge_t){0};
    step(&d, 10, 1, 1.0);
    step(&d, 10, 2, -0.5);
    for (uint64_t n = 3; n <= 50; n++) cr_assert_eq(step(&d, 10, n, 1e6), PSD_DIVERGE_OK, "a negative loss was seen");
    cr_expect_eq(psd_diverge_step(&d, 10, 51, 1.0, NAN, 1.0), PSD_DIVERGE_GRAD);
}

/* After --resume (the first step seen is not step 1) the losses are a
 * trained model's, noisy against their small mean: the rise check waits
 * for a whole baseline, then compares as usual. */
Test(diverge, after_a_resume_the_baseline_is_made_whole_first)
{
    psd_diverge_t d = {0};
    cr_assert_eq(step(&d, 10, 701, 0.01), PSD_DIVERGE_OK, "a lucky batch");
    cr_assert_eq(step(&d, 10, 702, 0.6), PSD_DIVERGE_OK, "60 times it: not compared yet");
    uint64_t n = 703;
    for (; n < 701 + PSD_DIVERGE_BASE; n++) cr_assert_eq(step(&d, 10, n, 0.2 + 0.01 * (double)(n % 7)), PSD_DIVERGE_OK);
    cr_expect_eq(d.n_base, PSD_DIVERGE_BASE);
    cr_assert_eq(step(&d, 10, n++, 0.3), PSD_DIVERGE_OK, "compared from here on");
    psd_diverge_verdict_t v = PSD_DIVERGE_OK;
    for (int i = 0; i < 5 && v == PSD_DIVERGE_OK; i++) v = step(&d, 10, n++, 1e9);
    cr_expect_eq(v, PSD_DIVERGE_RISE);
    char msg[512];
    psd_diverge_message(&d, v, 8, msg, sizeof msg);
    cr_expect(strstr(msg, "times the loss the run resumed at"), "%s", msg);
}

Test(diverge, messages_name_the_step_the_numbers_and_what_to_change)
{
    psd_diverge_t d = {0};
    char msg[512];
    step(&d, 10, 1, 2.5);
    psd_diverge_verdict_t v = step(&d, 10, 2, 1e21);
    cr_assert_eq(v, PSD_DIVERGE_RISE);
    psd_diverge_message(&d, v, 1, msg, sizeof msg);
    cr_expect_str_eq(msg, "training diverged at step 2 (epoch 1): the mean loss of the last 2 steps, 5e+20, is over 10 "
                          "times the loss the run started at (2.5); lower optimizer.lr, add warm-up "
                          "(schedule.warmup_epochs) or clip (optimizer.clip_norm); train.divergence.factor sets the "
                          "bound (off: no check)");
    v = psd_diverge_step(&d, 10, 3, 2.0, INFINITY, 1.0);
    psd_diverge_message(&d, v, 4, msg, sizeof msg);
    cr_expect(strstr(msg, "training diverged at step 3 (epoch 4): the gradient's norm is not finite (infinite") &&
                  strstr(msg, "lower optimizer.lr"),
              "%s", msg);
    v = psd_diverge_step(&d, 10, 9, 2.0, 1.0, NAN);
    psd_diverge_message(&d, v, 4, msg, sizeof msg);
    cr_expect(strstr(msg, "at step 9 (epoch 4): the weights' norm is not finite (NaN"), "%s", msg);
    v = psd_diverge_step(&d, 10, 10, NAN, 1.0, 1.0);
    psd_diverge_message(&d, v, 4, msg, sizeof msg);
    cr_expect(strstr(msg, "at step 10 (epoch 4): the step's mean batch loss is NaN"), "%s", msg);
    char small[16];
    cr_expect_gt(psd_diverge_message(&d, v, 4, small, sizeof small), (int)sizeof small, "cut short, counted whole");
    cr_expect_eq(strlen(small), sizeof small - 1);
}
