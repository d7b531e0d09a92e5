/* it_paths.c - integration tests (see itest.h): JSON logs and the progress line; shared
 * parameter slots stepped in place; ctr validation, the table rows a worker asks for and
 * validation parts with the table on psd shards; a forked child of a worker. (Split from
 * it_shards.c, which keeps a fake shard 0 against a real psd shard.) */

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
#include "ps_safetensors.h"
#include "ps_shm.h"
#include "ps_table.h"
#include "psworker.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"

/* --log-format json: every line psd and the workers write is one JSON
 * object with ts, role, level and msg (checked with Python's json module);
 * the rank-0 rule holds (rank 1 logs no INFO without --verbose). */
Test(short, json_logs_are_one_object_a_line)
{
    if (run_cmd("command -v python3 >/dev/null") != 0) cr_skip_test("no python3 to parse JSON with");
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--log-format", "json", NULL};
    const char *wargs[] = {"--log-format", "json", NULL};
    pid_t p = start_psd(&r, "json", 2, args);
    pid_t w0 = start_worker(&r, "json", 0, wargs);
    wait_log(r.psd_log, "rank 0", 60);
    pid_t w1 = start_worker(&r, "json", 1, wargs);
    cr_assert_eq(proc_wait(p, 300), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char script[] = "import json, sys\n"
                    "for f, want_info in zip(sys.argv[1:], (1, 1, 0)):\n"
                    "    n = info = 0\n"
                    "    for line in open(f, encoding='utf-8'):\n"
                    "        d = json.loads(line)\n"
                    "        assert set(d) == {'ts', 'role', 'level', 'msg'}, d\n"
                    "        assert d['level'] in ('error', 'warn', 'info', 'debug'), d\n"
                    "        n += 1; info += d['level'] == 'info'\n"
                    "    assert n > 0 and (info > 0) == bool(want_info), (f, n, info)\n";
    char py[512];
    path(py, sizeof py, "check.py");
    FILE *f = fopen(py, "w");
    cr_assert_not_null(f);
    fputs(script, f);
    fclose(f);
    cr_assert_eq(run_cmd("python3 '%s' '%s' '%s/json-w0.log' '%s/json-w1.log'", py, r.psd_log, dir, dir), 0,
                 "every log line is a JSON object (see the test's output)");
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "\"msg\":\"run finished: 1 epochs"), "%s", log);
    free(log);
}

/* Progress: on a terminal (a pseudo-terminal from script(1)) psd keeps a
 * live line (carriage return, erase to end of line) with the step, speed,
 * ETA, loss and slowest worker, and the log lines stay whole; without one it
 * writes plain progress lines every server.progress_every seconds and no
 * control character at all. */
Test(short, progress_on_a_terminal_and_off_it)
{
    if (run_cmd("command -v script >/dev/null") != 0) cr_skip_test("no script(1) for a pseudo-terminal");
    const char *wx[] = {"--no-shm", NULL}; /* slower: the epoch lasts a few timer ticks */
    /* on a terminal */
    run_t r;
    snprintf(r.endpoint, sizeof r.endpoint, "tcp://127.0.0.1:%d", free_port());
    char out[512];
    path(out, sizeof out, "tty.out");
    pid_t w0 = start_worker(&r, "tty", 0, wx), w1 = start_worker(&r, "tty", 1, wx);
    int rc = run_cmd("cd '%s' && TERM=xterm timeout 300 script -qfec \"'%s' --listen %s --workers 2 --epochs 1 "
                     "--set data.train_limit=20000 --set checkpoint.dir= --metrics '' --save ''\" /dev/null > '%s'",
                     dir, psd_bin, r.endpoint, out);
    cr_assert_eq(rc, 0, "psd under a pseudo-terminal");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char *t = slurp(out);
    cr_assert_not_null(t);
    cr_assert(strstr(t, "\r") && strstr(t, "\x1b[K"), "a live line on the terminal:\n%s", t);
    cr_assert(strstr(t, "\repoch 1/1 step ") && strstr(t, "samples/s ETA "), "%s", t);
    cr_assert(strstr(t, "psd INFO  epoch 1/1 step "), "the epoch's log line:\n%s", t);
    cr_assert(strstr(t, "\r\x1b[K20"), "a log line erases the live line first:\n%s", t);
    free(t);
    /* not a terminal */
    run_t q;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=20000", "--set", "server.progress_every=0.2",
                          NULL};
    train_wx(&q, "plain", 2, args, wx, 300);
    check_run(&q, 2, 1);
    char *log = slurp(q.psd_log);
    cr_assert_not_null(log);
    cr_assert(strstr(log, "psd INFO  epoch 1/1 step ") && strstr(log, " samples/s ETA "), "progress lines:\n%s", log);
    for (const char *c = log; *c; c++)
        cr_assert((unsigned char)*c >= 0x20 || *c == '\n', "control character %#x in a log file", *c);
    free(log);
}

