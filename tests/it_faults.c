/* it_faults.c - integration tests: fault injection: never hang, never lose a run (see itest.h). */
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

/* ---- fault injection (issue: never hang, never lose a run) -------------- */

/* Seconds psd reported between a worker's last message and declaring it
 * lost: for its silence ("nothing from it for 2.1 s") or for its closed
 * connection ("its connection closed, 0.0 s after its last message"); -1
 * if neither. *closed: which. */
static double detection_seconds(const char *psd_log, bool *closed)
{
    static const char *const how[2] = {"nothing from it for ", "its connection closed, "};
    char *log = slurp(psd_log);
    double d = -1;
    for (int k = 0; k < 2 && d < 0; k++) {
        const char *p = log ? strstr(log, how[k]) : NULL;
        if (p) d = strtod(p + strlen(how[k]), NULL), *closed = k == 1;
    }
    free(log);
    return d;
}

/* psd and 3 workers; one of them killed (SIGKILL) in the middle of epoch
 * 2: psd and the others finish the run. */
static void kill_one_mid_epoch(run_t *r, const char *tag, const char **args, int shards, const char **wargs)
{
    fault_seed();
    const char *a0[48];
    int k = 0;
    for (; args[k]; k++) a0[k] = args[k];
    if (shards > 1) a0[k++] = "--shard", a0[k++] = "0/2"; /* and shard 1 */
    a0[k] = NULL;
    pid_t p = start_psd(r, tag, 3, a0), s1 = shards > 1 ? start_shard(r, tag, 1, 2, args) : 0;
    pid_t w[3];
    for (int i = 0; i < 3; i++) w[i] = start_worker(r, tag, i, wargs);
    wait_metrics(r, 1);
    zmq_poll(NULL, 0, rand() % 150); /* mid-epoch 2 */
    int victim = rand() % 3;
    kill(w[victim], SIGKILL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd finished the run with the survivors");
    for (int i = 0; i < 3; i++)
        if (i != victim) cr_assert_eq(proc_wait(w[i], 30), 0, "worker %d", i);
    if (s1) cr_assert_eq(proc_wait(s1, 30), 0, "shard 1 exits 0");
}

Test(short, a_slow_link_is_not_taken_for_a_dead_worker)
{
    /* A 38 MB model over a 100 MB/s link (a process relaying the worker's
     * connection at that rate each way): each reply and each push is on the
     * wire for about 0.4 s, ZeroMQ hands it over only whole, so the worker
     * is silent for longer than --worker-timeout 0.5 at every step. psd
     * allows for a message of the whole model each way (at 40 MB/s, 0.95 s):
     * the worker is never declared lost and the run trains and validates
     * every sample. */
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=640", "--set", "model.layers=[784,12000,10]",
                          "--worker-timeout", "0.5", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "slow", 1, args);
    /* the link accepts at once: a worker that reached it before psd listens
     * would see its handshakes fail and give up */
    wait_log(r.psd_log, "listening on", 120);
    int lport = free_port();
    pid_t link = proc_slow_link(lport, atoi(strrchr(r.endpoint, ':') + 1), 100e6);
    cr_assert(link > 0, "the slow link listens");
    run_t via = r;
    snprintf(via.endpoint, sizeof via.endpoint, "tcp://127.0.0.1:%d", lport);
    const char *wargs[] = {"--no-shm", "--threads", "1", NULL};
    pid_t w = start_worker(&via, "slow", 0, wargs);
    r.psd_code = proc_wait(p, 300);
    r.worker_code[0] = proc_wait(w, 30);
    char *log = slurp(r.psd_log);
    cr_assert(log && strstr(log, "a silent worker is lost after"), "psd says how long it waits");
    cr_assert(!strstr(log, "lost:"), "no worker was declared lost on the slow link:\n%s", log);
    free(log);
    check_run(&r, 1, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 640, "%s", last_line(m));
    free(m);
}

/* The killed worker's connection closes with it: psd declares it lost at
 * once, not after --worker-timeout (60 s here: a psd that waited for it
 * took 63 s for the run). */
Test(short, killed_worker_the_others_finish_every_sample_once)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--worker-timeout", "60",
                          "--set", "checkpoint.dir=", NULL};
    double t0 = ps_now();
    kill_one_mid_epoch(&r, "k9", args, 1, NULL);
    check_every_epoch(&r, 3, 12000);
    bool closed = false;
    double d = detection_seconds(r.psd_log, &closed);
    cr_assert(closed && d >= 0 && d <= 1.0, "declared lost for its closed connection, %.1f s after its last message "
              "(the worker was training)", d);
    cr_assert_lt(ps_now() - t0, 60.0, "the run did not wait worker_timeout for the killed worker");
}

/* The same over the wire: 3 workers, more than psd's server.grad_room of 2,
 * so that they announce their pushes and psd sums them as they come; the
 * victim dies announced, asked for its push, or summed: every sample once,
 * the run never waits for it. */
Test(short, killed_wire_worker_while_pushes_are_summed_as_they_come)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--worker-timeout", "60",
                          "--set", "checkpoint.dir=", NULL};
    const char *wire[] = {"--no-shm", "--x-slow-rank-ms", "4", NULL};
    double t0 = ps_now();
    kill_one_mid_epoch(&r, "kw", args, 1, wire);
    check_every_epoch(&r, 3, 12000);
    cr_assert_lt(ps_now() - t0, 60.0, "the run did not wait worker_timeout for the killed worker");
}

/* A worker that dies before training starts frees its place: psd starts
 * with the two that are alive instead of counting the dead one in and
 * waiting worker_timeout (60 s) for it in the first epoch. */
