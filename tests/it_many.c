/* it_many.c - integration test (suite long): psd with 64 pworkers on one
 * host (issue 57, "64 workers"; see itest.h). */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <zmq.h>

#include "itest.h"
#include "proc.h"
#include "ps_util.h"

#define MANY 64   /* workers */
#define KILLED 16 /* of them killed at once in epoch 2 (or a later one) */
#define BATCH 16
#define STEPS 40  /* each worker's steps in an epoch of all 64 */
#define TRAIN (MANY * BATCH * STEPS) /* 40960 training samples */
#define EPOCHS 4
#define PROGRESS " samples/s ETA " /* in psd's progress lines only, while an epoch trains */

/* The epoch and step (at of of) of the last progress line in log. */
static void last_progress(const char *log, unsigned *e, unsigned *at, unsigned *of)
{
    const char *p = NULL;
    for (const char *q = log; (q = strstr(q, PROGRESS)); q++) p = q;
    if (!p) return;
    while (p > log && p[-1] != '\n') p--;
    const char *ep = strstr(p, "epoch ");
    cr_assert(ep && sscanf(ep, "epoch %u/%*u step %u/%u", e, at, of) == 3, "%.120s", p);
}

/* psd and 64 pworkers on this host (2 cores on the test VMs: 32 processes a
 * core), one BLAS thread each, a 784-16-10 model, batch 16, 40 steps a
 * worker in an epoch, 4 epochs: all register and train epoch 1 with exact
 * counts, every worker through shared memory; 16 of them are killed at once
 * (SIGKILL) in the middle of epoch 2 (or of a later one, where the first
 * try found a validation), psd declares them lost for their closed
 * connections (not for silence), and the other 48 finish that epoch and the
 * run: every training sample trained once an epoch, every test sample
 * validated once. 3 minutes: a bound on hanging, not a speed
 * check (most of it is the start: each worker reads the whole gzipped
 * training set, 0.3 s of CPU, 64 of them on 2 cores). --worker-timeout 30:
 * 32 processes a core keep a worker off the CPU for a while; nobody may be
 * lost for silence here (bench/many_workers.sh measures the tolerance). */
