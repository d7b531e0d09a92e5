/* psd_server.c - the run coordinator of psd.
 *
 * One thread. A libuv loop watches the ROUTER socket's ZMQ_FD (edge
 * triggered: every wake-up drains while ZMQ_EVENTS says readable, and every
 * callback that sent something drains again), a 100 ms timer enforces every
 * deadline, and signal handles end the run cleanly. The parameter store
 * (psd_store.c) holds weights and optimizer state; this file decides who
 * does what when. */
#include "psd_server.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "ps_idx.h"
#include "ps_log.h"
#include "ps_rng.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"
#include "psd_optim.h"
#include "psd_store.h"

#define MAX_WORKERS 1024

typedef enum {
    W_ASSIGNED = 0, /* registered, checking its data */
    W_READY,        /* data checked, waiting for the run to start */
    W_TRAIN,        /* has data left in this epoch */
    W_BARRIER,      /* its part of the epoch is done */
    W_VALIDATING,   /* evaluating its part of the test set */
    W_VALIDATED,    /* partial sums received */
    W_GONE,         /* failed or refused; never waited for */
} wstate_t;

static const char *wstate_name[] = {"assigned", "ready",     "training", "at barrier",
                                    "validating", "validated", "gone"};

typedef struct {
    uint8_t ident[PS_MAX_IDENTITY];
    size_t ident_len;
    uint32_t rank;
    char hostname[64], host_id[128], device[32];
    uint32_t pid;
    wstate_t state;
    double last_seen;     /* time of its last valid message */
    uint64_t seq_in;      /* last sequence number accepted */
    uint64_t seq_out;
    /* current epoch */
    uint64_t begin, end;  /* positions in the epoch's permutation */
    uint64_t samples;     /* samples pushed this epoch */
    /* the push of the step in progress: its tensors may come in several
     * PUSH messages (a GPU worker sends each layer's gradient as soon as its
     * backward is done); the frames are kept as received until the step */
    bool has_push, push_pull, push_started;
    zmq_msg_t grad[PS_MAX_TENSORS];
    uint64_t grad_mask;   /* tensors received */
    uint32_t push_batch;
    double push_loss;
    uint64_t push_correct;
    /* an outstanding PULL */
    bool wants, want_sent;
    uint64_t want_version;
    /* validation */
    uint64_t val_begin, val_end;
    double val_loss;
    uint64_t val_correct, val_count;
} worker_t;

typedef enum { PHASE_WAIT = 0, PHASE_TRAIN, PHASE_VALIDATE, PHASE_DONE } phase_t;

typedef struct {
    char role[16];
    char path[PS_PATH_MAX];
    uint64_t size, hash;
} datafile_t;

typedef struct {
    ps_config_t cfg;
    ps_layout_t layout;
    psd_store_t store;
    uint64_t run_id;
    void *zctx, *sock;
    uv_loop_t loop;
    uv_poll_t poll;
    uv_timer_t timer;
    uv_signal_t sigint, sigterm;
    worker_t *w;          /* MAX_WORKERS */
    int n;                /* registered */
    phase_t phase;
    int exit_code;
    datafile_t files[4];
    size_t train_count, test_count;
    uint32_t *perm;
    /* progress */
    uint32_t epoch;       /* 0-based */
    uint64_t step;        /* optimizer steps in the run */
    uint64_t epoch_step;  /* steps in this epoch */
    double spe;           /* steps per epoch */
    double lr;            /* of the last step */
    /* epoch statistics */
    double ep_loss;
    uint64_t ep_correct, ep_samples;
    double t_start, t_epoch, train_s_total, phase_deadline;
    uint64_t samples_total;
    FILE *metrics;
    uint64_t dropped;     /* bad messages, for rate-limited logging */
} srv_t;

/* ---- helpers ------------------------------------------------------------ */

