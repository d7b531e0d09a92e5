/* ps_pool.c - see ps_pool.h. Workers sleep on a condition variable between
 * loops; a loop hands out indices with an atomic counter. The caller, done
 * with its share, spins a little for the workers' last items before it
 * sleeps: a wake-up through the kernel costs more than a short item on a
 * virtual machine (tens of microseconds), and a step is a fraction of a
 * millisecond. Not when the pool has more threads than this process has
 * usable CPUs (ps_cpus_usable): then the spin would take a core from the
 * items it waits for; nor under a CPU quota, which the spin would spend.
 *
 * The workers are kept off the caller's CPU (steer): woken onto it, as the
 * scheduler sometimes places them, a worker only time-shares that core with
 * the caller while another is idle, and the loop takes as long as on one
 * thread, or longer. Before a loop the caller looks up its CPU (no system
 * call) and, when it has moved since the last loop, sets the workers'
 * affinity to its own allowed CPUs less that one. Only where the workers
 * then still have a CPU each. */
#include "ps_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#include "ps_util.h"

#define SPIN_S 50e-6 /* seconds */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

struct ps_pool {
    int n_threads;            /* including the caller */
    int spin;                 /* the caller spins for the last items: no more threads than cores */
    int steer;                /* the workers are kept off the caller's CPU */
    int avoid;                /* the CPU they are kept off now (-1: none yet) */
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t start_cv, done_cv;
    /* under mu */
    unsigned long gen;        /* loop number */
    int stop;
    atomic_int busy;          /* workers inside the current loop (changed under mu) */
    /* the current loop */
    void (*fn)(void *, int);
    void *arg;
    int n;
    atomic_int next;
};

static void run_items(ps_pool_t *p)
{
    for (;;) {
        int i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= p->n) return;
        p->fn(p->arg, i);
    }
}

static void *worker(void *arg)
{
    ps_pool_t *p = arg;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->gen == seen) pthread_cond_wait(&p->start_cv, &p->mu);
        if (p->stop) break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        run_items(p);
        pthread_mutex_lock(&p->mu);
        if (atomic_fetch_sub_explicit(&p->busy, 1, memory_order_release) == 1) pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

ps_pool_t *ps_pool_new(int threads)
{
    if (threads < 1) threads = 1;
    ps_pool_t *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = 1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->start_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    p->th = calloc((size_t)threads, sizeof *p->th);
    if (!p->th) {
        ps_pool_free(&p);
        return NULL;
    }
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&p->th[i - 1], NULL, worker, p) != 0) break;
        p->n_threads++;
    }
    /* not with more threads than usable CPUs (the spin would take a core
     * from the items it waits for), nor under a CPU quota (it would spend
     * the quota the items need) */
    bool by_quota = false;
    p->spin = p->n_threads <= ps_cpus_usable(NULL, &by_quota) && !by_quota;
    cpu_set_t own;
    p->steer = p->n_threads > 1 && sched_getaffinity(0, sizeof own, &own) == 0 && CPU_COUNT(&own) >= p->n_threads;
    p->avoid = -1;
    return p;
}

/* The workers onto the caller's allowed CPUs less its own, if it has moved
 * (or on the first loop). Best effort: a failure leaves them where they
 * were. */
static void steer_workers(ps_pool_t *p)
{
    int cpu = sched_getcpu();
    if (cpu < 0 || cpu == p->avoid || cpu >= CPU_SETSIZE) return;
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return;
    CPU_CLR(cpu, &set);
    if (CPU_COUNT(&set) < p->n_threads - 1) { /* no CPU each besides the caller's: leave them */
        p->avoid = cpu;
        return;
    }
    for (int i = 0; i < p->n_threads - 1; i++) pthread_setaffinity_np(p->th[i], sizeof set, &set);
    p->avoid = cpu;
}

void ps_pool_free(ps_pool_t **pp)
{
    ps_pool_t *p = *pp;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->th[i], NULL);
    pthread_cond_destroy(&p->start_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->mu);
    free(p->th);
    free(p);
    *pp = NULL;
}

int ps_pool_threads(const ps_pool_t *p) { return p ? p->n_threads : 1; }

void ps_pool_for(ps_pool_t *p, int n, void (*fn)(void *arg, int i), void *arg)
{
    if (n <= 0) return;
    if (!p || p->n_threads == 1 || n == 1) {
        for (int i = 0; i < n; i++) fn(arg, i);
        return;
    }
    if (p->steer) steer_workers(p);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->busy, p->n_threads - 1, memory_order_relaxed);
    p->gen++;
    pthread_cond_broadcast(&p->start_cv);
    pthread_mutex_unlock(&p->mu);
    run_items(p);
    /* the workers' last items: spin for up to SPIN_S, then sleep */
    if (p->spin)
        for (double t0 = ps_now(); atomic_load_explicit(&p->busy, memory_order_acquire) > 0 && ps_now() - t0 < SPIN_S;)
            cpu_relax();
    pthread_mutex_lock(&p->mu); /* the workers' writes are visible once busy is 0 under mu (or acquired above) */
    while (atomic_load_explicit(&p->busy, memory_order_acquire) > 0) pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