/* A worker on shared memory reads its weights in psd's parameter slot.
 * Until it promises to read no more of them once it pushes
 * (psw_client_release_on_push), psd's step leaves that slot alone: the next
 * version goes into another slot and the old one keeps its values. Once it
 * has promised, each step updates the slot in place (the same slot, new
 * values, the CRC-32 psd sends for it checked by the client), and the
 * metrics count those steps; the last push of the epoch asks for nothing,
 * so it releases nothing. The weights are the same as a wire worker's. */
/* psd's arguments for the in-place tests (one epoch of 384 samples, model
 * 784-32-10, CRC-32 of every version), the model's layout, a gradient that
 * moves every weight, and room for a copy of the first tensor */
static const char *const inplace_args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set",
                                           "model.layers=[784,32,10]", "--set", "checkpoint.dir=",
                                           "--x-verify-weights", NULL};

static float *inplace_model(ps_layout_t *l, float **copy)
{
    float *grad = lib_model(l, 32);
    for (size_t i = 0; i < l->n_params; i++) grad[i] = 0.01f * (float)(i % 7) - 0.02f;
    *copy = malloc(l->t[0].numel * sizeof **copy);
    cr_assert(*copy);
    return grad;
}

Test(short, a_shared_slot_is_stepped_in_place_only_once_released)
{
    const char **args = (const char **)inplace_args;
    ps_layout_t l;
    float *copy;
    float *grad = inplace_model(&l, &copy);
    const size_t n0 = l.t[0].numel;
    char weights[2][sizeof ((run_t *)0)->weights];
    for (int mode = 0; mode < 2; mode++) { /* shared memory, then the wire */
        run_t r;
        pid_t p = start_psd(&r, mode ? "inplace-wire" : "inplace", 1, args);
        char err[512];
        psw_client_t *c = lib_worker_shm(r.endpoint, mode == 0, err, sizeof err);
        cr_assert_eq(psw_client_push_region(c) != NULL, mode == 0, "shared memory only without no_shm");
        psw_event_t ev;
        lib_next(c, &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, 384);
        psw_client_pull(c, ev.version);
        lib_next(c, &ev, PSW_EV_WEIGHTS);
        const float *prev = ev.tensors[0];
        for (int step = 0; step < 6; step++) {
            int last = step == 5;
            memcpy(copy, ev.tensors[0], n0 * sizeof *copy);
            if (step == 1) psw_client_release_on_push(c, 1);
            lib_push(c, ev.version, 64, !last, grad, &l);
            if (last) break;
            lib_next(c, &ev, PSW_EV_WEIGHTS);
            if (mode == 1) continue;
            cr_assert_neq(memcmp(ev.tensors[0], copy, n0 * sizeof *copy), 0, "step %d changed the weights", step);
            if (step == 0) {
                cr_assert_neq(ev.tensors[0], prev, "not released: the next version in another slot");
                cr_assert_eq(memcmp(prev, copy, n0 * sizeof *copy), 0, "not released: the slot read is untouched");
            } else {
                cr_assert_eq(ev.tensors[0], prev, "released (step %d): the same slot, updated in place", step);
            }
            prev = ev.tensors[0];
        }
        psw_client_barrier(c, 0, 384);
        lib_next(c, &ev, PSW_EV_VALIDATE);
        cr_assert_eq(psw_client_val_result(c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                .loss_sum = 0, .correct = 0, .count = ev.val_end - ev.val_begin, .scores = NULL}),
                     0);
        lib_next(c, &ev, PSW_EV_SHUTDOWN);
        r.psd_code = proc_wait(p, 30);
        psw_client_destroy(&c);
        cr_assert_eq(r.psd_code, 0);
        char *m = metrics_last(&r);
        if (mode == 0) /* the 4 between: the first released nothing, the last asked for nothing */
            cr_assert_eq(json_num(m, "psd_steps_in_place"), 4, "%s", m);
        free(m);
        snprintf(weights[mode], sizeof weights[mode], "%s", r.weights);
    }
    cr_assert(weights_equal(weights[0], weights[1]), "in place or not, shared memory or wire: the same weights");
    free(copy);
    free(grad);
}

