/* it_sync.c - integration tests: consistency modes (bsp, async, ssp) and waits that are not
 * silences (see itest.h). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "itest.h"
#include "proc.h"
#include "ps_auth.h"
#include "ps_ctr.h"
#include "ps_model.h"
#include "ps_shm.h"
#include "psworker.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"

/* ---- consistency modes (train.sync: bsp | async | ssp) ------------------- */

/* psd + 2 workers, worker 0 slowed down by slow_ms per step; the largest
 * staleness and ssp lead over the epochs' metrics lines */
static void run_sync(run_t *r, const char *tag, const char *mode, int slow_ms, uint64_t *stale_max,
                     uint64_t *lead_max)
{
    char sync[32], slow[16];
    snprintf(sync, sizeof sync, "train.sync=%s", mode);
    snprintf(slow, sizeof slow, "%d", slow_ms);
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=3200", "--set", sync, "--set",
                          "train.staleness=2", "--set", "optimizer.lr=0.05", NULL};
    pid_t p = start_psd(r, tag, 2, args);
    const char *slowed[] = {"--x-slow-ms", slow, NULL};
    pid_t w0 = start_worker(r, tag, 0, slowed), w1 = start_worker(r, tag, 1, NULL);
    r->psd_code = proc_wait(p, 300);
    r->worker_code[0] = proc_wait(w0, 30);
    r->worker_code[1] = proc_wait(w1, 30);
    check_run(r, 2, 2);
    char *m = metrics_last(r), *save = NULL;
    *stale_max = *lead_max = 0;
    for (char *line = strtok_r(m, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char want[32];
        snprintf(want, sizeof want, "\"sync\":\"%s\"", mode);
        cr_assert(strstr(line, want), "%s in %s", want, line);
        double st = json_num(line, "staleness_max"), mean = json_num(line, "staleness_mean");
        cr_assert(mean > 0 && mean <= st, "staleness mean %g max %g", mean, st);
        if (st > (double)*stale_max) *stale_max = (uint64_t)st;
        if (json_num(line, "ssp_lead_max") > (double)*lead_max) *lead_max = (uint64_t)json_num(line, "ssp_lead_max");
    }
    free(m);
}

/* ssp with bound k = 2: the fast worker is held back at 2 steps ahead of the
 * slow one, so no gradient psd applies is more than 2k + 1 = 5 versions stale
 * (2 workers: while one computes, the other applies at most 2k + 1 pushes,
 * k + 1 while the slowest computes); async lets it run, and its staleness
 * goes past that (so the first check can fail). */
Test(short, ssp_holds_a_fast_worker_within_the_staleness_bound)
{
    int slow = sanitized() ? 200 : 40;
    run_t r;
    uint64_t stale, lead;
    run_sync(&r, "ssp", "ssp", slow, &stale, &lead);
    cr_assert_eq(lead, 2, "the fast worker reached the bound and never passed it (lead %" PRIu64 ")", lead);
    cr_assert(stale >= 1 && stale <= 5, "ssp staleness max %" PRIu64 " (bound 2k + 1 = 5)", stale);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "workers trained at most 2 steps ahead of the slowest (bound 2)"), "%s", log);
    free(log);
    run_sync(&r, "async", "async", slow, &stale, &lead);
    cr_assert_eq(lead, 0, "async has no bound to report");
    cr_assert_gt(stale, 5, "async lets the fast worker run ahead: staleness max %" PRIu64, stale);
}

/* ssp: the slowest worker dies; the fast one, held back, is let go once psd
 * declares it lost, and finishes the epoch (its samples too). */
Test(short, ssp_does_not_hang_when_the_slowest_worker_dies)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--set", "train.sync=ssp",
                          "--set", "train.staleness=1", "--set", "optimizer.lr=0.05", "--worker-timeout", "2",
                          NULL};
    pid_t p = start_psd(&r, "sspkill", 2, args);
    const char *slowed[] = {"--x-slow-ms", "300", "--retry-for", "0", NULL};
    pid_t w0 = start_worker(&r, "sspkill", 0, slowed), w1 = start_worker(&r, "sspkill", 1, NULL);
    wait_log(r.psd_log, "training 1 epoch", 60);
    zmq_poll(NULL, 0, 1500); /* the fast worker is held back by now */
    kill(w0, SIGKILL);
    cr_assert_eq(proc_wait(w0, 10), 128 + SIGKILL);
    r.psd_code = proc_wait(p, 120);
    r.worker_code[0] = 0;
    r.worker_code[1] = proc_wait(w1, 30);
    check_run(&r, 1, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 3200, "every sample trained once: %s", last_line(m));
    free(m);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "lost"), "%s", log);
    free(log);
}

