/* it_shard_init.c - integration tests: psd shards take the run's model and
 * their parts of its initial values from shard 0 (model.init's file, which
 * only shard 0 reads; the first worker's, model.kind from_worker), in
 * chunks; and a from_worker run with shards stopped and resumed. Two
 * library workers train each run; see itest.h. */
#include <criterion/criterion.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"
#include "ps_safetensors.h"
#include "ps_util.h"
#include "psworker.h"

/* The model of these tests: w [400, 160] and b [160], 64160 floats in 5
 * blocks of 16384 (each of 3 shards holds some), every value distinct. */
enum { ROWS = 400, COLS = 160, NW = ROWS * COLS, TRAIN = 512, TEST = 64, BATCH = 64 };

static const psw_tensor_t model[2] = {{.name = "w", .ndim = 2, .shape = {ROWS, COLS}, .numel = NW},
                                      {.name = "b", .ndim = 1, .shape = {COLS}, .numel = COLS}};

/* Its initial values: w then b. */
static float *init_values(void)
{
    float *v = malloc((NW + COLS) * sizeof *v);
    cr_assert(v);
    for (int j = 0; j < NW + COLS; j++) v[j] = 0.05f * sinf(0.37f * (float)j) + 1e-6f * (float)j;
    return v;
}

/* model.init's file: the values as safetensors (F32), at dir/name. */
static void write_init(const char *name)
{
    char file[256], err[512];
    path(file, sizeof file, name);
    float *v = init_values();
    const uint64_t sw[2] = {ROWS, COLS}, sb[1] = {COLS};
    ps_st_out_t t[2] = {{"w", 2, sw, v}, {"b", 1, sb, v + NW}};
    cr_assert_eq(ps_st_save(file, t, 2, NULL, NULL, 0, err, sizeof err), 0, "%s", err);
    free(v);
}

/* The table's layout (as psd lays it out). */
static void layout_of(ps_layout_t *l)
{
    ps_tensor_spec_t sp[2];
    memset(sp, 0, sizeof sp);
    for (int t = 0; t < 2; t++) {
        snprintf(sp[t].name, sizeof sp[t].name, "%s", model[t].name);
        sp[t].ndim = model[t].ndim;
        memcpy(sp[t].shape, model[t].shape, sizeof model[t].shape);
    }
    char err[256];
    cr_assert_eq(ps_layout_init_specs(l, sp, 2, err, sizeof err), 0, "%s", err);
}

typedef struct {
    psw_client_t *c;
    uint32_t epoch;
    uint64_t n_ids, pos;
    float *grad[2];
    bool done;
    int code;
} fit_t;

/* Two library workers at ep (offer: each offers the model and its values,
 * model.kind from_worker) train every epoch psd gives them, until it ends
 * the run: a batch's gradient of each tensor is the weights it was computed
 * on, so the last weights depend on every initial value. Returns the exit
 * code psd gave them (the same for both). */
