/* it_trust.c - integration tests: what psd takes from the files it finds
 * and what it leaves behind (see itest.h): a checkpoint of another run put
 * in a run's directory, a start that is refused. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <glob.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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
        int rc = run_cmd("'%s' --listen tcp://127.0.0.1:0 --epochs 6 --set data.train_limit=2000 --set '%s' --resume '%s' --check-config > '%s' "
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
    int rc = run_cmd("'%s' --listen tcp://127.0.0.1:0 --epochs 6 --set data.train_limit=2000 --resume '%s' --check-config > '%s' 2>&1", psd_bin,
                     dc, out);
    char *t = slurp(out);
    cr_assert_eq(rc, 2, "%s", t);
    cr_assert(strstr(t, "no valid checkpoint") && strstr(t, hexa) && strstr(t, "0123456789abcdef"), "%s", t);
    free(t);
}

/* A TCP port on 127.0.0.1 held listening by this process (*fd), for a psd
 * to find taken. */
static int taken_port(int *fd)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    *fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    cr_assert_geq(*fd, 0);
    cr_assert_eq(bind(*fd, (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(*fd, 1), 0);
    cr_assert_eq(getsockname(*fd, (struct sockaddr *)&a, &len), 0);
    return ntohs(a.sin_port);
}

/* Issue 57: a psd refused at its start (its port taken, a host name it
 * cannot listen on, the HTTP port taken, data it cannot use, a model that
 * does not fit the data) used to leave an empty run-<id>/ directory in
 * checkpoint.dir and an empty metrics file. Now it exits 2 and leaves
 * nothing: no run directory (no checkpoint.dir when there was none), no
 * metrics, weights or lock file; a resume refused so leaves the metrics
 * file as it was. */
Test(short, a_psd_refused_at_its_start_leaves_no_file_behind)
{
    int held;
    char port[16], ep[64], http[64], nodata[300], free_ep[64];
    snprintf(port, sizeof port, "%d", taken_port(&held));
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%s", port);
    snprintf(http, sizeof http, "127.0.0.1:%s", port);
    snprintf(free_ep, sizeof free_ep, "tcp://127.0.0.1:%d", free_port());
    snprintf(nodata, sizeof nodata, "data.train_images=%s/none.gz", dir);
    const struct {
        const char *args[6], *says;
    } cases[] = {
        {{"--listen", ep, NULL}, "cannot listen on"},
        {{"--listen", "tcp://localhost:6171", NULL}, "cannot listen on"},
        {{"--listen", free_ep, "--http", http, NULL}, "server.http: cannot listen on"},
        {{"--listen", free_ep, "--set", nodata, NULL}, "none.gz"},
        {{"--listen", free_ep, "--set", "model.layers=100,10", NULL}, "model.layers starts with 100"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        /* in case<k>/: checkpoint.dir there already (even k) or not (odd k), the metrics and weights files */
        char c[256], ck[300], ckset[320], met[300], wts[300], log[256], list[4096];
        snprintf(ck, sizeof ck, "case%zu", k);
        path(c, sizeof c, ck);
        snprintf(ck, sizeof ck, "%s/ckpt", c);
        snprintf(ckset, sizeof ckset, "checkpoint.dir=%s", ck);
        snprintf(met, sizeof met, "%s/metrics.jsonl", c);
        snprintf(wts, sizeof wts, "%s/weights.bin", c);
        snprintf(log, sizeof log, "%s.log", c);
        cr_assert_eq(run_cmd("mkdir -p '%s'", k % 2 ? c : ck), 0);
        const char *argv[32] = {psd_bin, "--workers", "1", "--start-timeout", "10", "--metrics", met, "--save", wts,
                                "--set", ckset, "--set", "train.keep_best.metric=val_acc", "--set"};
        char best[320];
        snprintf(best, sizeof best, "train.keep_best.path=%s/best.safetensors", c);
        int n = 14;
        argv[n++] = best;
        for (int i = 0; cases[k].args[i]; i++) argv[n++] = cases[k].args[i];
        argv[n] = NULL;
        int code = proc_wait(proc_spawn(argv, log), 60);
        char *t = slurp(log);
        cr_assert_eq(code, 2, "case %zu: refused with exit 2: %s", k, t);
        cr_assert(strstr(t, cases[k].says), "case %zu: says why (%s): %s", k, cases[k].says, t);
        free(t);
        char cmd[600];
        snprintf(cmd, sizeof cmd, "cd '%s' && find . -mindepth 1 | sort; find '%s' -maxdepth 1 -name '*.lock'", c, dir);
        run_cmd_out(cmd, list, sizeof list);
        cr_assert_str_eq(list, k % 2 ? "" : "./ckpt\n", "case %zu (%s): psd left files behind: %s", k,
                         cases[k].args[1], list);
    }
    /* a resume refused at its start (its port taken) leaves the run's metrics file as it was: the
     * lines of epochs past the checkpoint are dropped only by a psd that starts */
    char ck[256], ckset[300], met[256];
    path(ck, sizeof ck, "rckpt");
    snprintf(ckset, sizeof ckset, "checkpoint.dir=%s", ck);
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=2000", "--set", ckset, "--stop-after-epoch", "1",
                          NULL};
    run_t r;
    train(&r, "res", 1, args, 300);
    cr_assert_eq(r.psd_code, 0);
    snprintf(met, sizeof met, "%s", r.metrics);
    char *m = slurp(met);
    cr_assert(m && count_lines(m) == 1, "%s", m ? m : "");
    const char *rid = strstr(m, "\"run_id\":\"");
    cr_assert_not_null(rid);
    char line2[128];
    snprintf(line2, sizeof line2, "{\"run_id\":\"%.16s\",\"epoch\":2}\n", rid + 10); /* as if epoch 2 were logged */
    free(m);
    FILE *f = fopen(met, "a");
    cr_assert(f && fputs(line2, f) >= 0 && fclose(f) == 0);
    char *before = slurp(met), log[256], list[4096], cmd[600];
    path(log, sizeof log, "res2.log");
    const char *argv[] = {psd_bin, "--listen", ep, "--workers", "1", "--start-timeout", "10", "--metrics", met,
                          "--save", r.weights, "--epochs", "3", "--set", "data.train_limit=2000", "--set", ckset,
                          "--resume", ck, NULL};
    int code = proc_wait(proc_spawn(argv, log), 60);
    char *t = slurp(log), *after = slurp(met);
    cr_assert_eq(code, 2, "%s", t);
    cr_assert(strstr(t, "resuming run") && strstr(t, "cannot listen on"), "%s", t);
    cr_assert_str_eq(after, before, "the metrics file is as it was: %s", t);
    snprintf(cmd, sizeof cmd, "find '%s' '%s' -name '*.lock'", dir, ck);
    run_cmd_out(cmd, list, sizeof list);
    cr_assert_str_eq(list, "", "no lock file is left: %s", list);
    free(t);
    free(after);
    free(before);
    close(held);
}
