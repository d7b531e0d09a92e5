/* it_client.c - integration tests: the worker library against a fake psd; streamed steps and lost
 * contributors; worker slots; malformed messages; pworker's devices (see itest.h). */
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
#include "ps_table.h"
#include "ps_wire.h"

/* A fake psd: answers one REGISTER on its ROUTER with an ASSIGN of a ctr
 * model (32 -> 2) carrying task ct (batch sizes `batch` when not 0), then,
 * with wframes > 0, sends WEIGHTS of wframes f32 frames (tensor ids 0, 1,
 * ...) of wnumel floats each, or with wids, frame i of tensor wids[i], of
 * wsizes[i] floats of value wids[i] + 1 (the worker's event: the first
 * float of each tensor in wfirst); with noise > 0, that many messages no
 * worker expects from psd (PULL), 100 ms apart. With shutdown, it answers
 * the REGISTER with a SHUTDOWN of exit code shutdown_code instead (the
 * worker library's psw_client_shutdown_code() then: got_code). */
typedef struct {
    bool shutdown;
    int shutdown_code, got_code;
    void *router;
    Psd__CtrTask ct;
    uint32_t batch;
    int wframes;
    size_t wnumel;
    const uint32_t *wids;
    const size_t *wsizes;
    float wfirst[PS_MAX_TENSORS];
    int noise;
    bool check_push; /* after registering: psw_client_push_v's refusals (check_push_v) */
    bool told;       /* after the ASSIGN: an EPOCH and a SHUTDOWN with psd's last validation (check_told) */
} fake_psd_t;

/* psd's last validation as fake_psd tells it: the epoch's (EPOCH), then
 * the closing test's (SHUTDOWN). */
static void send_told(void *router, const ps_msg_t *m)
{
    Psd__NamedSum ns[2] = {PSD__NAMED_SUM__INIT, PSD__NAMED_SUM__INIT}, *nsp[2] = {&ns[0], &ns[1]};
    ns[0].name = (char *)"abs_err";
    ns[0].value = 12.5;
    ns[1].name = (char *)"a_sum_of_exactly_32_characters_x";
    ns[1].value = -3;
    Psd__ValSums v = {.base = PROTOBUF_C_MESSAGE_INIT(&psd__val_sums__descriptor), .epoch = 4,
                      .split = PSD__SPLIT__SPLIT_VAL, .count = 200, .loss_sum = 53.25, .correct = 184, .n_sums = 2,
                      .sums = nsp};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_EPOCH, 2);
    Psd__Epoch ep = PSD__EPOCH__INIT;
    ep.epoch = 5;
    ep.last_val = &v;
    h.body_case = PSD__HEADER__BODY_EPOCH;
    h.epoch = &ep;
    ps_msg_send(router, m->ident, m->ident_len, &h, NULL, 0);
    Psd__ValSums t = v;
    t.split = PSD__SPLIT__SPLIT_TEST;
    t.final = true;
    t.count = 500;
    t.n_sums = 1;
    Psd__Header d = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, 3);
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    sd.reason = (char *)"training finished";
    sd.last_val = &t;
    d.body_case = PSD__HEADER__BODY_SHUTDOWN;
    d.shutdown = &sd;
    ps_msg_send(router, m->ident, m->ident_len, &d, NULL, 0);
}

static void *fake_psd(void *p)
{
    fake_psd_t *f = p;
    ps_msg_t m = {0};
    char err[256];
    if (ps_msg_recv(f->router, &m, true, 0, err, sizeof err) != 0) return NULL;
    if (f->shutdown) {
        Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, 1);
        Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
        sd.exit_code = f->shutdown_code;
        sd.reason = (char *)"training finished";
        h.body_case = PSD__HEADER__BODY_SHUTDOWN;
        h.shutdown = &sd;
        ps_msg_send(f->router, m.ident, m.ident_len, &h, NULL, 0);
        ps_msg_deinit(&m);
        return NULL;
    }
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_ASSIGN, 1);
    Psd__Assign a = PSD__ASSIGN__INIT;
    Psd__Hyper hy = PSD__HYPER__INIT;
    uint32_t layers[] = {32, 2};
    a.layers = layers;
    a.n_layers = 2;
    hy.batch_size = f->batch ? f->batch : 16;
    hy.val_batch_size = f->batch ? f->batch : 16;
    hy.norm_std = 1;
    a.hyper = &hy;
    a.start_timeout_s = 5;
    a.step_timeout_s = 5;
    a.ctr = &f->ct;
    a.model = (char *)"ctr";
    h.body_case = PSD__HEADER__BODY_ASSIGN;
    h.assign = &a;
    ps_layout_t tl; /* the table (protocol 7): the one its sizes and task make */
    uint8_t *tb = NULL;
    size_t tlen = 0;
    int tk = ps_layout_init_table(&tl, (const int[]){32, 2}, 2, f->ct.rows, (int)f->ct.dim);
    if (tk == 0) tk = ps_table_pack(&tl, &tb, &tlen);
    ps_frame_t tf = {.data = tb, .nbytes = tlen, .dtype = PSD__DTYPE__DT_U8, .rows = tlen, .copy = true};
    ps_msg_send(f->router, m.ident, m.ident_len, &h, tk == 0 ? &tf : NULL, tk == 0);
    free(tb);
    if (f->told) send_told(f->router, &m);
    if (f->wframes > 0) {
        float *v = calloc(f->wnumel ? f->wnumel : 1, sizeof *v), *vi[PS_MAX_FRAMES] = {NULL};
        ps_frame_t fr[PS_MAX_FRAMES];
        for (int i = 0; i < f->wframes && i < PS_MAX_FRAMES; i++) {
            fr[i] = (ps_frame_t){.data = v, .nbytes = f->wnumel * sizeof *v, .id = (uint32_t)i,
                                 .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)f->wnumel};
            if (!f->wids) continue;
            vi[i] = malloc(f->wsizes[i] * sizeof *vi[i]);
            for (size_t j = 0; j < f->wsizes[i]; j++) vi[i][j] = (float)f->wids[i] + 1.0f;
            fr[i] = (ps_frame_t){.data = vi[i], .nbytes = f->wsizes[i] * sizeof(float), .id = f->wids[i],
                                 .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)f->wsizes[i], .copy = true};
        }
        Psd__Header w = fake_hdr(PSD__MSG_TYPE__MSG_WEIGHTS, 2);
        Psd__Weights wt = PSD__WEIGHTS__INIT;
        wt.version = 1;
        w.body_case = PSD__HEADER__BODY_WEIGHTS;
        w.weights = &wt;
        ps_msg_send(f->router, m.ident, m.ident_len, &w, fr, f->wframes < PS_MAX_FRAMES ? f->wframes : PS_MAX_FRAMES);
        free(v);
        for (int i = 0; i < PS_MAX_FRAMES; i++) free(vi[i]);
    }
    for (int i = 0; i < f->noise; i++) {
        Psd__Header n = fake_hdr(PSD__MSG_TYPE__MSG_PULL, 3 + (uint64_t)i);
        Psd__Pull pl = PSD__PULL__INIT;
        n.body_case = PSD__HEADER__BODY_PULL;
        n.pull = &pl;
        ps_msg_send(f->router, m.ident, m.ident_len, &n, NULL, 0);
        nanosleep(&(struct timespec){0, 100000000L}, NULL);
    }
    ps_msg_deinit(&m);
    return NULL;
}

/* A ctr task that fits the fake psd's model: 4 fields x 8 = 32 inputs, a
 * table of 50 x 8. */
static Psd__CtrTask fake_ctr_task(void)
{
    Psd__CtrTask ct = PSD__CTR_TASK__INIT;
    ct.fields = 4;
    ct.per_field = 2;
    ct.vocab = 100;
    ct.zipf = 1.1;
    ct.rows = 50;
    ct.dim = 8;
    ct.mean = true;
    ct.weight_std = 1;
    ct.seed = 3;
    ct.train = 1000;
    ct.test = 100;
    return ct;
}

