/* locality_probe - what psd's step costs on each core, after another core
 * received the gradient. Not a test.
 *
 *   build/locality_probe [ROUNDS]
 *
 * psd's step reads a gradient that ZeroMQ's I/O thread has just received
 * (the kernel's copy wrote it from that thread's core) and updates weights
 * that the I/O thread last read (it sent them). Each round here: thread B,
 * pinned to the second CPU of this process's mask, writes a 4 MiB gradient
 * (memcpy, as the receive's copy) and reads the 4 MiB weights (as the
 * send's copy); then one plain-SGD pass w -= lr * g over them runs
 *   on the other CPU alone  (thread A: the data is in B's core's caches),
 *   on B's CPU alone        (where the data is),
 *   on both                 (items of 128 KiB handed out by an atomic counter,
 *                            as psd's step pool does).
 * Prints the mean microseconds of the pass for each. Needs 2 CPUs in this
 * process's affinity mask. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_util.h"

#define N ((size_t)1 << 20)  /* floats: 4 MiB */
#define ITEM ((size_t)32768) /* floats an item: 128 KiB, psd's PSD_ITEM_FLOATS */

enum { IDLE, RECEIVE, RECEIVED, STEP, STEPPED, SEND, STOP };

static float *w, *g, *src, *dst;
static atomic_int phase, next;
static int mode; /* 0: A alone, 1: B alone, 2: both */
static int cpu[2];

static void pin(int c)
{
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(c, &s);
    pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void items(void)
{
    for (;;) {
        size_t i = (size_t)atomic_fetch_add(&next, 1);
        if (i * ITEM >= N) return;
        float *restrict wi = w + i * ITEM;
        const float *restrict gi = g + i * ITEM;
        for (size_t k = 0; k < ITEM; k++) wi[k] -= 0.01f * gi[k];
    }
}

static void wait_for(int p)
{
    while (atomic_load(&phase) != p) {
    }
}

/* thread B: the I/O thread's core */
static void *b_thread(void *arg)
{
    (void)arg;
    pin(cpu[1]);
    for (;;) {
        int p;
        while ((p = atomic_load(&phase)) != RECEIVE && p != STEP && p != SEND && p != STOP) {
        }
        if (p == STOP) return NULL;
        if (p == RECEIVE) {
            memcpy(g, src, N * sizeof *g);
            atomic_store(&phase, RECEIVED);
        } else if (p == STEP) {
            if (mode != 0) items();
            atomic_store(&phase, STEPPED);
        } else {
            memcpy(dst, w, N * sizeof *w);
            atomic_store(&phase, IDLE);
        }
    }
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 300;
    cpu_set_t mask;
    if (rounds < 1 || sched_getaffinity(0, sizeof mask, &mask) != 0) {
        fprintf(stderr, "usage: locality_probe [ROUNDS]\n");
        return 2;
    }
    int k = 0;
    for (int c = 0; c < CPU_SETSIZE && k < 2; c++)
        if (CPU_ISSET(c, &mask)) cpu[k++] = c;
    if (k < 2) {
        fprintf(stderr, "locality_probe: needs 2 CPUs in its affinity mask\n");
        return 2;
    }
    w = aligned_alloc(64, N * sizeof *w);
    g = aligned_alloc(64, N * sizeof *g);
    src = aligned_alloc(64, N * sizeof *src);
    dst = aligned_alloc(64, N * sizeof *dst);
    if (!w || !g || !src || !dst) return 1;
    for (size_t i = 0; i < N; i++) {
        w[i] = 1.0f;
        src[i] = 1e-3f;
    }
    pin(cpu[0]);
    pthread_t t;
    if (pthread_create(&t, NULL, b_thread, NULL) != 0) return 1;
    const char *name[3] = {"on the other CPU alone", "on the receiving CPU alone", "on both CPUs, items shared"};
    for (mode = 0; mode < 3; mode++) {
        double sum = 0;
        for (int r = 0; r < rounds; r++) {
            atomic_store(&phase, RECEIVE);
            wait_for(RECEIVED);
            double t0 = ps_now();
            atomic_store(&next, 0);
            atomic_store(&phase, STEP);
            if (mode != 1) items();
            wait_for(STEPPED);
            sum += ps_now() - t0;
            atomic_store(&phase, SEND);
            wait_for(IDLE);
        }
        printf("sgd pass over 4 MiB that CPU %d received, %s: %.1f us (mean of %d)\n", cpu[1], name[mode],
               sum / rounds * 1e6, rounds);
    }
    atomic_store(&phase, STOP);
    pthread_join(t, NULL);
    free(w);
    free(g);
    free(src);
    free(dst);
    return 0;
}
