/* test_best.c - the held-out split (ps_data.h), and the best epoch and
 * early stopping rules (psd_best.h) on scripted metric sequences. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps_data.h"
#include "psd_best.h"

Test(split, is_a_deterministic_partition_drawn_by_the_seed)
{
    enum { N = 1000, V = 100 };
    uint32_t *v1 = malloc(V * 4), *t1 = malloc((N - V) * 4), *v2 = malloc(V * 4), *t2 = malloc((N - V) * 4),
             *v3 = malloc(V * 4), *t3 = malloc((N - V) * 4);
    cr_assert_eq(ps_data_split(N, V, 7, v1, t1), 0);
    cr_assert_eq(ps_data_split(N, V, 7, v2, t2), 0);
    cr_assert_eq(ps_data_split(N, V, 8, v3, t3), 0);
    cr_expect_eq(memcmp(v1, v2, V * 4), 0, "the same seed, the same split");
    cr_expect_neq(memcmp(v1, v3, V * 4), 0, "another seed, another split");
    char seen[N] = {0};
    for (int i = 0; i < V; i++) {
        cr_expect(i == 0 || v1[i] > v1[i - 1], "held-out ids increase");
        seen[v1[i]]++;
    }
    for (int i = 0; i < N - V; i++) {
        cr_expect(i == 0 || t1[i] > t1[i - 1], "training ids increase");
        seen[t1[i]]++;
    }
    for (int i = 0; i < N; i++) cr_expect_eq(seen[i], 1, "sample %d in exactly one part", i);
    cr_expect_eq(ps_data_split(10, 11, 1, v1, t1), -1);
    free(v1), free(t1), free(v2), free(t2), free(v3), free(t3);
}

Test(split, counts_from_fraction_or_size)
{
    cr_expect_eq(ps_data_val_count(1000, 0.1, 0), 100);
    cr_expect_eq(ps_data_val_count(1000, 0, 0), 0);
    cr_expect_eq(ps_data_val_count(1000, 0.0001, 0), 1, "at least one");
    cr_expect_eq(ps_data_val_count(1000, 0, 250), 250);
    cr_expect_eq(ps_data_val_count(999, 0.5, 0), 500, "to the nearest");
}

Test(split, names_and_fingerprints)
{
    cr_expect(ps_sum_name_ok("abs_err"));
    cr_expect(ps_sum_name_ok("mae2"));
    cr_expect(!ps_sum_name_ok(""));
    cr_expect(!ps_sum_name_ok("loss"), "psd's own");
    cr_expect(!ps_sum_name_ok("acc"));
    cr_expect(!ps_sum_name_ok("Abs"));
    cr_expect(!ps_sum_name_ok("a-b"));
    cr_expect(!ps_sum_name_ok("abcdefghijklmnopqrstuvwxyz0123456"), "33 bytes");
    cr_expect(ps_data_id_ok(""));
    cr_expect(ps_data_id_ok("sha256:0f3a fashion-mnist v1"));
    cr_expect(!ps_data_id_ok("a\nb"));
    char big[300];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    cr_expect(!ps_data_id_ok(big));
}

/* The epoch (1-based) a rule stops after on seq (0: never), and its best. */
static uint32_t stops_after(psd_best_t *b, const double *seq, int n)
{
    for (int i = 0; i < n; i++) {
        psd_best_update(b, (uint32_t)i + 1, seq[i]);
        if (psd_best_stop(b)) return (uint32_t)i + 1;
    }
    return 0;
}

Test(best, early_stop_follows_its_rule)
{
    psd_best_t b;
    const double s1[] = {0.5, 0.4, 0.45, 0.3, 0.295, 0.36, 0.2};
    psd_best_init(&b, "val_loss", PS_BEST_AUTO, 0.01, 2);
    cr_expect_not(b.max);
    cr_expect_eq(stops_after(&b, s1, 7), 6, "0.295 is no improvement by more than 0.01");
    cr_expect_eq(b.epoch, 4);
    cr_expect_eq(b.best, 0.3);

    psd_best_init(&b, "val_loss", PS_BEST_MIN, 0, 2);
    cr_expect_eq(stops_after(&b, s1, 7), 0, "without min_delta 0.295 is one");

    const double acc[] = {0.5, 0.6, 0.6, 0.59, 0.7};
    psd_best_init(&b, "val_acc", PS_BEST_AUTO, 0, 3);
    cr_expect(b.max);
    cr_expect_eq(stops_after(&b, acc, 5), 0);
    cr_expect_eq(b.epoch, 5);
    psd_best_init(&b, "val_acc", PS_BEST_AUTO, 0, 2);
    cr_expect_eq(stops_after(&b, acc, 5), 4, "an equal figure is no improvement");

    const double nan_first[] = {NAN, 1.0, NAN, NAN};
    psd_best_init(&b, "val_mae", PS_BEST_AUTO, 0, 2);
    cr_expect_eq(stops_after(&b, nan_first, 4), 4, "NaN never improves");
    cr_expect_eq(b.epoch, 2);
}