/* psw_client_push_v refuses, before anything is sent, a push that is not
 * of the run's table (fake_psd's: fc1.weight [2, 32], fc1.bias [2], the
 * table [rows, dim]): an index past it, a gradient neither whole nor rows
 * or both, rows of a tensor that is not the table, rows twice, rows wanted
 * without the table's rows, more gradients than tensors. */
static void check_push_v(psw_client_t *c, const psw_assign_t *a)
{
    static float g[64 * 1024];
    const uint32_t ids[2] = {1, 3};
    cr_assert_eq(a->n_tensors, 3);
    cr_expect_str_eq(a->tensors[0].name, "fc1.weight");
    cr_expect_eq(a->tensors[2].sparse_rows, 1);
    const struct {
        psw_grad_t gr[2];
        int n;
        size_t n_want;
        const char *what;
    } bad[] = {
        {{{.tensor = 3, .data = g}}, 1, 0, "an index past the table"},
        {{{.tensor = 0}}, 1, 0, "neither data nor rows"},
        {{{.tensor = 2, .data = g, .row_ids = ids, .n_rows = 2, .row_vals = g}}, 1, 0, "data and rows"},
        {{{.tensor = 0, .row_ids = ids, .n_rows = 2, .row_vals = g}}, 1, 0, "rows of a dense tensor"},
        {{{.tensor = 2, .row_ids = ids, .n_rows = 2, .row_vals = g}, {.tensor = 2, .row_ids = ids, .n_rows = 2,
          .row_vals = g}}, 2, 0, "rows twice"},
        {{{.tensor = 2, .row_ids = ids, .n_rows = 0, .row_vals = g}}, 1, 0, "no rows"},
        {{{.tensor = 0, .data = g}}, 1, 2, "rows wanted without the table's rows"},
        {{{.tensor = 0, .data = g}}, PSW_MAX_TENSORS + 1, 0, "more gradients than a table holds"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        psw_push_t p = {.version = 0, .batch = 1, .pull = 1, .n_grads = bad[i].n, .grads = bad[i].gr, .want = ids,
                        .n_want = bad[i].n_want};
        cr_expect_eq(psw_client_push_v(c, &p), -EINVAL, "%s", bad[i].what);
    }
    cr_expect_eq(psw_client_push_v(c, NULL), -EINVAL);
    cr_expect(psw_client_push_done(c), "nothing was sent");
}

/* The events of send_told: psd's figures as it sent them, the names the
 * client's own copies. */
static int check_told(psw_client_t *c, char *err, size_t errlen)
{
    psw_event_t ev;
    int rc = psw_client_next(c, &ev, 10, err, errlen);
    if (rc != 0) return rc;
    cr_assert_eq(ev.kind, PSW_EV_EPOCH);
    cr_assert_eq(ev.has_last_val, 1);
    const psw_val_t *v = &ev.last_val;
    cr_expect(v->epoch == 4 && v->split == PSW_SPLIT_VAL && !ev.last_val_final && v->count == 200 &&
              v->loss_sum == 53.25 && v->correct == 184 && v->version == 0 && v->begin == 0 && !v->scores);
    cr_assert_eq(v->n_sums, 2);
    cr_expect_str_eq(v->sums[0].name, "abs_err");
    cr_expect_eq(v->sums[0].value, 12.5);
    cr_expect_str_eq(v->sums[1].name, "a_sum_of_exactly_32_characters_x");
    cr_expect_eq(v->sums[1].value, -3);
    if ((rc = psw_client_next(c, &ev, 10, err, errlen)) != 0) return rc;
    cr_assert_eq(ev.kind, PSW_EV_SHUTDOWN);
    cr_assert_eq(ev.has_last_val, 1);
    cr_expect(v->split == PSW_SPLIT_TEST && ev.last_val_final && v->count == 500 && v->n_sums == 1);
    cr_expect_str_eq(v->sums[0].name, "abs_err");
    return 0;
}

/* One worker (library) against fake psd f: the result of registering and,
 * when it registered and f sends weights, of the next event; err says why. */
static int against_fake_psd(fake_psd_t *f, void *ctx, psw_assign_t *a, char *err, size_t errlen)
{
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
    f->router = zmq_socket(ctx, ZMQ_ROUTER);
    cr_assert_eq(zmq_bind(f->router, ep), 0);
    pthread_t th;
    pthread_create(&th, NULL, fake_psd, f);
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(ep, &info, err, errlen);
    cr_assert_not_null(c, "%s", err);
    int rc = psw_client_register(c, a, 10, err, errlen);
    if (rc == 0 && f->check_push) check_push_v(c, a);
    if (rc == 0 && f->told) rc = check_told(c, err, errlen);
    psw_event_t ev;
    if (rc == 0 && f->wframes > 0) rc = psw_client_next(c, &ev, 10, err, errlen);
    if (rc == 0 && f->wframes > 0 && ev.kind == PSW_EV_WEIGHTS)
        for (int t = 0; t < ev.n_tensors && t < PS_MAX_TENSORS; t++) f->wfirst[t] = ev.tensor_numel[t] ? ev.tensors[t][0] : -1;
    if (rc == 0 && f->noise > 0) { /* 1 s to wait, which the messages it drops do not prolong */
        double t0 = ps_now();
        rc = psw_client_next(c, &ev, 1, err, errlen);
        cr_expect_lt(ps_now() - t0, 4.0, "waited %.1f s of psd's %d unexpected messages for a 1 s wait",
                     ps_now() - t0, f->noise);
    }
    pthread_join(th, NULL);
    f->got_code = psw_client_shutdown_code(c);
    psw_client_destroy(&c);
    int linger = 0;
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(f->router);
    return rc;
}

/* against_fake_psd with f, which the worker gets through (its checks are f's). */
static void passes_fake_psd(fake_psd_t f)
{
    void *ctx = zmq_ctx_new();
    char err[512] = "";
    psw_assign_t a;
    cr_assert_eq(against_fake_psd(&f, ctx, &a, err, sizeof err), 0, "%s", err);
    zmq_ctx_term(ctx);
}

Test(short, a_push_that_is_not_of_the_table_is_refused)
{
    passes_fake_psd((fake_psd_t){.ct = fake_ctr_task(), .check_push = true});
}

/* psd's last validation in EPOCH and SHUTDOWN (Epoch.last_val,
 * Shutdown.last_val) comes to the worker as psd sent it
 * (psw_event_t.last_val); a real psd's figures against its metrics file:
 * python/tests/test_last_val.py. */
Test(short, psds_last_validation_comes_with_epoch_and_shutdown)
{
    passes_fake_psd((fake_psd_t){.ct = fake_ctr_task(), .told = true});
}

/* psd ends the run while a worker registers (again, after psd declared it
 * lost): the SHUTDOWN that comes instead of the assignment ends the
 * registration at once with psd's exit code (it was dropped, and the worker
 * waited for an assignment that never came). */
Test(short, a_shutdown_instead_of_the_assignment_ends_the_registration)
{
    void *ctx = zmq_ctx_new();
    fake_psd_t f = {.shutdown = true, .shutdown_code = 3};
    char err[512] = "";
    psw_assign_t a;
    double t0 = ps_now();
    int rc = against_fake_psd(&f, ctx, &a, err, sizeof err);
    cr_expect_eq(rc, -ESHUTDOWN, "rc %d: %s", rc, err);
    cr_expect_eq(f.got_code, 3);
    cr_expect(strstr(err, "psd ended the run: training finished"), "%s", err);
    cr_expect_lt(ps_now() - t0, 5.0, "the registration waited for its timeout (10 s)");
    zmq_ctx_term(ctx);
}

/* The worker checks the ctr task psd sends as psd checks its config: a task
 * whose sizes overflow, or that does not fit the model, is refused with a
 * message (and nothing is allocated from it); a good one is taken. */
Test(short, a_bad_ctr_task_from_psd_is_refused)
{
    Psd__CtrTask good = fake_ctr_task();
    Psd__CtrTask bad[7];
    for (int i = 0; i < 7; i++) bad[i] = good;
    bad[0].test = UINT64_MAX; /* train + test wraps */
    bad[1].train = (uint64_t)1 << 33;
    bad[2].dim = 7;           /* fields x dim != layers[0] */
    bad[3].fields = 0;
    bad[4].per_field = 1000;  /* fields x per_field > 256 */
    bad[5].zipf = NAN;
    bad[6].rows = 0;
    void *ctx = zmq_ctx_new();
    for (int i = 0; i <= 7; i++) {
        fake_psd_t f = {.ct = i < 7 ? bad[i] : good};
        char err[512] = "";
        psw_assign_t a;
        int rc = against_fake_psd(&f, ctx, &a, err, sizeof err);
        if (i < 7) {
            cr_expect_eq(rc, -EPROTO, "case %d accepted", i);
            cr_expect(strstr(err, "invalid ctr task"), "case %d: %s", i, err);
        } else {
            cr_expect_eq(rc, 0, "the good task: %s", err);
            cr_expect_eq(a.ctr.fields, 4);
            cr_expect_eq(a.ctr.rows, 50);
            cr_expect_eq(a.n_files, 0);
        }
    }
    zmq_ctx_term(ctx);
}

/* The worker checks psd's batch sizes and weights: a batch size past
 * psd's own limit is an invalid assignment (it aborted the worker when cast
 * to int), and weights must be one frame per tensor of the model, each of
 * its size (40 frames overran the event's arrays). The model: W 32 x 2, b 2,
 * table 50 x 8. And a wait ends at its deadline however many messages the
 * worker drops meanwhile (each one restarted it). */
Test(short, bad_batch_sizes_and_weights_from_psd_are_refused)
{
    Psd__CtrTask ct = fake_ctr_task();
    void *ctx = zmq_ctx_new();
    char err[512] = "";
    psw_assign_t a;
    fake_psd_t big = {.ct = ct, .batch = 1u << 31};
    cr_expect_eq(against_fake_psd(&big, ctx, &a, err, sizeof err), -EPROTO, "a batch of 2^31 was taken");
    cr_expect(strstr(err, "invalid assignment"), "%s", err);
    fake_psd_t many = {.ct = ct, .wframes = 40, .wnumel = 2};
    cr_expect_eq(against_fake_psd(&many, ctx, &a, err, sizeof err), -EPROTO, "40 weights frames were taken");
    cr_expect(strstr(err, "40 weights frames for a model of 3 tensors"), "%s", err);
    fake_psd_t small = {.ct = ct, .wframes = 3, .wnumel = 2}; /* W and the table too small */
    cr_expect_eq(against_fake_psd(&small, ctx, &a, err, sizeof err), -EPROTO, "short weights frames were taken");
    cr_expect(strstr(err, "invalid weights frame 0"), "%s", err);
    /* protocol 5: tensor frames in any order, each tensor once (the model: W 64, b 2, the table 400) */
    const uint32_t rev[3] = {2, 1, 0}, twice[3] = {0, 0, 2}, beyond[3] = {1, 0, 3};
    const size_t rev_n[3] = {400, 2, 64}, twice_n[3] = {64, 64, 400}, beyond_n[3] = {2, 64, 400};
    fake_psd_t any = {.ct = ct, .wframes = 3, .wids = rev, .wsizes = rev_n};
    cr_expect_eq(against_fake_psd(&any, ctx, &a, err, sizeof err), 0, "frames in reverse: %s", err);
    cr_expect(any.wfirst[0] == 1.0f && any.wfirst[1] == 2.0f && any.wfirst[2] == 3.0f,
              "each tensor from its frame: %g %g %g", any.wfirst[0], any.wfirst[1], any.wfirst[2]);
    fake_psd_t two = {.ct = ct, .wframes = 3, .wids = twice, .wsizes = twice_n};
    cr_expect_eq(against_fake_psd(&two, ctx, &a, err, sizeof err), -EPROTO, "a tensor twice was taken");
    cr_expect(strstr(err, "not one of each tensor"), "%s", err);
    fake_psd_t out = {.ct = ct, .wframes = 3, .wids = beyond, .wsizes = beyond_n};
    cr_expect_eq(against_fake_psd(&out, ctx, &a, err, sizeof err), -EPROTO, "a tensor beyond the model was taken");
    cr_expect(strstr(err, "not one of each tensor"), "%s", err);
    fake_psd_t ok = {.ct = ct, .batch = 1u << 20};
    cr_expect_eq(against_fake_psd(&ok, ctx, &a, err, sizeof err), 0, "psd's largest batch: %s", err);
    fake_psd_t noisy = {.ct = ct, .noise = 80}; /* 8 s of messages it drops */
    cr_expect_eq(against_fake_psd(&noisy, ctx, &a, err, sizeof err), -ETIMEDOUT, "%s", err);
    zmq_ctx_term(ctx);
}

/* A worker that finished its samples, pushed its last batch (no pull) and
 * reached the barrier is given more samples when another is lost; it asks
 * for weights while its last push still waits for the step (a third worker
 * has not pushed yet). psd must answer with the version that step makes:
 * the version its push was computed on would make its next push stale. */
Test(short, more_samples_while_the_last_push_waits_are_trained_on_the_next_version)
{
    run_t r;
    /* (grad_room 0: this thread drives the 3 workers one after the other, so none could answer
     * psd's GO while it waits on another) */
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--worker-timeout", "1", "--set", "checkpoint.dir=", "--set", "server.grad_room=0", NULL};
    pid_t p = start_psd(&r, "defer", 3, args);
    char err[512];
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 16);
    psw_client_t *all[3];
    lib_start(r.endpoint, all, 3, 128); /* 128 samples each: two batches of 64 */
    psw_client_t *A = all[0], *C = all[2];
    for (int i = 0; i < 3; i++) {
        lib_next(all[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.version, 0);
        lib_push(all[i], 0, 64, 1, zero, &l);
    }
    for (int i = 0; i < 3; i++) {
        lib_next(all[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.version, 1);
    }
    lib_push(A, 1, 64, 0, zero, &l); /* A's last batch, then its barrier */
    psw_client_barrier(A, 0, 128);
    /* B falls silent; C keeps psd company (heartbeats) without pushing */
    double deadline = ps_now() + 20;
    int rc;
    for (;;) {
        psw_client_heartbeat(C, 0);
        rc = psw_client_next(A, &ev, 0.3, err, sizeof err);
        if (rc == 0 || ps_now() > deadline) break;
    }
    cr_assert_eq(rc, 0, "A was given B's samples: %s", err);
    cr_assert(ev.kind == PSW_EV_EPOCH && ev.append, "more samples for A (event %d)", (int)ev.kind);
    psw_client_pull(A, ev.version);
    lib_next(C, &ev, PSW_EV_EPOCH);
    cr_assert(ev.append);
    lib_push(C, 1, 64, 1, zero, &l); /* the step A's last push waited for */
    lib_next(A, &ev, PSW_EV_WEIGHTS);
    cr_assert_eq(ev.version, 2, "A is answered with the version the step made, not the one its push used");
    lib_next(C, &ev, PSW_EV_WEIGHTS);
    cr_assert_eq(ev.version, 2);
    for (int i = 0; i < 3; i++) psw_client_destroy(&all[i]);
    free(zero);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* train.stream: gradients and weights travel in chunks, each stepped as
 * soon as every worker has sent it, and the new values go back at once:
 * the same bits as whole steps (SGD; Adam with global-norm clipping, where
 * the chunks are reduced as they come and applied once the norm is known),
 * over the wire and with one worker on shared memory; the streamed weights
 * are checked by the workers against psd's CRC-32 of the version. */
Test(short, streamed_steps_give_the_same_weights_as_whole_steps)
{
    const char *opt[2][8] = {
        {"--set", "optimizer.name=sgd", NULL},
        {"--set", "optimizer.name=adam", "--set", "optimizer.lr=0.001", "--set", "optimizer.clip_norm=0.5", NULL}};
    const char *wire[] = {"--no-shm", "--verbose", NULL}, *shm[] = {"--verbose", NULL};
    for (int o = 0; o < 2; o++) {
        const char *args[24] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "13", "--x-verify-weights",
                                "--set", "server.chunk_bytes=65536", "--set", "checkpoint.dir="};
        int n = 11;
        for (int i = 0; opt[o][i]; i++) args[n++] = opt[o][i];
        args[n] = NULL;
        run_t a, b, c;
        char ta[16], tb[16], tc[16];
        snprintf(ta, sizeof ta, "whole%d", o);
        snprintf(tb, sizeof tb, "stream%d", o);
        snprintf(tc, sizeof tc, "smix%d", o);
        train_wx(&a, ta, 2, args, wire, 300);
        check_run(&a, 2, 2);
        args[n] = "--set";
        args[n + 1] = "train.stream=true";
        args[n + 2] = NULL;
        train_wx(&b, tb, 2, args, wire, 300);
        check_run(&b, 2, 2);
        pid_t p = start_psd(&c, tc, 2, args); /* rank 0 on shared memory, rank 1 on the wire */
        pid_t w0 = start_worker(&c, tc, 0, shm);
        wait_log(c.psd_log, "worker registered: rank 0", 60);
        pid_t w1 = start_worker(&c, tc, 1, wire);
        c.psd_code = proc_wait(p, 300);
        c.worker_code[0] = proc_wait(w0, 30);
        c.worker_code[1] = proc_wait(w1, 30);
        check_run(&c, 2, 2);
        char *lb = slurp(b.psd_log), *lc = slurp(c.psd_log);
        cr_assert(strstr(lb, "streamed steps: 37 chunks of up to 64 KiB"), "%s", lb);
        cr_assert_eq(count_in(lc, "through shared memory"), 1, "one of each:\n%s", lc);
        free(lb);
        free(lc);
        cr_assert(weights_equal(a.weights, b.weights), "streamed = whole steps, bit for bit (%s)", opt[o][1]);
        cr_assert(weights_equal(a.weights, c.weights), "streamed with a worker on shared memory (%s)", opt[o][1]);
        assert_workers_verified(tb, 2, "the streamed weights");
    }
}

/* A library worker with `left` of its `assigned` samples of epoch 1 to
 * train (weights asked for) trains until psd's SHUTDOWN in batches of 64,
 * taking the samples psd adds (appended: as an EPOCH that adds to the
 * epoch under way, else one that starts it: it then asks for weights),
 * and answers validations. Returns the samples it trained. */
static uint64_t lib_train_to_end(psw_client_t *c, uint64_t left, uint64_t assigned, bool appended, const float *zero,
                                 const ps_layout_t *l)
{
    char err[512];
    psw_event_t ev;
    uint64_t trained = 0;
    for (;;) {
        int rc = psw_client_next(c, &ev, 30, err, sizeof err);
        cr_assert_eq(rc, 0, "%s", err);
        if (ev.kind == PSW_EV_SHUTDOWN) return trained;
        if (ev.kind == PSW_EV_EPOCH) {
            cr_assert_eq(ev.append, appended);
            left += ev.n_samples;
            assigned += ev.n_samples;
            if (!appended) psw_client_pull(c, ev.version);
        } else if (ev.kind == PSW_EV_WEIGHTS) {
            cr_assert_gt(left, 0);
            uint32_t batch = left < 64 ? (uint32_t)left : 64;
            left -= batch;
            trained += batch;
            lib_push(c, ev.version, batch, left > 0, zero, l);
            if (left == 0) psw_client_barrier(c, 0, assigned);
        } else if (ev.kind == PSW_EV_VALIDATE) {
            psw_client_val_result(c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                    .loss_sum = 0.1 * (double)(ev.val_end - ev.val_begin), .correct = 0,
                    .count = ev.val_end - ev.val_begin, .scores = NULL});
        }
    }
}

/* psd for the streamed-loss tests: 384 samples, 7 chunks of 64 KiB, a
 * worker lost after 1 s of silence, clipping or not */
#define STREAM_LOSS_ARGS(clip)                                                                                        \
    "--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]", "--set",                  \
        "server.chunk_bytes=65536", "--set", "train.stream=true", "--worker-timeout", "1", "--set", "checkpoint.dir=", \
        "--set", (clip) ? "optimizer.clip_norm=1" : "optimizer.clip_norm=0"

/* train.stream: a worker lost after some of its chunks were stepped (with
 * clipping: reduced, to be applied once the norm is known). Its gradient
 * cannot be taken out of them again, so its batch counts as trained (with
 * clipping: once the step is taken) and the rest of the step goes on with
 * the other worker's alone; its other samples go to that worker; every
 * sample is trained once and nothing hangs. Two library workers: B sends
 * only its first tensor's chunks, then falls silent. */
static void lose_one_streamed_contributor(const char *tag, bool clip)
{
    run_t r;
    const char *args[] = {STREAM_LOSS_ARGS(clip), NULL};
    pid_t p = start_psd(&r, tag, 2, args);
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 64);
    psw_client_t *both[2];
    lib_start(r.endpoint, both, 2, 192);
    psw_client_t *A = both[0], *B = both[1];
    for (int i = 0; i < 2; i++) {
        lib_next(both[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.version, 0);
    }
    lib_push(A, 0, 64, 1, zero, &l);
    const psw_grad_t g0 = {.tensor = 0, .data = zero};
    const psw_push_t p0 = {.version = 0, .batch = 64, .loss_sum = 32.0, .pull = 1, .n_grads = 1, .grads = &g0};
    cr_assert_eq(psw_client_push_v(B, &p0), 0); /* W0's 4 chunks */
    while (!psw_client_push_done(B)) sched_yield();
    wait_log(r.psd_log, "its gradient is in 4 of 7 chunks", 30);
    psw_client_destroy(&B);
    /* A trains the rest: its own 128 samples and B's 128 */
    uint64_t trained = 64 + lib_train_to_end(A, 128, 192, true, zero, &l);
    cr_assert_eq(trained, 320, "A trained its 192 samples and B's 128 not yet trained");
    psw_client_destroy(&A);
    free(zero);
    r.psd_code = proc_wait(p, 60);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 384, "every sample trained once: %s", last_line(m));
    free(m);
}

