/* psd_shard.c - psd --shard i/n with i > 0: one part of the parameters.
 *
 * Shard 0 runs the run (registration, data, barriers, validation, who
 * contributes to each step); a shard i > 0 only holds its pieces of every
 * tensor (ps_shard_pieces) with their optimizer state, and does what shard
 * 0 tells it over one DEALER connection:
 *
 *   SHARD_HELLO   ->        (retried until answered; the answer has the run id
 *                           and the run's tensor table, or says to wait: shard 0
 *                           has no model yet, model.kind from_worker)
 *   SHARD_INIT_FETCH ->     (a run not resumed, values the config does not draw:
 *   <- SHARD_INIT_VALUES    model.init's, the first worker's) this part's initial
 *                           values, a chunk at a time, each asked for once the one
 *                           before is in
 *   SHARD_INIT_DONE  ->     this part holds its initial values (fetched, or drawn
 *                           as the config says): the shard has joined
 *   <- SHARD_WORKER         a worker's rank and token: it may now register here
 *   SHARD_HAVE    ->        a worker's push for the current version is all here
 *   <- SHARD_STEP           reduce these contributors in this order, and apply
 *   SHARD_NORM    ->        (clipping) the squared norms of this part's blocks,
 *   <- SHARD_APPLY          then apply with the whole gradient's norm
 *   <- SHARD_FETCH          send floats [from, from + count) of this part of
 *                           the current version (shard 0 writes the weights
 *                           file from them, a chunk at a time)
 *   <- HEARTBEAT / SHUTDOWN
 *
 * Workers talk to it directly (its ROUTER): REGISTER with the token, PUSH
 * of their pieces, PULL. Nothing here decides anything: a step takes exactly
 * the contributors shard 0 names, so every shard applies the same step and
 * the weights are the same bits as with one psd. Shard 0 silent past
 * worker_timeout (it sends a heartbeat every second; plus the time a message of
 * the whole model may take each way, psd_silence_limit): exit 5. */

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>
#include <zmq.h>

#include "ps_auth.h"
#include "ps_log.h"
#include "ps_table.h"
#include "ps_weights_st.h"
#include "ps_shm.h"
#include "ps_util.h"
#include "ps_wire.h"
#include "psd_ckpt.h"
#include "psd_contrib.h"
#include "psd_hold.h"
#include "psd_lock.h"
#include "psd_net.h"
#include "psd_opts.h"
#include "psd_shard.h"
#include "psd_store.h"
#include "psd_zap.h"
#include "ps_tcp.h"

#define SHARD_MAX_WORKERS 1024

typedef struct {
    bool known;                /* shard 0 told us its token */
    uint8_t token[PS_SHM_TOKEN];
    uint8_t ident[PS_MAX_IDENTITY];
    size_t ident_len;          /* 0: not registered here */
    uint64_t seq_in, seq_out;
    psd_contrib_t c;           /* its push (pieces so far, psd_contrib.h: HELD once whole here, the only
                                * part a shard knows of), the rows its reply brings */
    uint64_t want;             /* answer a pull with a version >= want - 1 (0: none) */
    int tcp_fd;                /* its connection given server.tcp_congestion (fd + 1, 0: none yet) */
} fw_t;

/* This shard's own state (shard 0's record of it is psd_core.h's shard_peer_t). */
typedef struct {
    ps_config_t cfg;
    psd_run_opts_t opts;
    ps_layout_t layout;
    psd_store_t store;
    psd_hold_t hold;           /* the pieces held, the workers' pushes (psd_hold.h) */
    void *zctx, *router, *leader, *mon; /* mon: its ROUTER's failed handshakes (with keys) */
    void *lmon;                /* PAIR with the connection to shard 0 closing */
    bool leader_closed;        /* it did: shard 0 is gone */
    psd_zap_t *zap;
    uint64_t hs_failed;
    uint64_t run_id, config_hash, seq_out;
    bool joined;
    /* its model: the config's layout (draws: laid out at the start, its
     * values drawn as the config says) or shard 0's table (model.init,
     * from_worker: fetched), set up when shard 0 answers HELLO (model_setup);
     * told_wait: shard 0 answered that it has no model yet */
    bool draws, told_wait;
    bool valued;               /* a run not resumed: this part's initial values are all here */
    uint64_t init_size, init_from, init_count, init_chunks; /* this part's floats, those in, the chunk asked for */
    double init_asked;         /* when that chunk was asked for (0: none is) */
    double leader_seen;
    int leader_tcp_fd;         /* the connection to shard 0 given server.tcp_congestion (fd + 1) */
    char bound[256];           /* the endpoint it listens on, its port found (ZMQ_LAST_ENDPOINT) */
    fw_t *w;
    double *norm_blk;          /* clipping: this part's blocks' squared norms for SHARD_NORM */
    size_t n_norm_blk;
    int n_w;                   /* 1 + the highest rank shard 0 told about: the loops per step stop there */
    bool awaiting_apply;
    double lr;
    ps_arena_t rx_arena;
    uint8_t rx_buf[64 << 10];
    uint64_t dropped;
    uint64_t bytes_in, rows_pushes, rows_in; /* gradient bytes received; pushes of table rows, their rows */
    uint64_t rows_out;                       /* table rows sent in replies that asked for rows */
    uint64_t bytes_out;                      /* tensor bytes sent to workers */
    int exit_code;
    bool done;
    psd_ckpt_writer_t *ckpt; /* this part's checkpoint being written */
    uint64_t ckpt_step, ckpt_version;
    char ckpt_dir[PS_PATH_MAX];
    psd_locks_t locks;       /* this shard's hold on its checkpoint directory and ipc socket (psd_lock.h) */
    bool run_ending;         /* shard 0 was stopped: it ends the run once its checkpoint is written */
    /* the loop (libuv, as shard 0's): both sockets' ZMQ_FD, a 100 ms tick, SIGINT and SIGTERM */
    uv_loop_t loop;
    uv_poll_t poll_leader, poll_router;
    uv_timer_t timer;
    uv_signal_t sigint, sigterm;
    bool loop_open;
    int stop_signal, stop_count; /* the stop signal and how many came (ps_stop_signal_note) */
    double start, last_hello, last_hb, last_mon, stop_at, silence;
    ps_hearing_t hearing;    /* shard 0's silence counts only while this loop ran */
} shard_self_t;


