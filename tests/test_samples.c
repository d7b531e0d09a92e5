/* test_samples.c - psd_samples: the sample accounting of an epoch as plain
 * data (no process, no socket): how an epoch's positions are handed out
 * and split among workers, that each is trained exactly once (also after
 * a lost worker's positions go to others or wait in the pool, and after a
 * resumed epoch), shares of several ranges (walk, positions, trim), the
 * rebalance plan of async and ssp and its full move, and ssp's hold-back. */
#include <criterion/criterion.h>

#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "psd_samples.h"

/* A new epoch of n positions: s set up, its positions (all of them, in
 * order) in *out (the caller frees it). */
static void epoch(psd_samples_t *s, uint64_t n, uint64_t **out)
{
    cr_assert_eq(psd_samples_init(s, n), 0);
    *out = malloc((n ? n : 1) * sizeof **out);
    cr_assert_not_null(*out);
    cr_assert_eq(psd_samples_begin(s, false, *out), n);
}

/* Consume all of sh's positions left, in batches of B (the last one
 * maybe short). */
static void consume_all(psd_share_t *sh, psd_samples_t *s, uint64_t B)
{
    cr_assert_leq(sh->consumed, sh->assigned);
    while (psd_share_left(sh) > 0) {
        uint64_t b = psd_share_left(sh) < B ? psd_share_left(sh) : B;
        psd_share_consume(sh, s, b);
    }
    cr_assert_eq(sh->consumed, sh->assigned);
}

/* All of sh's positions, in order (the caller frees it). */
static uint64_t *all_positions(const psd_share_t *sh)
{
    uint64_t *p = psd_share_positions(sh, 0, (size_t)sh->assigned);
    cr_assert_not_null(p);
    return p;
}

/* The sum of sh's ranges' lengths. */
static uint64_t ranges_len(const psd_share_t *sh)
{
    uint64_t len = 0;
    for (int i = 0; i < sh->n_ranges; i++) {
        cr_assert_leq(sh->ranges[i].begin, sh->ranges[i].end, "range %d", i);
        len += sh->ranges[i].end - sh->ranges[i].begin;
    }
    return len;
}