Test(short, a_worker_lost_in_the_middle_of_a_streamed_step) { lose_one_streamed_contributor("stlost", false); }

Test(short, a_worker_lost_in_the_middle_of_a_streamed_step_with_clipping)
{
    lose_one_streamed_contributor("stlostc", true);
}

/* train.stream, n workers that each send their first tensor's chunks and
 * fall silent: psd logs `said` (once the last is lost), and C, joining, is
 * given `left` samples and trains them; every sample is trained once, in 6
 * steps in all. */
static void lose_every_streamed_contributor(const char *tag, int n, bool clip, const char *said, uint64_t left)
{
    run_t r;
    const char *args[] = {STREAM_LOSS_ARGS(clip), NULL};
    pid_t p = start_psd(&r, tag, n, args);
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 64);
    psw_client_t *b[2], *c[1];
    cr_assert(n >= 1 && n <= 2);
    lib_start(r.endpoint, b, n, 384 / (size_t)n);
    const psw_grad_t g0 = {.tensor = 0, .data = zero};
    const psw_push_t p0 = {.version = 0, .batch = 64, .loss_sum = 32.0, .pull = 1, .n_grads = 1, .grads = &g0};
    for (int i = 0; i < n; i++) {
        lib_next(b[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(psw_client_push_v(b[i], &p0), 0); /* W0's 4 chunks */
        while (!psw_client_push_done(b[i])) sched_yield();
    }
    wait_log(r.psd_log, said, 30);
    for (int i = 0; i < n; i++) psw_client_destroy(&b[i]);
    lib_start(r.endpoint, c, 1, left);
    uint64_t trained = lib_train_to_end(c[0], left, left, true, zero, &l);
    cr_assert_eq(trained, left);
    psw_client_destroy(&c[0]);
    free(zero);
    r.psd_code = proc_wait(p, 60);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 384, "every sample trained once: %s", last_line(m));
    cr_assert_eq(json_num(last_line(m), "step"), 6, "6 steps in all: %s", last_line(m));
    free(m);
}