static void drop(srv_t *s, const worker_t *w, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void drop(srv_t *s, const worker_t *w, const char *fmt, ...)
{
    s->dropped++;
    if (s->dropped > 20 && s->dropped % 1000 != 0) return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (w)
        PS_WARN("dropped a message from rank %u (%s pid %u): %s%s", w->rank, w->hostname, w->pid, msg,
                s->dropped == 20 ? " (further drops logged every 1000th)" : "");
    else
        PS_WARN("dropped a message from an unknown peer: %s%s", msg,
                s->dropped == 20 ? " (further drops logged every 1000th)" : "");
}

static worker_t *find_worker(srv_t *s, const uint8_t *ident, size_t len)
{
    for (int i = 0; i < s->n; i++)
        if (s->w[i].ident_len == len && memcmp(s->w[i].ident, ident, len) == 0) return &s->w[i];
    return NULL;
}

static void hdr_for(srv_t *s, worker_t *w, Psd__Header *h, Psd__MsgType type)
{
    psd__header__init(h);
    h->run_id = s->run_id;
    h->type = type;
    h->rank = w ? w->rank : 0;
    h->seq = w ? ++w->seq_out : 0;
}

static int send_to(srv_t *s, worker_t *w, Psd__Header *h, const ps_frame_t *fr, int n)
{
    int rc = ps_msg_send(s->sock, w->ident, w->ident_len, h, fr, n);
    if (rc < 0)
        PS_WARN("cannot send %s to rank %u (%s pid %u): %s", ps_msg_type_name((int)h->type), w->rank,
                w->hostname, w->pid, zmq_strerror(-rc));
    return rc;
}

static void send_error_ident(srv_t *s, const uint8_t *ident, size_t len, Psd__ErrCode code,
                             const char *msg)
{
    Psd__Header h;
    Psd__Error e = PSD__ERROR__INIT;
    hdr_for(s, NULL, &h, PSD__MSG_TYPE__MSG_ERROR);
    e.code = code;
    e.message = (char *)msg;
    h.body_case = PSD__HEADER__BODY_ERROR;
    h.error = &e;
    ps_msg_send(s->sock, ident, len, &h, NULL, 0);
}

static void send_shutdown(srv_t *s, worker_t *w, int code, const char *reason)
{
    Psd__Header h;
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_SHUTDOWN);
    sd.exit_code = code;
    sd.reason = (char *)reason;
    h.body_case = PSD__HEADER__BODY_SHUTDOWN;
    h.shutdown = &sd;
    send_to(s, w, &h, NULL, 0);
}

/* Weights frames of the current version, sent without copying. */
static int weights_frames(srv_t *s, ps_frame_t *fr)
{
    const ps_layout_t *l = &s->layout;
    for (int t = 0; t < l->n_tensors; t++) {
        psd_arena_t *a = psd_store_ref_current(&s->store);
        fr[t] = (ps_frame_t){.data = a->w + l->t[t].offset, .nbytes = 4 * l->t[t].numel,
                             .ffn = psd_store_frame_free, .hint = a, .id = (uint32_t)t,
                             .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)l->t[t].rows,
                             .cols = t % 2 == 0 ? (uint32_t)l->t[t].cols : 0};
    }
    return l->n_tensors;
}

static void send_weights(srv_t *s, worker_t *w)
{
    Psd__Header h;
    Psd__Weights wt = PSD__WEIGHTS__INIT;
    ps_frame_t fr[PS_MAX_TENSORS];
    hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_WEIGHTS);
    wt.version = s->store.cur->version;
    wt.step = s->step;
    h.body_case = PSD__HEADER__BODY_WEIGHTS;
    h.weights = &wt;
    send_to(s, w, &h, fr, weights_frames(s, fr));
}

/* End the run: tell every live worker, stop the loop. */
static void finish(srv_t *s, int code, const char *reason)
{
    if (s->phase == PHASE_DONE) return;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state != W_GONE) send_shutdown(s, &s->w[i], code, reason);
    s->phase = PHASE_DONE;
    s->exit_code = code;
    uv_stop(&s->loop);
}

/* ---- epochs, steps, validation ------------------------------------------ */

static void start_epoch(srv_t *s)
{
    uint64_t T = s->train_count, N = (uint64_t)s->n;
    ps_rng_permutation(s->perm, T, s->cfg.seed, 1000 + s->epoch);
    uint64_t longest = 0;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        w->begin = T * w->rank / N;
        w->end = T * (w->rank + 1) / N;
        if (w->end - w->begin > longest) longest = w->end - w->begin;
    }
    s->spe = (double)((longest + s->cfg.batch_size - 1) / s->cfg.batch_size);
    if (s->spe < 1) s->spe = 1;
    s->epoch_step = 0;
    s->ep_loss = 0;
    s->ep_correct = s->ep_samples = 0;
    s->phase = PHASE_TRAIN;
    s->t_epoch = ps_now();
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        uint32_t on_host = 0;
        for (int j = 0; j < s->n; j++) on_host += strcmp(s->w[j].host_id, w->host_id) == 0;
        Psd__Header h;
        Psd__Epoch ep = PSD__EPOCH__INIT;
        Psd__Range r = PSD__RANGE__INIT, *rp = &r;
        hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_EPOCH);
        ep.epoch = s->epoch;
        ep.world = (uint32_t)s->n;
        ep.workers_on_host = on_host;
        ep.version = s->store.cur->version;
        r.begin = w->begin;
        r.end = w->end;
        ep.ranges = &rp;
        ep.n_ranges = 1;
        h.body_case = PSD__HEADER__BODY_EPOCH;
        h.epoch = &ep;
        ps_frame_t fr = {.data = s->perm + w->begin, .nbytes = 4 * (w->end - w->begin),
                         .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)(w->end - w->begin)};
        w->state = W_TRAIN;
        w->samples = 0;
        w->wants = w->want_sent = false;
        w->last_seen = ps_now();
        send_to(s, w, &h, &fr, w->end > w->begin ? 1 : 0);
    }
}

