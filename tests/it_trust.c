/* it_trust.c - integration tests: what psd takes from the files it finds
 * and what it leaves behind (see itest.h): a checkpoint of another run put
 * in a run's directory, a start that is refused. */
#include <criterion/criterion.h>
#include <glob.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"

/* The one run directory (run-<id>) in checkpoint directory ck into out;
 * its run id. */
static uint64_t run_dir_of(const char *ck, char *out, size_t n)
{
    char pat[300];
    snprintf(pat, sizeof pat, "%s/run-*", ck);
    glob_t g;
    cr_assert_eq(glob(pat, 0, NULL, &g), 0, "a run directory in %s", ck);
    cr_assert_eq(g.gl_pathc, 1, "one run directory in %s", ck);
    snprintf(out, n, "%s", g.gl_pathv[0]);
    globfree(&g);
    return strtoull(strrchr(out, '/') + 5, NULL, 16);
}

/* The line of text holding what, as a new string (caller frees), or NULL. */
static char *line_with(const char *text, const char *what)
{
    const char *p = text ? strstr(text, what) : NULL;
    if (!p) return NULL;
    const char *b = p, *e = strchr(p, '\n');
    while (b > text && b[-1] != '\n') b--;
    return strndup(b, e ? (size_t)(e - b) : strlen(b));
}

/* Issue 57: a checkpoint of run A (same config) copied into run B's
 * directory, named to sort newest, used to be resumed from: psd became run
 * A (B's own workers refused, "belongs to run ..."), finished with A's
 * weights and A's epochs in B's metrics file. It is skipped like a damaged
 * file, both runs named; B resumes from its own newest, its worker carries
 * on, and the run ends with B's counts. */
Test(short, a_checkpoint_of_another_run_in_a_runs_directory_is_skipped)
{
    char da[256], db[256], cka[300], ckb[300], rda[300], rdb[300], out[256];
    path(da, sizeof da, "ckptA");
    path(db, sizeof db, "ckptB");
    path(out, sizeof out, "check.txt");
    snprintf(cka, sizeof cka, "checkpoint.dir=%s", da);
    snprintf(ckb, sizeof ckb, "checkpoint.dir=%s", db);
    /* run A: stopped after epoch 3 of 6 (--stop-after-epoch is not part of the config) */
    run_t a, b;
    const char *aargs[] = {"--epochs", "6", "--set", "data.train_limit=2000", "--set", cka, "--stop-after-epoch", "3",
                           NULL};
    train(&a, "A", 1, aargs, 300);
    cr_assert_eq(a.psd_code, 0, "run A stopped after epoch 3");
    uint64_t ida = run_dir_of(da, rda, sizeof rda);
    /* run B, the same config: killed (-9) once its first checkpoint is written; its worker waits */
    const char *bargs[] = {"--epochs", "6", "--set", "data.train_limit=2000", "--set", ckb, NULL};
    pid_t p = start_psd(&b, "B", 1, bargs);
    const char *wx[] = {"--retry-for", "60", NULL};
    pid_t w = start_worker(&b, "B", 0, wx);
    wait_log(b.psd_log, ".psdc: ", 60);
    kill(p, SIGKILL);
    cr_assert_eq(proc_wait(p, 10), 128 + SIGKILL, "psd B was killed before the end of its run");
    uint64_t idb = run_dir_of(db, rdb, sizeof rdb);
    cr_assert_neq(ida, idb);
    char hexa[20], hexb[20];
    snprintf(hexa, sizeof hexa, "%016" PRIx64, ida);
    snprintf(hexb, sizeof hexb, "%016" PRIx64, idb);
    /* A's newest checkpoint (epoch 3) into B's directory, under a name newer than any of B's */
    cr_assert_eq(run_cmd("cp \"$(ls '%s'/ckpt-*.psdc | tail -1)\" '%s/ckpt-999999999999.psdc'", rda, rdb), 0);
    /* --check-config --resume, of B's directory and of checkpoint.dir: B's own newest, A's named and skipped */
    const char *resume_from[2] = {rdb, db};
    for (int k = 0; k < 2; k++) {
        int rc = run_cmd("'%s' --epochs 6 --set data.train_limit=2000 --set '%s' --resume '%s' --check-config > '%s' "
                         "2>&1", psd_bin, ckb, resume_from[k], out);
        char want[64];
        snprintf(want, sizeof want, "would resume run %s from %s/ckpt-", hexb, rdb);
        char *t = slurp(out), *skip = line_with(t, "ckpt-999999999999.psdc: "), *verdict = line_with(t, want);
        cr_assert_eq(rc, 0, "--resume %s: %s", resume_from[k], t);
        cr_assert(verdict && !strstr(verdict, "999999999999"),
                  "--resume %s resumes B from its own newest checkpoint: %s", resume_from[k], t);
        cr_assert(skip && strstr(skip, hexa) && strstr(skip, hexb), "the skipped file, with both runs: %s", t);
        free(verdict);
        free(skip);
        free(t);
    }
    /* resumed on B's endpoint: B's worker registers again, is taken, and the run ends as B */
    char log2[256];
    path(log2, sizeof log2, "B2-psd.log");
    const char *argv[] = {psd_bin, "--listen", b.endpoint, "--workers", "1", "--metrics", b.metrics, "--save",
                          b.weights, "--start-timeout", "60", "--worker-timeout", "5", "--epochs", "6", "--set",
                          "data.train_limit=2000", "--set", ckb, "--resume", rdb, NULL};
    pid_t p2 = proc_spawn(argv, log2);
    int code = proc_wait(p2, 300);
    char *l2 = slurp(log2), *skip = line_with(l2, "ckpt-999999999999.psdc: ");
    char want[64];
    snprintf(want, sizeof want, "resuming run %s from %s/ckpt-", hexb, rdb);
    cr_assert(skip && strstr(skip, hexa) && strstr(skip, hexb), "psd names the skipped file and both runs: %s", l2);
    cr_assert(strstr(l2, want) && !strstr(l2, "belongs to run"), "resumed as run B, its worker taken: %s", l2);
    cr_assert_eq(code, 0, "the resumed psd finished: %s", l2);
    free(skip);
    free(l2);
    cr_assert_eq(proc_wait(w, 30), 0, "B's worker carried on to the end");
    char *m = metrics_last(&b);
    char rid[64];
    snprintf(rid, sizeof rid, "\"run_id\":\"%s\"", hexb);
    cr_assert_eq(count_lines(m), 6, "one line an epoch: %s", m);
    cr_assert_eq(count_in(m, rid), 6, "every line is run B's: %s", m);
    cr_assert_eq(json_num(last_line(m), "epoch"), 6, "%s", m);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 2000, "%s", last_line(m));
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
    free(m);
    /* a run's directory with none of its own checkpoints left: refused, as when all are damaged */
    char dc[256];
    path(dc, sizeof dc, "ckptC/run-0123456789abcdef");
    cr_assert_eq(run_cmd("mkdir -p '%s' && cp \"$(ls '%s'/ckpt-*.psdc | tail -1)\" '%s/'", dc, rda, dc), 0);
    int rc = run_cmd("'%s' --epochs 6 --set data.train_limit=2000 --resume '%s' --check-config > '%s' 2>&1", psd_bin,
                     dc, out);
    char *t = slurp(out);
    cr_assert_eq(rc, 2, "%s", t);
    cr_assert(strstr(t, "no valid checkpoint") && strstr(t, hexa) && strstr(t, "0123456789abcdef"), "%s", t);
    free(t);
}
