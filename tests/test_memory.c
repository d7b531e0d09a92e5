/* ps_malloc_keep: a large block freed by one thread is the next one's, with
 * its pages already there (no page fault when it is filled again), as
 * ZeroMQ's I/O thread allocates each large message it receives. Each test
 * runs in a process of its own (Criterion), so the control sees glibc's
 * defaults. Not under a sanitizer: its allocator replaces glibc's. */
#include <criterion/criterion.h>
#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "ps_util.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED 1
#else
#define SANITIZED 0
#endif

enum { BLOCK = 80 << 20, ROUNDS = 4 }; /* an 80 MB model's message */

static long minor_faults(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt;
}

/* As ZeroMQ's I/O thread: a block per message, filled, freed; returns the page
 * faults of the rounds after the first. */
static void *receive_rounds(void *arg)
{
    long *faults = arg, before = 0;
    for (int r = 0; r < ROUNDS; r++) {
        if (r == 1) before = minor_faults();
        char *p = malloc(BLOCK);
        cr_assert(p != NULL);
        memset(p, r + 1, BLOCK);
        cr_assert_eq(p[BLOCK - 1], r + 1);
        free(p);
    }
    *faults = minor_faults() - before;
    return NULL;
}

static long faults_in_a_thread(void)
{
    pthread_t t;
    long faults = -1;
    cr_assert_eq(pthread_create(&t, NULL, receive_rounds, &faults), 0);
    cr_assert_eq(pthread_join(t, NULL), 0);
    return faults;
}

Test(memory, a_freed_large_block_is_reused_with_its_pages, .disabled = SANITIZED)
{
    ps_malloc_keep();
    long faults = faults_in_a_thread();
    /* 3 rounds of 20,480 pages each: none of them faults again (a few for the stack and the like) */
    cr_assert_lt(faults, 200, "%ld page faults in 3 rounds of an 80 MiB block", faults);
    struct mallinfo2 mi = mallinfo2();
    cr_assert_eq(mi.hblkhd, 0, "%zu bytes in mmapped blocks", mi.hblkhd);
    cr_assert_geq(mi.fordblks, (size_t)BLOCK, "the freed block was given back (%zu bytes free in the heap)",
                  mi.fordblks);
}

/* The control: glibc's defaults map such a block fresh each time, and every page faults */
Test(memory, without_it_each_block_faults_in_every_page, .disabled = SANITIZED)
{
    long faults = faults_in_a_thread();
    cr_assert_gt(faults, (long)(ROUNDS - 1) * (BLOCK / 4096) / 2, "%ld page faults", faults);
}