/* Two workers on shared memory read the same slot: one that releases it
 * with its push does not make psd step it in place while the other still
 * holds it (another slot, the read one untouched); once both release, the
 * step is in place. */
Test(short, a_slot_another_worker_still_reads_is_not_stepped_in_place)
{
    const char **args = (const char **)inplace_args;
    ps_layout_t l;
    float *copy;
    float *grad = inplace_model(&l, &copy);
    const size_t n0 = l.t[0].numel;
    run_t r;
    pid_t p = start_psd(&r, "inplace2", 2, args);
    char err[512];
    psw_client_t *c[2];
    psw_event_t ev[2];
    for (int i = 0; i < 2; i++) {
        c[i] = lib_worker_shm(r.endpoint, 1, err, sizeof err);
        cr_assert_not_null(psw_client_push_region(c[i]), "worker %d on shared memory", i);
    }
    psw_client_release_on_push(c[0], 1); /* worker 1 does not promise, at first */
    for (int i = 0; i < 2; i++) {
        lib_next(c[i], &ev[i], PSW_EV_EPOCH);
        cr_assert_eq(ev[i].n_samples, 192);
        psw_client_pull(c[i], ev[i].version);
        lib_next(c[i], &ev[i], PSW_EV_WEIGHTS);
    }
    /* each client maps psd's slots at its own addresses: each is compared with itself */
    for (int step = 0; step < 3; step++) {
        int last = step == 2;
        const float *prev[2] = {ev[0].tensors[0], ev[1].tensors[0]};
        memcpy(copy, prev[1], n0 * sizeof *copy);
        if (step == 1) psw_client_release_on_push(c[1], 1);
        for (int i = 0; i < 2; i++) lib_push(c[i], ev[i].version, 64, !last, grad, &l);
        if (last) break;
        for (int i = 0; i < 2; i++) lib_next(c[i], &ev[i], PSW_EV_WEIGHTS);
        for (int i = 0; i < 2; i++) {
            cr_assert_neq(memcmp(ev[i].tensors[0], copy, n0 * sizeof *copy), 0, "step %d changed the weights", step);
            if (step == 0)
                cr_assert_neq(ev[i].tensors[0], prev[i], "worker 1 still held the slot: the next version in another");
            else
                cr_assert_eq(ev[i].tensors[0], prev[i], "both released: the same slot, updated in place");
        }
        if (step == 0) cr_assert_eq(memcmp(prev[1], copy, n0 * sizeof *copy), 0, "the slot worker 1 held is untouched");
    }
    for (int i = 0; i < 2; i++) psw_client_barrier(c[i], 0, 192);
    for (int i = 0; i < 2; i++) {
        lib_next(c[i], &ev[i], PSW_EV_VALIDATE);
        cr_assert_eq(psw_client_val_result(c[i], &(psw_val_t){.epoch = ev[i].epoch, .version = ev[i].version, .begin = ev[i].val_begin,
                .loss_sum = 0, .correct = 0, .count = ev[i].val_end - ev[i].val_begin, .scores = NULL}),
                     0);
    }
    for (int i = 0; i < 2; i++) lib_next(c[i], &ev[i], PSW_EV_SHUTDOWN);
    r.psd_code = proc_wait(p, 30);
    for (int i = 0; i < 2; i++) psw_client_destroy(&c[i]);
    cr_assert_eq(r.psd_code, 0);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(m, "psd_steps_in_place"), 1, "only the step both released: %s", m);
    free(m);
    free(copy);
    free(grad);
}