/* With clipping chunks take the step only once the global norm is known,
 * so the step whose only contributor is lost in the middle of it takes
 * none (the chunks keep their values, Adam's count stays) and its batch is
 * still to be trained, as a gradient lost before a whole step: C is given
 * the whole epoch, and its 6 steps are the run's only ones. */
Test(short, a_streamed_step_whose_only_contributor_is_lost_is_no_step)
{
    lose_every_streamed_contributor(
        "stvoid", 1, true, "before any chunk took the step: no step is taken, and its batch of 64 is still to be trained",
        384);
}

/* The same with two contributors lost one by one: the first one's gradient
 * is in the chunks reduced so far, so its batch would count as trained had
 * the step been taken; it was not, so that batch is trained again too (it
 * was lost for the epoch: C was given 320 samples). */
Test(short, a_streamed_step_whose_contributors_are_all_lost_is_no_step)
{
    lose_every_streamed_contributor("stvoid2", 2, true, "no step is taken, and its batch of 64 is still to be trained",
                                    384);
}

/* Without clipping B's first tensor took the step before B was lost: its
 * batch counts as trained and the step ends with the other chunks as they
 * were (it never ended: psd then stepped those chunks again with no
 * contributor and waited for them forever); C is given the other 320
 * samples (5 steps after B's). */