/* A mode psd shards do not support is refused at start. */
Test(short, async_with_psd_shards_is_refused)
{
    char out[256];
    path(out, sizeof out, "syncshard.txt");
    cr_assert_eq(run_cmd("'%s' --shard 0/2 --set train.sync=async --listen tcp://127.0.0.1:9 > '%s' 2>&1", psd_bin, out),
                 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "train.sync: async needs one psd"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --set train.sync=sometimes --print-config > /dev/null 2>&1", psd_bin), 2);
    /* streamed steps: bsp and one psd only */
    cr_assert_eq(run_cmd("'%s' --set train.stream=true --set train.sync=ssp --print-config > '%s' 2>&1", psd_bin, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "train.stream: true needs train.sync: bsp"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --shard 0/2 --set train.stream=true --listen tcp://127.0.0.1:9 > '%s' 2>&1", psd_bin, out),
                 2);
    t = slurp(out);
    cr_assert(strstr(t, "train.stream: true needs one psd"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --set train.staleness=-1 --print-config > /dev/null 2>&1", psd_bin), 2);
}

/* Fashion-MNIST, 2 workers, 5 epochs: async and ssp learn as well as bsp
 * (lr 0.05: each push is a step of one worker's batch). */
static void full_sync(const char *mode)
{
    run_t r;
    char sync[32];
    snprintf(sync, sizeof sync, "train.sync=%s", mode);
    const char *args[] = {"--epochs", "5", "--set", sync, "--set", "optimizer.lr=0.05", NULL};
    train(&r, mode, 2, args, 900);
    check_run(&r, 2, 5);
    char *m = metrics_last(&r);
    const char *last = last_line(m);
    cr_assert_eq(json_num(last, "train_samples"), 60000);
    cr_assert_geq(json_num(last, "val_acc"), 0.88, "%s: %s", mode, last);
    fprintf(stderr, "%s: val_acc %.4f, %.0f samples/s\n", mode, json_num(last, "val_acc"),
            json_num(last, "samples_per_s"));
    free(m);
}

/* async, worker 0 slowed down (40 ms a step), 2 epochs: the fast worker
 * finishes its half, then takes over most of what the slow one has left
 * (train.rebalance, on by default), and trains most of the epoch; every
 * sample is trained once (psd's own check, in check_run, and the counts).
 * With train.rebalance=false each trains its half, the fast one waiting at
 * its barrier. The counts come from psd's log: "trained: rank 0 N, rank 1 M". */
static void trained_counts(const run_t *r, int epoch, uint64_t *moved, uint64_t n[2])
{
    char *log = slurp(r->psd_log), want[64];
    snprintf(want, sizeof want, "epoch %d: ", epoch);
    *moved = n[0] = n[1] = 0;
    for (const char *at = log; (at = strstr(at, want)) != NULL; at++) {
        unsigned long long mv, a, b;
        unsigned ra, rb;
        if (sscanf(at + strlen(want), "%llu samples moved from slower workers to those done with theirs; trained: "
                                      "rank %u %llu, rank %u %llu", &mv, &ra, &a, &rb, &b) == 5) {
            cr_assert(ra < 2 && rb < 2 && ra != rb, "%s", at);
            *moved = mv;
            n[ra] = a;
            n[rb] = b;
        }
    }
    free(log);
}

Test(short, async_gives_a_slow_workers_samples_to_the_fast_one)
{
    int slow = sanitized() ? 150 : 40;
    char slow_ms[16];
    snprintf(slow_ms, sizeof slow_ms, "%d", slow);
    const char *slowed[] = {"--x-slow-ms", slow_ms, NULL};
    for (int rebalance = 1; rebalance >= 0; rebalance--) {
        run_t r;
        const char *tag = rebalance ? "rebal" : "norebal";
        const char *args[] = {"--epochs", "2", "--set", "data.train_limit=3200", "--set", "train.sync=async",
                              "--set", rebalance ? "train.rebalance=true" : "train.rebalance=false", "--set",
                              "optimizer.lr=0.05", NULL};
        pid_t p = start_psd(&r, tag, 2, args);
        pid_t w0 = start_worker(&r, tag, 0, slowed), w1 = start_worker(&r, tag, 1, NULL);
        r.psd_code = proc_wait(p, 300);
        r.worker_code[0] = proc_wait(w0, 30);
        r.worker_code[1] = proc_wait(w1, 30);
        check_run(&r, 2, 2);
        char *m = metrics_last(&r);
        for (char *line = m, *nl; line && *line; line = nl ? nl + 1 : NULL) {
            nl = strchr(line, '\n');
            cr_assert_eq(json_num(line, "train_samples"), 3200, "every sample trained once an epoch: %.300s", line);
            cr_assert_eq(json_num(line, "samples_moved") > 0, rebalance, "%.600s", line);
        }
        free(m);
        for (int e = 1; e <= 2; e++) {
            uint64_t moved, n[2];
            trained_counts(&r, e, &moved, n);
            if (!rebalance) {
                cr_assert_eq(moved, 0, "nothing moved without train.rebalance");
                continue;
            }
            cr_assert_gt(moved, 0, "epoch %d: samples moved (psd's log %s)", e, r.psd_log);
            cr_assert_eq(n[0] + n[1], 3200, "epoch %d: %" PRIu64 " + %" PRIu64, e, n[0], n[1]);
            uint64_t lo = n[0] < n[1] ? n[0] : n[1], hi = n[0] + n[1] - lo;
            cr_assert_geq(hi, 2 * lo, "epoch %d: the fast worker trained most of the epoch (%" PRIu64 " / %" PRIu64 ")",
                          e, n[0], n[1]);
        }
    }
}

/* async with rebalancing: the fast worker takes over most of the slow one's
 * samples, then is killed; what it had not trained goes back to the slow one,
 * and every sample of the epoch is trained once. */
Test(short, a_worker_killed_after_taking_over_samples_gives_them_back)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--set", "train.sync=async",
                          "--set", "optimizer.lr=0.05", "--log-level", "debug", NULL};
    pid_t p = start_psd(&r, "rebalkill", 2, args);
    const char *slow[] = {"--x-slow-ms", "300", NULL}, *fast[] = {"--x-slow-ms", "30", NULL};
    pid_t w0 = start_worker(&r, "rebalkill", 0, slow), w1 = start_worker(&r, "rebalkill", 1, fast);
    wait_log(r.psd_log, "to 1 worker done with theirs", 60);
    kill(w1, SIGKILL);
    cr_assert_eq(proc_wait(w1, 10), 128 + SIGKILL);
    r.psd_code = proc_wait(p, 120);
    r.worker_code[0] = proc_wait(w0, 30);
    check_run(&r, 1, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 3200, "every sample trained once: %s", last_line(m));
    cr_assert_gt(json_num(last_line(m), "samples_moved"), 0, "%s", last_line(m));
    free(m);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "lost"), "the fast worker was lost: %s", log);
    free(log);
}