/* A library worker of the ctr run below that joins while its one test part
 * waits for a worker: registered, ready, given the part (VALIDATE in *ev). */
static psw_client_t *ctr_validator(const run_t *r, psw_event_t *ev)
{
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(r->endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(psw_client_ready(c, 256, 100, NULL), 0);
    lib_next(c, ev, PSW_EV_VALIDATE);
    cr_assert_eq(ev->val_end - ev->val_begin, 100);
    return c;
}

/* c's answer was refused: its run ends, exit 2, psd's reason naming why. */
static void ctr_refused(psw_client_t *c, const psw_val_t *v, const char *why)
{
    psw_event_t ev;
    psw_client_val_result(c, v);
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(ev.exit_code, 2);
    cr_assert(strstr(ev.message, "psd refused this worker: ") && strstr(ev.message, why), "%s", ev.message);
    psw_client_destroy(&c);
}

/* ctr validation results must carry the range's click probabilities (psd
 * reduces them to the AUC): without them, or with one that is no
 * probability, the worker's run ends with the reason, and the run goes on
 * with the next worker, given the part. A library worker that answers with
 * the planted probabilities gets psd's planted AUC back as val_auc: the
 * scores land where their examples are. */
Test(short, ctr_results_without_scores_end_the_workers_run)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "ctrbad", 1, args);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(r.endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(a.ctr.fields, 8);
    cr_assert_eq(a.n_files, 0);
    cr_assert_eq(psw_client_ready(c, 256, 100, NULL), 0);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    cr_assert_eq(l.n_tensors, 5);
    float *zero = calloc(l.n_params, sizeof *zero);
    cr_assert(zero);
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    cr_assert_eq(ev.n_samples, 256);
    psw_client_pull(c, ev.version);
    lib_next(c, &ev, PSW_EV_WEIGHTS);
    lib_push(c, ev.version, 256, 0, zero, &l);
    psw_client_barrier(c, 0, 256);
    lib_next(c, &ev, PSW_EV_VALIDATE);
    cr_assert_eq(ev.val_end - ev.val_begin, 100);
    ps_ctr_t g = {.fields = a.ctr.fields, .per_field = a.ctr.per_field, .vocab = a.ctr.vocab, .zipf = a.ctr.zipf,
                  .rows = a.ctr.rows, .weight_std = a.ctr.weight_std, .bias = a.ctr.bias, .seed = a.ctr.seed};
    float sc[100];
    uint32_t rows[PS_CTR_MAX_IDS];
    for (int i = 0; i < 100; i++) {
        uint8_t y;
        sc[i] = (float)ps_ctr_example(&g, a.ctr.train + (uint64_t)i, rows, NULL, &y);
    }
    psw_val_t v = {.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin, .loss_sum = 50, .correct = 60,
                   .count = 100, .scores = NULL};
    ctr_refused(c, &v, "without the range's 100 scores");
    float keep = sc[37];
    v.scores = sc;
    sc[37] = NAN;
    ctr_refused(ctr_validator(&r, &ev), &v, "without the range's 100 scores");
    sc[37] = 1.5f;
    ctr_refused(ctr_validator(&r, &ev), &v, "without the range's 100 scores");
    sc[37] = keep;
    c = ctr_validator(&r, &ev);
    psw_client_val_result(c, &v);
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(ev.exit_code, 0);
    r.psd_code = proc_wait(p, 30);
    psw_client_destroy(&c);
    free(zero);
    cr_assert_eq(r.psd_code, 0);
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "without the range's 100 scores"), 3, "%s", log);
    cr_assert_eq(count_in(log, "its run ends (exit 2)"), 3, "%s", log);
    free(log);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(m, "val_auc"), json_num(m, "optimum_auc"), "%s", m);
    cr_assert_eq(json_num(m, "val_loss"), 0.5, "%s", m);
    cr_assert_eq(json_num(m, "workers_refused"), 3, "%s", m);
    free(m);
}

