/* it_outputs.c - integration tests: a run's files are its own and nothing
 * of them is lost without a word (README "Faults"): a second psd on a live
 * run's checkpoint directory, on its metrics and weights files or on its
 * ipc:// socket is refused; a kill -9 leaves no lock behind; a metrics file
 * that cannot be written gives exit 6; a resume leaves each epoch in the
 * metrics file once. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"

#define OUT_ARGS "--epochs", "2", "--set", "data.train_limit=2000", "--seed", "5"

/* The run's checkpoint directory (dir/ckpt) as a --set argument. */
static void ckpt_set(char *arg, size_t n, char *ckdir, size_t m)
{
    path(ckdir, m, "ckpt");
    snprintf(arg, n, "checkpoint.dir=%s", ckdir);
}

/* psd started with exactly these args (NULL-terminated) in dir, its log <tag>-psd.log. */
static pid_t start_psd_raw(const char *tag, const char **args)
{
    char name[64], log[256];
    snprintf(name, sizeof name, "%s-psd.log", tag);
    path(log, sizeof log, name);
    const char *argv[40] = {psd_bin};
    int n = 1;
    for (int i = 0; args[i]; i++) argv[n++] = args[i];
    argv[n] = NULL;
    return proc_spawn(argv, log);
}

/* The second psd exited 2 and said which file another psd holds, and whose. */
static void assert_refused(int code, const char *tag, const char *file, pid_t holder)
{
    char name[64], logp[256], pid[32];
    snprintf(name, sizeof name, "%s-psd.log", tag);
    path(logp, sizeof logp, name);
    char *log = slurp(logp);
    snprintf(pid, sizeof pid, "psd pid %ld on host ", (long)holder);
    cr_assert_eq(code, 2, "the second psd exits 2: %s", log ? log : "");
    cr_assert(log && strstr(log, file) && strstr(log, pid) && strstr(log, "is held by"),
              "it names %s and its holder (%s): %s", file, pid, log ? log : "");
    free(log);
}

/* The epochs (1-based) of the lines of a metrics file, in order; how many. */
static int metrics_epochs(const char *file, int *ep, int max, double *resumed_from)
{
    char *m = slurp(file);
    cr_assert_not_null(m, "%s", file);
    int n = 0;
    for (char *line = m; *line && n < max;) {
        char *nl = strchr(line, '\n');
        cr_assert_not_null(nl, "every line of %s is whole: %s", file, line);
        *nl = '\0';
        cr_assert_eq(json_num(line, "schema"), IT_METRICS_SCHEMA, "%s", line);
        ep[n] = (int)json_num(line, "epoch");
        resumed_from[n++] = json_num(line, "resumed_from_step");
        line = nl + 1;
    }
    free(m);
    return n;
}

/* A run stopped after epoch 1 and resumed by psd A, which waits for its
 * workers: psd B resuming the same directory is refused and A then trains
 * to the end with its files intact. A kill -9 of a psd holding the
 * directory leaves nothing that stops the next --resume. */