Test(short, a_streamed_step_whose_only_contributor_is_lost_after_some_chunks_ends)
{
    lose_every_streamed_contributor("stlast", 1, false, "its batch of 64 counts as trained", 320);
}

/* Worker slots (1024 a run; 2 here with --x-max-workers): once every one
 * was taken, a new worker is refused with the reason until a gone worker's
 * slot is older than a worker's patience with psd (3 x its silence limit +
 * 10 s: it has registered again, or is dead); then it gets that slot and
 * its rank. A worker that registers again with its identity (as pworker
 * does) gets its own gone slot at once. Library workers: A (rank 0)
 * registers and leaves; B (rank 1) takes A's samples and falls silent
 * (lost), registers again with its identity (rank 1 again, at once) and
 * leaves; C is refused, retries, gets A's slot (gone longest) and trains
 * the epoch as rank 0. */
Test(short, worker_slots_are_reused_once_every_one_was_taken)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]",
                          "--worker-timeout", "1", "--x-max-workers", "2", "--set", "checkpoint.dir=",
                          "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "slots", 1, args);
    char err[512];
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 64);
    psw_client_t *a[1];
    lib_start(r.endpoint, a, 1, 384);
    psw_client_leave(a[0], "test");
    psw_client_destroy(&a[0]);
    wait_log(r.psd_log, "rank 0 (", 10);
    wait_log(r.psd_log, "left the run", 10);
    double gone = ps_now();
    static const char bid[] = "worker-b-identity";
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1, .identity = bid, .identity_len = sizeof bid};
    psw_assign_t as;
    psw_client_t *b = psw_client_new(r.endpoint, &info, err, sizeof err); /* rank 1 takes the samples A left */
    cr_assert(b && psw_client_register(b, &as, 30, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(as.rank, 1);
    cr_assert_eq(psw_client_ready(b, 384, 10000, NULL), 0);
    lib_next(b, &ev, PSW_EV_EPOCH);
    wait_log(r.psd_log, "lost: nothing from it", 10); /* B: silent while training */
    psw_client_destroy(&b);
    b = psw_client_new(r.endpoint, &info, err, sizeof err); /* B again: its own slot */
    cr_assert(b && psw_client_register(b, &as, 30, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(as.rank, 1, "its own slot");
    cr_assert_lt(ps_now() - gone, 9.0, "at once, not after a worker's patience");
    psw_client_leave(b, "test");
    psw_client_destroy(&b);
    wait_log(r.psd_log, "rank 1 registers again in its own slot: every one of psd's 2 worker slots was taken", 10);
    static const char cid[] = "worker-c-identity";
    info.identity = cid;
    info.identity_len = sizeof cid;
    psw_client_t *c = NULL;
    int refused = 0;
    for (;;) { /* refused until A's slot is free again */
        c = psw_client_new(r.endpoint, &info, err, sizeof err);
        cr_assert_not_null(c, "%s", err);
        if (psw_client_register(c, &as, 30, err, sizeof err) == 0) break;
        cr_assert(strstr(err, "psd refused: psd has no free worker slot"), "%s", err);
        psw_client_destroy(&c);
        refused++;
        cr_assert_lt(ps_now() - gone, 40, "a slot comes free within 3 x silence + 10 s");
        usleep(500000);
    }
    double waited = ps_now() - gone;
    cr_assert_gt(refused, 0, "refused while both slots were taken");
    cr_assert_gt(waited, 9.0, "A's slot was given after a worker's patience (%.1f s)", waited);
    cr_assert_eq(as.rank, 0, "the slot gone longest: A's");
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "refused a worker from") && strstr(log, "no free worker slot"), "%s", log);
    cr_assert(strstr(log, "rank 0 is given to a new worker: every one of psd's 2 worker slots was taken"), "%s", log);
    free(log);
    cr_assert_eq(psw_client_ready(c, 384, 10000, NULL), 0);
    cr_assert_eq(lib_train_to_end(c, 0, 0, false, zero, &l), 384, "the reused slot's worker trained the epoch");
    psw_client_destroy(&c);
    free(zero);
    r.psd_code = proc_wait(p, 60);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 384, "every sample trained once: %s", last_line(m));
    free(m);
}

/* A raw worker's message: header fields, then send (protocol filled in). */
static void raw_send(void *d, uint64_t *seq, uint64_t run, uint32_t rank, Psd__Header *h, const ps_frame_t *fr, int n)
{
    h->seq = ++*seq;
    h->run_id = run;
    h->rank = rank;
    cr_assert_eq(ps_msg_send(d, NULL, 0, h, fr, n), 0);
}

/* The next message psd sends d, which must be of `type` (psd's HEARTBEATs,
 * every second while a worker waits on it, are skipped). */
static void raw_expect(void *d, ps_msg_t *m, Psd__MsgType type)
{
    char err[256];
    do {
        zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
        cr_assert_eq(zmq_poll(&it, 1, 30000), 1, "psd answers");
        ps_msg_deinit(m);
        cr_assert_eq(ps_msg_recv(d, m, false, 0, err, sizeof err), 0, "%s", err);
    } while (m->hdr->type == PSD__MSG_TYPE__MSG_HEARTBEAT && type != PSD__MSG_TYPE__MSG_HEARTBEAT);
    cr_assert_eq(m->hdr->type, type, "got %s", ps_msg_type_name((int)m->hdr->type));
}

/* A raw worker on d: registers (the ASSIGN left in *m), says READY with
 * these counts, takes its EPOCH, pulls and takes version 0's WEIGHTS. */
static void raw_start(void *d, ps_msg_t *m, uint64_t *run, uint64_t *seq, uint32_t *rank, uint64_t train_count,
                      uint64_t test_count)
{
    cr_assert_eq(raw_register(d, m), 0);
    cr_assert_eq(m->hdr->type, PSD__MSG_TYPE__MSG_ASSIGN);
    *run = m->hdr->run_id;
    *seq = 1;
    *rank = m->hdr->assign->rank;
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Ready rd = PSD__READY__INIT;
    rd.train_count = train_count;
    rd.test_count = test_count;
    h.type = PSD__MSG_TYPE__MSG_READY;
    h.body_case = PSD__HEADER__BODY_READY;
    h.ready = &rd;
    raw_send(d, seq, *run, *rank, &h, NULL, 0);
    raw_expect(d, m, PSD__MSG_TYPE__MSG_EPOCH);
    Psd__Pull pl = PSD__PULL__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_PULL;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    raw_send(d, seq, *run, *rank, &h, NULL, 0);
    raw_expect(d, m, PSD__MSG_TYPE__MSG_WEIGHTS);
    cr_assert_eq(m->hdr->weights->version, 0);
}