static void start_validation(srv_t *s)
{
    double dt = ps_now() - s->t_epoch;
    s->train_s_total += dt;
    s->samples_total += s->ep_samples;
    s->phase = PHASE_VALIDATE;
    s->t_epoch = dt; /* keep the epoch's training time for the metrics */
    uint64_t T = s->test_count, N = (uint64_t)s->n;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        Psd__Header h;
        Psd__Validate v = PSD__VALIDATE__INIT;
        ps_frame_t fr[PS_MAX_TENSORS];
        hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_VALIDATE);
        w->val_begin = T * w->rank / N;
        w->val_end = T * (w->rank + 1) / N;
        v.epoch = s->epoch;
        v.version = s->store.cur->version;
        v.begin = w->val_begin;
        v.end = w->val_end;
        h.body_case = PSD__HEADER__BODY_VALIDATE;
        h.validate = &v;
        w->state = W_VALIDATING;
        w->last_seen = ps_now();
        send_to(s, w, &h, fr, weights_frames(s, fr));
    }
}

static void save_weights(srv_t *s)
{
    if (!s->cfg.save[0]) return;
    char err[512];
    ps_weights_meta_t meta = {.run_id = s->run_id, .step = s->step, .epoch = s->epoch};
    if (ps_weights_save(s->cfg.save, &s->layout, s->store.cur->w, &meta, err, sizeof err) != 0) {
        PS_ERROR("%s", err);
        s->exit_code = PSD_EXIT_ERROR;
        return;
    }
    PS_INFO("saved weights (version %" PRIu64 ") to %s", s->store.cur->version, s->cfg.save);
}

static void end_validation(srv_t *s)
{
    double loss = 0;
    uint64_t correct = 0, count = 0;
    for (int i = 0; i < s->n; i++) { /* rank order: same sums every run */
        loss += s->w[i].val_loss;
        correct += s->w[i].val_correct;
        count += s->w[i].val_count;
    }
    double val_loss = count ? loss / (double)count : 0, val_acc = count ? (double)correct / (double)count : 0;
    double train_loss = s->ep_samples ? s->ep_loss / (double)s->ep_samples : 0;
    double train_acc = s->ep_samples ? (double)s->ep_correct / (double)s->ep_samples : 0;
    double ep_sps = s->t_epoch > 0 ? (double)s->ep_samples / s->t_epoch : 0;
    double sps = s->train_s_total > 0 ? (double)s->samples_total / s->train_s_total : 0;
    double wall = ps_now() - s->t_start;
    PS_INFO("epoch %u/%d step %" PRIu64 " train_loss %.4f train_acc %.4f val_loss %.4f val_acc %.4f "
            "(%" PRIu64 "/%" PRIu64 ") %.0f samples/s lr %.5g",
            s->epoch + 1, s->cfg.epochs, s->step, train_loss, train_acc, val_loss, val_acc, correct,
            count, ep_sps, s->lr);
    if (s->metrics) {
        fprintf(s->metrics,
                "{\"schema\":1,\"run_id\":\"%016" PRIx64 "\",\"epoch\":%u,\"step\":%" PRIu64
                ",\"train_loss\":%.9g,\"train_acc\":%.9g,\"train_samples\":%" PRIu64
                ",\"val_loss\":%.9g,\"val_acc\":%.9g,\"val_correct\":%" PRIu64 ",\"val_samples\":%" PRIu64
                ",\"samples_per_s\":%.6g,\"epoch_samples_per_s\":%.6g,\"train_s\":%.6g,\"wall_s\":%.6g"
                ",\"workers\":%d,\"lr\":%.9g}\n",
                s->run_id, s->epoch + 1, s->step, train_loss, train_acc, s->ep_samples, val_loss,
                val_acc, correct, count, sps, ep_sps, s->train_s_total, wall, s->n, s->lr);
        fflush(s->metrics);
    }
    if (s->epoch + 1 < (uint32_t)s->cfg.epochs) {
        s->epoch++;
        start_epoch(s);
        return;
    }
    save_weights(s);
    PS_INFO("run finished: %d epochs, %" PRIu64 " steps, val_acc %.4f, %.0f samples/s, %.1f s",
            s->cfg.epochs, s->step, val_acc, sps, wall);
    int code = s->exit_code;
    finish(s, 0, "training finished");
    s->exit_code = code;
}

static void release_push(worker_t *w)
{
    for (int t = 0; t < PS_MAX_TENSORS; t++)
        if (w->grad_mask & (1ull << t)) zmq_msg_close(&w->grad[t]);
    w->grad_mask = 0;
    w->has_push = w->push_started = w->push_pull = false;
}