Test(long, async_two_workers_reach_088) { full_sync("async"); }
Test(long, ssp_two_workers_reach_088) { full_sync("ssp"); }

/* ---- waits that are not silences ------------------------------------------ */

/* The last worker training in an epoch is lost while another, which joined
 * during the epoch, waits for the next one: that worker takes the samples
 * at once (psd used to keep them for a worker to join, and the waiting one
 * only came for them when its own wait for psd timed out: start timeout +
 * 10 s). And when that waiting worker is dead too (lost at once: its
 * connection closed), psd gives up after its start timeout (exit 4)
 * instead of waiting for ever. */
Test(short, the_last_worker_lost_with_one_waiting_for_the_next_epoch)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--worker-timeout", "2",
                          "--start-timeout", "8", NULL};
    const char *slowed[] = {"--x-slow-ms", "200", NULL};
    for (int dead = 0; dead < 2; dead++) { /* the waiting worker alive, then dead */
        run_t r;
        const char *tag = dead ? "joinlast-dead" : "joinlast";
        pid_t p = start_psd(&r, tag, 1, args);
        pid_t a = start_worker(&r, tag, 0, slowed);
        wait_log(r.psd_log, "training 1 epoch", 60);
        pid_t b = start_worker(&r, tag, 1, NULL);
        wait_log(r.psd_log, "rank 1 joins from epoch 2", 60);
        if (dead) {
            kill(b, SIGKILL);
            cr_assert_eq(proc_wait(b, 10), 128 + SIGKILL);
        }
        kill(a, SIGKILL);
        cr_assert_eq(proc_wait(a, 10), 128 + SIGKILL);
        if (!dead) {
            wait_log(r.psd_log, "rank 1 takes the", 5); /* at once, not after b's own timeout */
            r.psd_code = proc_wait(p, 120);
            cr_assert_eq(r.psd_code, 0, "psd finished the run");
            cr_assert_eq(proc_wait(b, 30), 0);
            char *m = metrics_last(&r);
            cr_assert_eq(json_num(last_line(m), "train_samples"), 3200, "every sample once: %s", last_line(m));
            cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
            free(m);
        } else {
            /* b's connection closed with it: lost at once, before a's samples
             * could go to it; nobody comes within 8 s */
            r.psd_code = proc_wait(p, 60);
            cr_assert_eq(r.psd_code, 4, "psd gave up: no worker left (exit %d)", r.psd_code);
            char *log = slurp(r.psd_log);
            const char *bl = log ? strstr(log, "rank 1 (") : NULL, *lost = bl ? strstr(bl, ") lost: ") : NULL;
            cr_assert(lost && !memchr(bl, '\n', (size_t)(lost - bl)) &&
                          strncmp(lost, ") lost: its connection closed", 29) == 0 && !strstr(log, "rank 1 takes the") &&
                          strstr(log, "no worker came back within 8 s"),
                      "%s", log ? log : "");
            free(log);
        }
    }
}