Test(short, a_worker_that_dies_before_the_start_is_not_waited_for)
{
    run_t r;
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=12000", "--worker-timeout", "60",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "k9wait", 2, args);
    pid_t a = start_worker(&r, "k9wait", 0, NULL);
    wait_log(r.psd_log, "rank 0 exchanges tensors with psd", 60); /* its data checked: ready */
    kill(a, SIGKILL);
    cr_assert_eq(proc_wait(a, 10), 128 + SIGKILL);
    wait_log(r.psd_log, "lost: its connection closed", 10);
    double t0 = ps_now();
    pid_t b = start_worker(&r, "k9wait", 1, NULL), c = start_worker(&r, "k9wait", 2, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd");
    cr_assert_eq(proc_wait(b, 30), 0);
    cr_assert_eq(proc_wait(c, 30), 0);
    cr_assert_lt(ps_now() - t0, 50.0, "the dead worker was not waited for");
    char *log = slurp(r.psd_log);
    cr_assert(log && !strstr(log, "nothing from it"), "%s", log ? log : "");
    free(log);
    check_every_epoch(&r, 2, 12000);
}

/* psd itself held up (SIGSTOP) past its silence limit while it waits for
 * the workers: their messages wait unread in its queue, and the overdue timer
 * runs before they are read. Nobody is lost for that (psd used to take every
 * worker it waited for for lost and go on without them). */
Test(short, a_psd_held_up_past_its_silence_limit_loses_nobody)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=30000", "--worker-timeout", "1", "--set",
                          "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "held", 2, args);
    pid_t w0 = start_worker(&r, "held", 0, NULL), w1 = start_worker(&r, "held", 1, NULL);
    wait_metrics(&r, 1); /* epoch 2 under way: psd waits for the workers' pushes */
    kill(p, SIGSTOP);
    zmq_poll(NULL, 0, 2500); /* the silence limit is about 1 s */
    kill(p, SIGCONT);
    r.psd_code = proc_wait(p, 300);
    r.worker_code[0] = proc_wait(w0, 30);
    r.worker_code[1] = proc_wait(w1, 30);
    check_run(&r, 2, 3);
    char *log = slurp(r.psd_log);
    cr_assert(log && strstr(log, "event loop was held up") && !strstr(log, ") lost: ") && !strstr(log, "registers again"),
              "%s", log ? log : "");
    free(log);
}

/* A worker frozen (SIGSTOP) past psd's silence limit is declared lost, and
 * psd is stopped (SIGINT) before it wakes: psd's SHUTDOWN waits for it on its
 * connection, and once woken it ends at once with psd's code (it used to wait
 * for a psd that was gone for its whole --retry-for, 120 s by default). */
Test(short, a_worker_lost_while_frozen_is_told_that_the_run_ended)
{
    run_t r;
    const char *args[] = {"--epochs", "50", "--set", "data.train_limit=6000", "--worker-timeout", "1", "--set",
                          "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "told", 2, args);
    pid_t w0 = start_worker(&r, "told", 0, NULL), w1 = start_worker(&r, "told", 1, NULL);
    wait_metrics(&r, 1);
    kill(w1, SIGSTOP);
    wait_log(r.psd_log, ") lost: nothing from it", 30); /* before ZeroMQ's heartbeat closes its connection (3 s) */
    kill(p, SIGINT);
    cr_assert_eq(proc_wait(p, 60), 0, "psd stopped");
    double t0 = ps_now();
    kill(w1, SIGCONT);
    int code = proc_wait(w1, 20);
    cr_assert_eq(code, 0, "the woken worker ended with psd's code (exit %d after %.1f s)", code, ps_now() - t0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    char *l = slurp(r.psd_log);
    cr_assert(l && !strstr(l, ") lost: its connection closed"), "%s", l ? l : "");
    free(l);
}

Test(short, frozen_worker_is_dropped_then_rejoins_cleanly)
{
    fault_seed();
    run_t r;
    /* 8 epochs: after the 2-3 s to detect it and 0.5 s frozen, the worker must find the run
     * still going, to rejoin (with 3 the others sometimes finished first; a worker lost and
     * still frozen when the run ends: a_worker_lost_while_frozen_is_told_that_the_run_ended) */
    const char *args[] = {"--epochs", "8", "--set", "data.train_limit=12000", "--worker-timeout", "2", "--set",
                          "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "stop", 2, args);
    pid_t w0 = start_worker(&r, "stop", 0, NULL), w1 = start_worker(&r, "stop", 1, NULL);
    wait_metrics(&r, 1);
    zmq_poll(NULL, 0, rand() % 150);
    kill(w1, SIGSTOP);
    wait_log(r.psd_log, "lost: ", 30);
    zmq_poll(NULL, 0, 500);
    kill(w1, SIGCONT); /* it wakes up, is told it was declared lost, and registers again */
    cr_assert_eq(proc_wait(p, 300), 0, "psd finished the run");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 60), 0, "the frozen worker rejoined or left cleanly");
    check_every_epoch(&r, 8, 12000);
    char *l = slurp(r.psd_log);
    cr_assert(l && strstr(l, "joins from epoch"), "the frozen worker rejoined: %s", l ? l : "");
    free(l);
    bool closed = false;
    double d = detection_seconds(r.psd_log, &closed);
    /* for its silence (worker_timeout 2 s, 0.1 s timer), or, frozen where psd
     * does not wait for it (at the barrier), when ZeroMQ's heartbeat gives up
     * on its connection (3 s plus the model's transfer time) */
    cr_assert(closed ? d >= 3 && d <= 4.5 : d >= 2 && d <= 3.0, "declared lost after %.1f s (%s)", d,
              closed ? "its connection closed" : "silence");
}

/* Wait for a metrics line with "workers":n; returns the number of lines then. */
static int wait_workers_line(const run_t *r, int n, double timeout_s)
{
    char pat[32];
    snprintf(pat, sizeof pat, "\"workers\":%d,", n);
    for (double t = 0; t < timeout_s; t += 0.05) {
        char *m = slurp(r->metrics);
        int lines = m && strstr(m, pat) ? count_lines(m) : 0;
        free(m);
        if (lines) return lines;
        zmq_poll(NULL, 0, 50);
    }
    cr_assert_fail("no epoch with %d workers within %.0f s", n, timeout_s);
    return 0;
}

Test(short, worker_joins_mid_run)
{
    run_t r;
    const char *args[] = {"--epochs", "200", "--set", "data.train_limit=6000", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "join", 2, args);
    pid_t w0 = start_worker(&r, "join", 0, NULL), w1 = start_worker(&r, "join", 1, NULL);
    wait_metrics(&r, 1);
    pid_t w2 = start_worker(&r, "join", 2, NULL);
    wait_workers_line(&r, 3, 120); /* it trained a whole epoch with the others */
    kill(p, SIGINT);
    cr_assert_eq(proc_wait(p, 60), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    cr_assert_eq(proc_wait(w2, 30), 0);
    char *m = metrics_last(&r);
    int epochs = count_lines(m);
    free(m);
    check_every_epoch(&r, epochs, 6000);
}

Test(short, worker_sigterm_is_a_planned_departure)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "term", 2, args);
    pid_t w0 = start_worker(&r, "term", 0, NULL), w1 = start_worker(&r, "term", 1, NULL);
    wait_metrics(&r, 1);
    kill(w1, SIGTERM);
    cr_assert_eq(proc_wait(w1, 30), 0, "a worker stopped by SIGTERM exits 0");
    cr_assert_eq(proc_wait(p, 300), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    check_every_epoch(&r, 3, 12000);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "left the run"), "%s", log);
    cr_assert_null(strstr(log, "lost:"), "not taken for a failure: %s", log);
    free(log);
}