/* Every worker still training has pushed for this version: reduce, apply. */
static void maybe_step(srv_t *s)
{
    int pending = 0;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state == W_TRAIN && !w->has_push) return; /* still waiting for it */
        pending += w->has_push;
    }
    if (pending > 0) {
        /* contributors in rank order (ranks are indices) */
        int k = 0;
        uint64_t total = 0;
        for (int i = 0; i < s->n; i++)
            if (s->w[i].has_push) total += s->w[i].push_batch;
        const float *(*g)[PS_MAX_TENSORS] = malloc((size_t)pending * sizeof *g);
        double *wt = malloc((size_t)pending * sizeof *wt);
        if (!g || !wt) {
            free(g);
            free(wt);
            PS_ERROR("out of memory in a step");
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        for (int i = 0; i < s->n; i++) {
            worker_t *w = &s->w[i];
            if (!w->has_push) continue;
            for (int t = 0; t < s->layout.n_tensors; t++) g[k][t] = zmq_msg_data(&w->grad[t]);
            wt[k] = (double)w->push_batch / (double)total;
            k++;
        }
        s->lr = psd_sched_lr(&s->cfg, (double)s->epoch + (double)s->epoch_step / s->spe, s->spe);
        double norm = psd_store_step(&s->store, pending, (const float *const(*)[PS_MAX_TENSORS])g, wt,
                                     s->cfg.clip_norm, s->lr);
        free(g);
        free(wt);
        if (norm < 0) {
            PS_ERROR("no free parameter arena (too many pull replies in flight)");
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        s->step++;
        s->epoch_step++;
        for (int i = 0; i < s->n; i++) {
            worker_t *w = &s->w[i];
            if (!w->has_push) continue;
            bool pull = w->push_pull;
            release_push(w);
            if (pull && w->state == W_TRAIN) send_weights(s, w);
        }
    }
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_TRAIN) return;
    start_validation(s);
}

/* ---- message handlers --------------------------------------------------- */

static void on_register(srv_t *s, ps_msg_t *m)
{
    Psd__Register *r = m->hdr->reg;
    const char *host = r->hostname && r->hostname[0] ? r->hostname : "?";
    worker_t *w = find_worker(s, m->ident, m->ident_len);
    if (w) { /* a retry: same socket, answer again */
        drop(s, w, "repeated REGISTER");
        return;
    }
    if (s->phase != PHASE_WAIT || s->n >= s->cfg.workers) {
        PS_WARN("refused a worker from %s pid %u: the run already has its %d workers", host, r->pid,
                s->cfg.workers);
        send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED,
                         "this run already has all its workers");
        return;
    }
    w = &s->w[s->n];
    memset(w, 0, sizeof *w);
    memcpy(w->ident, m->ident, m->ident_len);
    w->ident_len = m->ident_len;
    w->rank = (uint32_t)s->n;
    snprintf(w->hostname, sizeof w->hostname, "%s", host);
    snprintf(w->host_id, sizeof w->host_id, "%s", r->host_id && r->host_id[0] ? r->host_id : host);
    snprintf(w->device, sizeof w->device, "%s", r->device && r->device[0] ? r->device : "cpu");
    w->pid = r->pid;
    w->state = W_ASSIGNED;
    w->last_seen = ps_now();
    w->seq_in = m->hdr->seq;
    s->n++;
    PS_INFO("worker registered: rank %u, %s pid %u, %s%s%s (%d/%d)", w->rank, w->hostname, w->pid,
            w->device, r->identity_hint && r->identity_hint[0] ? ", task " : "",
            r->identity_hint ? r->identity_hint : "", s->n, s->cfg.workers);

    Psd__Header h;
    Psd__Assign a = PSD__ASSIGN__INIT;
    Psd__Hyper hy = PSD__HYPER__INIT;
    Psd__DataFile df[4], *dfp[4];
    uint32_t layers[PS_MAX_LAYERS + 1];
    hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_ASSIGN);
    a.rank = w->rank;
    for (int i = 0; i < s->cfg.n_sizes; i++) layers[i] = (uint32_t)s->cfg.sizes[i];
    a.layers = layers;
    a.n_layers = (size_t)s->cfg.n_sizes;
    a.activation = "relu";
    for (int i = 0; i < 4; i++) {
        psd__data_file__init(&df[i]);
        df[i].role = s->files[i].role;
        df[i].path = s->files[i].path;
        df[i].size = s->files[i].size;
        df[i].hash = s->files[i].hash;
        dfp[i] = &df[i];
    }
    a.files = dfp;
    a.n_files = 4;
    hy.batch_size = (uint32_t)s->cfg.batch_size;
    hy.val_batch_size = (uint32_t)s->cfg.val_batch_size;
    hy.norm_mean = s->cfg.norm_mean;
    hy.norm_std = s->cfg.norm_std;
    hy.train_limit = (uint64_t)s->cfg.train_limit;
    hy.epochs = (uint32_t)s->cfg.epochs;
    hy.seed = s->cfg.seed;
    a.hyper = &hy;
    a.start_timeout_s = s->cfg.start_timeout + 10;
    a.step_timeout_s = s->cfg.worker_timeout * 2 + 10;
    h.body_case = PSD__HEADER__BODY_ASSIGN;
    h.assign = &a;
    send_to(s, w, &h, NULL, 0);
}