/* psd and `workers` workers, worker 0 slowed by slow_ms a step, train one
 * epoch of `samples` to the end with nobody lost, registering again or
 * giving psd up. */
static void run_slowed(const char *tag, int workers, const char **args, const char *slow_ms, double samples)
{
    run_t r;
    const char *slowed[] = {"--x-slow-ms", slow_ms, NULL};
    pid_t p = start_psd(&r, tag, workers, args), w[2];
    for (int i = 0; i < workers; i++) w[i] = start_worker(&r, tag, i, i == 0 ? slowed : NULL);
    r.psd_code = proc_wait(p, 180);
    for (int i = 0; i < workers; i++) r.worker_code[i] = proc_wait(w[i], 30);
    check_run(&r, workers, 1);
    char *log = slurp(r.psd_log);
    cr_assert(log && !strstr(log, "registers again") && !strstr(log, " lost"), "%s", log ? log : "");
    free(log);
    for (int i = 0; i < workers; i++) {
        char name[64], wl[512];
        snprintf(name, sizeof name, "%s-w%d.log", tag, i);
        path(wl, sizeof wl, name);
        char *l = slurp(wl);
        cr_assert(l && !strstr(l, "sent nothing"), "worker %d gave psd up: %s", i, l ? l : "");
        free(l);
    }
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), samples, "%s", last_line(m));
    free(m);
}

/* A worker that waits on psd longer than its step timeout (psd's worker
 * timeout x 3 + 10 s) is not waiting on a psd that is gone: in async
 * without rebalancing, the fast worker waits at its barrier while the slow
 * one trains its half of the epoch (about 15 s here, its step timeout about
 * 11.5 s). psd says it is there every second, and nobody registers again or
 * is lost (the fast worker used to give psd up, register again and count as
 * lost). */
Test(short, a_worker_waits_at_its_barrier_longer_than_its_step_timeout)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=6400", "--set", "train.sync=async",
                          "--set", "train.rebalance=false", "--worker-timeout", "0.5", NULL};
    run_slowed("barrierwait", 2, args, "300", 6400);
}

/* Steps longer than the worker timeout (1.8 s a step, psd's limit about 1 s
 * of silence): the worker says it is alive as its layers compute, and the run
 * goes on (it used to be taken for lost at every step, register again, take
 * its samples back and be lost again: no step ever counted). */
Test(short, steps_longer_than_the_worker_timeout_are_not_a_lost_worker)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=192", "--set", "train.batch_size=64",
                          "--worker-timeout", "1", NULL};
    run_slowed("longstep", 1, args, "1800", 192);
}

/* A peer that registers during training and never says its data is ready
 * is forgotten after the start timeout (its slot is no longer kept as a
 * worker to come), and the run goes on. */