Test(samples, an_epoch_is_handed_out_in_contiguous_even_shares)
{
    static const struct {
        uint64_t n;
        int k;
    } cases[] = {{0, 1}, {0, 3}, {1, 1}, {1, 4}, {3, 5}, {7, 7}, {10, 3}, {100, 1}, {100, 7}, {1000, 16}, {1001, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint64_t n = cases[c].n;
        const int k = cases[c].k;
        psd_samples_t s;
        uint64_t *out;
        epoch(&s, n, &out);
        for (uint64_t p = 0; p < n; p++) cr_assert_eq(out[p], p, "n %" PRIu64 ": all positions, in order", n);
        cr_assert_eq(psd_samples_unseen(&s), n);
        cr_assert_eq(s.twice, 0);
        cr_assert_eq(s.n_pool, 0);

        psd_share_t *sh = calloc((size_t)k, sizeof *sh);
        unsigned *times = calloc(n ? n : 1, sizeof *times);
        cr_assert(sh && times);
        uint64_t min = UINT64_MAX, max = 0, total = 0;
        cr_assert_eq(psd_split_at(n, 0, k), 0);
        cr_assert_eq(psd_split_at(n, k, k), n);
        for (int i = 0; i < k; i++) {
            const size_t a = psd_split_at(n, i, k), b = psd_split_at(n, i + 1, k);
            cr_assert_leq(a, b, "n %" PRIu64 " k %d worker %d", n, k, i);
            cr_assert_eq(psd_share_add(&sh[i], out + a, b - a), 0);
            cr_assert_eq(sh[i].assigned, b - a);
            cr_assert_eq(sh[i].consumed, 0);
            /* contiguous: one range [a, b), or none */
            if (b > a) {
                cr_assert_eq(sh[i].n_ranges, 1, "n %" PRIu64 " k %d worker %d", n, k, i);
                cr_assert_eq(sh[i].ranges[0].begin, a);
                cr_assert_eq(sh[i].ranges[0].end, b);
            } else {
                cr_assert_eq(sh[i].n_ranges, 0, "n %" PRIu64 " k %d worker %d: nothing", n, k, i);
            }
            min = sh[i].assigned < min ? sh[i].assigned : min;
            max = sh[i].assigned > max ? sh[i].assigned : max;
            total += sh[i].assigned;
            uint64_t *p = all_positions(&sh[i]);
            for (uint64_t j = 0; j < sh[i].assigned; j++) {
                cr_assert_lt(p[j], n);
                times[p[j]]++;
            }
            free(p);
        }
        cr_assert_leq(max - min, 1, "n %" PRIu64 " k %d: sizes %" PRIu64 "..%" PRIu64, n, k, min, max);
        cr_assert_eq(total, n);
        for (uint64_t p = 0; p < n; p++) cr_assert_eq(times[p], 1, "n %" PRIu64 " k %d: position %" PRIu64, n, k, p);
        for (int i = 0; i < k; i++) psd_share_free(&sh[i]);
        free(sh);
        free(times);
        free(out);
        psd_samples_free(&s);
    }
}

Test(samples, each_position_is_trained_exactly_once)
{
    const uint64_t n = 1000, B = 32;
    const int k = 3;
    psd_samples_t s;
    uint64_t *out;
    epoch(&s, n, &out);
    psd_share_t sh[3] = {0};
    for (int i = 0; i < k; i++) psd_share_add(&sh[i], out + psd_split_at(n, i, k), psd_split_at(n, i + 1, k) - psd_split_at(n, i, k));
    /* interleaved, as the workers' batches come */
    for (bool any = true; any;) {
        any = false;
        for (int i = 0; i < k; i++)
            if (psd_share_left(&sh[i]) > 0) {
                psd_share_consume(&sh[i], &s, psd_share_left(&sh[i]) < B ? psd_share_left(&sh[i]) : B);
                any = true;
            }
    }
    cr_expect_eq(psd_samples_unseen(&s), 0);
    cr_expect_eq(s.twice, 0);
    for (int i = 0; i < k; i++) cr_expect_eq(sh[i].consumed, sh[i].assigned);

    /* a position held by two shares: trained twice, counted once more each time */
    psd_samples_begin(&s, false, out);
    cr_expect_eq(psd_samples_unseen(&s), n, "a new epoch: nothing seen");
    psd_share_t a = {0}, b = {0};
    const uint64_t pa[] = {5, 6, 7}, pb[] = {7, 8, 5};
    psd_share_add(&a, pa, 3);
    psd_share_add(&b, pb, 3);
    consume_all(&a, &s, 2);
    cr_expect_eq(s.twice, 0);
    consume_all(&b, &s, 2);
    cr_expect_eq(s.twice, 2, "5 and 7 twice");
    cr_expect_eq(psd_samples_unseen(&s), n - 4);
    psd_samples_mark(&s, 7);
    cr_expect_eq(s.twice, 3, "7 a third time");
    psd_samples_mark(&s, 9);
    cr_expect_eq(s.twice, 3);
    cr_expect_eq(psd_samples_unseen(&s), n - 5);
    psd_share_free(&a);
    psd_share_free(&b);

    /* a resumed epoch: the checkpoint's seen ones stay, only the others are handed out */
    psd_samples_begin(&s, false, out);
    uint64_t marked = 0;
    for (uint64_t p = 0; p < n; p++)
        if (p % 3 == 0 || p % 7 == 1) psd_samples_mark(&s, p), marked++;
    psd_samples_mark(&s, 0); /* a twice that the resumed epoch forgets */
    cr_assert_eq(s.twice, 1);
    size_t m = psd_samples_begin(&s, true, out);
    cr_expect_eq(m, n - marked);
    cr_expect_eq(s.twice, 0);
    cr_expect_eq(psd_samples_unseen(&s), n - marked);
    size_t j = 0;
    for (uint64_t p = 0; p < n; p++)
        if (!(p % 3 == 0 || p % 7 == 1)) {
            cr_assert_lt(j, m);
            cr_assert_eq(out[j], p, "the unseen ones, in order: #%zu", j);
            j++;
        }
    cr_assert_eq(j, m);
    /* handed out and trained: the epoch is whole, exactly once */
    for (int i = 0; i < k; i++) {
        psd_share_reset(&sh[i]);
        cr_assert_eq(sh[i].assigned, 0);
        cr_assert_eq(sh[i].consumed, 0);
        cr_assert_eq(sh[i].n_ranges, 0);
        psd_share_add(&sh[i], out + psd_split_at(m, i, k), psd_split_at(m, i + 1, k) - psd_split_at(m, i, k));
    }
    for (int i = 0; i < k; i++) consume_all(&sh[i], &s, B);
    cr_expect_eq(psd_samples_unseen(&s), 0);
    cr_expect_eq(s.twice, 0);
    /* and a new epoch (not resumed) hands out everything again */
    cr_expect_eq(psd_samples_begin(&s, false, out), n);
    cr_expect_eq(psd_samples_unseen(&s), n);

    for (int i = 0; i < k; i++) psd_share_free(&sh[i]);
    free(out);
    psd_samples_free(&s);
}

Test(samples, a_lost_workers_untrained_positions_go_to_the_others)
{
    const uint64_t n = 997, B = 16;
    const int k = 4;
    psd_samples_t s;
    uint64_t *out;
    epoch(&s, n, &out);
    psd_share_t sh[4] = {0};
    for (int i = 0; i < k; i++) psd_share_add(&sh[i], out + psd_split_at(n, i, k), psd_split_at(n, i + 1, k) - psd_split_at(n, i, k));
    /* everyone trains a few batches; worker 1 is lost after 5 */
    for (int i = 0; i < k; i++) psd_share_consume(&sh[i], &s, (uint64_t)(i == 1 ? 5 : 3) * B);
    const uint64_t consumed = sh[1].consumed, left = sh[1].assigned - consumed;
    uint64_t *lost = psd_share_positions(&sh[1], consumed, (size_t)left);
    cr_assert_not_null(lost);
    const uint64_t first = psd_split_at(n, 1, k) + consumed;
    for (uint64_t j = 0; j < left; j++) cr_assert_eq(lost[j], first + j, "its untrained positions, in order: #%" PRIu64, j);
    cr_expect_eq(psd_samples_unseen(&s), n - 14 * B);
    /* spread among the 3 left, appended after theirs */
    const int alive[3] = {0, 2, 3};
    for (int i = 0; i < 3; i++) {
        psd_share_t *w = &sh[alive[i]];
        const uint64_t before = w->assigned;
        const size_t a = psd_split_at((size_t)left, i, 3), b = psd_split_at((size_t)left, i + 1, 3);
        cr_assert_eq(psd_share_add(w, lost + a, b - a), 0);
        cr_assert_eq(w->assigned, before + (b - a));
        uint64_t *p = psd_share_positions(w, before, b - a);
        cr_assert_not_null(p);
        cr_assert_eq(memcmp(p, lost + a, (b - a) * sizeof *p), 0, "appended after its own");
        free(p);
    }
    for (int i = 0; i < 3; i++) consume_all(&sh[alive[i]], &s, B);
    cr_expect_eq(psd_samples_unseen(&s), 0);
    cr_expect_eq(s.twice, 0);
    free(lost);

    /* no worker left: the positions wait in the pool; one joining takes them */
    psd_samples_begin(&s, false, out);
    cr_assert_eq(s.n_pool, 0);
    psd_share_t only = {0};
    psd_share_add(&only, out, (size_t)n);
    psd_share_consume(&only, &s, 3 * B);
    uint64_t *rest = psd_share_positions(&only, only.consumed, (size_t)psd_share_left(&only));
    cr_assert_not_null(rest);
    const size_t n_rest = (size_t)psd_share_left(&only);
    psd_share_free(&only); /* lost */
    psd_samples_pool_add(&s, rest, n_rest / 2);
    psd_samples_pool_add(&s, rest + n_rest / 2, n_rest - n_rest / 2);
    cr_assert_eq(s.n_pool, n_rest);
    cr_assert_eq(memcmp(s.pool, rest, n_rest * sizeof *rest), 0, "the pool: in order");
    psd_share_t joined = {0};
    cr_assert_eq(psd_share_add(&joined, s.pool, s.n_pool), 0);
    s.n_pool = 0;
    cr_expect_eq(joined.n_ranges, 1, "one range: [3B, n)");
    cr_expect_eq(joined.assigned, n - 3 * B);
    consume_all(&joined, &s, B);
    cr_expect_eq(psd_samples_unseen(&s), 0);
    cr_expect_eq(s.twice, 0);
    /* the next epoch starts with an empty pool */
    psd_samples_pool_add(&s, rest, 2);
    psd_samples_begin(&s, false, out);
    cr_expect_eq(s.n_pool, 0);

    free(rest);
    psd_share_free(&joined);
    for (int i = 0; i < k; i++) psd_share_free(&sh[i]);
    free(out);
    psd_samples_free(&s);
}

typedef struct {
    uint64_t got[64];
    size_t n;
} seen_t;

static void record(void *ud, uint64_t p)
{
    seen_t *v = ud;
    cr_assert_lt(v->n, 64, "walk called too often");
    v->got[v->n++] = p;
}

Test(samples, walks_and_positions_cross_ranges)
{
    psd_share_t sh = {0};
    /* adjacent adds merge, even one at a time */
    for (uint64_t p = 5; p < 8; p++) {
        cr_assert_eq(psd_share_add(&sh, &p, 1), 0);
        cr_expect_eq(sh.n_ranges, 1, "adding %" PRIu64, p);
    }
    cr_expect_eq(sh.ranges[0].begin, 5);
    cr_expect_eq(sh.ranges[0].end, 8);
    psd_share_reset(&sh);
    cr_expect_eq(sh.n_ranges, 0);
    cr_expect_eq(sh.assigned, 0);
    cr_expect_eq(sh.consumed, 0);

    const uint64_t a[] = {10, 11, 12}, b[] = {20, 21}, c[] = {13}, d[] = {30, 31, 32, 33, 34}, e[] = {35, 36};
    psd_share_add(&sh, a, 3);
    cr_expect_eq(sh.n_ranges, 1);
    psd_share_add(&sh, b, 2);
    cr_expect_eq(sh.n_ranges, 2);
    psd_share_add(&sh, c, 1);
    cr_expect_eq(sh.n_ranges, 3, "13 follows 21, not 12: its own range");
    psd_share_add(&sh, d, 5);
    cr_expect_eq(sh.n_ranges, 4);
    psd_share_add(&sh, e, 2);
    cr_expect_eq(sh.n_ranges, 4, "35 follows 34: merged");
    psd_share_add(&sh, NULL, 0);
    cr_expect_eq(sh.n_ranges, 4);
    const uint64_t flat[] = {10, 11, 12, 20, 21, 13, 30, 31, 32, 33, 34, 35, 36};
    const size_t N = sizeof flat / sizeof flat[0];
    cr_assert_eq(sh.assigned, N);
    cr_assert_eq(ranges_len(&sh), N);

    /* every window, from every offset, mid-range included */
    for (size_t from = 0; from <= N; from++)
        for (size_t cnt = 0; from + cnt <= N; cnt++) {
            uint64_t *p = psd_share_positions(&sh, from, cnt);
            cr_assert_not_null(p);
            for (size_t j = 0; j < cnt; j++) cr_assert_eq(p[j], flat[from + j], "from %zu count %zu: #%zu", from, cnt, j);
            free(p);
            seen_t v = {.n = 0};
            psd_share_walk(&sh, from, cnt, record, &v);
            cr_assert_eq(v.n, cnt, "from %zu count %zu", from, cnt);
            for (size_t j = 0; j < cnt; j++) cr_assert_eq(v.got[j], flat[from + j]);
        }
    /* a walk past the end stops at the end */
    seen_t v = {.n = 0};
    psd_share_walk(&sh, 9, 100, record, &v);
    cr_expect_eq(v.n, N - 9);
    v.n = 0;
    psd_share_walk(&sh, N + 5, 3, record, &v);
    cr_expect_eq(v.n, 0);

    /* any order: descending positions are not adjacent */
    psd_share_t r = {0};
    const uint64_t desc[] = {3, 2, 1};
    psd_share_add(&r, desc, 3);
    cr_expect_eq(r.n_ranges, 3);
    uint64_t *p = all_positions(&r);
    cr_expect(p[0] == 3 && p[1] == 2 && p[2] == 1, "the order added: %" PRIu64 " %" PRIu64 " %" PRIu64, p[0], p[1], p[2]);
    free(p);
    /* many ranges: the array grows */
    psd_share_t many = {0};
    for (uint64_t q = 0; q < 200; q++) {
        uint64_t x = 2 * q;
        cr_assert_eq(psd_share_add(&many, &x, 1), 0);
    }
    cr_expect_eq(many.n_ranges, 200);
    p = psd_share_positions(&many, 123, 50);
    for (uint64_t j = 0; j < 50; j++) cr_assert_eq(p[j], 2 * (123 + j));
    free(p);

    psd_share_free(&many);
    psd_share_free(&r);
    psd_share_free(&sh);
    cr_expect_eq(sh.ranges, NULL);
    cr_expect_eq(sh.n_ranges, 0);
}

Test(samples, trim_keeps_the_first_positions)
{
    const uint64_t a[] = {10, 11, 12}, b[] = {20, 21}, c[] = {13}, d[] = {30, 31, 32, 33, 34};
    const uint64_t flat[] = {10, 11, 12, 20, 21, 13, 30, 31, 32, 33, 34};
    /* ranges covering the first keep positions: keep 1..3 -> 1, 4..5 -> 2, 6 -> 3, 7.. -> 4 */
    const int n_ranges[] = {0, 1, 1, 1, 2, 2, 3, 4, 4, 4, 4, 4};
    const uint64_t N = sizeof flat / sizeof flat[0];
    psd_samples_t s;
    cr_assert_eq(psd_samples_init(&s, 64), 0);
    for (uint64_t consumed = 0; consumed <= N; consumed += 2)
        for (uint64_t keep = consumed; keep <= N; keep++) {
            psd_share_t sh = {0};
            psd_share_add(&sh, a, 3);
            psd_share_add(&sh, b, 2);
            psd_share_add(&sh, c, 1);
            psd_share_add(&sh, d, 5);
            psd_share_consume(&sh, &s, consumed);
            psd_share_trim(&sh, keep);
            cr_assert_eq(sh.assigned, keep, "consumed %" PRIu64 " keep %" PRIu64, consumed, keep);
            cr_assert_eq(sh.consumed, consumed);
            cr_assert_eq(psd_share_left(&sh), keep - consumed);
            cr_assert_eq(ranges_len(&sh), keep, "the ranges hold exactly the kept ones (keep %" PRIu64 ")", keep);
            if (keep > 0) cr_assert_eq(sh.n_ranges, n_ranges[keep], "keep %" PRIu64, keep);
            uint64_t *p = all_positions(&sh);
            for (uint64_t j = 0; j < keep; j++) cr_assert_eq(p[j], flat[j], "keep %" PRIu64 ": #%" PRIu64, keep, j);
            free(p);
            /* what is added next follows the kept ones */
            const uint64_t more[] = {50, 51};
            psd_share_add(&sh, more, 2);
            cr_assert_eq(sh.assigned, keep + 2);
            p = psd_share_positions(&sh, keep, 2);
            cr_assert(p[0] == 50 && p[1] == 51, "keep %" PRIu64 ": appended after the kept", keep);
            free(p);
            /* and a position right after the cut merges again */
            psd_share_trim(&sh, keep);
            if (keep > 0) {
                const uint64_t next = flat[keep - 1] + 1;
                const int before = sh.n_ranges;
                psd_share_add(&sh, &next, 1);
                cr_assert_eq(sh.n_ranges, before, "keep %" PRIu64 ": %" PRIu64 " merges", keep, next);
                p = psd_share_positions(&sh, keep, 1);
                cr_assert_eq(p[0], next);
                free(p);
            }
            psd_share_free(&sh);
        }
    psd_samples_free(&s);
}

Test(samples, rebalance_gives_whole_batches_in_proportion_to_speed)
{
    uint64_t give[8];
    const double r13[] = {1, 3};
    /* nothing to spare after its next batch, or no one to give to */
    memset(give, 0xff, sizeof give);
    cr_expect_eq(psd_rebalance_plan(10, 10, r13, 1, give), 0);
    cr_expect_eq(psd_rebalance_plan(5, 10, r13, 1, give), 0);
    cr_expect_eq(psd_rebalance_plan(0, 10, NULL, 3, give), 0);
    cr_expect_eq(psd_rebalance_plan(100000, 10, r13, 0, give), 0);
    cr_expect_eq(psd_rebalance_plan(100000, 10, NULL, 0, give), 0);
    cr_expect_eq(give[0], UINT64_MAX, "k 0: give untouched");
    /* less than a batch to spare for each: nothing */
    cr_expect_eq(psd_rebalance_plan(15, 10, r13, 1, give), 0);
    cr_expect_eq(give[0], 0);

    /* {1, 3}: the faster gets 3/4 of the spare, rounded down to batches */
    cr_expect_eq(psd_rebalance_plan(100010, 10, r13, 1, give), 75000);
    cr_expect_eq(give[0], 75000);
    cr_expect_eq(psd_rebalance_plan(1010, 10, r13, 1, give), 750);
    cr_expect_eq(psd_rebalance_plan(1009, 10, r13, 1, give), 740, "999 * 3/4 = 749.25: 74 batches");
    cr_expect_eq(give[0], 740);
    /* a slow worker twice as fast as the others keeps more */
    const double r211[] = {2, 1, 1};
    cr_expect_eq(psd_rebalance_plan(4010, 10, r211, 2, give), 2000);
    cr_expect(give[0] == 1000 && give[1] == 1000, "%" PRIu64 " %" PRIu64, give[0], give[1]);
    /* rate NULL: all equal, as all 1 */
    const double ones[] = {1, 1, 1, 1};
    uint64_t g1[3];
    cr_expect_eq(psd_rebalance_plan(1000, 10, NULL, 3, give), 720);
    for (int i = 0; i < 3; i++) cr_expect_eq(give[i], 240, "990 / 4 = 247.5: 24 batches each");
    cr_expect_eq(psd_rebalance_plan(1000, 10, ones, 3, g1), 720);
    cr_expect_eq(memcmp(give, g1, sizeof g1), 0);

    /* in general: whole batches, no more than the spare, proportional to within a batch */
    uint64_t z = 12345;
    for (int t = 0; t < 2000; t++) {
        z = z * 6364136223846793005ULL + 1442695040888963407ULL;
        const int k = 1 + (int)((z >> 33) % 7);
        const uint64_t B = 1 + (z >> 40) % 64;
        const uint64_t left = (z >> 20) % 20000;
        double rate[8];
        double sum = 0;
        for (int i = 0; i <= k; i++) {
            z = z * 6364136223846793005ULL + 1442695040888963407ULL;
            rate[i] = 0.1 + (double)((z >> 33) % 1000) / 100.0;
            sum += rate[i];
        }
        memset(give, 0, sizeof give);
        const uint64_t moved = psd_rebalance_plan(left, B, rate, k, give);
        if (left <= B) {
            cr_assert_eq(moved, 0);
            continue;
        }
        const uint64_t spare = left - B;
        uint64_t total = 0;
        for (int i = 0; i < k; i++) {
            cr_assert_eq(give[i] % B, 0, "left %" PRIu64 " B %" PRIu64 ": give[%d] %" PRIu64, left, B, i, give[i]);
            const double want = (double)spare * rate[1 + i] / sum;
            cr_assert_leq((double)give[i], want + 1e-6, "give[%d] %" PRIu64 " share %g", i, give[i], want);
            cr_assert_gt((double)give[i], want - (double)B - 1e-6, "give[%d] %" PRIu64 " share %g", i, give[i], want);
            total += give[i];
        }
        cr_assert_eq(moved, total);
        cr_assert_leq(moved, spare, "left %" PRIu64 " B %" PRIu64 " k %d", left, B, k);
    }
}

Test(samples, a_rebalance_moves_the_slow_workers_tail_exactly_once)
{
    const uint64_t B = 10;
    const uint64_t n = 2000;
    psd_samples_t s;
    uint64_t *out;
    epoch(&s, n, &out);
    /* worker 0 slow with [0, 1000), 1 and 2 done with [1000, 1500) and [1500, 2000) */
    psd_share_t sh[3] = {0};
    psd_share_add(&sh[0], out, 1000);
    psd_share_add(&sh[1], out + 1000, 500);
    psd_share_add(&sh[2], out + 1500, 500);
    psd_share_consume(&sh[0], &s, 10 * B);
    consume_all(&sh[1], &s, B);
    consume_all(&sh[2], &s, B);

    const double rate[] = {1, 2, 3};
    uint64_t give[2];
    const uint64_t left = psd_share_left(&sh[0]);
    const uint64_t moved = psd_rebalance_plan(left, B, rate, 2, give);
    cr_assert_eq(give[0], 290, "890 * 2/6 = 296.7");
    cr_assert_eq(give[1], 440, "890 * 3/6 = 445");
    cr_assert_eq(moved, 730);

    const uint64_t keep = sh[0].assigned - moved;
    uint64_t *tail = psd_share_positions(&sh[0], keep, (size_t)moved);
    cr_assert_not_null(tail);
    for (uint64_t j = 0; j < moved; j++) cr_assert_eq(tail[j], keep + j, "its last positions: #%" PRIu64, j);
    psd_share_trim(&sh[0], keep);
    cr_assert_eq(sh[0].assigned, keep);
    cr_assert_geq(psd_share_left(&sh[0]), B, "its next batch stays with it");
    cr_assert_eq(psd_share_add(&sh[1], tail, (size_t)give[0]), 0);
    cr_assert_eq(psd_share_add(&sh[2], tail + give[0], (size_t)give[1]), 0);
    cr_assert_eq(sh[1].assigned, 500 + give[0]);
    cr_assert_eq(sh[2].assigned, 500 + give[1]);
    cr_assert_eq(sh[1].n_ranges, 2);
    cr_assert_eq(sh[1].ranges[1].begin, keep);
    cr_assert_eq(sh[2].ranges[1].end, 1000);

    for (int i = 0; i < 3; i++) consume_all(&sh[i], &s, B);
    cr_expect_eq(psd_samples_unseen(&s), 0);
    cr_expect_eq(s.twice, 0);

    free(tail);
    for (int i = 0; i < 3; i++) psd_share_free(&sh[i]);
    free(out);
    psd_samples_free(&s);
}

Test(samples, ssp_holds_a_worker_more_than_staleness_ahead)
{
    cr_expect_not(psd_ssp_held(0, UINT64_MAX, 0), "no worker still training: never held");
    cr_expect_not(psd_ssp_held(UINT64_MAX - 1, UINT64_MAX, 3));
    cr_expect_not(psd_ssp_held(1000000, UINT64_MAX, 0));
    for (uint64_t m = 0; m < 5; m++)
        for (uint64_t st = 0; st < 5; st++) {
            cr_expect_not(psd_ssp_held(m, m, st), "level with the slowest");
            cr_expect_not(psd_ssp_held(m + st, m, st), "m %" PRIu64 " staleness %" PRIu64 ": at the bound", m, st);
            cr_expect(psd_ssp_held(m + st + 1, m, st), "m %" PRIu64 " staleness %" PRIu64 ": one past", m, st);
            cr_expect(psd_ssp_held(m + st + 10, m, st));
        }
    cr_expect_not(psd_ssp_held(3, 7, 0), "behind the slowest still training (it joined late)");
}