static void on_ready(srv_t *s, worker_t *w, ps_msg_t *m)
{
    if (w->state != W_ASSIGNED) {
        drop(s, w, "READY while %s", wstate_name[w->state]);
        return;
    }
    Psd__Ready *r = m->hdr->ready;
    if (r->train_count != s->train_count || r->test_count != s->test_count) {
        PS_ERROR("rank %u (%s pid %u) loaded %" PRIu64 "/%" PRIu64 " samples, psd has %zu/%zu; not using it",
                 w->rank, w->hostname, w->pid, r->train_count, r->test_count, s->train_count, s->test_count);
        send_shutdown(s, w, 2, "data differs from psd's");
        w->state = W_GONE;
        return;
    }
    w->state = W_READY;
    int ready = 0;
    for (int i = 0; i < s->n; i++) ready += s->w[i].state == W_READY;
    if (ready == s->cfg.workers) {
        PS_INFO("all %d workers ready; training %d epochs", s->n, s->cfg.epochs);
        s->t_start = ps_now();
        start_epoch(s);
    }
}

static void on_pull(srv_t *s, worker_t *w, ps_msg_t *m)
{
    if (w->state != W_TRAIN) {
        drop(s, w, "PULL while %s", wstate_name[w->state]);
        return;
    }
    uint64_t v = m->hdr->pull->min_version;
    if (v > s->store.cur->version + 1) {
        drop(s, w, "PULL of version %" PRIu64 ", current is %" PRIu64, v, s->store.cur->version);
        return;
    }
    if (v <= s->store.cur->version) send_weights(s, w);
    else {
        w->wants = true;
        w->want_version = v;
    }
}

static void on_push(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Push *p = m->hdr->push;
    const ps_layout_t *l = &s->layout;
    if (w->state != W_TRAIN) {
        drop(s, w, "PUSH while %s", wstate_name[w->state]);
        return;
    }
    if (w->has_push) {
        drop(s, w, "second PUSH for version %" PRIu64, p->version);
        return;
    }
    if (p->version != s->store.cur->version) {
        drop(s, w, "PUSH computed on version %" PRIu64 ", current is %" PRIu64, p->version,
             s->store.cur->version);
        return;
    }
    uint64_t left = w->end - w->begin - w->samples;
    if (p->batch == 0 || p->batch > (uint32_t)s->cfg.batch_size || p->batch > left) {
        drop(s, w, "PUSH of a batch of %u (batch size %d, %" PRIu64 " samples left)", p->batch,
             s->cfg.batch_size, left);
        return;
    }
    if (!isfinite(p->loss_sum) || p->loss_sum < 0 || p->correct > p->batch) {
        drop(s, w, "PUSH with invalid statistics");
        return;
    }
    if (w->push_started && (p->batch != w->push_batch || p->correct != w->push_correct ||
                            p->loss_sum != w->push_loss)) {
        drop(s, w, "PUSH part for another batch than the parts before it");
        return;
    }
    if (m->n_frames < 1) {
        drop(s, w, "PUSH without tensors");
        return;
    }
    uint64_t mask = 0;
    for (int i = 0; i < m->n_frames; i++) {
        size_t n = 0;
        const Psd__TensorDesc *d = m->hdr->tensors[i];
        uint32_t t = d->id;
        if (t >= (uint32_t)l->n_tensors || ((w->grad_mask | mask) & (1ull << t))) {
            drop(s, w, "PUSH of tensor %u: not in the model or already received", t);
            return;
        }
        if (!ps_msg_f32(m, i, &n) || d->offset != 0 || n != l->t[t].numel) {
            drop(s, w, "PUSH tensor %u does not match the model (%zu floats, want %zu)", t, n, l->t[t].numel);
            return;
        }
        mask |= 1ull << t;
    }
    /* keep the frames without copying: reduced in rank order once everyone has pushed */
    for (int i = 0; i < m->n_frames; i++) {
        uint32_t t = m->hdr->tensors[i]->id;
        zmq_msg_init(&w->grad[t]);
        zmq_msg_move(&w->grad[t], &m->frames[i]);
    }
    w->grad_mask |= mask;
    w->push_pull |= p->pull;
    if (!w->push_started) {
        w->push_started = true;
        w->push_batch = p->batch;
        w->push_loss = p->loss_sum;
        w->push_correct = p->correct;
    }
    uint64_t all = l->n_tensors == 64 ? ~0ull : (1ull << l->n_tensors) - 1;
    if (w->grad_mask != all) return; /* more parts to come */
    w->has_push = true;
    w->samples += p->batch;
    s->ep_loss += p->loss_sum;
    s->ep_correct += p->correct;
    s->ep_samples += p->batch;
    maybe_step(s);
}

static void on_barrier(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Barrier *b = m->hdr->barrier;
    if (w->state != W_TRAIN || b->epoch != s->epoch || (w->push_started && !w->has_push)) {
        drop(s, w, "BARRIER for epoch %u while %s in epoch %u", b->epoch, wstate_name[w->state], s->epoch);
        return;
    }
    if (b->samples != w->samples || w->samples != w->end - w->begin) {
        drop(s, w, "BARRIER after %" PRIu64 " samples, psd counted %" PRIu64 " of %" PRIu64, b->samples,
             w->samples, w->end - w->begin);
        return;
    }
    w->state = W_BARRIER;
    maybe_step(s);
}