/* The rows of the ctr task's table test examples [begin, end) read,
 * sorted, into out (room for (end - begin) x 8); their count. */
static size_t ctr_range_rows(const psw_assign_t *a, uint64_t begin, uint64_t end, uint32_t *out)
{
    ps_ctr_t gen = {.fields = a->ctr.fields, .per_field = a->ctr.per_field, .vocab = a->ctr.vocab,
                    .zipf = a->ctr.zipf, .rows = a->ctr.rows, .weight_std = a->ctr.weight_std, .bias = a->ctr.bias,
                    .seed = a->ctr.seed};
    const size_t per = (size_t)(a->ctr.fields * a->ctr.per_field);
    for (uint64_t i = begin; i < end; i++) {
        uint8_t y;
        ps_ctr_example(&gen, a->ctr.train + i, out + (i - begin) * per, NULL, &y);
    }
    return ps_sort_unique_u32(out, (size_t)(end - begin) * per);
}

/* The table on psd, as a library worker sees it: a plain pull brings no
 * row of the table, a pull listing rows brings exactly those (psd's
 * values, asked again: again), a push of rows steps them, and the
 * validation part brings the rows of its range's examples, the pushed
 * rows stepped and the others as they were. */
Test(short, a_worker_gets_the_table_rows_it_asks_for)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    pid_t p = start_psd(&r, "askrows", 1, args);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1};
    psw_client_t *c = psw_client_new(r.endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert(a.ctr.table_on_psd, "psd keeps the table");
    cr_assert(!a.shm, "and sends rows over the wire");
    cr_assert_eq(psw_client_ready(c, 256, 100, NULL), 0);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    float *w0 = calloc(l.n_params, sizeof *w0);
    cr_assert(w0);
    ps_model_init_params(&l, w0, 7); /* run.seed 7 in ctr.yaml */
    const float *E0 = w0 + l.t[4].offset;
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    psw_client_pull(c, ev.version);
    lib_next(c, &ev, PSW_EV_WEIGHTS);
    cr_assert(ev.n_row_ids == 0 && ev.tensor_numel[4] == 0, "no row asked for, none sent (never the table)");
    cr_assert(memcmp(ev.tensors[0], w0, l.t[0].numel * sizeof *w0) == 0, "the MLP whole");
    const uint32_t asks[2][3] = {{1, 5, 900}, {2, 3, 65535}};
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(psw_client_pull_rows(c, ev.version, asks[k], 3), 0);
        lib_next(c, &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.n_row_ids, 3);
        cr_assert(memcmp(ev.row_ids, asks[k], sizeof asks[k]) == 0, "the rows asked for");
        cr_assert_eq(ev.tensor_numel[4], 3 * 8);
        for (int j = 0; j < 3; j++)
            cr_assert(memcmp(ev.tensors[4] + j * 8, E0 + asks[k][j] * 8, 8 * sizeof(float)) == 0, "row %u's values",
                      asks[k][j]);
    }
    const uint32_t bad[2] = {5, 1};
    cr_assert_eq(psw_client_pull_rows(c, ev.version, bad, 2), -EINVAL, "refused before it leaves");
    /* push rows 1 and 5, then validate */
    float *zero = calloc(l.n_params, sizeof *zero), vals[16];
    cr_assert(zero);
    lib_grads_t ga;
    lib_grads(&ga, &l, zero);
    for (int i = 0; i < 16; i++) vals[i] = 0.25f;
    const uint32_t pushed[2] = {1, 5};
    ga.gr[4] = (psw_grad_t){.tensor = 4, .row_ids = pushed, .n_rows = 2, .row_vals = vals}; /* the table as rows */
    psw_push_t pp = {.version = ev.version, .batch = 256, .loss_sum = 100, .n_grads = 5, .grads = ga.gr};
    cr_assert_eq(psw_client_push_v(c, &pp), 0);
    psw_client_barrier(c, 0, 256);
    lib_next(c, &ev, PSW_EV_VALIDATE);
    uint32_t want[800];
    size_t nw = ctr_range_rows(&a, 0, 100, want);
    cr_assert_eq(ev.n_row_ids, nw, "the rows the range's examples read");
    cr_assert(memcmp(ev.row_ids, want, nw * sizeof *want) == 0, "those rows, increasing");
    for (size_t j = 0; j < ev.n_row_ids; j++) {
        uint32_t id = ev.row_ids[j];
        bool stepped = memcmp(ev.tensors[4] + j * 8, E0 + (size_t)id * 8, 8 * sizeof(float)) != 0;
        cr_assert_eq(stepped, id == 1 || id == 5, "row %u %s", id, stepped ? "changed" : "did not change");
    }
    float sc[100];
    for (int i = 0; i < 100; i++) sc[i] = 0.5f;
    psw_client_val_result(c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
            .loss_sum = 50, .correct = 60, .count = 100, .scores = sc});
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(proc_wait(p, 30), 0);
    psw_client_destroy(&c);
    free(zero);
    free(w0);
}