Test(short, a_second_psd_on_a_live_runs_checkpoint_directory_is_refused)
{
    char ck[300], ckdir[256];
    ckpt_set(ck, sizeof ck, ckdir, sizeof ckdir);
    const char *first[] = {OUT_ARGS, "--set", ck, "--stop-after-epoch", "1", NULL};
    run_t h;
    train(&h, "half", 2, first, 300);
    cr_assert_eq(h.psd_code, 0);

    /* a psd holding the directory killed with -9: nothing stops the next --resume */
    const char *resume[] = {OUT_ARGS, "--set", ck, "--resume", ckdir, NULL};
    run_t k;
    pid_t pk = start_psd(&k, "killed", 2, resume);
    wait_log(k.psd_log, "waiting for 2 workers", 60);
    kill(pk, SIGKILL);
    cr_assert_eq(proc_wait(pk, 30), 128 + SIGKILL);

    /* A: resumed, waiting for its workers (it holds the run's directory: the lock the
     * killed psd held is free) */
    run_t a;
    pid_t pa = start_psd(&a, "a", 2, resume);
    wait_log(a.psd_log, "waiting for 2 workers", 60);
    /* B: the same directory, its own metrics and weights files and port */
    run_t b;
    pid_t pb = start_psd(&b, "b", 2, resume);
    assert_refused(proc_wait(pb, 60), "b", "psd.lock", pa);
    struct stat st;
    cr_assert_neq(stat(b.metrics, &st), 0, "the refused psd wrote no metrics file");
    cr_assert_neq(stat(b.weights, &st), 0, "nor weights");

    pid_t w[2];
    for (int i = 0; i < 2; i++) w[i] = start_worker(&a, "a", i, NULL);
    a.psd_code = proc_wait(pa, 300);
    for (int i = 0; i < 2; i++) a.worker_code[i] = proc_wait(w[i], 30);
    cr_assert_eq(a.psd_code, 0, "the first psd trains to the end");
    for (int i = 0; i < 2; i++) cr_assert_eq(a.worker_code[i], 0);
    char *m = metrics_last(&a);
    cr_assert(count_lines(m) == 1 && json_num(m, "epoch") == 2 && json_num(m, "val_samples") == 10000,
              "epoch 2's line, whole (epoch 1 was trained before the stop): %s", m);
    free(m);
    cr_assert_eq(stat(a.weights, &st), 0, "its weights are saved");
}

/* Two psd's started in one directory with the default file names
 * (psd-metrics.jsonl, psd-weights.bin): the second is refused, the first
 * trains to the end. And two on one ipc:// path: the second is refused
 * instead of taking the socket over. */
Test(short, a_second_psd_on_the_same_default_files_or_ipc_path_is_refused)
{
    char ep1[64], ep2[64], sock[256], ipc[300];
    snprintf(ep1, sizeof ep1, "tcp://127.0.0.1:%d", free_port());
    snprintf(ep2, sizeof ep2, "tcp://127.0.0.1:%d", free_port());
    const char *a_args[] = {"--listen", ep1, "--workers", "1", OUT_ARGS, "--set", "checkpoint.dir=", NULL};
    pid_t pa = start_psd_raw("da", a_args);
    char alog[256];
    path(alog, sizeof alog, "da-psd.log");
    wait_log(alog, "waiting for 1 workers", 60);
    const char *b_args[] = {"--listen", ep2, "--workers", "1", OUT_ARGS, "--set", "checkpoint.dir=", NULL};
    assert_refused(proc_wait(start_psd_raw("db", b_args), 60), "db", "psd-weights.bin.lock", pa);
    run_t a = {0};
    snprintf(a.endpoint, sizeof a.endpoint, "%s", ep1);
    pid_t w = start_worker(&a, "da", 0, NULL);
    cr_assert_eq(proc_wait(pa, 300), 0, "the first psd trains to the end");
    cr_assert_eq(proc_wait(w, 30), 0);
    char mfile[256];
    path(mfile, sizeof mfile, "psd-metrics.jsonl");
    int ep[8];
    double from[8];
    cr_assert_eq(metrics_epochs(mfile, ep, 8, from), 2, "two epochs, of the first psd only");

    path(sock, sizeof sock, "psd.sock");
    snprintf(ipc, sizeof ipc, "ipc://%s", sock);
    const char *c_args[] = {"--listen", ipc, "--workers", "1", OUT_ARGS, "--set", "checkpoint.dir=",
                            "--metrics", "c.jsonl", "--save", "c.bin", NULL};
    pid_t pc = start_psd_raw("ic", c_args);
    char clog[256];
    path(clog, sizeof clog, "ic-psd.log");
    wait_log(clog, "waiting for 1 workers", 60);
    const char *d_args[] = {"--listen", ipc, "--workers", "1", OUT_ARGS, "--set", "checkpoint.dir=",
                            "--metrics", "d.jsonl", "--save", "d.bin", NULL};
    assert_refused(proc_wait(start_psd_raw("id", d_args), 60), "id", "psd.sock.lock", pc);
    run_t c = {0};
    snprintf(c.endpoint, sizeof c.endpoint, "%s", ipc);
    w = start_worker(&c, "ic", 0, NULL);
    cr_assert_eq(proc_wait(pc, 300), 0, "the first psd keeps its socket and trains to the end");
    cr_assert_eq(proc_wait(w, 30), 0);
}