static int fit(const char *ep, bool offer)
{
    float *v = init_values();
    const float *vals[2] = {v, v + NW};
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    if (offer) info.n_offer = 2, info.offer = model, info.offer_values = vals;
    fit_t f[2];
    char err[512];
    memset(f, 0, sizeof f);
    for (int i = 0; i < 2; i++) {
        psw_assign_t a;
        f[i].c = psw_client_new(ep, &info, err, sizeof err);
        cr_assert(f[i].c && psw_client_register(f[i].c, &a, 60, err, sizeof err) == 0, "worker %d: %s", i, err);
        cr_assert(a.n_tensors == 2 && strcmp(a.tensors[0].name, "w") == 0 && a.tensors[1].numel == COLS,
                  "the model's table");
        cr_assert_eq(psw_client_ready(f[i].c, TRAIN, TEST, NULL), 0);
        for (int t = 0; t < 2; t++) cr_assert((f[i].grad[t] = malloc(model[t].numel * sizeof(float))));
    }
    free(v);
    const double end = ps_now() + 120;
    int left = 2;
    while (left > 0) {
        cr_assert_lt(ps_now(), end, "the run did not end within 120 s");
        for (int i = 0; i < 2; i++) {
            fit_t *w = &f[i];
            psw_event_t ev;
            if (w->done) continue;
            int rc = psw_client_next(w->c, &ev, 0.05, err, sizeof err);
            if (rc == -ETIMEDOUT) continue;
            cr_assert_eq(rc, 0, "worker %d: %s", i, err);
            if (ev.kind == PSW_EV_SHUTDOWN) {
                w->done = true;
                w->code = ev.exit_code;
                left--;
            } else if (ev.kind == PSW_EV_EPOCH) {
                cr_assert_not(ev.append, "nobody leaves: no samples move");
                w->n_ids = ev.n_samples;
                w->pos = 0;
                w->epoch = ev.epoch;
                cr_assert_eq(psw_client_pull(w->c, ev.version), 0);
            } else if (ev.kind == PSW_EV_WEIGHTS) {
                while (!psw_client_push_done(w->c)) {
                }
                uint64_t b = w->n_ids - w->pos < BATCH ? w->n_ids - w->pos : BATCH;
                w->pos += b;
                const int last = w->pos >= w->n_ids;
                psw_grad_t g[2];
                for (int t = 0; t < 2; t++) {
                    cr_assert_eq(ev.tensor_numel[t], model[t].numel);
                    memcpy(w->grad[t], ev.tensors[t], model[t].numel * sizeof(float));
                    g[t] = (psw_grad_t){.tensor = (uint32_t)t, .data = w->grad[t]};
                }
                psw_push_t p = {.version = ev.version, .batch = (uint32_t)b, .loss_sum = (double)b, .pull = !last,
                                .n_grads = 2, .grads = g};
                cr_assert_eq(psw_client_push_v(w->c, &p), 0);
                if (last) cr_assert_eq(psw_client_barrier(w->c, w->epoch, w->n_ids), 0);
            } else if (ev.kind == PSW_EV_VALIDATE) {
                uint64_t n = ev.val_end - ev.val_begin;
                cr_assert_eq(psw_client_val_result(w->c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                        .loss_sum = 0.5 * (double)n, .correct = 0, .count = n, .scores = NULL}), 0);
            }
        }
    }
    for (int i = 0; i < 2; i++) {
        while (!psw_client_push_done(f[i].c)) {
        }
        psw_client_destroy(&f[i].c);
        for (int t = 0; t < 2; t++) free(f[i].grad[t]);
    }
    cr_assert_eq(f[0].code, f[1].code);
    return f[0].code;
}

/* How a sharded run of these tests starts. */
typedef struct {
    const char *shard_cwd;          /* shards 1..n-1 run there (NULL: the test's directory) */
    const char *remove;             /* this file of the test's directory is removed once shard 0 is up */
    const char *const *shard_extra; /* more arguments for shards 1..n-1 only */
    bool offer;                     /* the workers offer the model (model.kind from_worker) */
    int code;                       /* the exit code psd and the workers must end with */
} fit_opts_t;

/* psd as n shards (n 1: one psd) with the arguments args (every shard),
 * two library workers (fit), to the end: psd, every shard and the workers
 * end with o->code. */