/* The table on psd with 2 psd shards, as a library worker sees it, given
 * two validation parts at once (the second one is a worker's that left
 * while it validated): each part's event brings the rows its range's
 * examples read, all of them, put together from both shards (psd's
 * values: the pushes were zero), the second after the first; the run ends
 * with both results in. */
Test(short, two_validation_parts_at_once_with_the_table_on_psd_shards)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *base[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=512", "--set", "ctr.test=200",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    const char *a0[16] = {NULL};
    int n0 = 0;
    while (base[n0]) a0[n0] = base[n0], n0++;
    a0[n0++] = "--shard", a0[n0] = "0/2"; /* shard 0, and shard 1 */
    pid_t p = start_psd(&r, "twoparts", 2, a0), p1 = start_shard(&r, "twoparts", 1, 2, base);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c[2];
    psw_assign_t a;
    for (int i = 0; i < 2; i++) {
        c[i] = psw_client_new(r.endpoint, &info, err, sizeof err);
        cr_assert(c[i] && psw_client_register(c[i], &a, 60, err, sizeof err) == 0, "%s", err);
        cr_assert(a.ctr.table_on_psd, "psd keeps the table");
        cr_assert_eq(psw_client_ready(c[i], 512, 200, NULL), 0);
    }
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    float *w0 = calloc(l.n_params, sizeof *w0), *zero = calloc(l.n_params, sizeof *zero);
    cr_assert(w0 && zero);
    ps_model_init_params(&l, w0, 7); /* run.seed 7 in ctr.yaml */
    const float *E0 = w0 + l.t[4].offset;
    psw_event_t ev;
    lib_grads_t ga;
    lib_grads(&ga, &l, zero);
    const uint32_t one_row[1] = {1};
    const float vals[8] = {0};
    for (int i = 0; i < 2; i++) { /* one batch each, a zero gradient */
        lib_next(c[i], &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, 256);
        psw_client_pull(c[i], ev.version);
        lib_next(c[i], &ev, PSW_EV_WEIGHTS);
        ga.gr[4] = (psw_grad_t){.tensor = 4, .row_ids = one_row, .n_rows = 1, .row_vals = vals}; /* the table as rows */
        psw_push_t pp = {.version = ev.version, .batch = 256, .loss_sum = 100, .n_grads = 5, .grads = ga.gr};
        cr_assert_eq(psw_client_push_v(c[i], &pp), 0);
        psw_client_barrier(c[i], 0, 256);
    }
    psw_event_t gone;
    lib_next(c[1], &gone, PSW_EV_VALIDATE); /* validation began; worker 1 leaves with its part */
    cr_assert_eq(psw_client_leave(c[1], "test: leaves while validating"), 0);
    psw_client_destroy(&c[1]);
    wait_log(r.psd_log, "left the run", 30);
    zmq_poll(NULL, 0, 300); /* the second part is on its way to worker 0 */
    uint32_t *want = malloc(200 * 8 * sizeof *want);
    cr_assert(want);
    uint64_t covered = 0;
    float sc[200];
    for (int i = 0; i < 200; i++) sc[i] = 0.5f;
    for (int k = 0; k < 2; k++) {
        lib_next(c[0], &ev, PSW_EV_VALIDATE);
        if (k == 1) cr_assert_eq(ev.val_begin, gone.val_begin, "the part of the worker that left, second");
        size_t nw = ctr_range_rows(&a, ev.val_begin, ev.val_end, want);
        cr_assert_eq(ev.n_row_ids, nw, "part %d [%" PRIu64 ", %" PRIu64 "): the rows its examples read", k,
                     ev.val_begin, ev.val_end);
        cr_assert(memcmp(ev.row_ids, want, nw * sizeof *want) == 0, "part %d: those rows", k);
        cr_assert_eq(ev.tensor_numel[4], nw * 8);
        for (size_t j = 0; j < nw; j++)
            cr_assert(memcmp(ev.tensors[4] + j * 8, E0 + (size_t)want[j] * 8, 8 * sizeof(float)) == 0,
                      "part %d, row %u: psd's values (from shard %d)", k, want[j], want[j] < 32768 ? 0 : 1);
        covered += ev.val_end - ev.val_begin;
        psw_client_val_result(c[0], &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                .loss_sum = 50, .correct = 60, .count = ev.val_end - ev.val_begin, .scores = sc});
    }
    cr_assert_eq(covered, 200, "both parts");
    lib_next(c[0], &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(proc_wait(p, 30), 0);
    cr_assert_eq(proc_wait(p1, 30), 0);
    psw_client_destroy(&c[0]);
    free(want);
    free(zero);
    free(w0);
}