Test(long, sixty_four_workers_train_and_survive_sixteen_killed_at_once, .timeout = 180)
{
    double t0 = ps_now();
    run_t r;
    char limit[64];
    snprintf(limit, sizeof limit, "data.train_limit=%d", TRAIN);
    char epochs[16];
    snprintf(epochs, sizeof epochs, "%d", EPOCHS);
    const char *args[] = {"--epochs", epochs, "--set", limit, "--set", "model.layers=[784,16,10]",
                          "--set", "train.batch_size=16", "--set", "checkpoint.dir=",
                          /* a progress line every 0.2 s: where the epoch stands when the kill comes */
                          "--set", "server.progress_every=0.2",
                          "--worker-timeout", "30", "--start-timeout", "150", NULL};
    pid_t p = start_psd(&r, "many", MANY, args);
    pid_t w[MANY];
    const char *wargs[] = {"--threads", "1", NULL};
    for (int i = 0; i < MANY; i++) {
        w[i] = start_worker(&r, "many", i, wargs);
        cr_assert_gt(w[i], 0, "worker %d started", i);
    }
    char ready[64];
    snprintf(ready, sizeof ready, "%d workers ready; training", MANY);
    wait_log(r.psd_log, ready, 150);
    double t_ready = ps_now();
    wait_metrics(&r, 1);
    double t_e1 = ps_now();
    char *m = metrics_last(&r);
    const char *l1 = last_line(m);
    cr_assert_eq(json_num(l1, "epoch"), 1, "%s", l1);
    cr_assert_eq(json_num(l1, "train_samples"), TRAIN, "epoch 1 trained every sample once: %s", l1);
    cr_assert_eq(json_num(l1, "val_samples"), 10000, "epoch 1 validated every test sample once: %s", l1);
    cr_assert_eq(json_num(l1, "workers"), MANY, "%s", l1);
    cr_assert_eq(json_num(l1, "step"), STEPS, "64 workers, %d steps: %s", STEPS, l1);
    cr_assert_eq(json_num(l1, "workers_lost"), 0, "%s", l1);
    /* every one through shared memory (a burst of more than 8 requests used
     * to be refused: those workers went over the wire) */
    cr_assert_eq(json_num(l1, "wire_bytes_in"), 0, "%s", l1);
    free(m);
    char *shm = slurp(r.psd_log);
    cr_assert_eq(count_in(shm, "exchanges tensors with psd through shared memory"), MANY, "%s",
                 strstr(shm, "refused a shared-memory request") ? strstr(shm, "refused a shared-memory request") : "");
    free(shm);

    /* 16 killed at once in the middle of an epoch's training, epoch 2 or a
     * later one. An epoch takes well under a second here, so first the 16
     * are stopped (SIGSTOP): psd cannot step without them, the epoch stands
     * still where it is, and psd's next progress line (only while an epoch
     * trains) says where; then they are killed there (SIGKILL), still
     * stopped. Stopped during a validation instead (no progress line), they
     * go on (SIGCONT) and are stopped again a little later. The other 48 run
     * all along. */
    unsigned e = 0, at = 0, of = 0;
    for (int tries = 0; !e; tries++) {
        cr_assert_lt(tries, 10, "never stopped in the middle of an epoch's training");
        zmq_poll(NULL, 0, 20);
        for (int i = 0; i < MANY; i += MANY / KILLED) kill(w[i], SIGSTOP);
        double t_stop = ps_now();
        char *log = slurp(r.psd_log);
        int lines0 = count_in(log, PROGRESS);
        free(log);
        while (!e && ps_now() - t_stop < 1.0) {
            zmq_poll(NULL, 0, 50);
            log = slurp(r.psd_log);
            if (count_in(log, PROGRESS) > lines0) /* the last one: after the stop */
                last_progress(log, &e, &at, &of);
            free(log);
        }
        if (e && (e < 2 || at >= of)) e = 0; /* not in the middle of epoch 2 or later: go on and stop again */
        if (e) break;
        for (int i = 0; i < MANY; i += MANY / KILLED) kill(w[i], SIGCONT);
        zmq_poll(NULL, 0, 100);
    }
    m = metrics_last(&r);
    cr_assert_eq(count_lines(m), (int)e - 1, "epoch %u stands still with 16 workers stopped: %s", e, m);
    free(m);
    for (int i = 0; i < MANY; i += MANY / KILLED) kill(w[i], SIGKILL);
    double t_kill = ps_now();

    r.psd_code = proc_wait(p, 180 - (ps_now() - t0));
    double t_end = ps_now();
    for (int i = 0; i < MANY; i++) {
        int code = proc_wait(w[i], 30);
        if (i % (MANY / KILLED) == 0) cr_assert_eq(code, 128 + SIGKILL, "worker %d was killed", i);
        else cr_assert_eq(code, 0, "worker %d (a survivor) exit %d", i, code);
    }
    char *log = slurp(r.psd_log);
    size_t len = log ? strlen(log) : 0;
    cr_assert_eq(r.psd_code, 0, "psd exit %d; end of its log:\n%s", r.psd_code, log ? log + (len > 1500 ? len - 1500 : 0) : "");
    cr_assert(!strstr(log, "psd's bookkeeping"), "every training sample trained once an epoch");
    cr_assert_eq(count_in(log, ") lost: its connection closed"), KILLED, "the 16 killed were lost for their closed "
                 "connections");
    cr_assert(!strstr(log, "lost: nothing from it"), "nobody was lost for silence: %s", strstr(log, "lost: nothing"));
    /* each lost worker's untrained samples of the epoch went to the others */
    char moved[64];
    snprintf(moved, sizeof moved, " samples of epoch %u go to ", e);
    cr_assert_eq(count_in(log, moved), KILLED, "killed in the middle of epoch %u (step %u of %u)", e, at, of);
    free(log);

    /* every epoch: every training sample trained once, every test sample
     * validated once; 48 workers from the kill's epoch on */
    m = metrics_last(&r);
    cr_assert_eq(count_lines(m), EPOCHS, "%s", m);
    unsigned k = 1;
    for (char *line = m; line && *line; k++) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        cr_assert_eq(json_num(line, "epoch"), k, "%s", line);
        cr_assert_eq(json_num(line, "train_samples"), TRAIN, "epoch %u trained every sample once: %s", k, line);
        cr_assert_eq(json_num(line, "val_samples"), 10000, "epoch %u validated every test sample once: %s", k, line);
        cr_assert_eq(json_num(line, "workers"), k < e ? MANY : MANY - KILLED, "%s", line);
        cr_assert_eq(json_num(line, "workers_lost"), k < e ? 0 : KILLED, "%s", line);
        line = nl ? nl + 1 : NULL;
    }
    free(m);
    cr_log_info("64 workers: ready %.1f s after the start, epoch 1 done %.1f s later, 16 killed at step %u/%u of "
                "epoch %u, psd done %.1f s after the kill; %.1f s in all",
                t_ready - t0, t_e1 - t_ready, at, of, e, t_end - t_kill, t_end - t0);
}