static void fit_run(run_t *r, const char *tag, int n, const char *const *args, const char *const *shard0_extra,
                    const fit_opts_t *o)
{
    const char *a0[48], *ai[48];
    int k = 0, m = 0;
    char sh[16];
    snprintf(sh, sizeof sh, "0/%d", n);
    for (int j = 0; args[j]; j++) a0[k++] = ai[m++] = args[j];
    for (int j = 0; shard0_extra && shard0_extra[j]; j++) a0[k++] = shard0_extra[j];
    for (int j = 0; o->shard_extra && o->shard_extra[j]; j++) ai[m++] = o->shard_extra[j];
    if (n > 1) a0[k++] = "--shard", a0[k++] = sh;
    a0[k] = ai[m] = NULL;
    pid_t p = start_psd(r, tag, 2, a0), f[PS_MAX_SHARDS];
    if (o->remove) { /* shard 0 has read it: listening, it waits for its shards */
        char file[256];
        wait_log(r->psd_log, n > 1 ? "waiting for shards" : "listening on", 60);
        path(file, sizeof file, o->remove);
        cr_assert_eq(unlink(file), 0, "%s: %s", file, strerror(errno));
    }
    if (o->shard_cwd) proc_set_cwd(o->shard_cwd);
    for (int i = 1; i < n; i++) f[i] = start_shard(r, tag, i, n, ai);
    proc_set_cwd(dir);
    int wcode = fit(r->endpoint, o->offer);
    r->psd_code = proc_wait(p, 60);
    cr_assert_eq(r->psd_code, o->code, "%s: psd exit %d (log %s)", tag, r->psd_code, r->psd_log);
    cr_assert_eq(wcode, o->code, "%s: the workers were told to exit %d", tag, wcode);
    for (int i = 1; i < n; i++) cr_assert_eq(proc_wait(f[i], 30), o->code, "%s: shard %d/%d exit", tag, i, n);
}

/* The log of shard i of run tag (caller frees). */
static char *shard_log(const char *tag, int i)
{
    char name[96], file[256];
    snprintf(name, sizeof name, "%s-shard%d.log", tag, i);
    path(file, sizeof file, name);
    char *t = slurp(file);
    cr_assert_not_null(t, "%s", file);
    return t;
}

/* psd's log of run r (n shards): every shard had its part of the initial
 * values before training began (workers wait for it). */
static void values_before_training(const run_t *r, int n)
{
    char *t = slurp(r->psd_log), want[96];
    const char *ready = t ? strstr(t, "workers ready") : NULL;
    cr_assert(ready, "%s", r->psd_log);
    for (int i = 1; i < n; i++) {
        snprintf(want, sizeof want, "psd shard %d/%d has its part of the initial values", i, n);
        const char *at = strstr(t, want);
        cr_assert(at && at < ready, "%s, before training: %s", want, t);
    }
    free(t);
}

#define RUN_ARGS(...)                                                                                             \
    {"--epochs", "2", "--set", "data.train_size=512", "--set", "data.test_size=64", "--set", "checkpoint.dir=",   \
     "--set", "optimizer.clip_norm=1", __VA_ARGS__, NULL}

/* model.init with psd shards: only shard 0 reads the file. Shard 1 of 2 is
 * started where the file's relative path names nothing; with 3 shards the
 * file is removed once shard 0 read it, and shards 1 and 2 fetch their
 * parts in chunks of 1000 floats (psd --x-fetch-floats). Either way each
 * shard's part of the initial values comes from shard 0, and the run ends
 * with the weights of one psd, bit for bit. model.kind from_worker with 2
 * shards, the workers offering the same table and values: the same
 * weights again. */