static void on_val_result(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__ValResult *v = m->hdr->val_result;
    if (w->state != W_VALIDATING || v->epoch != s->epoch || v->version != s->store.cur->version) {
        drop(s, w, "VAL_RESULT for epoch %u version %" PRIu64 " while %s", v->epoch, v->version,
             wstate_name[w->state]);
        return;
    }
    if (v->count != w->val_end - w->val_begin || v->correct > v->count || !isfinite(v->loss_sum) ||
        v->loss_sum < 0) {
        drop(s, w, "VAL_RESULT with invalid sums (count %" PRIu64 ", expected %" PRIu64 ")", v->count,
             w->val_end - w->val_begin);
        return;
    }
    w->val_loss = v->loss_sum;
    w->val_correct = v->correct;
    w->val_count = v->count;
    w->state = W_VALIDATED;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_VALIDATING) return;
    end_validation(s);
}

static void on_worker_error(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Error *e = m->hdr->error;
    PS_ERROR("rank %u (%s pid %u) failed: %s", w->rank, w->hostname, w->pid,
             e->message ? e->message : "(no message)");
    wstate_t was = w->state;
    w->state = W_GONE;
    if (s->phase == PHASE_WAIT) {
        /* free its slot: another worker may take it before the start timeout */
        int i = (int)(w - s->w);
        memmove(&s->w[i], &s->w[i + 1], (size_t)(s->n - i - 1) * sizeof *w);
        s->n--;
        for (int j = 0; j < s->n; j++) s->w[j].rank = (uint32_t)j;
        (void)was;
        return;
    }
    char reason[160];
    snprintf(reason, sizeof reason, "rank %u failed", w->rank);
    finish(s, PSD_EXIT_WORKER_LOST, reason);
}

static void handle(srv_t *s, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->protocol != PS_PROTOCOL_VERSION) {
        const char *host = "?";
        uint32_t pid = 0;
        if (h->type == PSD__MSG_TYPE__MSG_REGISTER) {
            host = h->reg->hostname ? h->reg->hostname : "?";
            pid = h->reg->pid;
        }
        PS_WARN("refused a worker from %s pid %u: it speaks protocol %u, psd %u", host, pid, h->protocol,
                PS_PROTOCOL_VERSION);
        char msg[128];
        snprintf(msg, sizeof msg, "psd speaks protocol %u, this worker %u", PS_PROTOCOL_VERSION, h->protocol);
        send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_PROTOCOL, msg);
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_REGISTER) {
        if (h->run_id != 0 && h->run_id != s->run_id) {
            drop(s, NULL, "REGISTER for run %016" PRIx64, h->run_id);
            send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_RUN, "this is another run");
            return;
        }
        on_register(s, m);
        return;
    }
    worker_t *w = find_worker(s, m->ident, m->ident_len);
    if (!w) {
        drop(s, NULL, "%s from a peer that never registered", ps_msg_type_name((int)h->type));
        return;
    }
    if (w->state == W_GONE) return;
    if (h->run_id != s->run_id) {
        drop(s, w, "run id %016" PRIx64 ", this run is %016" PRIx64, h->run_id, s->run_id);
        return;
    }
    if (h->rank != w->rank) {
        drop(s, w, "claims rank %u", h->rank);
        return;
    }
    if (h->seq <= w->seq_in) {
        drop(s, w, "sequence number %" PRIu64 " not after %" PRIu64 " (duplicate)", h->seq, w->seq_in);
        return;
    }
    w->seq_in = h->seq;
    w->last_seen = ps_now();
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_READY: on_ready(s, w, m); break;
    case PSD__MSG_TYPE__MSG_PULL: on_pull(s, w, m); break;
    case PSD__MSG_TYPE__MSG_PUSH: on_push(s, w, m); break;
    case PSD__MSG_TYPE__MSG_BARRIER: on_barrier(s, w, m); break;
    case PSD__MSG_TYPE__MSG_VAL_RESULT: on_val_result(s, w, m); break;
    case PSD__MSG_TYPE__MSG_ERROR: on_worker_error(s, w, m); break;
    default: drop(s, w, "%s is not a message workers send", ps_msg_type_name((int)h->type));
    }
}

/* ---- loop --------------------------------------------------------------- */

static void drain(srv_t *s)
{
    while (s->phase != PHASE_DONE) {
        int events = 0;
        size_t len = sizeof events;
        if (zmq_getsockopt(s->sock, ZMQ_EVENTS, &events, &len) != 0) return;
        if (!(events & ZMQ_POLLIN)) return;
        ps_msg_t m;
        char why[256];
        int rc = ps_msg_recv(s->sock, &m, true, ZMQ_DONTWAIT, why, sizeof why);
        if (rc == -EAGAIN || rc == -EINTR) continue;
        if (rc == -EPROTO) {
            drop(s, find_worker(s, m.ident, m.ident_len), "%s", why);
            continue;
        }
        if (rc < 0) {
            PS_ERROR("receive failed: %s", zmq_strerror(-rc));
            finish(s, PSD_EXIT_ERROR, "psd failed");
            return;
        }
        handle(s, &m);
        ps_msg_deinit(&m);
    }
}