static const char *ckpt_dir_arg(char *buf, size_t n)
{
    char d[256];
    path(d, sizeof d, "ckpt");
    snprintf(buf, n, "checkpoint.dir=%s", d);
    return buf;
}

Test(short, killed_psd_resumes_and_the_same_workers_carry_on)
{
    fault_seed();
    run_t r;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *args[] = {"--epochs", "4", "--set", "data.train_limit=12000", "--set", ck, NULL};
    pid_t p = start_psd(&r, "pk", 2, args);
    const char *wx[] = {"--retry-for", "60", NULL};
    pid_t w0 = start_worker(&r, "pk", 0, wx), w1 = start_worker(&r, "pk", 1, wx);
    wait_metrics(&r, 1);
    /* the epoch's checkpoint is written in the background after its metrics
     * line: kill only once it is there (else there is nothing to resume) */
    wait_log(r.psd_log, ".psdc: ", 60);
    zmq_poll(NULL, 0, rand() % 200);
    kill(p, SIGKILL); /* no goodbye: the workers see the connection drop */
    proc_wait(p, 10);
    /* restart on the same endpoint from the checkpoint */
    const char *rargs[] = {"--epochs", "4", "--set", "data.train_limit=12000", "--set", ck, "--resume", dirbuf, NULL};
    char name[64];
    snprintf(name, sizeof name, "pk2-psd.log");
    char log2[256];
    path(log2, sizeof log2, name);
    char wn[4] = "2";
    const char *argv[40] = {psd_bin, "--listen", r.endpoint, "--workers", wn, "--metrics", r.metrics, "--save",
                            r.weights, "--start-timeout", "60", "--worker-timeout", "5"};
    int n = 13;
    for (int i = 0; rargs[i]; i++) argv[n++] = rargs[i];
    argv[n] = NULL;
    pid_t p2 = proc_spawn(argv, log2);
    int code = proc_wait(p2, 300);
    char *l2 = slurp(log2);
    cr_assert_eq(code, 0, "resumed psd finished: %s", l2);
    cr_assert(strstr(l2, "resuming run"), "%s", l2);
    free(l2);
    cr_assert_eq(proc_wait(w0, 30), 0, "worker 0 carried on without a restart");
    cr_assert_eq(proc_wait(w1, 30), 0, "worker 1 carried on without a restart");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "epoch"), 4, "the run reached its last epoch: %s", m);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 12000, "%s", last_line(m));
    free(m);
}

Test(short, stopped_at_an_epoch_boundary_and_resumed_gives_identical_weights)
{
    run_t a, b;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *plain[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set",
                           "checkpoint.dir=", NULL};
    train(&a, "full", 2, plain, 300);
    check_run(&a, 2, 3);
    const char *first[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck,
                           "--stop-after-epoch", "2", NULL};
    train(&b, "half", 2, first, 300);
    cr_assert_eq(b.psd_code, 0, "stop after epoch 2 exits 0");
    const char *second[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck,
                            "--resume", dirbuf, NULL};
    run_t c;
    train(&c, "rest", 2, second, 300);
    cr_assert_eq(c.psd_code, 0);
    cr_assert(weights_equal(a.weights, c.weights), "resumed run ends with bit-identical weights");
    /* epoch 1's checkpoint (step 24) still being written (a slow disk) when epoch 2 ends at
     * step 48: the epoch's end is written after it, and the stop waits for that one (it used
     * to stop with the one of step 24, and the resume trained epoch 2 again) */
    char ck2[300], dir2[256];
    path(dir2, sizeof dir2, "ckpt2");
    snprintf(ck2, sizeof ck2, "checkpoint.dir=%s", dir2);
    const char *slow[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck2,
                          "--x-slow-ckpt-ms", "5000", "--stop-after-epoch", "2", NULL};
    run_t e, g;
    train(&e, "slowhalf", 2, slow, 300);
    cr_assert_eq(e.psd_code, 0);
    char *l = slurp(e.psd_log);
    const char *stopping = strstr(l, "stopping after epoch 2"), *c24 = strstr(l, "ckpt-000000000024.psdc: ");
    cr_assert(stopping && c24 && stopping < c24 && strstr(l, "ckpt-000000000048.psdc: "),
              "epoch 2 ended while step 24's checkpoint was written, then step 48's was: %s", l);
    free(l);
    const char *rest2[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck2,
                           "--resume", dir2, NULL};
    train(&g, "slowrest", 2, rest2, 300);
    cr_assert_eq(g.psd_code, 0);
    cr_assert(weights_equal(a.weights, g.weights), "resumed from the epoch's end: bit-identical weights");
    /* resumed once more at its end: nothing to train, and the weights file is the same, its
     * header (step, last epoch trained) included */
    run_t d;
    pid_t p = start_psd(&d, "atend1", 2, second);
    cr_assert_eq(proc_wait(p, 60), 0);
    l = slurp(d.psd_log);
    cr_assert(l && strstr(l, "nothing to train"), "%s", l ? l : "");
    free(l);
    cr_assert(weights_equal(a.weights, d.weights), "the weights file of a resume at the end = the run's");
    /* and another config is refused */
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --set optimizer.lr=0.5 --set '%s' --check-config > /dev/null 2>&1",
                         psd_bin, dirbuf, ck), 2);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --set optimizer.lr=0.5 --force-resume --set data.train_limit=3000 "
                         "--seed 11 --check-config > /dev/null 2>&1", psd_bin, dirbuf), 0);
}

