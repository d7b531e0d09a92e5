/* itest.c - see itest.h. */
#include "itest.h"

#include <criterion/criterion.h>
#include <math.h>
#include <stdarg.h>
#include <sys/wait.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "proc.h"
#include "ps_util.h"
#include "ps_weights.h"

char dir[128];
const char *psd_bin, *pworker_bin;
const char *slice[] = {"--epochs", "1", "--set", "data.train_limit=4000", NULL};

TestSuite(short, .init = it_setup, .fini = it_teardown, .timeout = 600);
TestSuite(long, .init = it_setup, .fini = it_teardown, .timeout = 900);

void it_setup(void)
{
    psd_bin = getenv("PSD_BIN");
    pworker_bin = getenv("PWORKER_BIN");
    cr_assert_not_null(psd_bin, "PSD_BIN is set by meson");
    cr_assert_not_null(pworker_bin, "PWORKER_BIN is set by meson");
    snprintf(dir, sizeof dir, "/tmp/psd-it-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    proc_set_cwd(dir); /* default checkpoint dirs and the like go there */
}

void it_teardown(void)
{
    proc_reap_all();
    if (getenv("PSD_TEST_KEEP")) { /* keep the logs for a look */
        fprintf(stderr, "kept %s\n", dir);
        return;
    }
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

void path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", dir, name); }

/* The log of the worker that got rank 0 (the one that logs its INFO lines)
 * among the `workers` of run `tag`; NULL if none. Caller frees. */
char *rank0_log(const char *tag, int workers)
{
    for (int i = 0; i < workers; i++) {
        char name[256], wl[512];
        snprintf(name, sizeof name, "%s-w%d.log", tag, i);
        path(wl, sizeof wl, name);
        char *log = slurp(wl);
        if (log && strstr(log, ": rank 0, run ")) return log;
        free(log);
    }
    return NULL;
}


/* Start psd with the given extra args (NULL-terminated). */
pid_t start_psd(run_t *r, const char *tag, int workers, const char **extra)
{
    char wn[16];
    snprintf(wn, sizeof wn, "%d", workers);
    snprintf(r->endpoint, sizeof r->endpoint, "tcp://127.0.0.1:%d", free_port());
    char name[64];
    snprintf(name, sizeof name, "%s-metrics.jsonl", tag);
    path(r->metrics, sizeof r->metrics, name);
    snprintf(name, sizeof name, "%s-weights.bin", tag);
    path(r->weights, sizeof r->weights, name);
    snprintf(name, sizeof name, "%s-psd.log", tag);
    path(r->psd_log, sizeof r->psd_log, name);
    const char *argv[64] = {psd_bin, "--listen", r->endpoint, "--workers", wn, "--metrics", r->metrics,
                            "--save", r->weights, "--start-timeout", "120", "--worker-timeout", "60"};
    int n = 13;
    for (int i = 0; extra && extra[i]; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    return proc_spawn(argv, r->psd_log);
}

pid_t start_worker(run_t *r, const char *tag, int i, const char **extra)
{
    char name[64], log[256];
    snprintf(name, sizeof name, "%s-w%d.log", tag, i);
    path(log, sizeof log, name);
    const char *argv[32] = {pworker_bin, "--connect", r->endpoint, "--wait", "120"};
    int n = 5;
    for (int k = 0; extra && extra[k]; k++) argv[n++] = extra[k];
    argv[n] = NULL;
    return proc_spawn(argv, log);
}

/* psd + N workers (each with worker_extra) to the end. */
void train_wx(run_t *r, const char *tag, int workers, const char **extra,
                     const char **worker_extra, double timeout)
{
    pid_t p = start_psd(r, tag, workers, extra);
    pid_t w[MAXW];
    for (int i = 0; i < workers; i++) w[i] = start_worker(r, tag, i, worker_extra);
    r->psd_code = proc_wait(p, timeout);
    for (int i = 0; i < workers; i++) r->worker_code[i] = proc_wait(w[i], 30);
}

void train(run_t *r, const char *tag, int workers, const char **extra, double timeout)
{
    train_wx(r, tag, workers, extra, NULL, timeout);
}

char *metrics_last(const run_t *r)
{
    char *m = slurp(r->metrics);
    cr_assert_not_null(m, "metrics file %s exists", r->metrics);
    return m;
}

/* Built with sanitizers (meson sets PSD_TEST_SANITIZED). */
bool sanitized(void)
{
    const char *v = getenv("PSD_TEST_SANITIZED");
    return v && strcmp(v, "1") == 0;
}

/* The last epoch validated every test sample once. */
void assert_validated_all(const run_t *r)
{
    char *m = metrics_last(r);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
    free(m);
}

void check_run(const run_t *r, int workers, int epochs)
{
    char *log = slurp(r->psd_log);
    size_t len = log ? strlen(log) : 0; /* Criterion drops long messages: the tail */
    cr_assert_eq(r->psd_code, 0, "psd exit %d; end of its log:\n%s", r->psd_code,
                 log ? log + (len > 1500 ? len - 1500 : 0) : "");
    cr_assert(!strstr(log, "psd's bookkeeping"), "every training sample trained once an epoch: %s",
              strstr(log, "trained twice"));
    for (int i = 0; i < workers; i++) cr_assert_eq(r->worker_code[i], 0, "worker %d exit %d", i, r->worker_code[i]);
    char *m = metrics_last(r);
    cr_assert_eq(count_lines(m), epochs, "one metrics line per epoch");
    const char *last = last_line(m);
    cr_assert_eq(json_num(last, "schema"), IT_METRICS_SCHEMA);
    cr_assert_eq(json_num(last, "val_samples"), 10000, "every test sample counted once: %s", last);
    cr_assert_eq(json_num(last, "workers"), workers);
    cr_assert_eq(json_num(last, "epoch"), epochs);
    cr_assert_gt(json_num(last, "samples_per_s"), 0);
    /* the workers' step time and the part of it spent waiting for weights */
    double step_ms = json_num(last, "worker_step_ms"), frac = json_num(last, "worker_wait_frac");
    cr_assert(step_ms > 0 && step_ms < 60000, "worker_step_ms %g", step_ms);
    cr_assert(frac > 0 && frac < 1, "worker_wait_frac %g", frac);
    /* psd's own step (reduce + optimizer) is part of the workers' wait */
    double psd_ms = json_num(last, "psd_step_ms");
    cr_assert(psd_ms > 0 && psd_ms < step_ms, "psd_step_ms %g, worker_step_ms %g", psd_ms, step_ms);
    free(m);
    free(log);
}

/* The same model, run id aside (ps_weights_same, as bench/same_weights.sh). */
int weights_equal(const char *a, const char *b)
{
    char why[512];
    int same = ps_weights_same(a, b, why, sizeof why);
    if (same != 1) cr_log_info("weights %s and %s: %s", a, b, why);
    return same == 1;
}

int count_in(const char *text, const char *what)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)); p += strlen(what)) n++;
    return n;
}

/* Wait until psd's metrics file has at least n lines, allowing 60 s for
 * each new line. */
void wait_metrics(const run_t *r, int n)
{
    int seen = -1;
    double since = ps_now();
    while (ps_now() - since < 60) {
        char *m = slurp(r->metrics);
        int lines = m ? count_lines(m) : 0;
        free(m);
        if (lines >= n) return;
        if (lines != seen) {
            seen = lines;
            since = ps_now();
        }
        zmq_poll(NULL, 0, 50);
    }
    cr_assert_fail("psd wrote no new metrics line in 60 s (%d of %d)", seen, n);
}

void wait_log(const char *file, const char *text, double timeout_s)
{
    for (double t = 0; t < timeout_s; t += 0.05) {
        char *log = slurp(file);
        int found = log && strstr(log, text);
        free(log);
        if (found) return;
        zmq_poll(NULL, 0, 50);
    }
    cr_assert_fail("'%s' did not appear in %s within %.0f s", text, file, timeout_s);
}

int run_cmd(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}