Test(short, psd_shards_take_the_model_and_its_initial_values_from_shard_0)
{
    write_init("init.safetensors");
    const char *init[] = RUN_ARGS("--set", "model.kind=tensors", "--set", "model.init=init.safetensors");
    const char *from_worker[] = RUN_ARGS("--set", "model.kind=from_worker");
    char other[256];
    path(other, sizeof other, "elsewhere");
    cr_assert_eq(mkdir(other, 0755), 0);
    const char *small[] = {"--x-fetch-floats", "1000", NULL};
    run_t one, two, three, fw;
    fit_run(&one, "one", 1, init, NULL, &(fit_opts_t){0});
    fit_run(&two, "two", 2, init, NULL, &(fit_opts_t){.shard_cwd = other});
    fit_run(&three, "three", 3, init, NULL, &(fit_opts_t){.remove = "init.safetensors", .shard_extra = small});
    fit_run(&fw, "fw", 2, from_worker, NULL, &(fit_opts_t){.offer = true});
    cr_assert(weights_equal(one.weights, two.weights), "2 shards, shard 1 elsewhere = 1 psd, bit for bit");
    cr_assert(weights_equal(one.weights, three.weights), "3 shards, the file gone, small chunks = 1 psd");
    cr_assert(weights_equal(one.weights, fw.weights), "from_worker with 2 shards = model.init with 1 psd");
    values_before_training(&two, 2);
    values_before_training(&three, 3);
    values_before_training(&fw, 2);
    ps_layout_t l;
    layout_of(&l);
    char want[160];
    for (int i = 1; i < 3; i++) { /* the chunks asked for and sent */
        ps_piece_t p[PS_MAX_TENSORS];
        ps_shard_pieces(&l, i, 3, p);
        const uint64_t part = ps_part_size(p, l.n_tensors), chunks = (part + 999) / 1000;
        char *sl = shard_log("three", i), *l0 = slurp(three.psd_log);
        snprintf(want, sizeof want, "has its part of the initial values from shard 0: %" PRIu64 " floats in %" PRIu64
                 " chunks", part, chunks);
        cr_assert(chunks > 5 && strstr(sl, want), "shard %d: %s: %s", i, want, sl);
        snprintf(want, sizeof want, "psd shard %d/3 has its part of the initial values: %" PRIu64 " floats, sent in %"
                 PRIu64 " chunks", i, part, chunks);
        cr_assert(strstr(l0, want), "%s: %s", want, l0);
        free(sl);
        free(l0);
    }
    ps_layout_free(&l);
    char *s1 = shard_log("two", 1);
    cr_assert(strstr(s1, "in 1 chunks"), "16 MiB at a time: %s", s1);
    free(s1);
    /* every shard on 127.0.0.1: said once; one psd says nothing of shards */
    char *t0 = slurp(three.psd_log), *o0 = slurp(one.psd_log);
    const char *said = "all 3 psd shards run on this host", *at = strstr(t0, said);
    cr_assert(at && !strstr(at + 1, said), "once: %s", t0);
    cr_assert(!strstr(o0, "shards run on this host"), "%s", o0);
    free(t0);
    free(o0);
    char *f0 = slurp(fw.psd_log), *f1 = shard_log("fw", 1);
    cr_assert(strstr(f0, "the model is the first worker's: 2 tensors"), "%s", f0);
    cr_assert(strstr(f1, "has its part of the initial values from shard 0"), "%s", f1);
    free(f0);
    free(f1);
}

/* model.kind from_worker with 2 shards, stopped after epoch 1 (each shard
 * checkpoints its part; shard 0's file holds the table) and resumed: the
 * shards take the table from shard 0, which has it from its checkpoint,
 * and resume their parts from theirs (no initial values travel, no worker
 * is asked for its model); the run ends with the weights of one psd that
 * never stopped, bit for bit. */
Test(short, a_from_worker_run_with_psd_shards_stopped_and_resumed_gives_the_same_weights)
{
    char ck[256], ckarg[300];
    path(ck, sizeof ck, "ck");
    snprintf(ckarg, sizeof ckarg, "checkpoint.dir=%s", ck);
    const char *plain[] = RUN_ARGS("--set", "model.kind=from_worker");
    const char *args[] = RUN_ARGS("--set", "model.kind=from_worker", "--set", ckarg);
    const char *stop[] = {"--stop-after-epoch", "1", NULL}, *resume[] = {"--resume", ck, NULL};
    run_t one, a, b;
    fit_run(&one, "fw1", 1, plain, NULL, &(fit_opts_t){.offer = true});
    fit_run(&a, "fwstop", 2, args, stop, &(fit_opts_t){.offer = true});
    fit_run(&b, "fwres", 2, args, resume, &(fit_opts_t){.offer = true, .shard_extra = resume});
    cr_assert(weights_equal(one.weights, b.weights), "stopped and resumed with 2 shards = one psd that never stopped");
    char *l0 = slurp(b.psd_log), *l1 = shard_log("fwres", 1);
    cr_assert(strstr(l0, "all 2 psd shards resumed at step"), "%s", l0);
    cr_assert_null(strstr(l0, "offers the model"), "the resumed run has its model: %s", l0);
    cr_assert(strstr(l1, "resumed its part from") && !strstr(l1, "initial values"), "%s", l1);
    free(l0);
    free(l1);
}