Test(short, a_registration_never_ready_is_forgotten)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--start-timeout", "2", NULL};
    const char *slowed[] = {"--x-slow-ms", "150", NULL};
    pid_t p = start_psd(&r, "neverready", 1, args);
    pid_t w = start_worker(&r, "neverready", 0, slowed);
    wait_log(r.psd_log, "training 1 epoch", 60);
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    cr_assert_eq(raw_register(d, &m), 0);
    cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ASSIGN);
    wait_log(r.psd_log, "never said it was ready; forgetting it", 30);
    r.psd_code = proc_wait(p, 120);
    r.worker_code[0] = proc_wait(w, 30);
    check_run(&r, 1, 1);
    ps_msg_deinit(&m);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

/* Stops and resumes that could not be what they say are refused up front or
 * fail loudly: --stop-after-epoch without checkpoints, --save into a
 * directory that is not there (found at start, not after the training), a
 * checkpoint resumed with another optimizer of the same slot count (even
 * forced), and a stop whose checkpoint fails (exit 1, not "checkpoint
 * saved"). */
Test(short, stops_and_resumes_that_cannot_work_are_refused)
{
    cr_assert_eq(run_cmd("'%s' --stop-after-epoch 1 --set checkpoint.dir= --listen tcp://127.0.0.1:1 > '%s/nock.txt' 2>&1",
                         psd_bin, dir), 2);
    char out[512];
    path(out, sizeof out, "nock.txt");
    char *t = slurp(out);
    cr_assert(t && strstr(t, "--stop-after-epoch needs checkpoints"), "%s", t ? t : "");
    free(t);
    cr_assert_eq(run_cmd("'%s' --save '%s/no/such/dir/w.bin' --listen tcp://127.0.0.1:1 > '%s/nosave.txt' 2>&1", psd_bin,
                         dir, dir), 2);
    path(out, sizeof out, "nosave.txt");
    t = slurp(out);
    cr_assert(t && strstr(t, "cannot write in") && strstr(t, "No such file or directory"), "%s", t ? t : "");
    free(t);
    /* a checkpoint of SGD with momentum (one slot), resumed as Adagrad (one slot) */
    char ck[256], arg[300];
    path(ck, sizeof ck, "optck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *stop[] = {"--epochs", "2", "--set", "data.train_limit=1000", "--set", arg, "--stop-after-epoch", "1",
                          NULL};
    run_t a;
    train(&a, "optstop", 1, stop, 120);
    cr_assert_eq(a.psd_code, 0);
    const char *res[] = {"--epochs", "2", "--set", "data.train_limit=1000", "--set", arg, "--resume", ck,
                         "--force-resume", "--set", "optimizer.name=adagrad", NULL};
    run_t b;
    pid_t p = start_psd(&b, "optres", 1, res);
    cr_assert_eq(proc_wait(p, 60), 2, "another optimizer's state is not resumed");
    t = slurp(b.psd_log);
    cr_assert(t && strstr(t, "its optimizer does not match this config"), "%s", t ? t : "");
    free(t);
    /* --check-config --resume says the same (it checks what a resume checks, but the data) */
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --force-resume --set optimizer.name=adagrad --check-config > /dev/null "
                         "2>&1", psd_bin, ck), 2);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --force-resume --set 'model.layers=[784,32,10]' --check-config > "
                         "/dev/null 2>&1", psd_bin, ck), 2);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --epochs 2 --set data.train_limit=1000 --set '%s' --check-config > "
                         "/dev/null 2>&1", psd_bin, ck, arg), 0, "the same config would resume");
    /* the checkpoint of a stop fails (its directory is gone): exit 1, and the workers are told */
    char ck2[256], arg2[300];
    path(ck2, sizeof ck2, "goneck");
    snprintf(arg2, sizeof arg2, "checkpoint.dir=%s", ck2);
    const char *gone[] = {"--epochs", "2", "--set", "data.train_limit=1000", "--set", arg2, "--stop-after-epoch", "1",
                          NULL};
    const char *slowed[] = {"--x-slow-ms", "100", NULL};
    run_t c;
    p = start_psd(&c, "goneck", 1, gone);
    pid_t w = start_worker(&c, "goneck", 0, slowed);
    wait_log(c.psd_log, "training 2 epochs", 60);
    cr_assert_eq(run_cmd("rm -rf '%s'", ck2), 0);
    c.psd_code = proc_wait(p, 120);
    c.worker_code[0] = proc_wait(w, 30);
    t = slurp(c.psd_log);
    cr_assert_eq(c.psd_code, 1, "exit 1 (got %d): %s", c.psd_code, t ? t : "");
    cr_assert(t && strstr(t, "checkpoint failed") && !strstr(t, "checkpoint saved"), "%s", t ? t : "");
    free(t);
    path(out, sizeof out, "goneck-w0.log");
    t = slurp(out);
    cr_assert(t && strstr(t, "psd ended the run: psd stopped; its checkpoint failed"), "%s", t ? t : "");
    free(t);
    cr_assert_eq(c.worker_code[0], 1, "the worker exits with psd's code");
}