/* With the pushes summed as they come (3 workers on the wire, more than
 * server.grad_room's 2): stopped after epoch 1 and resumed, the run ends with
 * the weights of the run in one go, bit for bit. */
Test(short, summed_as_they_come_stopped_and_resumed_gives_identical_weights)
{
    char ck[300], dirbuf[256];
    path(dirbuf, sizeof dirbuf, "ckpt-wire");
    snprintf(ck, sizeof ck, "checkpoint.dir=%s", dirbuf);
    const char *plain[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "12", "--set",
                           "checkpoint.dir=", NULL};
    const char *first[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "12", "--set", ck,
                           "--stop-after-epoch", "1", NULL};
    const char *second[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "12", "--set", ck,
                            "--resume", dirbuf, NULL};
    const char *wire[] = {"--no-shm", NULL};
    run_t a, b, c;
    train_wx(&a, "wfull", 3, plain, wire, 300);
    check_run(&a, 3, 2);
    train_wx(&b, "whalf", 3, first, wire, 300);
    cr_assert_eq(b.psd_code, 0, "stop after epoch 1 exits 0");
    train_wx(&c, "wrest", 3, second, wire, 300);
    cr_assert_eq(c.psd_code, 0);
    char *m = metrics_last(&a);
    cr_assert_gt(json_num(last_line(m), "wire_bytes_in"), 0, "over the wire: %s", last_line(m));
    free(m);
    cr_assert(weights_equal(a.weights, c.weights), "resumed run ends with bit-identical weights");
}

/* Both workers of run <tag> (--verbose) say the table stayed on psd and was
 * never sent whole, and that `also` */
static void assert_table_stayed(const char *tag, const char *also)
{
    for (int i = 0; i < 2; i++) {
        char wlog[512];
        snprintf(wlog, sizeof wlog, "%s/%s-w%d.log", dir, tag, i);
        char *log = slurp(wlog);
        cr_assert(log && strstr(log, also) && strstr(log, "the table stayed on psd") && strstr(log, "whole 0 times"),
                  "worker %d: %s", i, log ? log : "");
        free(log);
    }
}

/* The click-through model trained with SGD (plain, and with momentum), its
 * table's gradient pushed as rows and forced whole (train.sparse_threshold=0):
 * the same weights, bit for bit, and only the rows' bytes on the wire. */
Test(short, sparse_and_dense_table_pushes_give_the_same_weights_with_sgd)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *mom[] = {"optimizer.momentum=0", "optimizer.momentum=0.9"};
    const char *wex[] = {"--no-shm", NULL};
    for (int o = 0; o < 2; o++) {
        const char *args[24] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                                "--set", "checkpoint.dir=", "--set", "optimizer.name=sgd", "--set",
                                "optimizer.lr=0.1", "--set", "optimizer.weight_decay=0", "--set", mom[o]};
        int n = 18;
        run_t a, b;
        char ta[16], tb[16];
        snprintf(ta, sizeof ta, "sgdrows%d", o);
        snprintf(tb, sizeof tb, "sgdwhole%d", o);
        args[n] = NULL;
        train_wx(&a, ta, 2, args, wex, 300);
        args[n] = "--set";
        args[n + 1] = "train.sparse_threshold=0";
        args[n + 2] = NULL;
        train_wx(&b, tb, 2, args, wex, 300);
        cr_assert(a.psd_code == 0 && b.psd_code == 0, "psd exit %d / %d", a.psd_code, b.psd_code);
        cr_assert(weights_equal(a.weights, b.weights), "%s: rows = whole table, bit for bit", mom[o]);
        char *ma = metrics_last(&a), *mb = metrics_last(&b);
        const char *la = last_line(ma), *lb = last_line(mb);
        cr_assert_eq(json_num(la, "table_row_pushes"), 2 * 40, "every push as rows: %s", la);
        cr_assert_eq(json_num(lb, "table_row_pushes"), 0, "%s", lb);
        cr_assert_lt(json_num(la, "wire_bytes_in") * 10, json_num(lb, "wire_bytes_in"), "rows: %s\nwhole: %s", la, lb);
        cr_assert_eq(json_num(la, "val_loss"), json_num(lb, "val_loss"));
        free(ma);
        free(mb);
    }
}

/* The embedding table's gradient goes as the rows a batch touched when
 * they are few (train.sparse_threshold, default 0.3 of the table), and the
 * reply brings only the rows the next batch reads: the weights are bit for
 * bit those of whole-table pushes and pulls (psd steps a table-sized
 * gradient that is zero elsewhere; the worker's batch reads only rows it
 * was sent), and the bytes follow the rows: every push is the MLP's tensors
 * plus 4 + 4 x dim bytes per row and 4 per row wanted, every reply the
 * MLP's plus 4 x dim per row, where the whole table is 4 x rows x dim.
 * Over the wire (on shared memory the table is not sent). */
