/* The CPUs a process may use (ps_cpus_usable): its affinity mask, and the
 * CPU quota of its cgroup read from a cgroup file system (here a tree made
 * in a temporary directory, with the files the kernel writes), and psd's
 * thread counts sized by them. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_config.h"
#include "ps_pool.h"
#include "ps_util.h"
#include "psd_net.h"
#include "psd_opts.h"

static char root[64];

static void setup(void)
{
    snprintf(root, sizeof root, "/tmp/psd-cpus-XXXXXX");
    cr_assert(mkdtemp(root) != NULL);
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    cr_assert_eq(system(cmd), 0);
}

TestSuite(cpus, .init = setup, .fini = teardown);

/* root/rel (its directories made), holding text */
static void put(const char *rel, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; (p = strchr(p, '/')) != NULL; p++) {
        *p = 0;
        mkdir(path, 0755);
        *p = '/';
    }
    FILE *f = fopen(path, "w");
    cr_assert(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

Test(cpus, v2_quota_is_the_smallest_along_the_path)
{
    put("job/cpu.max", "250000 100000\n"); /* 2.5 CPUs: 3 threads' worth */
    put("job/step/cpu.max", "max 100000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/job/step\n"), 3);
    put("job/step/cpu.max", "50000 100000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/job/step\n"), 1);
    /* a trailing slash, and a cgroup with no file of its own */
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/job/step/\n"), 1);
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/job/other\n"), 3);
}

Test(cpus, v2_in_a_container_reads_the_mount_root)
{
    /* a cgroup namespace (docker on cgroup v2): the path is "/" and the
     * mount is the container's own cgroup */
    put("cpu.max", "200000 100000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/\n"), 2);
}

Test(cpus, v1_quota_comes_from_the_cpu_controller)
{
    put("cpu,cpuacct/job/cpu.cfs_quota_us", "-1\n");
    put("cpu,cpuacct/job/cpu.cfs_period_us", "100000\n");
    put("cpu,cpuacct/cpu.cfs_quota_us", "400000\n");
    put("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
    const char *self = "12:memory:/job\n5:cpuacct,cpu:/job\n1:name=systemd:/job\n";
    cr_assert_eq(ps_cgroup_cpu_quota(root, self), 4);
    /* only the cpu controller's line counts: not cpuacct alone, not memory */
    cr_assert_eq(ps_cgroup_cpu_quota(root, "12:memory:/job\n3:cpuacct:/job\n"), 0);
    put("cpu,cpuacct/job/cpu.cfs_quota_us", "150000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, self), 2);
}

Test(cpus, no_quota_or_unreadable_text_is_no_limit)
{
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/none\n"), 0); /* no files */
    put("a/cpu.max", "max 100000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/a\n"), 0);
    const char *bad[] = {"", "garbage\n", "100000\n", "100000 0\n", "-5 100000\n", "12x 100000\n", "100000 -1\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        put("a/cpu.max", bad[i]);
        cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/a\n"), 0, "'%s'", bad[i]);
    }
    cr_assert_eq(ps_cgroup_cpu_quota(root, ""), 0);
    cr_assert_eq(ps_cgroup_cpu_quota(root, "no colons here\n"), 0);
}

Test(cpus, an_affinity_mask_sizes_psd_threads)
{
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t was, one;
    cr_assert_eq(sched_getaffinity(0, sizeof was, &was), 0);
    if (online < 2 || CPU_COUNT(&was) < 2) cr_skip_test("needs 2 usable CPUs");
    int first = -1;
    for (int i = 0; i < CPU_SETSIZE && first < 0; i++)
        if (CPU_ISSET(i, &was)) first = i;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    cr_assert_eq(sched_setaffinity(0, sizeof one, &one), 0);
    bool bound = false;
    int n = ps_cpus_usable(&bound, NULL);
    ps_config_t c;
    ps_config_defaults(&c);
    int step = psd_step_threads(&c), io = psd_io_threads(&c);
    c.threads = 3;
    c.io_threads = 2;
    int step_set = psd_step_threads(&c), io_set = psd_io_threads(&c);
    cr_assert_eq(sched_setaffinity(0, sizeof was, &was), 0);
    cr_assert_eq(n, 1);
    cr_assert(bound, "one CPU of %ld is a share of the host", online);
    cr_assert_eq(step, 1);
    cr_assert_eq(io, 1);
    cr_assert_eq(step_set, 3, "server.threads, when set, is taken as it is");
    cr_assert_eq(io_set, 2);
}

Test(cpus, io_threads_follow_the_usable_cpus)
{
    const int cores[] = {1, 2, 3, 7, 8, 11, 12, 15, 16, 19, 20, 64};
    const int io[] = {1, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4};
    for (size_t i = 0; i < sizeof cores / sizeof *cores; i++)
        cr_assert_eq(psd_io_threads_for(cores[i]), io[i], "%d CPUs", cores[i]);
}

Test(cpus, a_quota_is_rounded_up_and_huge_values_do_not_overflow)
{
    put("q/cpu.max", "100001 100000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/q\n"), 2);
    put("q/cpu.max", "100000 100000\n");
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/q\n"), 1);
    put("q/cpu.max", "9223372036854775807 100000\n"); /* capped, no overflow (UBSan) */
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/q\n"), 4096);
    put("q/cpu.max", "100000 99999999999999999999999\n"); /* out of range: not a quota */
    cr_assert_eq(ps_cgroup_cpu_quota(root, "0::/q\n"), 0);
}