/* A message with this run's id from a peer psd does not know (a worker
 * whose slot went to another, or one from before a restart) is dropped and
 * answered with ERR_LOST, so that the worker registers again at once; a
 * stranger with another run id gets nothing. */
Test(short, a_stranger_of_this_run_is_told_to_register_again)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "stranger", 1, args);
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint), *x = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq, xseq = 0;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, 384, 10000);
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull pl = PSD__PULL__INIT;
    h.type = PSD__MSG_TYPE__MSG_PULL;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    raw_send(x, &xseq, run + 1, 0, &h, NULL, 0); /* another run's */
    zmq_pollitem_t it = {x, 0, ZMQ_POLLIN, 0};
    cr_assert_eq(zmq_poll(&it, 1, 500), 0, "no answer to a stranger of another run");
    raw_send(x, &xseq, run, 0, &h, NULL, 0);
    raw_expect(x, &m, PSD__MSG_TYPE__MSG_ERROR);
    cr_assert_eq(m.hdr->error->code, PSD__ERR_CODE__ERR_LOST);
    cr_assert(strstr(m.hdr->error->message, "register again"), "%s", m.hdr->error->message);
    ps_msg_deinit(&m);
    zmq_close(x);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGTERM);
    cr_assert_neq(proc_wait(p, 60), -1, "psd ended");
}

/* A message psd cannot take from a worker in the run ends that worker's run
 * at once, with the reason: a fresh raw worker (registered, READY, its EPOCH
 * and version 0's weights) sends frames fr[0..n) with header h and gets
 * SHUTDOWN, exit 2, its reason containing `words`; psd goes on. */
static void raw_refused(const char *endpoint, Psd__Header *h, const ps_frame_t *fr, int n, uint64_t train,
                        uint64_t test, const char *words)
{
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, train, test);
    raw_send(d, &seq, run, rank, h, fr, n);
    raw_expect(d, &m, PSD__MSG_TYPE__MSG_SHUTDOWN);
    cr_assert_eq(m.hdr->shutdown->exit_code, 2, "refused: exit 2");
    cr_assert(m.hdr->shutdown->reason && strstr(m.hdr->shutdown->reason, "psd refused this worker: ") &&
                  strstr(m.hdr->shutdown->reason, words),
              "the reason names what psd could not take (%s): %s", words, m.hdr->shutdown->reason);
    ps_msg_deinit(&m);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

Test(short, malformed_streamed_pushes_end_the_workers_run)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]",
                          "--set", "server.chunk_bytes=65536", "--set", "train.stream=true", "--set",
                          "server.shared_memory=false", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "stbad", 1, args);
    ps_layout_t l;
    float *g = lib_model(&l, 64);
    for (size_t i = 0; i < l.n_params; i++) g[i] = 1e-3f;
    Psd__Header h;
    /* chunk k of W0 (784 x 64 = 50176 floats: chunks of 16384), or a piece at any offset (from a
     * buffer that has the bytes of a piece past the tensor too) */
    const size_t cf = 16384;
    float *w0 = calloc(4 * cf, sizeof *w0);
    cr_assert(w0);
#define W0_PIECE(off, n) \
    ((ps_frame_t){.data = w0 + (off), .nbytes = (n) * 4, .id = 0, .dtype = PSD__DTYPE__DT_F32, .rows = 64, \
                  .cols = 784, .offset = (off)})
    Psd__Push pu = PSD__PUSH__INIT;
    pu.version = 0;
    pu.batch = 64;
    pu.loss_sum = 32;
    pu.pull = 1;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &pu;
    ps_frame_t bad1 = W0_PIECE(5, cf), dup[2] = {W0_PIECE(0, cf), W0_PIECE(0, cf)}, tail = W0_PIECE(3 * cf, cf);
    raw_refused(r.endpoint, &h, &bad1, 1, 384, 10000, "is no chunk of the model");  /* not at a chunk's start */
    raw_refused(r.endpoint, &h, &tail, 1, 384, 10000, "outside shape");  /* past the tensor (the wire's check) */
    raw_refused(r.endpoint, &h, dup, 2, 384, 10000, "already received"); /* one chunk twice in a message */
    /* a right worker: every chunk once, version 1 in parts */
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, 384, 10000);
    cr_assert_eq(m.hdr->weights->parts, 0, "weights outside a step come whole");
    for (int k = 0; k < 4; k++) {
        size_t off = (size_t)k * cf, n = k < 3 ? cf : l.t[0].numel - 3 * cf;
        ps_frame_t f = W0_PIECE(off, n);
        raw_send(d, &seq, run, rank, &h, &f, 1);
    }
#undef W0_PIECE
    for (int t = 1; t < l.n_tensors; t++) {
        ps_frame_t f = {.data = g + l.t[t].offset, .nbytes = l.t[t].numel * 4, .id = (uint32_t)t,
                        .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)l.t[t].rows,
                        .cols = t % 2 == 0 ? (uint32_t)l.t[t].cols : 0};
        raw_send(d, &seq, run, rank, &h, &f, 1);
    }
    uint64_t got = 0;
    while (got != (1ull << l.n_tensors) - 1) { /* version 1 in parts, every tensor once */
        raw_expect(d, &m, PSD__MSG_TYPE__MSG_WEIGHTS);
        cr_assert_eq(m.hdr->weights->version, 1);
        cr_assert_eq(m.hdr->weights->parts, (uint32_t)l.n_tensors);
        for (int i = 0; i < m.n_frames; i++) {
            uint32_t t = m.hdr->tensors[i]->id;
            cr_assert(t < (uint32_t)l.n_tensors && !(got & (1ull << t)), "tensor %u once", t);
            cr_assert_eq(zmq_msg_size(&m.frames[i]), l.t[t].numel * 4, "tensor %u whole", t);
            got |= 1ull << t;
        }
    }
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, ") refused: "), 3, "%s", log);
    cr_assert_eq(count_in(log, "its run ends (exit 2)"), 3, "%s", log);
    cr_assert_eq(count_in(log, "dropped a message"), 0, "%s", log);
    free(log);
    ps_msg_deinit(&m);
    free(g);
    free(w0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* Rows of the table's gradient that are not rows of it (ids not strictly
 * increasing, beyond the table, without their values, values of another
 * count), and PULLs asking for rows that are not rows of it or more than a
 * batch of the click-through task reads, each end the run of the worker that
 * sent them, naming the limit and the keys that set it; right ones are taken
 * and stepped. */
Test(short, malformed_table_rows_end_the_workers_run)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "server.shared_memory=false", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "rowsbad", 1, args);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, (const int[]){64, 64, 2}, 3, 65536, 8), 0);
    float *g = calloc(l.n_params, sizeof *g);
    cr_assert(g);
    Psd__Header h;
    Psd__Push pu = PSD__PUSH__INIT;
    pu.version = 0;
    pu.batch = 256;
    pu.loss_sum = 100;
    pu.pull = 1;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &pu;
    /* the MLP's four tensors whole, then the table as rows */
    ps_frame_t fr[6];
    for (int t = 0; t < 4; t++)
        fr[t] = (ps_frame_t){.data = g + l.t[t].offset, .nbytes = l.t[t].numel * 4, .id = (uint32_t)t,
                             .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)l.t[t].rows,
                             .cols = t % 2 == 0 ? (uint32_t)l.t[t].cols : 0};
    uint32_t same[2] = {3, 3}, beyond[2] = {3, 70000}, good[2] = {1, 5};
    float vals[3 * 8];
    for (int i = 0; i < 24; i++) vals[i] = 0.25f;