Test(short, table_rows_and_whole_table_pushes_give_the_same_weights)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *sparse[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                            "--set", "checkpoint.dir=", NULL};
    const char *dense[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", "--set", "train.sparse_threshold=0", NULL};
    const char *wex[] = {"--no-shm", NULL};
    run_t a, b;
    train_wx(&a, "rows", 2, sparse, wex, 300);
    train_wx(&b, "whole", 2, dense, wex, 300);
    cr_assert_eq(a.psd_code, 0);
    cr_assert_eq(b.psd_code, 0);
    cr_assert(weights_equal(a.weights, b.weights), "rows = whole table, bit for bit");
    char *ma = metrics_last(&a), *mb = metrics_last(&b);
    const char *la = last_line(ma), *lb = last_line(mb);
    /* the model: 64 -> 64 -> 2 (4290 floats) and a table of 65536 x 8 */
    const double mlp = 4.0 * 4290, table = 4.0 * 65536 * 8, row = 4 + 4 * 8;
    double pushes = json_num(la, "table_row_pushes"), rows = json_num(la, "table_rows_in");
    cr_assert_eq(pushes, 2 * 40, "every push of the epoch as rows (2 workers x 40 batches): %s", la);
    cr_assert(rows > pushes && rows < 0.3 * 65536 * pushes, "%s", la);
    /* replies: the rows the next batch reads (asked for in the push: 4 bytes a row), but for
     * the epoch's first weights, its last (partial) batch's and the validation's, which bring
     * the whole table */
    double replies = json_num(la, "table_row_replies"), out = json_num(la, "table_rows_out");
    cr_assert_eq(json_num(la, "wire_bytes_in"), pushes * mlp + rows * row + out * 4, "%s", la);
    cr_assert_eq(json_num(lb, "table_row_pushes"), 0, "%s", lb);
    cr_assert_eq(json_num(lb, "wire_bytes_in"), pushes * (mlp + table), "%s", lb);
    cr_assert(replies >= 2 * 37 && out < 0.3 * 65536 * replies, "%s", la);
    double whole = (json_num(la, "wire_bytes_out") - replies * mlp - out * (row - 4)) / (mlp + table);
    cr_assert(whole == floor(whole) && whole >= 2 && whole <= 3 * 2, "%g whole-table sends: %s", whole, la);
    cr_assert_eq(json_num(lb, "table_row_replies"), 0, "%s", lb);
    /* the table on psd (ctr.worker_table_mb=0; workers may use shared memory: psd offers none
     * then): the same bits, and the table never goes whole: every reply brings the rows asked
     * for (the epoch's first and the partial batch's too), each validation part the rows of
     * its range (4 bytes of id more a row) */
    const char *onpsd[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    run_t c;
    const char *verbose[] = {"--verbose", NULL};
    train_wx(&c, "onpsd", 2, onpsd, verbose, 300);
    cr_assert_eq(c.psd_code, 0);
    cr_assert(weights_equal(a.weights, c.weights), "the table on psd = a replica on each worker, bit for bit");
    char *mc = metrics_last(&c);
    const char *lc = last_line(mc);
    double rc = json_num(lc, "table_row_replies"), oc = json_num(lc, "table_rows_out");
    cr_assert_eq(json_num(lc, "table_row_pushes"), 2 * 40, "%s", lc);
    cr_assert_eq(rc, 2 * 39 + 2, "every reply as rows, the epoch's first included: %s", lc);
    double val_ids = json_num(lc, "wire_bytes_out") - (rc + 2) * mlp - oc * (row - 4);
    cr_assert(val_ids > 0 && val_ids < 4 * oc && fmod(val_ids, 4) == 0,
              "two validation parts with their rows, no whole table (%g): %s", val_ids, lc);
    cr_assert_eq(json_num(lc, "val_loss"), json_num(la, "val_loss"), "the same validation: %s", lc);
    cr_assert_eq(json_num(lc, "val_auc"), json_num(la, "val_auc"), "%s", lc);
    assert_table_stayed("onpsd", "the table stayed on psd");
    char *plog = slurp(c.psd_log);
    cr_assert(plog && strstr(plog, "stays on psd") && !strstr(plog, "shared memory for workers"), "%s", plog);
    free(plog);
    /* device workers (the CPU backend posing as one: uploads, downloads), table replicas and the
     * table on psd: the same bits, every push as rows */
    const char *dev_wire[] = {"--x-device-sim", "--no-shm", NULL}, *dev[] = {"--x-device-sim", "--verbose", NULL};
    run_t e;
    train_wx(&e, "rows-dev", 2, sparse, dev_wire, 300);
    cr_assert_eq(e.psd_code, 0);
    cr_assert(weights_equal(a.weights, e.weights), "device workers' rows = the CPU's, bit for bit");
    char *me = metrics_last(&e);
    cr_assert_eq(json_num(last_line(me), "table_row_pushes"), 2 * 40, "%s", last_line(me));
    cr_assert_eq(json_num(last_line(me), "val_loss"), json_num(la, "val_loss"), "%s", last_line(me));
    free(me);
    /* and its replica crosses the bus by the rows of a step, not whole: up, the rows the batch
     * reads (ids and values), the MLP and the batch (the whole table only for the 2 validations);
     * down, the MLP's gradient and the touched rows' (at most 256 x 8 rows of 32 bytes a step) */
    double up, down, steps;
    char *dl = rank0_log("rows-dev", 2);
    const char *dc = dl ? strstr(dl, "device copies: ") : NULL;
    cr_assert(dc && sscanf(dc, "device copies: %lf bytes up, %lf bytes down; %lf training steps", &up, &down, &steps) == 3,
              "%s", dl ? dl : "no log");
    cr_assert(steps == 80 && down > 0 && down < steps * (mlp + 2048 * 32), "down %g in %g steps", down, steps);
    cr_assert(up > 2 * table && up < 2 * table + steps * (mlp + 4 * 256 + 8 * 256 * 4 + 2048 * 36),
              "up %g in %g steps (a whole table is %g)", up, steps, table);
    free(dl);
    /* on psd's host (shared memory: the whole table in psd's slot, gradients pushed whole): the
     * same bits, and still only the batch's rows go up */
    train_wx(&e, "rows-dev-shm", 2, sparse, dev, 300);
    cr_assert_eq(e.psd_code, 0);
    cr_assert(weights_equal(a.weights, e.weights), "device workers through shared memory, bit for bit");
    dl = rank0_log("rows-dev-shm", 2);
    dc = dl ? strstr(dl, "device copies: ") : NULL;
    cr_assert(dc && sscanf(dc, "device copies: %lf bytes up, %lf bytes down; %lf training steps", &up, &down, &steps) == 3,
              "%s", dl ? dl : "no log");
    cr_assert(steps == 80 && up < 2 * table + steps * (mlp + 4 * 256 + 8 * 256 * 4 + 2048 * 36),
              "up %g in %g steps (a whole table is %g)", up, steps, table);
    cr_assert(strstr(dl, "pushed as rows 0 times, whole 80 times"), "%s", dl);
    free(dl);
    dl = slurp(e.psd_log);
    cr_assert(dl && strstr(dl, "rank 0 exchanges tensors with psd through shared memory"), "%s", dl ? dl : "");
    free(dl);
    train_wx(&e, "onpsd-dev", 2, onpsd, dev, 300);
    cr_assert_eq(e.psd_code, 0);
    cr_assert(weights_equal(c.weights, e.weights), "device workers with the table on psd, bit for bit");
    me = metrics_last(&e);
    cr_assert_eq(json_num(last_line(me), "val_loss"), json_num(lc, "val_loss"), "%s", last_line(me));
    cr_assert_eq(json_num(last_line(me), "val_auc"), json_num(lc, "val_auc"), "%s", last_line(me));
    cr_assert_eq(json_num(last_line(me), "table_row_replies"), rc, "%s", last_line(me));
    free(me);
    assert_table_stayed("onpsd-dev", "backend cpu-as-device");
    /* asked for streamed steps, psd steps whole so that the table still goes by rows */
    const char *streamed[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                              "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", "--set",
                              "train.stream=true", NULL};
    run_t d;
    train_wx(&d, "onpsd-st", 2, streamed, NULL, 300);
    cr_assert_eq(d.psd_code, 0);
    cr_assert(weights_equal(c.weights, d.weights), "train.stream changes nothing with a table");
    char *md = metrics_last(&d);
    cr_assert_eq(json_num(last_line(md), "table_row_replies"), rc, "%s", last_line(md));
    free(md);
    plog = slurp(d.psd_log);
    cr_assert(plog && strstr(plog, "steps are whole (not streamed)") && strstr(plog, "stays on psd") &&
                  !strstr(plog, "streamed steps:"),
              "%s", plog);
    free(plog);
    free(mc);
    free(ma);
    free(mb);
}

/* The table on psd (ctr.worker_table_mb=0) with 2 psd shards: each shard
 * keeps its piece of the table, and workers hold only the rows of their
 * batch, put together from every shard's: the same bits, the same
 * validation as one psd; shard 1 (the table's rows 32768.. and nothing
 * else) sends only rows, each asked for; shard 0 sends the MLP and rows of
 * its piece, and the ids of a validation part's rows with its part. Device
 * workers (the CPU backend posing as one) give the same bits. */
Test(short, the_table_on_psd_with_psd_shards)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *args[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    const char *wex[] = {"--no-shm", "--verbose", NULL};
    run_t a, b;
    train_ok(&a, "onpsd1", 1, args, wex);
    train_ok(&b, "onpsd2", 2, args, wex);
    cr_assert(weights_equal(a.weights, b.weights), "the table on 2 psd shards = on 1 psd, bit for bit");
    assert_table_stayed("onpsd2", "the table stayed on psd");
    /* device workers (the CPU backend posing as one: uploads, downloads): the same bits */
    const char *dev[] = {"--x-device-sim", "--no-shm", "--verbose", NULL};
    run_t d;
    train_ok(&d, "onpsd2-dev", 2, args, dev);
    cr_assert(weights_equal(a.weights, d.weights), "device workers, the table on 2 psd shards, bit for bit");
    assert_table_stayed("onpsd2-dev", "backend cpu-as-device");
    char *ma = metrics_last(&a), *mb = metrics_last(&b);
    const char *la = last_line(ma), *lb = last_line(mb);
    cr_assert_eq(json_num(lb, "val_loss"), json_num(la, "val_loss"), "the same validation: %s", lb);
    cr_assert_eq(json_num(lb, "val_auc"), json_num(la, "val_auc"), "%s", lb);
    cr_assert_eq(json_num(lb, "val_samples"), 2000, "%s", lb);
    /* shard 0: every reply as rows (of its piece), the validation parts with their rows' ids */
    const double mlp = 4.0 * 4290, row = 4 + 4 * 8;
    double rc = json_num(lb, "table_row_replies"), oc = json_num(lb, "table_rows_out");
    cr_assert_eq(rc, json_num(la, "table_row_replies"), "every reply as rows: %s", lb);
    cr_assert(oc > 0 && oc < json_num(la, "table_rows_out"), "shard 0 sends the rows of its piece only: %s", lb);
    double val_ids = json_num(lb, "wire_bytes_out") - (rc + 2) * mlp - oc * (row - 4);
    cr_assert(val_ids > 0 && val_ids < 4 * 2000 * 8 && fmod(val_ids, 4) == 0,
              "two validation parts with their rows' ids, no whole table (%g): %s", val_ids, lb);
    /* shard 1: rows only, those asked for */
    char lp[256];
    path(lp, sizeof lp, "onpsd2-shard1.log");
    char *l1 = slurp(lp);
    const char *p = l1 ? strstr(l1, "shard 1 received: ") : NULL;
    double got[5];
    cr_assert(p && sscanf(p, "shard 1 received: %lf gradient bytes, %lf pushes of table rows (%lf rows); sent %lf rows "
                             "in replies, %lf weights bytes",
                          &got[0], &got[1], &got[2], &got[3], &got[4]) == 5,
              "%s", l1 ? l1 : "no log");
    cr_assert(got[3] > 0 && got[4] == got[3] * (row - 4), "shard 1 sent %g rows in %g bytes: nothing else", got[3],
              got[4]);
    cr_assert_eq(got[1], 2 * 2 * 40, "shard 1: every push as rows");
    free(l1);
    free(ma);
    free(mb);
}

/* The table on psd with a worker killed mid-epoch: the others take its
 * samples (the batches they had asked rows for may grow: they ask again),
 * every epoch trains each example once and validates every test example;
 * with one psd and with 2 psd shards. */
Test(short, killed_worker_with_the_table_on_psd)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *args[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=60000", "--set", "ctr.test=3000",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", "--worker-timeout", "2",
                          "--set", "train.batch_size=100", NULL};
    for (int shards = 1; shards <= 2; shards++) { /* one psd, and 2 psd shards */
        run_t r;
        kill_one_mid_epoch(&r, shards > 1 ? "k9psd2" : "k9psd", args, shards, NULL);
        char *m = metrics_last(&r);
        cr_assert_eq(count_lines(m), 3, "%s", m);
        for (char *line = m; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = '\0';
            cr_assert_eq(json_num(line, "train_samples"), 60000, "%d shards: %s", shards, line);
            cr_assert_eq(json_num(line, "val_samples"), 3000, "%s", line);
            double opt = json_num(line, "optimum_loss"), cst = json_num(line, "constant_loss");
            cr_assert_lt(json_num(line, "val_loss") - opt, 0.8 * (cst - opt), "trained: %s", line);
            line = nl ? nl + 1 : NULL;
        }
        free(m);
    }
}