static void sdrop(shard_self_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sdrop(shard_self_t *s, const char *fmt, ...)
{
    if (++s->dropped > 20 && s->dropped % 1000 != 0) return;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    PS_WARN("shard %d dropped a message: %s", s->opts.shard, msg);
}

static int to_leader(shard_self_t *s, Psd__Header *h, const ps_frame_t *fr, int n)
{
    h->run_id = s->run_id;
    h->rank = (uint32_t)s->opts.shard;
    h->seq = ++s->seq_out;
    return ps_msg_send(s->leader, NULL, 0, h, fr, n);
}

/* A message of registered worker `rank` this shard cannot take: dropped
 * and logged, and shard 0 told (SHARD_HAVE with the words), which ends
 * that worker's run with them (a worker left waiting for an answer the
 * shard will never give would only be lost and register again). */
static void refuse(shard_self_t *s, uint32_t rank, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void refuse(shard_self_t *s, uint32_t rank, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sdrop(s, "%s", msg);
    Psd__Header h;
    Psd__ShardHave hv = PSD__SHARD_HAVE__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_HAVE;
    hv.rank = rank;
    hv.version = s->store.cur->version;
    hv.refused = msg;
    h.body_case = PSD__HEADER__BODY_SHARD_HAVE;
    h.shard_have = &hv;
    to_leader(s, &h, NULL, 0);
}

static void hello(shard_self_t *s)
{
    char host[64];
    ps_hostname(host, sizeof host);
    Psd__Header h;
    Psd__ShardHello b = PSD__SHARD_HELLO__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
    b.shard = (uint32_t)s->opts.shard;
    b.shards = (uint32_t)s->opts.shards;
    b.endpoint = (char *)s->opts.advertise;
    b.config_hash = s->config_hash;
    b.n_params = s->draws ? s->layout.n_params : 0; /* 0: the model is shard 0's to say */
    b.hostname = host;
    b.pid = (uint32_t)getpid();
    b.version = PSD_VERSION;
    b.resume = s->opts.resume_dir != NULL;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &b;
    to_leader(s, &h, NULL, 0);
}

static void fail(shard_self_t *s, const char *why);

/* w's push goes: its frames, and its row buffer back to the holder. */
static void release(shard_self_t *s, fw_t *w) { psd_contrib_release(&w->c, &s->hold); }

/* A WEIGHTS header of the current version (h's run, rank and sequence to fill). */
static void weights_header(const shard_self_t *s, Psd__Header *h, Psd__Weights *wt)
{
    psd__header__init(h);
    psd__weights__init(wt);
    h->type = PSD__MSG_TYPE__MSG_WEIGHTS;
    wt->version = s->store.cur->version;
    wt->step = s->store.steps;
    h->body_case = PSD__HEADER__BODY_WEIGHTS;
    h->weights = wt;
}

/* The current version of this shard's part, to worker w (its ident, rank
 * and sequence): psd_hold_reply (the table's rows it asked for instead of
 * the piece; with the table on psd, always rows). */
static void send_weights_to(shard_self_t *s, fw_t *w, uint32_t rank)
{
    Psd__Header h;
    Psd__Weights wt;
    ps_frame_t fr[PS_MAX_TENSORS];
    weights_header(s, &h, &wt);
    h.run_id = s->run_id;
    h.rank = rank;
    h.seq = ++w->seq_out;
    long rows;
    int n = psd_hold_reply(&s->hold, &w->c.push, fr, &wt.crc, &rows);
    if (rows >= 0) {
        wt.rows = true;
        s->rows_out += (uint64_t)rows;
    }
    for (int i = 0; i < n; i++) s->bytes_out += fr[i].nbytes;
    int rc = ps_msg_send(s->router, w->ident, w->ident_len, &h, fr, n);
    psd_hold_sent(&s->hold, &w->c.push);
    if (rc < 0) PS_WARN("shard %d cannot send weights: %s", s->opts.shard, zmq_strerror(-rc));
}

/* SHARD_FETCH: floats [from, from + count) of this part of the final
 * version, for the weights file shard 0 writes a chunk at a time. */
static void send_part(shard_self_t *s, const Psd__ShardFetch *f)
{
    ps_frame_t fr[PS_MAX_TENSORS];
    int n = f->version == s->store.cur->version ? psd_store_range_frames(&s->store, f->from, f->count, fr) : 0;
    if (n == 0) {
        sdrop(s, "SHARD_FETCH of floats [%" PRIu64 ", +%" PRIu64 ") of version %" PRIu64 ": not in this shard's "
              "part of version %" PRIu64, f->from, f->count, f->version, s->store.cur->version);
        return;
    }
    if (s->opts.break_fetch && fr[n - 1].nbytes > 4) fr[n - 1].nbytes -= 4; /* tests only: a float short */
    Psd__Header h;
    Psd__Weights wt;
    weights_header(s, &h, &wt);
    int rc = to_leader(s, &h, fr, n);
    if (rc < 0) PS_WARN("shard %d cannot send its part of the weights: %s", s->opts.shard, zmq_strerror(-rc));
}

/* A new version: answer the pulls waiting for it. */
static void answer_pulls(shard_self_t *s)
{
    for (int r = 0; r < s->n_w; r++) {
        fw_t *w = &s->w[r];
        if (w->want == 0 || w->want - 1 > s->store.cur->version || w->ident_len == 0) continue;
        w->want = 0;
        send_weights_to(s, w, (uint32_t)r);
    }
}

static void fail(shard_self_t *s, const char *why)
{
    PS_ERROR("shard %d: %s", s->opts.shard, why);
    Psd__Header h;
    Psd__Error e = PSD__ERROR__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_ERROR;
    e.code = PSD__ERR_CODE__ERR_INTERNAL;
    e.message = (char *)why;
    h.body_case = PSD__HEADER__BODY_ERROR;
    h.error = &e;
    to_leader(s, &h, NULL, 0);
    s->exit_code = PSD_EXIT_ERROR;
    s->done = true;
}

static void applied(shard_self_t *s)
{
    s->awaiting_apply = false;
    answer_pulls(s);
}

static void on_step(shard_self_t *s, ps_msg_t *m)
{
    Psd__ShardStep *st = m->hdr->shard_step;
    if (st->version != s->store.cur->version || st->step != s->store.steps || s->awaiting_apply ||
        st->n_ranks != st->n_weights || st->n_ranks == 0 || st->n_ranks > SHARD_MAX_WORKERS) {
        char why[200];
        snprintf(why, sizeof why, "STEP for version %" PRIu64 " step %" PRIu64 " does not follow this shard's version %"
                 PRIu64 " step %" PRIu64, st->version, st->step, s->store.cur->version, s->store.steps);
        fail(s, why);
        return;
    }
    bool seen[SHARD_MAX_WORKERS] = {0};
    psd_push_t *ps[SHARD_MAX_WORKERS];
    for (size_t k = 0; k < st->n_ranks; k++) {
        fw_t *w = st->ranks[k] < SHARD_MAX_WORKERS ? &s->w[st->ranks[k]] : NULL;
        if (!isfinite(st->lr) || st->clip_norm != s->cfg.clip_norm || (w && seen[st->ranks[k]]) ||
            !isfinite(st->weights[k]) || st->weights[k] < 0) {
            fail(s, "STEP with a repeated rank, a weight or learning rate that is not a finite non-negative number, "
                    "or another clip norm than this shard's config");
            return;
        }
        if (w) seen[st->ranks[k]] = true;
        if (!w || !psd_contrib_held(&w->c) || w->c.head.version != st->version) {
            char why[160];
            snprintf(why, sizeof why, "STEP names rank %u, whose push for version %" PRIu64 " is not here",
                     st->ranks[k], st->version);
            fail(s, why);
            return;
        }
        ps[k] = &w->c.push;
    }
    if (psd_hold_gather(&s->hold, ps, NULL, (int)st->n_ranks) != 0) {
        fail(s, "out of memory for a step's table rows");
        return;
    }
    s->lr = st->lr;
    if (st->cycled && psd_optim_set_momentum(&s->store.opt, st->momentum) != 0) {
        fail(s, "STEP with a cycled momentum out of [0, 1)");
        return;
    }
    if (st->clip_norm > 0) { /* the norm of the whole gradient first */
        if (psd_hold_step(&s->hold, (int)st->n_ranks, st->weights, 0, 0, true) != 0) {
            fail(s, "more table rows in a step than this shard made room for");
            return;
        }
        Psd__Header h;
        Psd__ShardNorm nb = PSD__SHARD_NORM__INIT;
        double *blk = s->norm_blk;
        size_t nblk = s->n_norm_blk, j = 0;
        for (int t = 0; t < s->layout.n_tensors; t++) {
            size_t b = ps_layout_first_block(&s->layout, t) + s->store.own[t].off / PSD_NORM_BLOCK;
            for (size_t o = 0; o < s->store.own[t].n; o += PSD_NORM_BLOCK) blk[j++] = s->store.blk_sq[b++];
        }
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_NORM;
        nb.version = st->version;
        nb.block_sq = blk;
        nb.n_block_sq = nblk;
        h.body_case = PSD__HEADER__BODY_SHARD_NORM;
        h.shard_norm = &nb;
        to_leader(s, &h, NULL, 0);
        s->awaiting_apply = true;
    } else {
        double rc = psd_hold_step(&s->hold, (int)st->n_ranks, st->weights, 0, st->lr, false);
        if (rc < 0) {
            fail(s, rc == -2 ? "more table rows in a step than this shard made room for"
                             : "no free parameter arena (too many pull replies in flight)");
            return;
        }
    }
    for (int r = 0; r < s->n_w; r++) /* every push of that version is used or stale */
        if (s->w[r].c.push.mask && s->w[r].c.head.version <= st->version) release(s, &s->w[r]);
    if (!s->awaiting_apply) applied(s);
}

static void on_apply(shard_self_t *s, ps_msg_t *m)
{
    Psd__ShardApply *a = m->hdr->shard_apply;
    if (!s->awaiting_apply || a->version != s->store.cur->version) {
        fail(s, "APPLY without the STEP before it");
        return;
    }
    if (a->sumsq < 0) {
        fail(s, "APPLY with a negative sum of squares");
        return;
    }
    if (psd_store_apply(&s->store, a->sumsq, s->cfg.clip_norm, s->lr) != 0) {
        fail(s, "no free parameter arena (too many pull replies in flight)");
        return;
    }
    applied(s);
}

/* ---- checkpoints: this part, at the steps shard 0 writes its own ---------- */

/* Tell shard 0 how its part of checkpoint `step` went (error NULL: written):
 * shard 0 counts the checkpoint written only when every part is. */
static void ckpt_ack(shard_self_t *s, int type, uint64_t step, uint64_t version, const char *error)
{
    Psd__Header h;
    Psd__ShardCkpt ck = PSD__SHARD_CKPT__INIT;
    psd__header__init(&h);
    h.type = type;
    ck.step = step;
    ck.version = version;
    ck.error = (char *)(error ? error : "");
    h.body_case = PSD__HEADER__BODY_SHARD_CKPT;
    h.shard_ckpt = &ck;
    to_leader(s, &h, NULL, 0);
}

/* The checkpoint being written, if it is finished (wait: once it is):
 * confirmed to shard 0. -errno if it failed, else 0. */
static int ckpt_finish(shard_self_t *s, bool wait)
{
    if (!s->ckpt || (!wait && !psd_ckpt_done(s->ckpt))) return 0;
    char path[PS_PATH_MAX], err[PS_PATH_MAX + 64];
    double secs = 0;
    uint64_t bytes = 0, peak = 0;
    int rc = psd_ckpt_end(&s->ckpt, path, sizeof path, &secs, &bytes, &peak);
    if (rc != 0) {
        snprintf(err, sizeof err, "cannot write its part in %s: %s", s->ckpt_dir, strerror(-rc));
        PS_ERROR("shard %d: checkpoint failed: %s", s->opts.shard, err);
    } else {
        PS_DEBUG("shard %d: checkpoint %s: %.1f MB in %.2f s", s->opts.shard, path, (double)bytes / 1e6, secs);
    }
    ckpt_ack(s, PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE, s->ckpt_step, s->ckpt_version, rc != 0 ? err : NULL);
    return rc;
}

static int mkdirs(const char *path)
{
    char p[PS_PATH_MAX];
    snprintf(p, sizeof p, "%s", path);
    for (char *q = p + 1; *q; q++)
        if (*q == '/') {
            *q = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) return -errno;
            *q = '/';
        }
    return mkdir(p, 0755) != 0 && errno != EEXIST ? -errno : 0;
}

static void ckpt_meta(shard_self_t *s, psd_ckpt_meta_t *m)
{
    memset(m, 0, sizeof *m);
    m->run_id = s->run_id;
    m->config_hash = s->config_hash;
    m->seed = s->cfg.seed;
    m->step = s->store.steps;
    m->version = s->store.cur->version;
    m->n_sizes = s->layout.n_sizes;
    memcpy(m->sizes, s->layout.sizes, sizeof m->sizes);
    if (s->layout.table >= 0) {
        m->table_rows = (uint64_t)s->layout.t[s->layout.table].rows;
        m->table_dim = (uint32_t)s->layout.t[s->layout.table].cols;
    }
    m->opt_kind = (uint32_t)s->cfg.opt;
    m->n_slots = (uint32_t)psd_optim_slots(&s->store.opt);
    m->shard = (uint32_t)s->opts.shard;
    m->shards = (uint32_t)s->opts.shards;
    m->n_params = s->layout.n_params;
    m->lr = s->lr;
}

static void on_ckpt(shard_self_t *s, ps_msg_t *m)
{
    Psd__ShardCkpt *ck = m->hdr->shard_ckpt;
    if (ck->stop) { /* shard 0 was stopped: it ends the run when its checkpoint is written, however long that takes */
        s->run_ending = true;
        if (ck->step == 0) return;
    }
    if (ck->step != s->store.steps || ck->version != s->store.cur->version || s->awaiting_apply) {
        fail(s, "CKPT for another step than this shard's");
        return;
    }
    if (!s->cfg.ckpt_dir[0]) {
        ckpt_ack(s, PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE, ck->step, ck->version, "this shard has no checkpoint.dir");
        return;
    }
    /* shard 0 asks for one only once this shard confirmed the one before
     * (CKPT_DONE): none is being written; if one were, it is finished first */
    ckpt_finish(s, true);
    snprintf(s->ckpt_dir, sizeof s->ckpt_dir, "%s/run-%016" PRIx64 "/shard-%d", s->cfg.ckpt_dir, s->run_id,
             s->opts.shard);
    int rc = mkdirs(s->ckpt_dir);
    char why[PS_PATH_MAX + 400];
    if (rc == 0 && (rc = psd_lock_dir(&s->locks, s->ckpt_dir, why, sizeof why)) == -EWOULDBLOCK) {
        fail(s, why); /* another psd writes this part's checkpoints */
        s->exit_code = PSD_EXIT_USAGE;
        return;
    }
    psd_ckpt_meta_t meta;
    ckpt_meta(s, &meta);
    meta.keep_step = ck->keep_step;
    static const uint8_t none[1];
    s->ckpt_step = ck->step;
    s->ckpt_version = ck->version;
    if (rc == 0) rc = psd_ckpt_begin(&s->ckpt, s->ckpt_dir, psd_ckpt_keep(&s->cfg, s->opts.shards), &meta, none,
                                     &s->store);
    if (rc != 0) {
        char err[PS_PATH_MAX + 64];
        snprintf(err, sizeof err, "cannot start a checkpoint in %s: %s", s->ckpt_dir, strerror(-rc));
        PS_ERROR("shard %d: %s", s->opts.shard, err);
        s->ckpt = NULL;
        ckpt_ack(s, PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE, ck->step, ck->version, err);
    }
}

/* --resume DIR: where this part's checkpoints are: DIR/run-<run id>/shard-<i>,
 * DIR/shard-<i> (DIR a run's directory) or DIR, the first that holds any */
static const char *resume_dir(shard_self_t *s, char *dir, size_t n)
{
    uint64_t any;
    for (int i = 0; i < 3; i++) {
        if (i == 0) snprintf(dir, n, "%s/run-%016" PRIx64 "/shard-%d", s->opts.resume_dir, s->run_id, s->opts.shard);
        else if (i == 1) snprintf(dir, n, "%s/shard-%d", s->opts.resume_dir, s->opts.shard);
        else snprintf(dir, n, "%s", s->opts.resume_dir);
        if (psd_ckpt_steps(dir, UINT64_MAX, &any, 1) == 1) return dir;
    }
    return NULL;
}

/* This part at the newest of the steps shard 0 can resume at (newest first)
 * that this shard has a valid checkpoint of; answered with SHARD_RESUMED
 * (the step, or why none). Shard 0 then takes the oldest step a shard
 * resumed at, and asks the others to go back to it. 0, or -1. */
static int resume_part(shard_self_t *s, const uint64_t *steps, size_t n_steps)
{
    char dir[PS_PATH_MAX], path[PS_PATH_MAX], err[PS_PATH_MAX + 400];
    uint64_t have[PSD_RESUME_STEPS_MAX];
    size_t n_have = 0;
    if (!resume_dir(s, dir, sizeof dir)) {
        snprintf(err, sizeof err, "no checkpoint of its part under %s (looked in run-%016" PRIx64 "/shard-%d, "
                 "shard-%d and the directory itself)", s->opts.resume_dir, s->run_id, s->opts.shard, s->opts.shard);
        goto none;
    }
    if (psd_lock_dir(&s->locks, dir, err, sizeof err) == -EWOULDBLOCK) { /* a shard still running writes there */
        fail(s, err);
        s->exit_code = PSD_EXIT_USAGE;
        return -1;
    }
    n_have = psd_ckpt_steps(dir, UINT64_MAX, have, PSD_RESUME_STEPS_MAX);
    for (size_t i = 0; i < n_steps; i++) {
        bool found = false;
        for (size_t j = 0; j < n_have && !found; j++) found = have[j] == steps[i];
        if (!found) continue;
        psd_ckpt_meta_t m;
        float *w = NULL, *sl[2] = {NULL, NULL};
        if (psd_ckpt_load_step(dir, s->run_id, steps[i], &m, NULL, &w, sl, path, sizeof path, err, sizeof err) != 0) {
            PS_WARN("shard %d: %s; trying an older one", s->opts.shard, err);
            continue;
        }
        const char *misfit = NULL;
        uint64_t rows = s->layout.table >= 0 ? (uint64_t)s->layout.t[s->layout.table].rows : 0;
        if (m.n_params != s->layout.n_params || m.table_rows != rows ||
            (rows && (uint64_t)m.table_dim != s->layout.t[s->layout.table].cols) ||
            m.table_crc != psd_ckpt_table_crc(&s->layout) || m.n_slots != (uint32_t)psd_optim_slots(&s->store.opt) || m.opt_kind != (uint32_t)s->cfg.opt ||
            m.run_id != s->run_id)
            misfit = "it does not fit the run shard 0 resumed (model, optimizer or run)";
        else if (m.shards && (m.shard != (uint32_t)s->opts.shard || m.shards != (uint32_t)s->opts.shards))
            misfit = "it holds the part of another psd shard or shard layout";
        else if (m.config_hash != s->config_hash && !s->opts.force_resume)
            misfit = "it was written with another config; use --force-resume to resume anyway";
        if (!misfit) { /* this part only: the rest of the arena is never touched (nor resident) */
            psd_store_load_part(&s->store, w, (const float *const *)sl, m.n_slots);
            s->store.steps = m.step;
            s->store.cur->version = m.version;
        }
        free(w);
        free(sl[0]);
        free(sl[1]);
        if (misfit) {
            snprintf(err, sizeof err, "%s: %s", path, misfit);
            goto none;
        }
        PS_INFO("shard %d resumed its part from %s: step %" PRIu64, s->opts.shard, path, m.step);
        ckpt_ack(s, PSD__MSG_TYPE__MSG_SHARD_RESUMED, m.step, m.version, NULL);
        return 0;
    }
    snprintf(err, sizeof err, "no valid checkpoint in %s of a step shard 0 can resume at (newest %" PRIu64
             ", %zu of them)", dir, n_steps ? steps[0] : 0, n_steps);
none:
    PS_ERROR("shard %d: cannot resume: %s", s->opts.shard, err);
    ckpt_ack(s, PSD__MSG_TYPE__MSG_SHARD_RESUMED, 0, 0, err);
    s->exit_code = PSD_EXIT_USAGE;
    s->done = true;
    return -1;
}

/* ---- the model: shard 0's table, this part's initial values ------------- */

/* This part's store, holder and step buffers for s->layout. 0, or an exit
 * code after a message. */
static int model_setup(shard_self_t *s)
{
    const ps_config_t *c = &s->cfg;
    const int shard = s->opts.shard, shards = s->opts.shards;
    psd_optim_t opt;
    psd_optim_from_config(&opt, c);
    if (psd_store_init_part(&s->store, &s->layout, &opt, c->seed, shard, shards) != 0 ||
        psd_store_groups(&s->store, c->groups, c->n_groups) != 0 || /* shard 0's groups: the same config */
        psd_store_set_parallel(&s->store, psd_step_threads(c), (size_t)c->chunk_bytes) != 0) {
        PS_ERROR("shard %d: out of memory for %zu parameters", shard, s->layout.n_params);
        return PSD_EXIT_ERROR;
    }
    if (psd_hold_init(&s->hold, &s->store, &s->layout, c, true, SHARD_MAX_WORKERS) != 0) {
        PS_ERROR("shard %d: out of memory for the workers' pushes", shard);
        return PSD_EXIT_ERROR;
    }
    s->hold.verify = s->opts.verify_weights;
    s->init_size = ps_part_size(s->store.own, s->layout.n_tensors);
    for (int t = 0; t < s->layout.n_tensors; t++)
        s->n_norm_blk += (s->store.own[t].n + PSD_NORM_BLOCK - 1) / PSD_NORM_BLOCK;
    if (!(s->norm_blk = calloc(s->n_norm_blk ? s->n_norm_blk : 1, sizeof *s->norm_blk))) {
        PS_ERROR("shard %d: out of memory for %zu parameters", shard, s->layout.n_params);
        return PSD_EXIT_ERROR;
    }
    if (s->init_size == 0) { /* shard 0 refuses such a model first: this one's config, then */
        PS_ERROR("shard %d of %d holds no parameters: the model has fewer blocks of %d floats than shards; use fewer "
                 "shards", shard, shards, PSD_NORM_BLOCK);
        return PSD_EXIT_USAGE;
    }
    /* the table stepped by rows when every shard's piece of it is whole rows
     * (as shard 0 and the workers decide: they then send rows) */
    if (ps_shards_table_rows(&s->layout, shards)) {
        size_t room = (size_t)c->workers * s->hold.room_rows;
        if (psd_store_lazy_table(&s->store, room ? room : 1, SHARD_MAX_WORKERS) != 0) {
            PS_ERROR("shard %d: out of memory for the table's row steps", shard);
            return PSD_EXIT_ERROR;
        }
        s->hold.table_on_psd = psd_table_on_psd(c, &s->layout, true); /* as shard 0 decides */
    }
    s->silence = psd_silence_limit(c, s->layout.n_params);
    PS_INFO("shard %d/%d holds %" PRIu64 " of %zu parameters (%.1f MB)", shard, shards, s->init_size,
            s->layout.n_params, (double)s->init_size * sizeof(float) / 1e6);
    return 0;
}

/* The model of shard 0's answer to HELLO (its one DT_U8 frame: the run's
 * tensor table) set up: the config's layout when this shard draws its
 * values (it must be the same table), else the table itself (this shard
 * never reads model.init's file). 0, or -1 after fail(). */
static int take_model(shard_self_t *s, const ps_msg_t *m)
{
    ps_layout_t l;
    char why[400] = "no DT_U8 frame", msg[600];
    if (m->n_frames != 1 || m->hdr->tensors[0]->dtype != PSD__DTYPE__DT_U8 ||
        ps_table_unpack(zmq_msg_data((zmq_msg_t *)&m->frames[0]), zmq_msg_size((zmq_msg_t *)&m->frames[0]), &l, why,
                        sizeof why) != 0) {
        snprintf(msg, sizeof msg, "shard 0's answer holds no tensor table this shard can read: %s", why);
        fail(s, msg);
        return -1;
    }
    if (s->draws && !ps_layout_same_table_as(&s->layout, &l, "in this shard's config", "in shard 0's", why,
                                             sizeof why)) {
        snprintf(msg, sizeof msg, "the model of this shard's config is not shard 0's: %s", why);
        fail(s, msg);
        s->exit_code = PSD_EXIT_USAGE;
        ps_layout_free(&l);
        return -1;
    }
    if (s->draws) {
        ps_layout_free(&l);
    } else {
        ps_layout_free(&s->layout);
        s->layout = l; /* moved */
    }
    int code = model_setup(s);
    if (code != 0) {
        fail(s, code == PSD_EXIT_USAGE ? "its part of the model is empty (more shards than blocks)"
                                       : "out of memory for its part of the model");
        s->exit_code = code;
        return -1;
    }
    return 0;
}

/* SHARD_INIT_FETCH or SHARD_INIT_DONE to shard 0: floats [from, from + count)
 * of this part. */
static void init_send(shard_self_t *s, int type, uint64_t from, uint64_t count)
{
    Psd__Header h;
    Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
    psd__header__init(&h);
    h.type = type;
    f.from = from;
    f.count = count;
    h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
    h.shard_fetch = &f;
    int rc = to_leader(s, &h, NULL, 0);
    if (rc < 0) PS_WARN("shard %d cannot send %s: %s", s->opts.shard, ps_msg_type_name(type), zmq_strerror(-rc));
}

/* This part holds its initial values: shard 0 is told (it counts this shard
 * joined only then). */
static void init_done(shard_self_t *s, bool fetched)
{
    s->valued = true;
    init_send(s, PSD__MSG_TYPE__MSG_SHARD_INIT_DONE, 0, s->init_size);
    if (fetched)
        PS_INFO("shard %d has its part of the initial values from shard 0: %" PRIu64 " floats in %" PRIu64 " chunks",
                s->opts.shard, s->init_size, s->init_chunks);
    else
        PS_INFO("shard %d drew its part of the initial values as the config says: %" PRIu64 " floats", s->opts.shard,
                s->init_size);
}

/* Ask shard 0 for the next chunk of this part's initial values (psd
 * --x-fetch-floats N sets its size, tests only; 16 MiB at most), or, all
 * in, say so. */
static void init_next(shard_self_t *s)
{
    if (s->init_from >= s->init_size) {
        init_done(s, true);
        return;
    }
    uint64_t chunk = s->opts.fetch_floats && s->opts.fetch_floats < PSD_FETCH_FLOATS ? s->opts.fetch_floats
                                                                                     : PSD_FETCH_FLOATS;
    s->init_count = s->init_size - s->init_from < chunk ? s->init_size - s->init_from : chunk;
    s->init_asked = ps_now();
    s->init_chunks++;
    init_send(s, PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH, s->init_from, s->init_count);
}

/* SHARD_INIT_VALUES: the chunk asked for, checked against the pieces of
 * this part it must hold (ps_part_range, as shard 0 cut it), into the
 * store. One that was not asked for is dropped; the chunk asked for that
 * does not match fails the run (shard 0 sends it once). */
static void on_init_values(shard_self_t *s, ps_msg_t *m)
{
    const Psd__ShardFetch *f = m->hdr->shard_fetch;
    if (s->init_asked == 0 || f->from != s->init_from || f->count != s->init_count) {
        sdrop(s, "INIT_VALUES of floats [%" PRIu64 ", +%" PRIu64 ") of its part, which it did not ask for", f->from,
              f->count);
        return;
    }
    ps_piece_t r[PS_MAX_TENSORS];
    int nr = ps_part_range(s->store.own, s->layout.n_tensors, s->init_from, s->init_count, r);
    bool ok = nr > 0 && nr == m->n_frames;
    for (int k = 0; ok && k < nr; k++) {
        size_t n = 0;
        ok = ps_msg_f32(m, k, &n) && m->hdr->tensors[k]->id == (uint32_t)r[k].t &&
             m->hdr->tensors[k]->offset == r[k].off && n == r[k].n;
    }
    if (!ok) {
        fail(s, "shard 0 sent initial values that are not the chunk of this shard's part asked for");
        return;
    }
    for (int k = 0; k < nr; k++) {
        size_t n = 0;
        const float *src = ps_msg_f32(m, k, &n);
        memcpy(s->store.cur->w + s->layout.t[r[k].t].offset + r[k].off, src, n * sizeof(float));
    }
    s->init_from += s->init_count;
    s->init_asked = 0;
    init_next(s);
}

/* Shard 0's answer to HELLO (not a wait): the run, its model, then this
 * part: resumed from this shard's checkpoints, fetched from shard 0, or
 * drawn as the config says. */
static void on_joined(shard_self_t *s, ps_msg_t *m)
{
    const Psd__ShardHello *a = m->hdr->shard_hello;
    s->joined = true;
    s->run_id = m->hdr->run_id;
    if (a->resume && !s->opts.resume_dir) {
        fail(s, "shard 0 resumed a run, and this shard was started without --resume DIR");
        s->exit_code = PSD_EXIT_USAGE;
        return;
    }
    if (a->resume && a->n_resume_steps > PSD_RESUME_STEPS_MAX) {
        fail(s, "shard 0 sent more steps to resume at than a run keeps");
        return;
    }
    if (take_model(s, m) != 0) return;
    PS_INFO("shard %d/%d joined run %016" PRIx64 "; workers reach it at %s", s->opts.shard, s->opts.shards, s->run_id,
            s->opts.advertise);
    if (a->resume)
        resume_part(s, a->resume_steps, a->n_resume_steps);
    else if (a->fetch_values)
        init_next(s);
    else if (s->draws)
        init_done(s, false); /* drawn by psd_store_init_part */
    else
        fail(s, "shard 0 sends no initial values, and this shard's config does not draw them");
}

static void on_leader(shard_self_t *s, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->type == PSD__MSG_TYPE__MSG_ERROR) {
        PS_ERROR("shard 0 refused shard %d: %s", s->opts.shard, h->error->message ? h->error->message : "(no reason)");
        s->exit_code = PSD_EXIT_USAGE;
        s->done = true;
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO) {
        if (s->joined) return; /* an answer to a HELLO said again */
        if (h->shard_hello->wait) { /* model.kind from_worker: until the first worker's values come */
            if (!s->told_wait)
                PS_INFO("shard %d: shard 0 has no model yet (model.kind from_worker: the first worker's); waiting",
                        s->opts.shard);
            s->told_wait = true;
            return;
        }
        on_joined(s, m);
        return;
    }
    if (!s->joined || h->run_id != s->run_id) {
        sdrop(s, "%s from shard 0 before joining or of another run", ps_msg_type_name((int)h->type));
        return;
    }
    /* a run not resumed: nothing but this part's values (and the run's end) until they are all here */
    if (!s->opts.resume_dir && !s->valued && h->type != PSD__MSG_TYPE__MSG_SHARD_INIT_VALUES &&
        h->type != PSD__MSG_TYPE__MSG_HEARTBEAT && h->type != PSD__MSG_TYPE__MSG_SHUTDOWN) {
        sdrop(s, "%s from shard 0 before this shard has its initial values", ps_msg_type_name((int)h->type));
        return;
    }
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_HEARTBEAT: break;
    case PSD__MSG_TYPE__MSG_SHARD_INIT_VALUES: on_init_values(s, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_WORKER: {
        Psd__ShardWorker *sw = h->shard_worker;
        if (sw->rank >= SHARD_MAX_WORKERS || sw->token.len != PS_SHM_TOKEN) {
            sdrop(s, "SHARD_WORKER for rank %u", sw->rank);
            break;
        }
        fw_t *w = &s->w[sw->rank];
        if (w->known && memcmp(w->token, sw->token.data, PS_SHM_TOKEN) != 0) {
            /* shard 0 gave the rank of a worker long gone to a new one
             * (every slot taken): none of the old one's pieces stay, nor
             * its connection (on_register sets the rest for the new one) */
            release(s, w);
            w->ident_len = 0;
        }
        w->known = true;
        if ((int)sw->rank >= s->n_w) s->n_w = (int)sw->rank + 1;
        memcpy(w->token, sw->token.data, PS_SHM_TOKEN);
        break;
    }
    case PSD__MSG_TYPE__MSG_SHARD_STEP: on_step(s, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_APPLY: on_apply(s, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_FETCH: send_part(s, h->shard_fetch); break;
    case PSD__MSG_TYPE__MSG_SHARD_CKPT: on_ckpt(s, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_RESUME: /* another shard had no checkpoint as new as this one's: go back */
        /* not once training began */
        if (!s->opts.resume_dir || s->n_w > 0 || h->shard_hello->n_resume_steps > PSD_RESUME_STEPS_MAX) {
            sdrop(s, "SHARD_RESUME to a shard that did not resume");
            break;
        }
        resume_part(s, h->shard_hello->resume_steps, h->shard_hello->n_resume_steps);
        break;
    case PSD__MSG_TYPE__MSG_SHUTDOWN:
        PS_INFO("shard %d: shard 0 ends the run: %s", s->opts.shard, h->shutdown->reason ? h->shutdown->reason : "");
        PS_INFO("shard %d received: %" PRIu64 " gradient bytes, %" PRIu64 " pushes of table rows (%" PRIu64
                " rows); sent %" PRIu64 " rows in replies, %" PRIu64 " weights bytes to workers",
                s->opts.shard, s->bytes_in, s->rows_pushes, s->rows_in, s->rows_out, s->bytes_out);
        s->exit_code = 0;
        s->done = true;
        break;
    default: sdrop(s, "%s is not a message shard 0 sends", ps_msg_type_name((int)h->type));
    }
}

static fw_t *worker_of(shard_self_t *s, const ps_msg_t *m)
{
    uint32_t r = m->hdr->rank;
    if (r >= SHARD_MAX_WORKERS) return NULL;
    fw_t *w = &s->w[r];
    if (w->ident_len != m->ident_len || memcmp(w->ident, m->ident, m->ident_len) != 0) return NULL;
    return w;
}

static void on_register(shard_self_t *s, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    uint32_t r = h->rank;
    fw_t *w = r < SHARD_MAX_WORKERS ? &s->w[r] : NULL;
    if (!s->joined || h->run_id != s->run_id || !w || !w->known) {
        /* shard 0's SHARD_WORKER may still be on its way: the worker asks again */
        PS_DEBUG("shard %d: REGISTER of rank %u not known yet", s->opts.shard, r);
        return;
    }
    uint8_t diff = 0;
    if (h->reg->shard_token.len == PS_SHM_TOKEN)
        for (int i = 0; i < PS_SHM_TOKEN; i++) diff |= (uint8_t)(h->reg->shard_token.data[i] ^ w->token[i]);
    if (h->reg->shard_token.len != PS_SHM_TOKEN || diff) {
        sdrop(s, "REGISTER of rank %u with the wrong token", r);
        return;
    }
    if (w->ident_len && (w->ident_len != m->ident_len || memcmp(w->ident, m->ident, m->ident_len) != 0) &&
        !psd_contrib_held(&w->c))
        release(s, w); /* the same rank from a new connection: its pieces so far go; a complete push stays, as
                     * shard 0 has been told about it (SHARD_HAVE) and may name it in a STEP */
    memcpy(w->ident, m->ident, m->ident_len);
    w->ident_len = m->ident_len;
    w->tcp_fd = 0; /* a new connection maybe under an fd number the last one had */
    w->seq_in = h->seq;
    w->want = 0;
    w->c.push.want.has = false;
    Psd__Header a;
    Psd__Assign as = PSD__ASSIGN__INIT;
    psd__header__init(&a);
    a.type = PSD__MSG_TYPE__MSG_ASSIGN;
    a.run_id = s->run_id;
    a.rank = r;
    a.seq = ++w->seq_out;
    as.rank = r;
    a.body_case = PSD__HEADER__BODY_ASSIGN;
    a.assign = &as;
    ps_msg_send(s->router, w->ident, w->ident_len, &a, NULL, 0);
}

static void on_push(shard_self_t *s, fw_t *w, uint32_t rank, ps_msg_t *m)
{
    Psd__Push *p = m->hdr->push;
    if (p->version != s->store.cur->version || s->awaiting_apply) {
        sdrop(s, "PUSH of rank %u computed on version %" PRIu64 ", current is %" PRIu64, rank, p->version,
              s->store.cur->version);
        return;
    }
    if (w->c.push.mask && w->c.head.version != p->version) release(s, w); /* a push that never completed */
    if (psd_contrib_held(&w->c)) {
        sdrop(s, "second PUSH of rank %u for version %" PRIu64, rank, p->version);
        return;
    }
    psd_took_t took;
    char why[256];
    if (psd_push_take(&s->hold, &w->c.push, m, s->hold.wire_bf16, 0, &took, why, sizeof why) != 0) {
        refuse(s, rank, "PUSH of rank %u %s", rank, why);
        return;
    }
    s->bytes_in += took.bytes;
    if (took.row_push) {
        s->rows_pushes++;
        s->rows_in += took.rows;
    }
    /* the version is all a shard checks of the head (shard 0 checks the rest) */
    const psd_contrib_head_t head = {.version = p->version};
    psd_contrib_part(&w->c, &head);
    w->c.head.version = p->version;
    if (p->pull) w->want = p->version + 2; /* the next version */
    if (w->c.push.mask != s->hold.all) return;
    psd_contrib_own(&w->c, ps_now(), 0); /* held: no other shard's word to wait for */
    Psd__Header h;
    Psd__ShardHave hv = PSD__SHARD_HAVE__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_HAVE;
    hv.rank = rank;
    hv.version = p->version;
    h.body_case = PSD__HEADER__BODY_SHARD_HAVE;
    h.shard_have = &hv;
    to_leader(s, &h, NULL, 0);
}

static void on_worker(shard_self_t *s, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->protocol != PS_PROTOCOL_VERSION) {
        sdrop(s, "protocol %u, this shard speaks %u", h->protocol, PS_PROTOCOL_VERSION);
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_REGISTER) {
        on_register(s, m);
        return;
    }
    fw_t *w = worker_of(s, m);
    if (!w || h->run_id != s->run_id) {
        sdrop(s, "%s from a peer that did not register here", ps_msg_type_name((int)h->type));
        return;
    }
    if (h->seq <= w->seq_in) {
        sdrop(s, "sequence number %" PRIu64 " of rank %u not after %" PRIu64, h->seq, h->rank, w->seq_in);
        return;
    }
    w->seq_in = h->seq;
    ps_tcp_cc_conn(&w->tcp_fd, m->srcfd, s->cfg.tcp_congestion, true);
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_PUSH: on_push(s, w, h->rank, m); break;
    case PSD__MSG_TYPE__MSG_PULL:
        if (h->pull->min_version > s->store.cur->version + 1) {
            sdrop(s, "PULL of version %" PRIu64 " from rank %u, current is %" PRIu64, h->pull->min_version, h->rank,
                  s->store.cur->version);
            break;
        }
        /* with want_rows: the rows of this shard's piece a batch or a
         * validation part reads (at most the piece's), the reply brings only
         * those; without, the piece whole (rows with the table on psd: none) */
        if (h->pull->want_rows) {
            char why[256];
            if (psd_want_take(&s->hold, &w->c.push, m, s->hold.piece_rows, why, sizeof why) != 0) {
                refuse(s, h->rank, "PULL of rank %u %s", h->rank, why);
                break;
            }
        } else {
            w->c.push.want.has = false;
        }
        w->want = h->pull->min_version + 1;
        if (!s->awaiting_apply) answer_pulls(s);
        break;
    default: refuse(s, h->rank, "%s is not a message workers send to a shard", ps_msg_type_name((int)h->type));
    }
}

/* The messages waiting on one socket; how many were handled. */
static int drain_sock(shard_self_t *s, void *sock, bool router)
{
    int got = 0;
    while (!s->done) {
        ps_msg_t m;
        char why[256];
        int rc = ps_msg_recv_arena(sock, &m, router, ZMQ_DONTWAIT, &s->rx_arena, why, sizeof why);
        if (rc == -EAGAIN || rc == -EINTR) return got;
        got++;
        if (rc == -EPROTO) {
            sdrop(s, "%s", why);
            continue;
        }
        if (rc < 0) {
            PS_ERROR("shard %d: receive failed: %s", s->opts.shard, zmq_strerror(-rc));
            s->exit_code = PSD_EXIT_ERROR;
            s->done = true;
            return got;
        }
        if (router) {
            on_worker(s, &m);
        } else {
            s->leader_seen = ps_now();
            ps_tcp_cc_conn(&s->leader_tcp_fd, m.srcfd, s->cfg.tcp_congestion, true);
            on_leader(s, &m);
        }
        ps_msg_deinit(&m);
    }
    return got;
}

/* Both sockets until neither has a message: their ZMQ_FDs are edge
 * triggered, and a send on one (a SHARD_HAVE while handling a worker's
 * push) may take the other's edge, so a pass that handled anything is
 * followed by another, and so is the confirmation of a checkpoint part
 * written meanwhile. Stops the loop once the shard is done. */
static void drain_all(shard_self_t *s)
{
    while (!s->done) {
        int got = drain_sock(s, s->leader, false); /* shard 0's first, as ever */
        got += s->done ? 0 : drain_sock(s, s->router, true);
        bool any = got > 0;
        if (!s->done && s->ckpt && psd_ckpt_done(s->ckpt)) { /* its part written: shard 0 told at once */
            ckpt_finish(s, false);
            any = true;
        }
        if (!any) break;
    }
    if (s->done) uv_stop(&s->loop);
}

static void on_poll(uv_poll_t *p, int status, int events)
{
    (void)status;
    (void)events;
    drain_all(p->data);
}

static void on_leader_closed(void *arg, int fd);

/* Every 100 ms: a stop asked for, the monitors, joining (HELLO until
 * answered), shard 0's silence, heartbeats, the checkpoint being written. */
static void on_tick(uv_timer_t *t)
{
    shard_self_t *s = t->data;
    const ps_config_t *c = &s->cfg;
    const int shard = s->opts.shard;
    if (s->done) { /* stopped in this pass of the loop already: nothing more is handled */
        uv_stop(&s->loop);
        return;
    }
    /* a signal (Ctrl-C, SLURM's preemption) usually reaches every psd:
     * shard 0 checkpoints and ends the run, this one waits for that;
     * a second signal, or none of that within worker_timeout, stops it
     * (once shard 0 says it was stopped too, the wait is as long as its
     * checkpoint takes: shard 0 falling silent still ends it) */
    if (s->stop_signal && s->stop_at == 0) {
        s->stop_at = ps_now();
        PS_WARN("shard %d received %s: waiting for shard 0 to end the run (again to stop now)", shard,
                strsignal(s->stop_signal));
    }
    if (s->stop_at > 0 &&
        (s->stop_count > 1 || !s->joined || (!s->run_ending && ps_now() - s->stop_at > c->worker_timeout))) {
        char why[96];
        snprintf(why, sizeof why, "shard %d was stopped (%s)", shard, strsignal(s->stop_signal));
        fail(s, why); /* done */
        s->exit_code = 128 + s->stop_signal;
        uv_stop(&s->loop);
        return;
    }
    double now = ps_now();
    ps_hearing_tick(&s->hearing, now, s->silence);
    if (now - s->last_mon >= 0.1) {
        if (s->mon) psd_router_monitor(s->mon, &s->hs_failed, NULL, NULL);
        if (s->lmon) psd_router_monitor(s->lmon, &s->hs_failed, on_leader_closed, s);
        s->last_mon = now;
    }
    if (!s->joined) {
        if (now - s->start > c->start_timeout) {
            if (s->told_wait)
                PS_ERROR("shard %d: shard 0 at %s had no model in %.0f s (model.kind from_worker: no worker offered "
                         "one)", shard, s->opts.leader, c->start_timeout);
            else
                PS_ERROR("shard %d: shard 0 at %s did not answer in %.0f s", shard, s->opts.leader, c->start_timeout);
            s->exit_code = PSD_EXIT_START_TIMEOUT;
            s->done = true;
            uv_stop(&s->loop);
            return;
        }
        if (now - s->last_hello >= 1.0) {
            hello(s);
            s->last_hello = now;
        }
    } else {
        if (s->leader_closed) drain_sock(s, s->leader, false); /* its last words first (SHUTDOWN) */
        if (s->done) {
            uv_stop(&s->loop);
            return;
        }
        if (now - ps_heard_at(&s->hearing, s->leader_seen) > s->silence || s->leader_closed) {
            if (s->leader_closed)
                PS_ERROR("shard %d: the connection to shard 0 closed, %.1f s after its last message: it is "
                         "gone; stopping", shard, now - s->leader_seen);
            else
                PS_ERROR("shard %d: nothing from shard 0 for %.1f s: it is gone; stopping", shard,
                         now - s->leader_seen);
            s->exit_code = PSD_EXIT_SHARD_LOST;
            s->done = true;
            uv_stop(&s->loop);
            return;
        }
        if (s->init_asked > 0 && now - ps_heard_at(&s->hearing, s->init_asked) > s->silence) {
            char why[160];
            snprintf(why, sizeof why, "shard 0 did not send the chunk of this shard's initial values asked for %.1f s "
                     "ago", now - s->init_asked);
            fail(s, why);
            s->exit_code = PSD_EXIT_SHARD_LOST;
            uv_stop(&s->loop);
            return;
        }
        if (now - s->last_hb >= 1.0) {
            Psd__Header h;
            Psd__Heartbeat hb = PSD__HEARTBEAT__INIT;
            psd__header__init(&h);
            h.type = PSD__MSG_TYPE__MSG_HEARTBEAT;
            h.body_case = PSD__HEADER__BODY_HEARTBEAT;
            h.heartbeat = &hb;
            to_leader(s, &h, NULL, 0);
            s->last_hb = now;
        }
    }
    drain_all(s);
}

static void on_signal(uv_signal_t *h, int signum)
{
    shard_self_t *s = h->data;
    int n = ps_stop_signal_note(signum); /* 0: the first one again at once (timeout(1)) */
    if (n == 0 || s->done) return;
    s->stop_signal = signum;
    s->stop_count = n;
    on_tick(&s->timer); /* at once, not at the next tick */
}

static void close_cb(uv_handle_t *h) { (void)h; }

/* The loop: until the shard is done or stopped. 0, or -1 if libuv could
 * not be set up (logged). */
static int run_loop(shard_self_t *s)
{
    int fl = -1, fr = -1;
    size_t len = sizeof fl, len2 = sizeof fr;
    if (zmq_getsockopt(s->leader, ZMQ_FD, &fl, &len) != 0 || zmq_getsockopt(s->router, ZMQ_FD, &fr, &len2) != 0 ||
        uv_loop_init(&s->loop) != 0) {
        PS_ERROR("shard %d: cannot start its event loop", s->opts.shard);
        return -1;
    }
    if (uv_poll_init(&s->loop, &s->poll_leader, fl) != 0 || uv_poll_init(&s->loop, &s->poll_router, fr) != 0 ||
        uv_timer_init(&s->loop, &s->timer) != 0 || uv_signal_init(&s->loop, &s->sigint) != 0 ||
        uv_signal_init(&s->loop, &s->sigterm) != 0) { /* none of these fails on Linux but for a bad fd */
        PS_ERROR("shard %d: cannot watch its sockets", s->opts.shard);
        uv_loop_close(&s->loop);
        return -1;
    }
    s->loop_open = true;
    s->poll_leader.data = s->poll_router.data = s->timer.data = s->sigint.data = s->sigterm.data = s;
    uv_poll_start(&s->poll_leader, UV_READABLE, on_poll);
    uv_poll_start(&s->poll_router, UV_READABLE, on_poll);
    uv_timer_start(&s->timer, on_tick, 0, 100);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    if (ps_early_stop_signal() && !s->stop_signal) { /* one that came while this shard loaded */
        s->stop_signal = ps_early_stop_signal();
        s->stop_count = 1;
    }
    ps_malloc_settle(); /* what loading freed */
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return 0;
}

/* The loop's handles closed, the loop with them. */
static void close_loop(shard_self_t *s)
{
    if (!s->loop_open) return;
    uv_close((uv_handle_t *)&s->poll_leader, close_cb);
    uv_close((uv_handle_t *)&s->poll_router, close_cb);
    uv_close((uv_handle_t *)&s->timer, close_cb);
    uv_close((uv_handle_t *)&s->sigint, close_cb);
    uv_close((uv_handle_t *)&s->sigterm, close_cb);
    for (int i = 0; i < 3 && uv_run(&s->loop, UV_RUN_DEFAULT) != 0; i++) {}
    if (uv_loop_close(&s->loop) != 0) PS_WARN("shard %d: its event loop did not close cleanly", s->opts.shard);
    s->loop_open = false;
}

/* psd_router_monitor's on_closed for the connection to shard 0 (once
 * joined, a closed one is shard 0 gone: nothing reconnects to a run) */
static void on_leader_closed(void *arg, int fd)
{
    (void)fd;
    shard_self_t *s = arg;
    if (s->joined) s->leader_closed = true;
}

int psd_shard_run(const ps_config_t *c, const psd_run_opts_t *opts)
{
    shard_self_t *s = calloc(1, sizeof *s);
    if (!s) return PSD_EXIT_ERROR;
    int code = PSD_EXIT_ERROR;
    s->cfg = *c;
    s->opts = *opts;
    s->config_hash = ps_config_hash(c);
    s->w = calloc(SHARD_MAX_WORKERS, sizeof *s->w);
    ps_arena_init(&s->rx_arena, s->rx_buf, sizeof s->rx_buf);
    if (!s->w) goto out;
    /* the model is shard 0's (its answer to HELLO holds the table); a config
     * that draws the initial values (not model.init's file, not the first
     * worker's) is laid out now, and checked against shard 0's table then */
    s->draws = c->kind != PS_MODEL_FROM_WORKER && !(c->kind == PS_MODEL_TENSORS && c->init_file[0]);
    char lerr[512];
    if (s->draws && ps_run_layout(c, &s->layout, lerr, sizeof lerr) != 0) {
        PS_ERROR("%s", lerr);
        code = PSD_EXIT_USAGE;
        goto out;
    }
    /* messages and silences sized for the model, or before it is known for
     * the largest shard 0 takes (model.max_params) */
    const size_t n_params = s->draws ? s->layout.n_params : (size_t)c->max_params;
    s->zctx = psd_zmq_context(c);
    if ((code = psd_router_open(s->zctx, c, c->listen, opts->no_zap, n_params, false, false, &s->locks, &s->router,
                                &s->zap, &s->mon)) != 0)
        goto out;
    const double silence = psd_silence_limit(c, n_params);
    code = PSD_EXIT_ERROR;
    char *ep = s->bound, bad[400];
    size_t eplen = sizeof s->bound;
    zmq_getsockopt(s->router, ZMQ_LAST_ENDPOINT, ep, &eplen);
    /* by default where it listens, with the port it got for :0 or :* */
    if (!s->opts.advertise || !s->opts.advertise[0]) s->opts.advertise = ep[0] ? ep : c->listen;
    if (strstr(s->opts.advertise, "://*") || strstr(s->opts.advertise, "://0.0.0.0")) {
        PS_ERROR("shard %d listens on %s: give the address workers reach it at with --advertise ENDPOINT",
                 opts->shard, s->opts.advertise);
        code = PSD_EXIT_USAGE;
        goto out;
    }
    if (ps_endpoint_check(s->opts.advertise, PS_EP_CONNECT, bad, sizeof bad) != 0) {
        PS_ERROR("shard %d: workers could not reach it at %s", opts->shard, bad);
        code = PSD_EXIT_USAGE;
        goto out;
    }
    if (opts->check) { /* --check-config: what its start checks, it has (shard 0 holds the model and data) */
        code = 0;
        goto out;
    }
    s->leader = zmq_socket(s->zctx, ZMQ_DEALER);
    if (!s->leader) goto out;
    int linger = 1000, zero = 0;
    zmq_setsockopt(s->leader, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s->leader, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(s->leader, ZMQ_RCVHWM, &zero, sizeof zero);
    if (c->key_file[0]) { /* shard 0 lets its own key in: every shard has the same key pair */
        ps_keypair_t kp;
        char err[512];
        if (ps_auth_load_secret(c->key_file, &kp, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            code = PSD_EXIT_USAGE;
            goto out;
        }
        zmq_setsockopt(s->leader, ZMQ_CURVE_SERVERKEY, kp.public_z85, 40);
        zmq_setsockopt(s->leader, ZMQ_CURVE_PUBLICKEY, kp.public_z85, 40);
        zmq_setsockopt(s->leader, ZMQ_CURVE_SECRETKEY, kp.secret_z85, 40);
        memset(&kp, 0, sizeof kp);
    }
    ps_zmq_endpoint_opts(s->leader, opts->leader);
    /* shard 0 killed: its kernel closes the connection, and this shard
     * stops at once rather than after the silence limit */
    s->lmon = ps_zmq_monitor(s->zctx, s->leader, "inproc://psd-shard-leader", ZMQ_EVENT_DISCONNECTED);
    if (zmq_connect(s->leader, opts->leader) != 0) {
        PS_ERROR("cannot connect to shard 0 at '%s': %s", opts->leader, zmq_strerror(zmq_errno()));
        code = PSD_EXIT_USAGE;
        goto out;
    }
    PS_INFO("psd %s shard %d/%d: listening on %s, joining shard 0 at %s", PSD_VERSION, opts->shard, opts->shards, ep,
            opts->leader);
    s->silence = silence;
    s->start = s->leader_seen = ps_now();
    if (run_loop(s) != 0) goto out;
    code = s->exit_code;
out:
    /* a checkpoint being written is finished first (shard 0 did not wait for it: the run ended), while
     * a signal is still only noted (the loop's handles hold them); then they are ignored: closing the
     * last uv_signal handle restores SIG_DFL, which would end the shard in its last second */
    if (ckpt_finish(s, true) != 0 && code == 0) code = PSD_EXIT_ERROR;
    close_loop(s);
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    for (int r = 0; s->w && s->hold.sp_free && r < SHARD_MAX_WORKERS; r++) {
        release(s, &s->w[r]);
        psd_push_free(&s->w[r].c.push);
    }
    psd_hold_deinit(&s->hold);
    free(s->norm_blk);
    if (s->router) ps_msg_drain(s->router, 0.05, 0.5);
    ps_zmq_close_monitored(s->router, s->mon);
    ps_zmq_close_monitored(s->leader, s->lmon);
    psd_zap_stop(&s->zap);
    if (s->zctx) zmq_ctx_term(s->zctx);
    psd_locks_release(&s->locks);
    psd_store_deinit(&s->store);
    ps_layout_free(&s->layout);
    free(s->w);
    free(s);
    return code;
}