/* ps_pool keeps its workers off the CPU the caller is on when a loop
 * starts: each worker that runs an item is allowed every CPU the caller is
 * allowed but that one (on a 2-CPU machine: the other CPU). Retried until
 * the caller stayed on one CPU across the loop (the scheduler may move it). */

typedef struct {
    pthread_t caller;
    int caller_cpu;           /* where the caller ran its first item */
    cpu_set_t seen;           /* a worker's affinity, as it ran an item */
    atomic_int recorded;
} steer_t;

static void steer_item(void *arg, int i)
{
    steer_t *t = arg;
    volatile double x = 0;
    for (int k = 0; k < 20000; k++) x += k * 1e-9; /* some microseconds, so that the worker takes items */
    (void)i;
    if (pthread_equal(pthread_self(), t->caller)) {
        if (t->caller_cpu < 0) t->caller_cpu = sched_getcpu();
        return;
    }
    if (atomic_exchange(&t->recorded, 1) == 0) sched_getaffinity(0, sizeof t->seen, &t->seen);
}

Test(cpus, a_pool_keeps_its_workers_off_the_callers_cpu)
{
    cpu_set_t own;
    cr_assert_eq(sched_getaffinity(0, sizeof own, &own), 0);
    if (CPU_COUNT(&own) < 2) cr_skip_test("needs 2 usable CPUs");
    ps_pool_t *p = ps_pool_new(2);
    cr_assert_not_null(p);
    bool checked = false;
    for (int attempt = 0; attempt < 200 && !checked; attempt++) {
        steer_t t = {.caller = pthread_self(), .caller_cpu = -1};
        int before = sched_getcpu();
        ps_pool_for(p, 400, steer_item, &t);
        int after = sched_getcpu();
        if (before != after || t.caller_cpu != before || !atomic_load(&t.recorded)) continue;
        cpu_set_t want = own;
        CPU_CLR(before, &want);
        cr_assert(CPU_EQUAL(&t.seen, &want), "a worker may run on the caller's CPU %d (%d of its CPUs allowed)",
                  before, CPU_COUNT(&t.seen));
        checked = true;
    }
    ps_pool_free(&p);
    cr_assert(checked, "the caller never stayed on one CPU through a loop a worker took part in");
}