#define IDS(p, n) ((ps_frame_t){.data = (p), .nbytes = (n) * 4, .id = 4, .dtype = PSD__DTYPE__DT_U32, .rows = (n)})
#define VALS(n) ((ps_frame_t){.data = vals, .nbytes = (n) * 32, .id = 4, .dtype = PSD__DTYPE__DT_F32, .rows = (n), .cols = 8})
    const char *rows = "that are not rows of the table";
    fr[4] = IDS(same, 2), fr[5] = VALS(2);
    raw_refused(r.endpoint, &h, fr, 6, 256, 100, rows); /* a row twice */
    fr[4] = IDS(beyond, 2);
    raw_refused(r.endpoint, &h, fr, 6, 256, 100, rows); /* beyond the table */
    fr[4] = IDS(good, 2);
    raw_refused(r.endpoint, &h, fr, 5, 256, 100, rows); /* ids without their values */
    fr[5] = VALS(3);
    raw_refused(r.endpoint, &h, fr, 6, 256, 100, rows); /* 3 rows of values for 2 ids */
    fr[5] = VALS(2);
    pu.want_rows = 1;
    raw_refused(r.endpoint, &h, fr, 6, 256, 100, rows); /* its last frame is no list of rows wanted */
    pu.want_rows = 0;
    /* PULLs asking for table rows: a row twice, beyond the table, more rows than a batch
     * reads (256 x 8 x 1), no list */
    Psd__Header ph;
    Psd__Pull pl = PSD__PULL__INIT;
    pl.want_rows = 1;
    psd__header__init(&ph);
    ph.type = PSD__MSG_TYPE__MSG_PULL;
    ph.body_case = PSD__HEADER__BODY_PULL;
    ph.pull = &pl;
    uint32_t *many = malloc(2049 * sizeof *many);
    cr_assert(many);
    for (uint32_t i = 0; i < 2049; i++) many[i] = i;
    ps_frame_t pf = IDS(same, 2);
    raw_refused(r.endpoint, &ph, &pf, 1, 256, 100, rows);
    pf = IDS(beyond, 2);
    raw_refused(r.endpoint, &ph, &pf, 1, 256, 100, rows);
    pf = IDS(many, 2049);
    raw_refused(r.endpoint, &ph, &pf, 1, 256, 100, "at most 2048: train.batch_size x ctr.fields x ctr.per_field");
    raw_refused(r.endpoint, &ph, NULL, 0, 256, 100, rows);
    free(many);
    /* a right worker: stepped */
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, 256, 100);
    raw_send(d, &seq, run, rank, &h, fr, 6);
#undef IDS
#undef VALS
    raw_expect(d, &m, PSD__MSG_TYPE__MSG_WEIGHTS);
    cr_assert_eq(m.hdr->weights->version, 1);
    cr_assert_eq(m.n_frames, 5);
    /* SGD in the config? no: Adagrad moves each touched float by about lr; rows 1 and 5 moved, row 2 did not */
    const float *E = (const float *)zmq_msg_data(&m.frames[4]);
    float *E0 = calloc(l.t[4].numel, sizeof *E0);
    cr_assert(E0);
    ps_model_init_params(&l, g, 7); /* run.seed 7 in ctr.yaml */
    memcpy(E0, g + l.t[4].offset, l.t[4].numel * sizeof *E0);
    cr_assert(E[1 * 8] != E0[1 * 8] && E[5 * 8 + 7] != E0[5 * 8 + 7], "rows 1 and 5 stepped");
    cr_assert(memcmp(E + 2 * 8, E0 + 2 * 8, 3 * 8 * sizeof *E) == 0, "rows 2-4 untouched");
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "that are not rows of the table"), 9, "%s", log);
    cr_assert_eq(count_in(log, "its run ends (exit 2)"), 9, "%s", log);
    free(log);
    free(E0);
    ps_msg_deinit(&m);
    free(g);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* One hello on psd's shared-memory socket; returns the reply's status (or
 * -1000 - errno when there was none) and closes any fd that came back. */
static int hello(const char *name, uint64_t run_id, uint32_t rank, const uint8_t *token, int fd, uint64_t bytes,
                 char *msg, size_t n)
{
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct timeval tv = {10, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(s, (struct sockaddr *)&a, alen) != 0) {
        close(s);
        return -1000 - errno;
    }
    ps_shm_hello_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, PS_SHM_MAGIC, sizeof h.magic);
    h.run_id = run_id;
    h.rank = rank;
    memcpy(h.token, token, PS_SHM_TOKEN);
    h.grad_bytes = bytes;
    ps_shm_reply_t r;
    int rfd = -1, rc = ps_shm_send(s, &h, sizeof h, fd);
    if (rc == 0) rc = ps_shm_recv(s, &r, sizeof r, &rfd, 0);
    close(s);
    if (rc != 0) return -1000 + rc;
    if (rfd >= 0) {
        /* what psd hands out must be read-only */
        void *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rfd, 0);
        cr_assert(w == MAP_FAILED, "psd's parameter region can be mapped writable");
        close(rfd);
    }
    snprintf(msg, n, "%.*s", (int)sizeof r.message, r.message);
    return r.status == 0 && rfd < 0 ? -2000 : r.status;
}

/* A raw worker (DEALER *d on ctx) registers with psd r, whose model is the
 * MLP 784-32-10: its ASSIGN offers shared memory (socket name, token), and
 * the run id, rank and gradient bytes a hello gives. */
static void shm_offer(const run_t *r, void *ctx, void **d, char name[128], uint8_t tok[PS_SHM_TOKEN], uint64_t *run,
                      uint32_t *rank, uint64_t *bytes)
{
    *d = zmq_socket(ctx, ZMQ_DEALER);
    cr_assert_eq(zmq_connect(*d, r->endpoint), 0);
    ps_msg_t m = {0};
    cr_assert_eq(raw_register(*d, &m), 0, "psd answers a raw REGISTER");
    cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ASSIGN);
    Psd__Assign *as = m.hdr->assign;
    cr_assert(as->shm_socket && as->shm_socket[0] && as->shm_token.len == PS_SHM_TOKEN,
              "psd offers shared memory to a worker on its host");
    snprintf(name, 128, "%s", as->shm_socket);
    memcpy(tok, as->shm_token.data, PS_SHM_TOKEN);
    ps_layout_t lay;
    cr_assert_eq(ps_layout_init(&lay, (const int[]){784, 32, 10}, 3), 0);
    *run = m.hdr->run_id;
    *bytes = lay.n_params * sizeof(float);
    ps_layout_free(&lay);
    *rank = as->rank;
    ps_msg_deinit(&m);
}

/* psd's shared-memory socket is reachable by anyone on the host: it takes a
 * region only from the worker it offered one to (token from the ASSIGN),
 * only a memfd of the gradient's size whose size is sealed (a region that
 * could shrink would crash psd when read), only once; everything else gets
 * a refusal and a log line, and training carries on. */
