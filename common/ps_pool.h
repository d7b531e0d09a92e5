/* ps_pool.h - a small persistent thread pool for data-parallel loops.
 *
 * ps_pool_for(p, n, fn, arg) runs fn(arg, i) for every i in [0, n) on the
 * pool's threads and the calling thread, and returns when all are done.
 * Which thread runs which i is not fixed: fn must write disjoint outputs per
 * i (results then do not depend on the number of threads). One loop at a
 * time; not re-entrant. */
#ifndef PS_POOL_H
#define PS_POOL_H

typedef struct ps_pool ps_pool_t;

/* threads: total, including the caller (1 = no extra thread). NULL on error. */
ps_pool_t *ps_pool_new(int threads);
void ps_pool_free(ps_pool_t **p);
int ps_pool_threads(const ps_pool_t *p);
void ps_pool_for(ps_pool_t *p, int n, void (*fn)(void *arg, int i), void *arg);

#endif