/* psd gives a worker at most two validation parts at once (its own and one
 * more): the parts of three workers that left during validation wait on
 * psd and come one at a time as the worker answers, instead of piling up on
 * it (a worker's queue of parts is bounded). Every test example is still
 * validated exactly once. Four library workers; three leave. */
Test(short, validation_parts_of_workers_that_left_come_one_at_a_time)
{
    run_t r;
    /* (grad_room 0: this thread drives the 4 workers one after the other, so none could answer
     * psd's GO while it waits on another) */
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--set", "checkpoint.dir=", "--set", "server.grad_room=0", NULL};
    pid_t p = start_psd(&r, "vparts", 4, args);
    ps_layout_t l;
    float *zero = lib_model(&l, 16);
    psw_client_t *w[4];
    lib_start(r.endpoint, w, 4, 96);
    psw_event_t ev, held[8];
    for (int i = 0; i < 4; i++) { /* two batches each (64 and 32), then the barrier */
        lib_next(w[i], &ev, PSW_EV_WEIGHTS);
        lib_push(w[i], ev.version, 64, 1, zero, &l);
    }
    for (int i = 0; i < 4; i++) {
        lib_next(w[i], &ev, PSW_EV_WEIGHTS);
        lib_push(w[i], ev.version, 32, 0, zero, &l);
        psw_client_barrier(w[i], 0, 96);
    }
    int n = 0;
    lib_next(w[0], &held[n++], PSW_EV_VALIDATE);
    for (int i = 1; i < 4; i++) {
        lib_next(w[i], &ev, PSW_EV_VALIDATE); /* validation began: they leave with their parts */
        cr_assert_eq(psw_client_leave(w[i], "test: leaves while validating"), 0);
        psw_client_destroy(&w[i]);
    }
    for (int t = 0; t < 600; t++) {
        char *log = slurp(r.psd_log);
        int left = log ? count_in(log, "left the run") : 0;
        free(log);
        if (left == 3) break;
        zmq_poll(NULL, 0, 50);
    }
    char err[512];
    uint64_t covered = 0;
    int most = 0, answered = 0;
    for (;;) {
        /* take what psd sends without answering for a while: what it holds at once */
        while (psw_client_next(w[0], &ev, 0.5, err, sizeof err) == 0) {
            if (ev.kind == PSW_EV_SHUTDOWN) goto done;
            cr_assert_eq(ev.kind, PSW_EV_VALIDATE, "event %d", (int)ev.kind);
            cr_assert_lt(n, 8);
            held[n++] = ev;
        }
        if (n > most) most = n;
        cr_assert_gt(n, 0, "psd sent nothing more and did not end the run: %s", err);
        ev = held[0]; /* answer the oldest */
        memmove(held, held + 1, (size_t)(n - 1) * sizeof *held);
        n--;
        covered += ev.val_end - ev.val_begin;
        answered++;
        psw_client_val_result(w[0], &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                .loss_sum = 0.5 * (double)(ev.val_end - ev.val_begin), .correct = 0,
                .count = ev.val_end - ev.val_begin, .scores = NULL});
    }