Test(short, shared_memory_requests_are_checked)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--set", "model.layers=[784,32,10]",
                          NULL};
    pid_t p = start_psd(&r, "shmreq", 1, args);
    void *ctx = zmq_ctx_new(), *d;
    char name[128];
    uint8_t tok[PS_SHM_TOKEN], bad[PS_SHM_TOKEN];
    uint64_t run, bytes;
    uint32_t rank;
    shm_offer(&r, ctx, &d, name, tok, &run, &rank, &bytes);
    memcpy(bad, tok, PS_SHM_TOKEN);
    bad[7] ^= 1;
    char msg[128];
    int sealed = ps_shm_memfd("t", bytes, 1), loose = ps_shm_memfd("t", bytes, 0);
    int small = ps_shm_memfd("t", bytes - 64, 1);
    cr_assert(sealed >= 0 && loose >= 0 && small >= 0);
    cr_assert_neq(hello(name, run, rank, bad, sealed, bytes, msg, sizeof msg), 0, "a wrong token is refused");
    cr_assert(strstr(msg, "token"), "%s", msg);
    cr_assert_neq(hello(name, run + 1, rank, tok, sealed, bytes, msg, sizeof msg), 0, "another run is refused");
    cr_assert_neq(hello(name, run, rank + 1, tok, sealed, bytes, msg, sizeof msg), 0, "another rank is refused");
    cr_assert_neq(hello(name, run, rank, tok, -1, bytes, msg, sizeof msg), 0, "a hello without a region");
    cr_assert(strstr(msg, "memfd"), "%s", msg);
    cr_assert_neq(hello(name, run, rank, tok, loose, bytes, msg, sizeof msg), 0, "an unsealed region is refused");
    cr_assert(strstr(msg, "sealed"), "%s", msg);
    cr_assert_neq(hello(name, run, rank, tok, small, bytes - 64, msg, sizeof msg), 0, "a region of another size");
    int tmp = open(dir, O_TMPFILE | O_RDWR, 0600);
    cr_assert(tmp >= 0 && ftruncate(tmp, (off_t)bytes) == 0);
    cr_assert_neq(hello(name, run, rank, tok, tmp, bytes, msg, sizeof msg), 0, "a plain file is refused");
    cr_assert_eq(hello(name, run, rank, tok, sealed, bytes, msg, sizeof msg), 0, "the right one is taken: %s", msg);
    cr_assert_neq(hello(name, run, rank, tok, sealed, bytes, msg, sizeof msg), 0, "only once");
    /* a connection that never says anything is dropped, not waited for */
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    int mute = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    cr_assert_eq(connect(mute, (struct sockaddr *)&a, alen), 0);
    close(tmp);
    close(sealed);
    close(loose);
    close(small);
    /* a real worker trains the run to the end */
    zmq_close(d);
    zmq_ctx_term(ctx);
    wait_log(r.psd_log, "sent nothing for", 30);
    close(mute);
    pid_t w = start_worker(&r, "shmreq", 0, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd");
    cr_assert_eq(proc_wait(w, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert_geq(count_in(log, "refused a shared-memory request"), 8, "%s", log);
    free(log);
}

/* A burst of shared-memory requests waits its turn: with every one of psd's
 * 8 places taken by connections that say nothing, the next request waits in
 * the socket's backlog and is answered once the silent ones are dropped (2 s)
 * instead of being refused (64 workers starting at once on 2 cores found 8
 * pending and fell back to the wire; it_many.c). */
Test(short, a_shared_memory_request_beyond_eight_pending_waits_its_turn)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--set", "model.layers=[784,32,10]",
                          NULL};
    pid_t p = start_psd(&r, "shmwait", 1, args);
    void *ctx = zmq_ctx_new(), *d;
    char name[128];
    uint8_t tok[PS_SHM_TOKEN];
    uint64_t run, bytes;
    uint32_t rank;
    shm_offer(&r, ctx, &d, name, tok, &run, &rank, &bytes);
    /* 8 connections that never say anything: every place taken (the
     * backlog is first in, first out: psd takes these before the hello) */
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    int mute[8];
    for (int i = 0; i < 8; i++) {
        mute[i] = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
        cr_assert_eq(connect(mute[i], (struct sockaddr *)&a, alen), 0, "%s", strerror(errno));
    }
    int sealed = ps_shm_memfd("t", bytes, 1);
    cr_assert(sealed >= 0);
    char msg[128] = "";
    double t0 = ps_now();
    int rc = hello(name, run, rank, tok, sealed, bytes, msg, sizeof msg);
    double took = ps_now() - t0;
    cr_assert_eq(rc, 0, "the ninth request is answered, not refused (%d, %s)", rc, msg);
    cr_assert(took >= 1.0 && took < 9.0, "answered once the silent ones were dropped: %.2f s", took);
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "sent nothing for"), 8, "%s", log);
    cr_assert(!strstr(log, "refused a shared-memory request"), "%s", log);
    free(log);
    for (int i = 0; i < 8; i++) close(mute[i]);
    close(sealed);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* Nothing of the shared memory outlives the processes, whatever kills
 * them: memfds are freed with their last descriptor and mapping (nothing
 * is in /dev/shm: other tests running beside may put files there, so the
 * processes' own mappings and descriptors are checked), the socket's name
 * is abstract. */
Test(short, nothing_is_left_behind_after_kill_9)
{
    run_t r;
    const char *args[] = {"--epochs", "20", "--set", "data.train_limit=6000", NULL};
    pid_t p = start_psd(&r, "shk", 2, args);
    pid_t w0 = start_worker(&r, "shk", 0, NULL), w1 = start_worker(&r, "shk", 1, NULL);
    wait_metrics(&r, 1);
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "through shared memory"), 2, "%s", log);
    const char *at = strstr(log, "socket @");
    cr_assert_not_null(at);
    char sock[96];
    snprintf(sock, sizeof sock, "%.*s", (int)strcspn(at + 8, " \n"), at + 8);
    free(log);
    cr_assert(unix_socket_listed(sock), "%s is in /proc/net/unix while psd runs", sock);
    const pid_t ps[] = {p, w0, w1};
    for (int i = 0; i < 3; i++) {
        int memfd;
        cr_assert_eq(dev_shm_files_of(ps[i], &memfd), 0, "process %d of 3 uses a file in /dev/shm", i + 1);
        cr_assert_geq(memfd, 2, "process %d of 3 maps the gradient and parameter memfds", i + 1);
    }
    kill(p, SIGKILL);
    kill(w0, SIGKILL);
    kill(w1, SIGKILL);
    cr_assert_eq(proc_wait(p, 10), 128 + SIGKILL);
    cr_assert_eq(proc_wait(w0, 10), 128 + SIGKILL);
    cr_assert_eq(proc_wait(w1, 10), 128 + SIGKILL);
    cr_assert_not(unix_socket_listed(sock), "%s gone with psd", sock);
}

Test(short, one_pworker_command_starts_one_worker_per_device)
{
    run_t r;
    pid_t p = start_psd(&r, "sup", 3, slice);
    const char *devs[] = {"--devices", "cpu,cpu,cpu", NULL};
    pid_t sup = start_worker(&r, "sup", 0, devs);
    cr_assert_eq(proc_wait(p, 300), 0, "psd got its 3 workers from one pworker command");
    cr_assert_eq(proc_wait(sup, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "rank 2"), "%s", log);
    free(log);
}

Test(short, pworker_forwards_signals_to_its_workers)
{
    run_t r;
    const char *args[] = {"--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "sig", 3, args);
    const char *devs[] = {"--devices", "cpu,cpu", NULL};
    pid_t sup = start_worker(&r, "sig", 0, devs);
    for (int i = 0; i < 300; i++) { /* both registered */
        char *log = slurp(r.psd_log);
        int both = log && strstr(log, "rank 1,");
        free(log);
        if (both) break;
        zmq_poll(NULL, 0, 50);
    }
    zmq_poll(NULL, 0, 300);
    kill(sup, SIGTERM);
    int code = proc_wait(sup, 30);
    cr_assert_eq(code, 0, "both workers got SIGTERM and left cleanly (got %d)", code);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "rank 0") && strstr(log, "left the run"), "psd saw them leave: %s", log);
    free(log);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0, "psd stops on SIGTERM with exit 0");
}

static void setenv_no_gpu(void) { setenv("CUDA_VISIBLE_DEVICES", "", 1); }

Test(short, devices_auto_without_gpu_trains_on_cpu_with_one_warning)
{
    setenv_no_gpu();
    run_t r;
    train(&r, "auto", 1, slice, 300);
    check_run(&r, 1, 1);
    char log[256];
    path(log, sizeof log, "auto-w0.log");
    char *t = slurp(log);
    int warnings = 0;
    for (const char *q = t; (q = strstr(q, "WARN")) != NULL; q++) warnings++;
    cr_assert_eq(warnings, 1, "exactly one warning: %s", t);
    cr_assert(strstr(t, "no GPU found") && strstr(t, "training on the CPU"), "%s", t);
    free(t);
}

Test(short, a_gpu_that_does_not_exist_is_an_error)
{
    setenv_no_gpu();
    char out[256];
    path(out, sizeof out, "dev.txt");
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices 7 > '%s' 2>&1", pworker_bin, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "GPU 7 does not exist"), "%s", t);
    cr_assert_eq(count_lines(t), 1, "one line: %s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices 0,zz > /dev/null 2>&1", pworker_bin), 2);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices '' > /dev/null 2>&1", pworker_bin), 2);
}
