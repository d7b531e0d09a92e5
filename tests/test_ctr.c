/* Unit tests of the click-through task's generator (common/ps_ctr.c). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps_ctr.h"

static ps_ctr_t gen(void)
{
    return (ps_ctr_t){.fields = 4, .per_field = 2, .vocab = 5000, .zipf = 1.1, .rows = 1 << 16,
                      .weight_std = 1.0, .bias = -1.0, .seed = 7};
}

Test(ctr, examples_are_a_function_of_seed_and_index)
{
    ps_ctr_t g = gen(), g2 = gen();
    g2.seed = 8;
    uint32_t r1[PS_CTR_MAX_IDS], r2[PS_CTR_MAX_IDS];
    uint64_t v1[PS_CTR_MAX_IDS], v2[PS_CTR_MAX_IDS];
    uint8_t y1, y2;
    int differ = 0;
    for (uint64_t i = 0; i < 1000; i++) {
        double p1 = ps_ctr_example(&g, i * 7919, r1, v1, &y1);
        double p2 = ps_ctr_example(&g, i * 7919, r2, v2, &y2);
        cr_assert(p1 == p2 && y1 == y2 && memcmp(r1, r2, 8 * sizeof *r1) == 0 && memcmp(v1, v2, 8 * sizeof *v1) == 0);
        cr_assert(p1 > 0 && p1 < 1);
        for (int k = 0; k < 8; k++) {
            cr_assert_lt(r1[k], g.rows);
            cr_assert_lt(v1[k], g.vocab);
            cr_assert_eq(r1[k], ps_ctr_row(&g, k / 2, v1[k]), "the row is the hash of (field, value)");
        }
        ps_ctr_example(&g2, i * 7919, r2, v2, &y2);
        differ += memcmp(v1, v2, 8 * sizeof *v1) != 0;
    }
    cr_assert_gt(differ, 900, "another seed gives other examples (%d of 1000 differ)", differ);
}

/* The values follow Zipf(s): P(rank k) = k^-s / H(n, s), checked on the
 * first ranks against their expected counts (4 standard deviations), for
 * s below, at and above 1. */
Test(ctr, values_are_zipf_distributed)
{
    const double ss[3] = {0.8, 1.0, 1.3};
    const uint64_t n = 1000, draws = 200000;
    uint64_t *count = calloc(n, sizeof *count);
    cr_assert(count);
    for (int t = 0; t < 3; t++) {
        memset(count, 0, n * sizeof *count);
        uint64_t x = 12345 + (uint64_t)t;
        for (uint64_t i = 0; i < draws; i++) {
            uint64_t k = ps_zipf(&x, n, ss[t]);
            cr_assert_lt(k, n);
            count[k]++;
        }
        double H = 0;
        for (uint64_t k = 1; k <= n; k++) H += pow((double)k, -ss[t]);
        for (uint64_t k = 0; k < 20; k++) {
            double p = pow((double)(k + 1), -ss[t]) / H, want = p * (double)draws;
            double sd = sqrt((double)draws * p * (1 - p));
            cr_assert(fabs((double)count[k] - want) < 4 * sd, "s %.1f rank %llu: %llu draws, expected %.0f +- %.0f",
                      ss[t], (unsigned long long)k + 1, (unsigned long long)count[k], want, sd);
        }
    }
    free(count);
    uint64_t x = 1;
    cr_assert_eq(ps_zipf(&x, 1, 1.1), 0);
}

/* Labels are drawn from the planted probabilities: the click rate matches
 * their mean, and the planted model's log-loss (the best reachable) beats
 * the best constant prediction by a clear margin; its AUC is well above
 * chance. */
Test(ctr, labels_follow_the_planted_model)
{
    ps_ctr_t g = gen();
    const size_t n = 40000;
    float *p = malloc(n * sizeof *p);
    uint8_t *y = malloc(n);
    uint32_t *order = malloc(n * sizeof *order), rows[PS_CTR_MAX_IDS];
    cr_assert(p && y && order);
    double sum_p = 0, clicks = 0, ll_true = 0;
    for (size_t i = 0; i < n; i++) {
        p[i] = (float)ps_ctr_example(&g, i, rows, NULL, &y[i]);
        sum_p += p[i];
        clicks += y[i];
        ll_true += ps_logloss(p[i], y[i]);
    }
    double rate = clicks / (double)n, mean_p = sum_p / (double)n;
    cr_assert(fabs(rate - mean_p) < 4 * sqrt(mean_p * (1 - mean_p) / (double)n), "click rate %.4f, mean p %.4f", rate,
              mean_p);
    double ll_const = 0;
    for (size_t i = 0; i < n; i++) ll_const += ps_logloss(rate, y[i]);
    ll_true /= (double)n;
    ll_const /= (double)n;
    cr_assert_lt(ll_true, ll_const - 0.05, "planted model %.4f against constant %.4f", ll_true, ll_const);
    double auc = ps_auc(p, y, n, order);
    cr_assert(auc > 0.7 && auc < 1, "AUC of the planted probabilities %.3f", auc);
    free(p);
    free(y);
    free(order);
}

Test(ctr, auc_of_known_rankings)
{
    uint32_t order[6];
    const uint8_t y[6] = {0, 0, 1, 0, 1, 1};
    const float sorted[6] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
    /* positives at ranks 3, 5, 6: pairs (pos > neg) = 2 + 3 + 3 = 8 of 9 */
    cr_assert_float_eq(ps_auc(sorted, y, 6, order), 8.0 / 9.0, 1e-12);
    const float perfect[6] = {0, 0, 1, 0, 1, 1}, reversed[6] = {1, 1, 0, 1, 0, 0}, tied[6] = {0};
    cr_assert_float_eq(ps_auc(perfect, y, 6, order), 1.0, 1e-12);
    cr_assert_float_eq(ps_auc(reversed, y, 6, order), 0.0, 1e-12);
    cr_assert_float_eq(ps_auc(tied, y, 6, order), 0.5, 1e-12);
    const uint8_t none[6] = {0};
    cr_assert_float_eq(ps_auc(sorted, none, 6, order), 0.5, 1e-12);
    cr_assert_float_eq(ps_logloss(0.25, 1), -log(0.25), 1e-12);
    cr_assert_float_eq(ps_logloss(0.25, 0), -log(0.75), 1e-12);
    cr_assert(isfinite(ps_logloss(0.0, 1)) && isfinite(ps_logloss(1.0, 0)), "clamped");
}

Test(ctr, bad_parameters_are_refused)
{
    char err[128];
    ps_ctr_t g = gen();
    cr_assert_eq(ps_ctr_check(&g, err, sizeof err), 0);
    ps_ctr_t bad[6];
    for (int i = 0; i < 6; i++) bad[i] = g;
    bad[0].fields = 0;
    bad[1].per_field = 300;
    bad[2].vocab = 0;
    bad[3].zipf = 0;
    bad[4].rows = 0;
    bad[5].weight_std = NAN;
    for (int i = 0; i < 6; i++) {
        err[0] = 0;
        cr_assert_eq(ps_ctr_check(&bad[i], err, sizeof err), -1, "case %d", i);
        cr_assert(err[0], "case %d has a message", i);
    }
}