static void on_poll(uv_poll_t *p, int status, int events)
{
    (void)status;
    (void)events;
    drain(p->data);
}

static void on_timer(uv_timer_t *t)
{
    srv_t *s = t->data;
    double now = ps_now();
    if (s->phase == PHASE_WAIT) {
        if (now > s->phase_deadline) {
            int ready = 0;
            for (int i = 0; i < s->n; i++) ready += s->w[i].state == W_READY;
            PS_ERROR("start timeout: %d of %d workers registered, %d ready after %.0f s", s->n,
                     s->cfg.workers, ready, s->cfg.start_timeout);
            finish(s, PSD_EXIT_START_TIMEOUT, "not all workers came in time");
        }
    } else if (s->phase == PHASE_TRAIN || s->phase == PHASE_VALIDATE) {
        for (int i = 0; i < s->n; i++) {
            worker_t *w = &s->w[i];
            bool waited_for = (w->state == W_TRAIN && !w->has_push) || w->state == W_VALIDATING;
            if (!waited_for || now - w->last_seen < s->cfg.worker_timeout) continue;
            time_t last = time(NULL) - (time_t)(now - w->last_seen);
            struct tm tm;
            char when[32];
            gmtime_r(&last, &tm);
            strftime(when, sizeof when, "%H:%M:%SZ", &tm);
            PS_ERROR("rank %u (%s pid %u) lost: nothing from it for %.0f s (last message at %s) while %s",
                     w->rank, w->hostname, w->pid, now - w->last_seen, when, wstate_name[w->state]);
            w->state = W_GONE;
            char reason[128];
            snprintf(reason, sizeof reason, "rank %u was lost", w->rank);
            finish(s, PSD_EXIT_WORKER_LOST, reason);
            break;
        }
    }
    drain(s);
}

static void on_signal(uv_signal_t *h, int signum)
{
    srv_t *s = h->data;
    PS_WARN("received %s: telling the workers to stop", strsignal(signum));
    finish(s, 128 + signum, "psd was interrupted");
}

/* ---- set-up ------------------------------------------------------------- */

static int check_data(srv_t *s)
{
    const char *roles[4] = {"train_images", "train_labels", "test_images", "test_labels"};
    const char *paths[4] = {s->cfg.train_images, s->cfg.train_labels, s->cfg.test_images, s->cfg.test_labels};
    char err[512];
    ps_idx_t idx[4] = {0};
    int rc = -1;
    for (int i = 0; i < 4; i++) {
        snprintf(s->files[i].role, sizeof s->files[i].role, "%s", roles[i]);
        snprintf(s->files[i].path, sizeof s->files[i].path, "%s", paths[i]);
        if (ps_idx_load(&idx[i], paths[i], i % 2 == 0 ? 3 : 1, err, sizeof err) != 0) {
            PS_ERROR("%s: %s", roles[i], err);
            goto out;
        }
        int h = ps_file_hash(paths[i], &s->files[i].size, &s->files[i].hash);
        if (h != 0) {
            PS_ERROR("%s: %s", paths[i], strerror(-h));
            goto out;
        }
    }
    int classes = s->cfg.sizes[s->cfg.n_sizes - 1];
    for (int k = 0; k < 2; k++) {
        ps_idx_t *im = &idx[2 * k], *lb = &idx[2 * k + 1];
        if (im->count != lb->count) {
            PS_ERROR("%s has %zu images but %s has %zu labels", paths[2 * k], im->count, paths[2 * k + 1],
                     lb->count);
            goto out;
        }
        if (im->item != (size_t)s->cfg.sizes[0]) {
            PS_ERROR("%s: %zu pixels per image, but model.layers starts with %d", paths[2 * k], im->item,
                     s->cfg.sizes[0]);
            goto out;
        }
        for (size_t j = 0; j < lb->count; j++)
            if (lb->data[j] >= classes) {
                PS_ERROR("%s: label %u of sample %zu, but the model has %d classes", paths[2 * k + 1],
                         lb->data[j], j, classes);
                goto out;
            }
    }
    s->train_count = idx[0].count;
    if (s->cfg.train_limit > 0 && (size_t)s->cfg.train_limit < s->train_count)
        s->train_count = (size_t)s->cfg.train_limit;
    s->test_count = idx[2].count;
    rc = 0;
out:
    for (int i = 0; i < 4; i++) ps_idx_deinit(&idx[i]);
    return rc;
}

static uint64_t make_run_id(void)
{
    uint64_t id = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &id, sizeof id) != sizeof id) id = 0;
        close(fd);
    }
    uint64_t x = id ^ (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    id = ps_splitmix64(&x);
    return id ? id : 1;
}

static bool is_loopback(const char *ep)
{
    return strncmp(ep, "ipc://", 6) == 0 || strncmp(ep, "inproc://", 9) == 0 ||
           strncmp(ep, "tcp://127.", 10) == 0 || strncmp(ep, "tcp://localhost:", 16) == 0 ||
           strncmp(ep, "tcp://[::1]:", 12) == 0;
}