/* The congestion control of the established tcp connections to (sport) and
 * from (dport) port `port`, as `ss` shows them: how many it listed, and how
 * many of them use `cc` (the first word of each one's info line). */
static int conns_using(int port, const char *cc, int *total)
{
    char out[256], cmd[512];
    path(out, sizeof out, "ss.txt");
    snprintf(cmd, sizeof cmd, "ss -Htin state established '( sport = :%d or dport = :%d )' > '%s' 2>&1", port, port,
             out);
    cr_assert_eq(run_cmd("%s", cmd), 0, "ss (iproute2: deploy/setup.sh installs it) failed");
    char *txt = slurp(out);
    cr_assert(txt);
    int n = 0, hits = 0;
    for (char *line = strtok(txt, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] != ' ' && line[0] != '\t') continue; /* the address line; its info follows, indented */
        n++;
        while (*line == ' ' || *line == '\t') line++;
        size_t k = strlen(cc);
        if (strncmp(line, cc, k) == 0 && (line[k] == ' ' || line[k] == '\0')) hits++;
    }
    free(txt);
    *total = n;
    return hits;
}

/* psd and the worker each set server.tcp_congestion on their side of the
 * connection (psd from the worker's messages, the worker from ASSIGN):
 * named (reno), every end uses it; auto: no loopback end is left on bbr
 * (where the kernel's default is bbr, both ends moved off it). Polled
 * while the training runs over tcp; psd is then stopped. */
static void cc_run(const char *tag, const char *setting, const char *want, const char *unwanted)
{
    run_t r;
    char set[64];
    snprintf(set, sizeof set, "server.tcp_congestion=%s", setting);
    const char *extra[] = {"--set", "run.epochs=30", "--set", set, "--set", "checkpoint.dir=", NULL};
    const char *wire[] = {"--no-shm", NULL};
    pid_t p = start_psd(&r, tag, 1, extra);
    int port = atoi(strrchr(r.endpoint, ':') + 1);
    pid_t w = start_worker(&r, tag, 0, wire);
    int total = 0, good = 0;
    for (double t0 = ps_now(); ps_now() - t0 < 60; usleep(100000)) {
        int hits = conns_using(port, want ? want : unwanted, &total);
        good = want ? hits : total - hits;
        if (total >= 2 && good == total) break; /* both ends, as wanted */
    }
    kill(p, SIGTERM);
    int pc = proc_wait(p, 60), wc = proc_wait(w, 30);
    cr_assert_eq(total, 2, "%s: ss shows %d ends of the worker's connection, not 2", tag, total);
    if (want)
        cr_assert_eq(good, total, "%s: %d of the %d ends use %s", tag, good, total, want);
    else
        cr_assert_eq(good, total, "%s: %d of the %d ends are on %s", tag, total - good, total, unwanted);
    cr_assert(pc == 0 || pc == 143 || pc == 130, "%s: psd exited %d", tag, pc);
    cr_assert(wc == 0, "%s: the worker exited %d", tag, wc);
}

Test(short, tcp_connections_use_the_congestion_control_psd_is_given)
{
    cc_run("ccreno", "reno", "reno", NULL);
    cc_run("ccauto", "auto", NULL, "bbr");
    char err[512];
    int rc = run_cmd("%s --listen tcp://127.0.0.1:0 --set server.tcp_congestion=no_such_cc --check-config > %s/cc.txt 2>&1", psd_bin, dir);
    cr_assert_eq(rc, 2, "an unusable congestion control is a configuration error (exit %d)", rc);
    snprintf(err, sizeof err, "%s/cc.txt", dir);
    char *txt = slurp(err);
    cr_assert(txt && strstr(txt, "server.tcp_congestion") && strstr(txt, "no_such_cc"), "%s", txt ? txt : "");
    free(txt);
}