/* Table rows both ways in async and ssp (each push stepped on its own and
 * answered at once, or held back): the run trains as in bsp. */
Test(short, table_rows_in_async_and_ssp)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *modes[] = {"train.sync=async", "train.sync=ssp"};
    const char *wex[] = {"--no-shm", NULL};
    for (int k = 0; k < 2; k++) {
        const char *args[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=40000", "--set", "ctr.test=4000",
                              "--set", "checkpoint.dir=", "--set", modes[k], NULL};
        run_t r;
        train_wx(&r, k ? "rowsssp" : "rowsasync", 2, args, wex, 300);
        cr_assert_eq(r.psd_code, 0, "%s", modes[k]);
        char *m = metrics_last(&r);
        const char *l = last_line(m);
        cr_assert_gt(json_num(l, "table_row_pushes"), 100, "%s: %s", modes[k], l);
        cr_assert_gt(json_num(l, "table_row_replies"), 100, "%s: %s", modes[k], l);
        double opt = json_num(l, "optimum_loss"), cst = json_num(l, "constant_loss");
        cr_assert_lt(json_num(l, "val_loss") - opt, 0.6 * (cst - opt), "%s: %s", modes[k], l);
        free(m);
    }
}

/* The ctr model's embedding table is checkpointed and restored with the
 * rest (checkpoint format 2 carries its shape): stopped after epoch 2 and
 * resumed, the run ends with the weights of one that never stopped. */
