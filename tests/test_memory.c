/* ps_malloc_keep: a large block freed by one thread is the next one's, with
 * its pages already there (no page fault when it is filled again), as
 * ZeroMQ's I/O thread allocates each large message it receives; and after
 * ps_malloc_settle, two messages' blocks that come in another order each
 * round fit the space the last round's freed. Each test
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

/* Two workers' messages of the MLP 784-4096-4096-10 (a 12.8 MB and a 64 MiB
 * tensor each) as two I/O threads allocate them, in an order that changes
 * from round to round, with a small block allocated amid them each round
 * that outlives the round (a ZeroMQ pipe's chunk): the heap's size after
 * each round (mallinfo2's arena). */
enum { TENSOR_S = 12845056, TENSOR_L = 64 << 20, SMALL = 16400, ORDERS = 4 };

static void rounds_of_two_messages(size_t arena[ORDERS])
{
    static const int order[ORDERS][4] = {{0, 1, 2, 3}, {0, 2, 1, 3}, {1, 3, 0, 2}, {0, 2, 3, 1}};
    const size_t size[4] = {TENSOR_S, TENSOR_L, TENSOR_S, TENSOR_L}; /* worker 0's two, worker 1's two */
    void *kept = NULL;
    for (int r = 0; r < ORDERS; r++) {
        void *block[4], *small = NULL;
        for (int i = 0; i < 4; i++) {
            block[order[r][i]] = malloc(size[order[r][i]]);
            cr_assert(block[order[r][i]] != NULL);
            memset(block[order[r][i]], 1, 4096); /* received into */
            if (i == 1) small = malloc(SMALL);
        }
        cr_assert(small != NULL);
        for (int i = 0; i < 4; i++) free(block[i]); /* the step */
        free(kept);
        kept = small;
        arena[r] = mallinfo2().arena;
    }
    free(kept);
}

Test(memory, two_messages_in_changing_order_fit_what_the_last_round_freed, .disabled = SANITIZED)
{
    ps_malloc_keep();
    ps_malloc_settle();
    size_t arena[ORDERS];
    rounds_of_two_messages(arena);
    for (int r = 1; r < ORDERS; r++)
        cr_assert_eq(arena[r], arena[0], "round %d: the heap grew from %zu to %zu bytes", r + 1, arena[0], arena[r]);
}

/* The control: without the small blocks' reserve the small block lands amid
 * the large ones and the heap grows by more than a tensor */
Test(memory, without_the_reserve_the_heap_grows, .disabled = SANITIZED)
{
    ps_malloc_keep();
    size_t arena[ORDERS];
    rounds_of_two_messages(arena);
    cr_assert_gt(arena[ORDERS - 1], arena[0] + TENSOR_S, "the heap: %zu bytes after round 1, %zu after round %d",
                 arena[0], arena[ORDERS - 1], ORDERS);
}