static void close_cb(uv_handle_t *h) { (void)h; }

int psd_server_run(const ps_config_t *c)
{
    srv_t *s = calloc(1, sizeof *s);
    if (!s) return PSD_EXIT_ERROR;
    int code = PSD_EXIT_ERROR;
    bool loop_ok = false;
    s->cfg = *c;
    s->run_id = make_run_id();
    s->w = calloc(MAX_WORKERS, sizeof *s->w);
    if (!s->w) goto out;
    if (ps_layout_init(&s->layout, c->sizes, c->n_sizes) != 0) {
        PS_ERROR("invalid model.layers");
        code = PSD_EXIT_USAGE;
        goto out;
    }
    if (check_data(s) != 0) {
        code = PSD_EXIT_USAGE;
        goto out;
    }
    s->perm = malloc((s->train_count ? s->train_count : 1) * sizeof *s->perm);
    psd_optim_t opt;
    psd_optim_from_config(&opt, c);
    if (!s->perm || psd_store_init(&s->store, &s->layout, &opt, c->seed) != 0) {
        PS_ERROR("out of memory for %zu parameters", s->layout.n_params);
        goto out;
    }
    if (c->metrics[0]) {
        s->metrics = fopen(c->metrics, "a");
        if (!s->metrics) {
            PS_ERROR("metrics file %s: %s", c->metrics, strerror(errno));
            code = PSD_EXIT_USAGE;
            goto out;
        }
    }
    s->zctx = zmq_ctx_new();
    s->sock = s->zctx ? zmq_socket(s->zctx, ZMQ_ROUTER) : NULL;
    if (!s->sock) {
        PS_ERROR("zeromq: %s", zmq_strerror(zmq_errno()));
        goto out;
    }
    int one = 1, linger = 1000, hwm = 1000, ivl = 1000, tmo = 10000;
    zmq_setsockopt(s->sock, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s->sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s->sock, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s->sock, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(s->sock, ZMQ_HEARTBEAT_TIMEOUT, &tmo, sizeof tmo);
    /* a message larger than the biggest legitimate one disconnects its sender */
    int64_t maxmsg = (int64_t)(4 * s->layout.n_params + (size_t)(4 << 20));
    zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    if (zmq_bind(s->sock, c->listen) != 0) {
        PS_ERROR("cannot listen on '%s': %s", c->listen, zmq_strerror(zmq_errno()));
        code = PSD_EXIT_USAGE;
        goto out;
    }
    char ep[256] = "";
    size_t eplen = sizeof ep;
    zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, ep, &eplen);
    if (!is_loopback(c->listen))
        PS_WARN("listening on %s, beyond loopback, without authentication: anyone who can reach it "
                "can read or change the model",
                ep);
    PS_INFO("psd %s (protocol %u): run %016" PRIx64 ", listening on %s, waiting for %d workers",
            PSD_VERSION, PS_PROTOCOL_VERSION, s->run_id, ep, c->workers);
    PS_INFO("model %zu parameters, %zu training / %zu test samples, optimizer %s, schedule %s",
            s->layout.n_params, s->train_count, s->test_count, ps_opt_name(c->opt), ps_sched_name(c->sched));

    int fd;
    size_t fdlen = sizeof fd;
    zmq_getsockopt(s->sock, ZMQ_FD, &fd, &fdlen);
    uv_loop_init(&s->loop);
    loop_ok = true;
    uv_poll_init(&s->loop, &s->poll, fd);
    uv_timer_init(&s->loop, &s->timer);
    uv_signal_init(&s->loop, &s->sigint);
    uv_signal_init(&s->loop, &s->sigterm);
    s->poll.data = s->timer.data = s->sigint.data = s->sigterm.data = s;
    uv_poll_start(&s->poll, UV_READABLE, on_poll);
    uv_timer_start(&s->timer, on_timer, 100, 100);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    s->phase = PHASE_WAIT;
    s->phase_deadline = ps_now() + c->start_timeout;
    drain(s);
    if (s->phase != PHASE_DONE) uv_run(&s->loop, UV_RUN_DEFAULT);
    code = s->exit_code;
out:
    if (loop_ok) {
        uv_close((uv_handle_t *)&s->poll, close_cb);
        uv_close((uv_handle_t *)&s->timer, close_cb);
        uv_close((uv_handle_t *)&s->sigint, close_cb);
        uv_close((uv_handle_t *)&s->sigterm, close_cb);
        uv_run(&s->loop, UV_RUN_DEFAULT);
        uv_loop_close(&s->loop);
    }
    if (s->w)
        for (int i = 0; i < s->n; i++) release_push(&s->w[i]);
    if (s->sock) zmq_close(s->sock); /* lingers up to 1 s to deliver SHUTDOWN */
    if (s->zctx) zmq_ctx_term(s->zctx);
    if (s->metrics) fclose(s->metrics);
    psd_store_deinit(&s->store);
    free(s->perm);
    free(s->w);
    free(s);
    return code;
}