/* The metrics file on a full file system (/dev/full, through a link):
 * psd trains to the end, says the file is incomplete and exits 6; its
 * worker exits 0 (its work was done) and the weights are saved. */
Test(short, a_metrics_file_that_cannot_be_written_gives_exit_6)
{
    run_t r;
    char link[256];
    path(link, sizeof link, "full-metrics.jsonl");
    cr_assert_eq(symlink("/dev/full", link), 0);
    train(&r, "full", 1, slice, 300);
    char *log = slurp(r.psd_log);
    cr_assert_eq(r.psd_code, 6, "psd exits 6: %s", log ? log : "");
    cr_assert_eq(r.worker_code[0], 0, "the worker exits 0");
    cr_assert(strstr(log, "metrics file") && strstr(log, "No space left on device") && strstr(log, "INCOMPLETE") &&
                  strstr(log, "exit 6"),
              "the log says what was lost and why: %s", log);
    free(log);
    struct stat st;
    cr_assert_eq(stat(r.weights, &st), 0, "the weights are saved");
}

/* Killed (kill -9) right after epoch 2's metrics line, before its
 * checkpoint: the resume from epoch 1's checkpoint trains epoch 2 again,
 * and the metrics file holds each epoch once, the resumed lines saying
 * which step they continue from. */
Test(short, a_resume_leaves_each_epoch_in_the_metrics_file_once)
{
    char ck[300], ckdir[256];
    ckpt_set(ck, sizeof ck, ckdir, sizeof ckdir);
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=2000", "--seed", "5", "--set", ck,
                          "--x-die-after-metrics", "2", NULL};
    run_t a;
    pid_t p = start_psd(&a, "die", 2, args);
    pid_t w[2];
    for (int i = 0; i < 2; i++) w[i] = start_worker(&a, "die", i, NULL);
    cr_assert_eq(proc_wait(p, 300), 128 + SIGKILL, "psd killed itself after epoch 2's line");
    for (int i = 0; i < 2; i++) {
        kill(w[i], SIGKILL);
        proc_wait(w[i], 30);
    }
    int ep[8];
    double from[8];
    cr_assert_eq(metrics_epochs(a.metrics, ep, 8, from), 2, "epochs 1 and 2 logged before the kill");
    char *m = slurp(a.metrics);
    double step1 = json_num(m, "step");
    free(m);

    /* resumed with the same metrics file (start_psd names it after the tag) */
    const char *rest[] = {"--epochs", "3", "--set", "data.train_limit=2000", "--seed", "5", "--set", ck,
                          "--resume", ckdir, NULL};
    run_t b;
    pid_t pb = start_psd(&b, "die", 2, rest);
    for (int i = 0; i < 2; i++) w[i] = start_worker(&b, "die", i, NULL);
    b.psd_code = proc_wait(pb, 300);
    for (int i = 0; i < 2; i++) b.worker_code[i] = proc_wait(w[i], 30);
    cr_assert_eq(b.psd_code, 0);
    int n = metrics_epochs(b.metrics, ep, 8, from);
    cr_assert_eq(n, 3, "three lines, one an epoch");
    for (int i = 0; i < 3; i++) cr_assert_eq(ep[i], i + 1, "line %d is epoch %d, not %d", i + 1, i + 1, ep[i]);
    cr_assert(isnan(from[0]), "epoch 1's line is the first run's");
    cr_assert_eq(from[1], step1, "epochs 2 and 3 continue from epoch 1's checkpoint (step %g)", step1);
    cr_assert_eq(from[2], step1);
    char *log = slurp(b.psd_log);
    cr_assert(log && strstr(log, "dropped the lines of epochs 2..2"), "%s", log ? log : "");
    free(log);
}
