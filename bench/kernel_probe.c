/* kernel_probe - what the kernel's entries cost on this machine, for telling
 * hosts apart (bench/lib.sh machine_line prints it with every benchmark): a
 * system call (getppid), a wake-up's system calls (an eventfd written and
 * read), a wake-up of a thread blocked on the other CPU (futex, there and
 * back), the same wake-up when both threads slept a millisecond before it
 * (the other vCPU halted: the host must run it again), and a page fault (a
 * fresh anonymous page, zeroed by the kernel).
 * On a VM whose kernel runs deprivileged (PVM) or with page-table isolation
 * each costs several times what it does on bare metal; psd's round makes
 * more of them than the raw probe does (docs/design.md, the one-worker
 * round). Prints one line. Not a test.
 *   build/kernel_probe */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "bench_util.h"

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static double now(void) { return (double)now_ns() * 1e-9; }

static _Atomic uint32_t turn; /* 0: the main thread's, 1: the other's */
enum { PINGS = 20000 };

static void futex_wait(_Atomic uint32_t *a, uint32_t v) { syscall(SYS_futex, a, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0); }
static void futex_wake(_Atomic uint32_t *a) { syscall(SYS_futex, a, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }

static void *pong(void *arg)
{
    (void)arg;
    for (int i = 0; i < PINGS; i++) {
        while (atomic_load(&turn) != 1) futex_wait(&turn, 0);
        atomic_store(&turn, 0);
        futex_wake(&turn);
    }
    return NULL;
}

/* the median of 5 runs of f, in microseconds per operation */
static double median5(double (*f)(void))
{
    double v[5];
    for (int i = 0; i < 5; i++) v[i] = f();
    qsort(v, 5, sizeof v[0], bench_cmp_double);
    return v[2];
}

static double syscall_us(void)
{
    enum { N = 100000 };
    double t = now();
    for (int i = 0; i < N; i++) syscall(SYS_getppid);
    return (now() - t) / N * 1e6;
}

static double eventfd_us(void)
{
    enum { N = 50000 };
    int fd = eventfd(0, EFD_NONBLOCK);
    if (fd < 0) return -1;
    uint64_t v = 1;
    double t = now();
    for (int i = 0; i < N; i++) {
        if (write(fd, &v, sizeof v) != sizeof v || read(fd, &v, sizeof v) != sizeof v) break;
        v = 1;
    }
    double us = (now() - t) / N * 1e6;
    close(fd);
    return us;
}

static double wakeup_us(void)
{
    pthread_t t;
    atomic_store(&turn, 0);
    if (pthread_create(&t, NULL, pong, NULL) != 0) return -1;
    double t0 = now();
    for (int i = 0; i < PINGS; i++) {
        atomic_store(&turn, 1);
        futex_wake(&turn);
        while (atomic_load(&turn) != 0) futex_wait(&turn, 1);
    }
    double us = (now() - t0) / PINGS * 1e6 / 2; /* one wake-up each way */
    pthread_join(t, NULL);
    return us;
}

static _Atomic uint32_t seq;
static _Atomic int64_t stamp_ns;
enum { COLD = 200 };
static double cold_lat[COLD];

static void *sleeper(void *arg)
{
    (void)arg;
    for (uint32_t i = 0; i < COLD; i++) {
        while (atomic_load(&seq) == i) futex_wait(&seq, i);
        cold_lat[i] = (double)(now_ns() - atomic_load(&stamp_ns)) / 1e3;
    }
    return NULL;
}

/* the median latency from a futex wake to the woken thread running, both idle 1 ms before */
static double cold_wakeup_us(void)
{
    pthread_t t;
    atomic_store(&seq, 0);
    if (pthread_create(&t, NULL, sleeper, NULL) != 0) return -1;
    struct timespec ms = {0, 1000000};
    for (uint32_t i = 0; i < COLD; i++) {
        nanosleep(&ms, NULL);
        atomic_store(&stamp_ns, now_ns());
        atomic_store(&seq, i + 1);
        futex_wake(&seq);
    }
    pthread_join(t, NULL);
    qsort(cold_lat, COLD, sizeof cold_lat[0], bench_cmp_double);
    return cold_lat[COLD / 2];
}

static double fault_us(void)
{
    size_t bytes = (size_t)32 << 20;
    char *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return -1;
    madvise(p, bytes, MADV_NOHUGEPAGE);
    double t = now();
    for (size_t o = 0; o < bytes; o += 4096) p[o] = 1;
    double us = (now() - t) / (double)(bytes / 4096) * 1e6;
    munmap(p, bytes);
    return us;
}

int main(void)
{
    printf("kernel: system call %.2f us, eventfd write+read %.2f us, thread wake-up %.1f us (after 1 ms idle %.1f us), "
           "page fault %.2f us (medians)\n",
           median5(syscall_us), median5(eventfd_us), median5(wakeup_us), cold_wakeup_us(), median5(fault_us));
    return 0;
}