done:
    cr_assert_eq(n, 0);
    cr_assert_eq(answered, 4, "its part and the three of the workers that left");
    cr_assert_eq(most, 2, "two parts held at once, never more (held %d)", most);
    cr_assert_eq(covered, 10000, "every test example once");
    psw_client_destroy(&w[0]);
    free(zero);
    cr_assert_eq(proc_wait(p, 30), 0);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
    free(m);
}

/* This process's TCP connections to 127.0.0.1 at one of the ports (its fds
 * whose peer is there). */
static int conns_to(const int ports[2])
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));) {
        struct sockaddr_in a;
        socklen_t len = sizeof a;
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == dirfd(d) || getpeername(fd, (struct sockaddr *)&a, &len) != 0 ||
            a.sin_family != AF_INET || a.sin_addr.s_addr != htonl(INADDR_LOOPBACK))
            continue;
        n += ntohs(a.sin_port) == ports[0] || ntohs(a.sin_port) == ports[1];
    }
    closedir(d);
    return n;
}

/* A worker's child forked without exec (a torch DataLoader's reader
 * processes) does not hold the worker's connections to psd and to psd's
 * shard: the library closes them in the child, so that psd notices at once
 * when the worker dies (issue 56). The worker keeps its own: it goes on
 * with both. */
Test(short, a_forked_child_of_a_worker_holds_none_of_its_connections)
{
    run_t r;
    char ep1[64];
    const char *base[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--set", "checkpoint.dir=", NULL};
    const char *a0[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                        "--set", "checkpoint.dir=", "--shard", "0/2", NULL};
    start_psd(&r, "fork", 1, a0);
    start_shard_at(&r, "fork", 1, 2, base, ep1);
    const int ports[2] = {atoi(strrchr(r.endpoint, ':') + 1), atoi(strrchr(ep1, ':') + 1)};
    char err[512];
    psw_client_t *c = lib_worker(r.endpoint, err, sizeof err);
    cr_assert_eq(conns_to(ports), 2, "the worker's connections to psd and to its shard");
    pid_t ch = fork();
    cr_assert_geq(ch, 0);
    if (ch == 0) _exit(conns_to(ports) & 0x7f);
    int st;
    cr_assert_eq(waitpid(ch, &st, 0), ch);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child holds %d of them", WEXITSTATUS(st));
    cr_assert_eq(conns_to(ports), 2, "the worker's own stay");
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    cr_assert_eq(psw_client_pull(c, ev.version), 0);
    lib_next(c, &ev, PSW_EV_WEIGHTS); /* both parts: over both connections */
    psw_client_destroy(&c);
}
