/* psd_samples.h - the sample accounting of an epoch, as plain data: which
 * positions of the epoch's permutation each worker has (its share: ranges,
 * in order, of which the first `consumed` are trained), which positions
 * are trained (the seen bitmap: exactly once each), the pool of positions
 * waiting for a worker, how positions are split among workers, how async
 * and ssp move samples from a slow worker to those done with theirs, and
 * ssp's hold-back. No messages, no clock, no srv_t: psd_give.c turns these
 * into EPOCH messages, and tests/test_samples.c checks them alone.
 *
 * Ownership: each psd_share_t and the psd_samples_t belong to psd's loop
 * thread; their arrays are theirs (psd_share_free, psd_samples_free). */
#ifndef PSD_SAMPLES_H
#define PSD_SAMPLES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t begin, end; /* positions [begin, end) of the epoch's permutation */
} psd_range_t;

/* A worker's positions of this epoch, in the order it trains them. */
typedef struct {
    psd_range_t *ranges;
    int n_ranges, cap_ranges;
    uint64_t assigned, consumed; /* positions given, and trained (the first `consumed`) */
} psd_share_t;

/* The epoch's positions: the permutation, the trained ones, the pool. */
typedef struct {
    uint64_t n;        /* positions: the training set's size */
    uint32_t *perm;    /* this epoch's permutation: position -> sample id */
    uint8_t *seen;     /* positions trained this epoch (bitmap) */
    uint64_t twice;    /* positions trained when already seen this epoch (never: a bug) */
    uint64_t *pool;    /* positions waiting for a worker (room for n) */
    size_t n_pool;
} psd_samples_t;

/* Room for n positions. 0 or -ENOMEM. */
int psd_samples_init(psd_samples_t *s, uint64_t n);
void psd_samples_free(psd_samples_t *s);
/* A new epoch: nothing seen (keep_seen: a resumed epoch keeps what its
 * checkpoint had), the pool empty. Returns the positions not seen yet into
 * out (room for n), in order, and their count. */
size_t psd_samples_begin(psd_samples_t *s, bool keep_seen, uint64_t *out);
/* Positions of the epoch not trained (0 at the end of a whole epoch). */
uint64_t psd_samples_unseen(const psd_samples_t *s);
/* Position p trained (a second time counts in twice). */
void psd_samples_mark(psd_samples_t *s, uint64_t p);
/* Positions pos[0..n) wait for a worker. */
void psd_samples_pool_add(psd_samples_t *s, const uint64_t *pos, size_t n);

/* Forget sh's positions (a new epoch). */
void psd_share_reset(psd_share_t *sh);
void psd_share_free(psd_share_t *sh);
/* Add positions pos[0..n) (any order) after sh's others. 0 or -ENOMEM
 * (those before the failure are added). */
int psd_share_add(psd_share_t *sh, const uint64_t *pos, size_t n);
/* Call fn on positions [from, from + count) of sh, in order. */
void psd_share_walk(const psd_share_t *sh, uint64_t from, uint64_t count, void (*fn)(void *, uint64_t), void *ud);
/* Positions [from, from + n) of sh in a new array (NULL: out of memory). */
uint64_t *psd_share_positions(const psd_share_t *sh, uint64_t from, size_t n);
/* sh's next `batch` positions are trained: marked seen in s, consumed. */
void psd_share_consume(psd_share_t *sh, psd_samples_t *s, uint64_t batch);
/* Cut sh to its first keep positions (consumed <= keep <= assigned). */
void psd_share_trim(psd_share_t *sh, uint64_t keep);
/* Its positions not trained yet. */
static inline uint64_t psd_share_left(const psd_share_t *sh) { return sh->assigned - sh->consumed; }

/* n positions split among k workers contiguously, in order: worker i gets
 * [psd_split_at(n, i, k), psd_split_at(n, i + 1, k)). */
static inline size_t psd_split_at(size_t n, int i, int k) { return n * (size_t)i / (size_t)k; }

/* async and ssp (train.rebalance): a worker with `left` positions and
 * batches of B about to train its next batch, and k workers done with
 * theirs; rate[0] its speed (batches a second, or 1 for each if any is
 * not timed: rate NULL), rate[1..k] theirs. The positions after its next
 * batch are shared among it and them in proportion to their speeds, in
 * whole batches: give[i] for worker i of the k (sum <= left - B). Returns
 * the sum moved (0: none). */
uint64_t psd_rebalance_plan(uint64_t left, uint64_t B, const double *rate, int k, uint64_t *give);

/* ssp: a worker at clock `clock` (its pushes applied this epoch) waits
 * while it is more than staleness steps ahead of the slowest worker still
 * training (clock m; UINT64_MAX: none). */
static inline bool psd_ssp_held(uint64_t clock, uint64_t m, uint64_t staleness)
{
    return m != UINT64_MAX && clock > m + staleness;
}

#endif