Test(short, ctr_stopped_and_resumed_gives_identical_weights)
{
    char cfg[1024], ck[300], dirbuf[256];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *plain[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", NULL};
    const char *first[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", ck, "--stop-after-epoch", "2", NULL};
    const char *second[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                            "--set", ck, "--resume", dirbuf, NULL};
    run_t a, b, c;
    train(&a, "ctrfull", 2, plain, 300);
    cr_assert_eq(a.psd_code, 0);
    train(&b, "ctrhalf", 2, first, 300);
    cr_assert_eq(b.psd_code, 0, "stop after epoch 2 exits 0");
    train(&c, "ctrrest", 2, second, 300);
    cr_assert_eq(c.psd_code, 0);
    char *log = slurp(c.psd_log);
    cr_assert(strstr(log, "resum"), "%s", log);
    free(log);
    cr_assert(weights_equal(a.weights, c.weights), "resumed ctr run ends with bit-identical weights, table included");
}

Test(short, corrupt_newest_checkpoint_falls_back_to_the_previous)
{
    run_t r;
    char ck[300], dirbuf[256], out[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    path(out, sizeof out, "resume.txt");
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=2000", "--set", ck, NULL};
    train(&r, "cc", 1, args, 300);
    check_run(&r, 1, 3);
    const char *cfg = "--set data.train_limit=2000 --epochs 3";
    /* the files, oldest first (which steps they hold depends on when each write could start:
     * one that waits for the previous write lands inside the next epoch) */
    char list[256];
    path(list, sizeof list, "ckpts.txt");
    cr_assert_eq(run_cmd("ls '%s'/run-*/ckpt-*.psdc > '%s'", dirbuf, list), 0);
    char *files = slurp(list), *name[3] = {NULL, NULL, NULL};
    int n_files = 0;
    for (char *line = strtok(files, "\n"); line; line = strtok(NULL, "\n")) {
        memmove(name, name + 1, sizeof name - sizeof name[0]); /* the newest 3: name[2] the newest */
        name[2] = line;
        n_files++;
    }
    cr_assert_geq(n_files, 3, "checkpoint.keep 3: three files after 3 epochs");
    /* flip a byte in the middle of the newest */
    cr_assert_eq(run_cmd("f=$(ls '%s'/run-*/ckpt-*.psdc | tail -1); printf '\\x55' | dd of=\"$f\" bs=1 seek=5000 "
                         "conv=notrunc status=none", dirbuf), 0);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 %s --resume '%s' --check-config > '%s' 2>&1", psd_bin, cfg, dirbuf, out), 0);
    char *t = slurp(out);
    cr_assert(strstr(t, "checksum") || strstr(t, "CRC") || strstr(t, "corrupt"), "says why: %s", t);
    cr_assert(strstr(t, name[1]), "uses the previous one (%s): %s", name[1], t);
    free(t);
    /* truncate the next one too */
    cr_assert_eq(run_cmd("f=$(ls '%s'/run-*/ckpt-*.psdc | tail -2 | head -1); truncate -s 1000 \"$f\"", dirbuf), 0);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 %s --resume '%s' --check-config > '%s' 2>&1", psd_bin, cfg, dirbuf, out), 0);
    t = slurp(out);
    cr_assert(strstr(t, name[0]), "falls back twice (%s): %s", name[0], t);
    free(t);
    free(files);
}

Test(short, sigint_on_psd_checkpoints_and_stops_the_workers)
{
    run_t r;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *args[] = {"--epochs", "50", "--set", "data.train_limit=12000", "--set", ck, NULL};
    pid_t p = start_psd(&r, "int", 2, args);
    pid_t w0 = start_worker(&r, "int", 0, NULL), w1 = start_worker(&r, "int", 1, NULL);
    wait_metrics(&r, 1);
    kill(p, SIGINT);
    cr_assert_eq(proc_wait(p, 60), 0, "psd exits 0 after SIGINT");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "checkpoint "), "%s", log);
    free(log);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --epochs 50 --set data.train_limit=12000 --resume '%s' --check-config > /dev/null",
                         psd_bin, dirbuf), 0, "the checkpoint loads");
}

Test(long, psd_killed_while_writing_checkpoints_always_resumes)
{
    /* checkpoints of a 2.9M-parameter Adam model every step: psd spends most
     * of its time writing; kill -9 it at 20 random moments, each time the
     * newest complete checkpoint must load */
    fault_seed();
    char ck[300], dirbuf[256], out[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    path(out, sizeof out, "check.txt");
    const char *args[] = {"--epochs", "1000", "--set", "data.train_limit=6400", "--set", ck, "--set",
                          "model.layers=784,2048,640,10", "--set", "optimizer.name=adam", "--set",
                          "optimizer.lr=0.001", "--set", "checkpoint.every_steps=1", "--set",
                          "checkpoint.keep=2", NULL};
    int loaded = 0;
    for (int round = 0; round < 20; round++) {
        run_t r;
        char tag[16];
        snprintf(tag, sizeof tag, "kc%d", round);
        const char *a2[40];
        int n = 0;
        for (int i = 0; args[i]; i++) a2[n++] = args[i];
        if (round > 0) {
            a2[n++] = "--resume";
            a2[n++] = dirbuf;
        }
        a2[n] = NULL;
        pid_t p = start_psd(&r, tag, 1, a2);
        const char *wx[] = {"--retry-for", "0", NULL};
        pid_t w = start_worker(&r, tag, 0, wx);
        char psdlog[256];
        snprintf(psdlog, sizeof psdlog, "%s", r.psd_log);
        if (round == 0) wait_log(psdlog, "checkpoint ", 60); /* one complete checkpoint first */
        else wait_log(psdlog, "resuming run", 60);
        zmq_poll(NULL, 0, 50 + rand() % 400);
        kill(p, SIGKILL);
        proc_wait(p, 10);
        kill(w, SIGKILL);
        proc_wait(w, 10);
        int rc = run_cmd("'%s' --listen tcp://127.0.0.1:0 --set data.train_limit=6400 --epochs 1000 --set model.layers=784,2048,640,10 "
                         "--set optimizer.name=adam --set optimizer.lr=0.001 --resume '%s' --check-config > '%s' 2>&1",
                         psd_bin, dirbuf, out);
        char *t = slurp(out);
        cr_assert_eq(rc, 0, "round %d: the newest complete checkpoint loads: %s", round, t);
        free(t);
        loaded++;
    }
    cr_assert_eq(loaded, 20);
}

Test(short, a_worker_of_another_run_is_refused)
{
    run_t r;
    const char *args[] = {"--epochs", "200", "--set", "data.train_limit=3000", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "ar", 1, args);
    const char *wx[] = {"--retry-for", "60", NULL};
    pid_t w = start_worker(&r, "ar", 0, wx);
    wait_metrics(&r, 1);
    kill(p, SIGKILL);
    proc_wait(p, 10);
    /* a new run (not a resume) on the same endpoint: the worker belongs to the old one */
    char log2[256];
    path(log2, sizeof log2, "ar2-psd.log");
    const char *argv[] = {psd_bin, "--listen", r.endpoint, "--workers", "1", "--set", "checkpoint.dir=",
                          "--metrics", "", "--start-timeout", "60", NULL};
    pid_t p2 = proc_spawn(argv, log2);
    cr_assert_eq(proc_wait(w, 60), 2, "the old run's worker is refused and exits 2");
    char wlog[256];
    path(wlog, sizeof wlog, "ar-w0.log");
    char *t = slurp(wlog);
    cr_assert(strstr(t, "belongs to run"), "a clear message: %s", t);
    free(t);
    wait_log(log2, "the worker belongs to run", 10);
    kill(p2, SIGUSR1); /* and SIGUSR1 on an idle psd is harmless */
    kill(p2, SIGTERM);
    cr_assert_eq(proc_wait(p2, 30), 0);
}

Test(short, sigusr1_writes_a_checkpoint_and_training_goes_on)
{
    run_t r;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--set", ck, "--set",
                          "checkpoint.every_epochs=0", NULL};
    pid_t p = start_psd(&r, "usr1", 1, args);
    pid_t w = start_worker(&r, "usr1", 0, NULL);
    wait_metrics(&r, 1);
    kill(p, SIGUSR1);
    wait_log(r.psd_log, "checkpoint ", 30);
    cr_assert_eq(proc_wait(p, 300), 0, "training went on to the end");
    cr_assert_eq(proc_wait(w, 30), 0);
    check_every_epoch(&r, 3, 12000);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --epochs 3 --set data.train_limit=12000 --resume '%s' --check-config > /dev/null",
                         psd_bin, dirbuf), 0);
}

Test(short, a_second_sigint_exits_at_once)
{
    /* a 74M-parameter Adam model (a checkpoint of 0.9 GB: one of 240 MB was
     * written within the wait below on CI's VM): the first SIGINT's
     * checkpoint takes a while, the second one must not wait for it */
    run_t r;
    char ck[300];
    ckpt_dir_arg(ck, sizeof ck);
    const char *args[] = {"--epochs", "5", "--set", "data.train_limit=640", "--set", ck, "--set",
                          "model.layers=784,8192,8192,10", "--set", "optimizer.name=adam", "--set",
                          "checkpoint.every_epochs=0", NULL};
    pid_t p = start_psd(&r, "int2", 1, args);
    pid_t w = start_worker(&r, "int2", 0, NULL);
    wait_log(r.psd_log, "1 workers ready", 60);
    zmq_poll(NULL, 0, 300);
    kill(p, SIGINT);
    /* two signals sent close together can reach psd as one (standard signals
     * do not queue), or as an echo of one (the same within PS_SIGNAL_ECHO_S,
     * as timeout(1) sends it): the second goes once psd has taken the first,
     * and 0.12 s after it (PS_SIGNAL_ECHO_S is 0.1 s: the 240 MB checkpoint may take as
     * little as 0.2 s where the page cache is fast; this one 0.9 GB) */
    wait_log(r.psd_log, "writing a checkpoint", 30);
    zmq_poll(NULL, 0, 120);
    kill(p, SIGINT);
    int code = proc_wait(p, 30);
    cr_assert_eq(code, 128 + SIGINT, "the second SIGINT exits at once, during the 0.9 GB checkpoint (%d)", code);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "again: exiting now"), "%s", log);
    free(log);
    /* and the workers were told: they do not wait for psd to come back */
    proc_wait(w, 30);
    char wlog[256];
    path(wlog, sizeof wlog, "int2-w0.log");
    char *wl = slurp(wlog);
    cr_assert(wl && strstr(wl, "psd ended the run"), "the worker heard of the stop: %s", wl ? wl : "");
    free(wl);
}
