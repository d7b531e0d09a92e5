/* psd_server.c - the run coordinator of psd.
 *
 * One thread. A libuv loop watches the ROUTER socket's ZMQ_FD (edge
 * triggered: every wake-up drains while ZMQ_EVENTS says readable, and every
 * callback that sent something drains again), a 100 ms timer enforces every
 * deadline and polls the checkpoint writer, and signal handles stop the run
 * cleanly. The parameter store (psd_store.c) holds weights and optimizer
 * state; this file decides who does what when.
 *
 * Workers come and go: a worker psd waits for that stays silent past
 * worker_timeout (plus, for a large model, the time a message of the whole
 * model takes each way: psd_silence_limit) is declared lost, one that
 * leaves (SIGTERM) says so; either way the samples of the epoch it had not
 * trained are given to the others (or to the next worker to join), and its
 * part of a validation goes to another worker, so every sample is trained
 * once per epoch and validated once. New workers may join at any time: they
 * get samples from the next epoch, or at once if some are waiting for a
 * worker. */
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
#include <dirent.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>
#include <zlib.h>

#include "ps_ctr.h"
#include "ps_idx.h"
#include "ps_log.h"
#include "ps_rng.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"
#include "psd_ckpt.h"
#include "psd_diverge.h"
#include "psd_optim.h"
#include "psd_http.h"
#include "psd_lock.h"
#include "psd_metrics.h"
#include "psd_shm.h"
#include "psd_store.h"
#include "psd_zap.h"
#include "ps_auth.h"
#include "ps_tcp.h"

#define MAX_WORKERS 1024
/* histogram buckets (seconds) of the workers' step times in /metrics */
#define PSD_HIST_N 12
/* the live page's curves: at most this many (step, loss) points, thinned
 * by half (and recorded half as often) whenever full */
#define PSD_CURVE_MAX 2048
extern const char *const psd_page_html;
extern const size_t psd_page_html_len;
static const double hist_le[PSD_HIST_N] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5};

#ifndef ZMQ_ZAP_ENFORCE_DOMAIN
#define ZMQ_ZAP_ENFORCE_DOMAIN 93 /* a DRAFT option of libzmq 4.3, built into Debian's */
#endif

typedef enum {
    W_ASSIGNED = 0, /* registered, checking its data */
    W_READY,        /* data checked, waiting for an epoch */
    W_TRAIN,        /* has samples left in this epoch */
    W_BARRIER,      /* its samples of the epoch are done */
    W_VALIDATING,   /* evaluating parts of the test set */
    W_VALIDATED,    /* its parts are done */
    W_GONE,         /* lost, left or failed; never waited for */
} wstate_t;

static const char *wstate_name[] = {"assigned", "ready",      "training", "at barrier",
                                    "validating", "validated", "gone"};

typedef struct {
    uint64_t begin, end; /* positions in the epoch's permutation */
} prange_t;

typedef struct {
    uint8_t ident[PS_MAX_IDENTITY];
    size_t ident_len;
    uint32_t rank;        /* = its slot (reused once every slot was taken: free_slot) */
    char hostname[64], host_id[128], device[32];
    uint32_t pid;
    wstate_t state;
    double last_seen;     /* time of its last valid message */
    double sent_at;       /* time of psd's last message to it (keep_alive) */
    double gone_at;
    uint64_t seq_in, seq_out;
    int conn;             /* the connection its messages come on (fd + 1, 0: not known), given
                           * server.tcp_congestion when first seen (note_conn) */
    bool conn_closed;     /* that connection closed (the ROUTER's monitor): lost at the next tick */
    uint64_t lost_replies;
    bool lost_silent;     /* gone for its silence: it may be alive and connected (told when the run ends) */
    /* this epoch: positions assigned (ranges, in order) and trained */
    prange_t *ranges;
    int n_ranges, cap_ranges;
    uint64_t assigned, consumed;
    /* the push of the step in progress: its tensors may come in several
     * PUSH messages (a GPU worker sends each layer's gradient as soon as its
     * backward is done); the frames are kept as received until the step */
    bool has_push, push_pull, push_started;
    zmq_msg_t grad[PS_MAX_TENSORS];
    uint64_t grad_mask;
    uint32_t push_batch;
    double push_loss;
    uint64_t push_correct;
    int val_pending;      /* validation parts given and not answered */
    double compute_ewma;  /* its compute time per step (from its pushes), for "slowest worker" */
    /* same host (psd_shm.h): its gradient region, mapped read-only, and the
     * parameter slot it reads from, held until it is sent a newer one */
    uint8_t shm_token[PS_SHM_TOKEN];
    const float *shm_grad; /* NULL: no region */
    bool shm;             /* READY confirmed: tensors go through shared memory */
    uint64_t grad_shm;    /* tensors of the push in progress that are in shm_grad */
    /* its table gradient as rows (the table is stepped lazily: store.lazy),
     * pushed as rows (grad_rows) or gathered at the step from the nonzero
     * rows of the table (its piece on a psd shard) pushed whole */
    bool grad_rows;
    int sp_table;
    psd_want_t want;      /* the rows its next batch reads (Push.want_rows): the reply brings only those */
    psd_rowbuf_t sp;
    psd_arena_t *hold;
    /* psd shards: the token it presents to shards 1..n-1, which of them
     * have its whole push for the current version (bit i), and whether its
     * ASSIGN waits for every shard to join */
    uint8_t shard_token[PS_SHM_TOKEN];
    uint32_t shard_have;  /* shards that have its push for the current version (cleared at each step) */
    bool own_push;        /* this shard's part of its push is complete */
    double own_push_at;
    bool want_pull;       /* send it the version the step in progress makes */
    bool assign_wait;
    /* async and ssp (train.sync): the version its push was computed on, its
     * pushes applied this epoch (ssp's clock), and whether psd holds back its
     * weights because it is train.staleness steps ahead of the slowest */
    uint64_t push_version;
    uint64_t clock;
    bool ssp_wait;
    /* streamed steps (train.stream): the chunks of its push for the step
     * in progress (gch_in: 0 not here, 1 a frame in gch, 2 in its shared
     * region, 3 stepped and let go), whether it is one of the step's
     * contributors, whether it asked for the step's version (each tensor
     * goes to it once made: st_sent of s->st_tord so far) */
    zmq_msg_t *gch;
    uint8_t *gch_in;
    int n_gch, n_gch_cap;
    bool st_member, st_req;
    int st_sent;
    /* for /metrics: its step times (from its pushes) as histograms, and
     * the time it waited at barriers */
    uint64_t h_wait[PSD_HIST_N + 1], h_compute[PSD_HIST_N + 1];
    double h_wait_sum, h_compute_sum;
    double barrier_at, barrier_wait_s;
} worker_t;

typedef struct {
    uint64_t begin, end;  /* test samples */
    int worker;           /* slot it is given to, -1 if waiting for one */
    bool done;
    double loss;
    uint64_t correct, count;
} vpart_t;

typedef enum { PHASE_WAIT = 0, PHASE_TRAIN, PHASE_VALIDATE, PHASE_DONE } phase_t;

typedef struct {
    char role[16];
    char path[PS_PATH_MAX];
    uint64_t size, hash;
} datafile_t;

/* A psd shard i > 0, as shard 0 sees it. */
typedef struct {
    uint8_t ident[PS_MAX_IDENTITY];
    size_t ident_len;
    bool joined;
    char endpoint[256], hostname[64];
    uint32_t pid;
    double last_seen;
    uint64_t seq_out;
    bool norm_in;
    bool ck_acked;        /* its part of the checkpoint being taken is written, or failed (SHARD_CKPT_DONE) */
    bool resumed;         /* --resume: it resumed its part (SHARD_RESUMED) at resumed_step */
    uint64_t resumed_step, resumed_version;
    int conn;             /* the connection its messages come on (as a worker's) */
    bool conn_closed;     /* that connection closed: the run stops at the next tick */
} shard_t;

typedef struct {
    ps_config_t cfg;
    psd_run_opts_t opts;
    /* psd shards (--shard 0/n): this psd coordinates, shards 1..n-1 hold
     * the other parts of the parameters */
    int n_shards;         /* 1: one psd */
    shard_t shards[PS_MAX_SHARDS];
    bool stepping;        /* with clipping: waiting for the shards' block norms */
    bool ckpt_deferred;   /* a checkpoint asked for while stepping: taken once the step is applied */
    double stepping_since;
    /* end of the run with --save: the weights file (wr; not NULL while it is
     * written) is written as the other shards' parts come, PSD_FETCH_FLOATS at
     * a time from shard fetch_k, whose part is fetch_part (never the whole
     * model in memory) */
    ps_weights_writer_t *wr;
    double fetching_since; /* the last chunk asked for */
    int fetch_k;
    ps_piece_t fetch_part[PS_MAX_TENSORS];
    uint64_t fetch_size, fetch_from, fetch_count, fetch_chunks;
    /* HTTP endpoint (server.http) and what /metrics and /status report
     * beyond the state above */
    psd_http_t *http;
    char http_token[256];
    uint64_t bytes_in_done, bytes_out_done; /* of the epochs before this one */
    double val_acc_last, val_loss_last;
    uint32_t val_epoch_last;              /* epochs validated (0: none yet) */
    uint64_t ckpts_written, workers_lost;
    double ckpt_last_t, t_boot;
    /* psctl checkpoint: who waits for the checkpoint being written */
    struct {
        uint8_t ident[PS_MAX_IDENTITY];
        size_t ident_len;
    } ctl_wait[8];
    int n_ctl_wait;
    /* curves for the live page (/history) */
    struct { uint64_t step; float loss; } curve[PSD_CURVE_MAX];
    int n_curve;
    uint64_t curve_every;                 /* record every curve_every-th step */
    struct { uint32_t epoch; uint64_t step; float train_loss, val_loss, val_acc; } *val_curve;
    int n_val_curve;
    double shard_hb;      /* when shard 0 last sent them a heartbeat */
    double silence;       /* a peer psd waits for is lost after this (psd_silence_limit) */
    ps_hearing_t hearing; /* silence counts only while the event loop ran (on_timer's ticks) */
    ps_layout_t layout;
    psd_store_t store;
    uint64_t run_id, config_hash;
    void *zctx, *sock;
    uv_loop_t loop;
    uv_poll_t poll;
    uv_timer_t timer;
    uv_signal_t sigint, sigterm, sigusr1, sighup;
    psd_zap_t *zap;       /* authentication handler, NULL without keys */
    void *mon;            /* PAIR with the ROUTER's events: closed connections, failed handshakes */
    uint64_t hs_failed;
    worker_t *w;          /* MAX_WORKERS slots */
    int max_workers;      /* slots taken before gone ones are reused (MAX_WORKERS; tests: --x-max-workers) */
    uint64_t registrations;
    double stranger_reply_t; /* the last ERR_LOST to a peer of this run psd does not know */
    int n;                /* slots used */
    phase_t phase;
    int exit_code;
    datafile_t files[4];
    size_t train_count, test_count;
    double ctr_opt_loss;  /* model.kind ctr: the planted model's log-loss on the test examples */
    double ctr_const_loss; /* and the best constant's (the test click rate) */
    double ctr_opt_auc;   /* the planted probabilities' AUC on the test examples */
    float *val_scores;    /* ctr: the workers' click probabilities of the test examples (VAL_RESULT) */
    uint8_t *test_labels; /* ctr: the test examples' clicks */
    uint32_t *auc_order;  /* ps_auc's scratch */
    uint32_t *perm;       /* this epoch's permutation of the training set */
    uint8_t *seen;        /* positions of the epoch trained (bitmap) */
    uint64_t ep_twice;    /* positions trained when already seen this epoch (never: a bug) */
    uint64_t *pool;       /* positions waiting for a worker */
    size_t n_pool;
    vpart_t *parts;       /* validation parts of this epoch */
    int n_parts;
    /* progress */
    uint32_t epoch;       /* 0-based */
    uint64_t step;        /* optimizer steps in the run */
    uint64_t epoch_step;  /* steps in this epoch */
    double spe;           /* steps per epoch (schedule position) */
    double lr;
    bool resumed_mid_epoch;
    /* epoch statistics */
    double ep_loss;
    uint64_t ep_correct, ep_samples;
    double ep_compute_s, ep_wait_s; /* workers' step times this epoch (from their pushes) */
    uint64_t ep_timed;
    double ep_step_s0;    /* store.step_s when the epoch began, and the epoch's steps: psd's own step */
    uint64_t ep_step_n;
    uint64_t ep_in_place0; /* store.in_place when the epoch began */
    double t_start, t_epoch, train_s_total, phase_deadline, orphan_deadline;
    uint64_t samples_total;
    psd_metrics_t metrics; /* the metrics file (psd_metrics.h) */
    psd_locks_t locks;     /* this run's hold on its files (psd_lock.h) */
    uint64_t resumed_step; /* the step a --resume continued from, for the metrics lines; 0: none */
    bool resumed;
    uint64_t dropped;     /* bad messages, for rate-limited logging */
    const void *(*step_g)[PS_MAX_TENSORS]; /* a step's gradients, MAX_WORKERS rows */
    uint8_t *step_bf16;   /* and whether each row is bfloat16 */
    uint64_t ep_bytes_in, ep_bytes_out; /* tensor bytes received / sent on the wire this epoch */
    uint64_t ep_rows_in, ep_rows_pushes; /* table rows received in row-sparse pushes, and those pushes */
    uint64_t ep_rows_out, ep_rows_replies; /* table rows sent in replies that carry only the rows asked for */
    /* async and ssp: staleness of the gradients applied this epoch (versions
     * between the one a push was computed on and the one it was applied to),
     * and ssp's largest lead (steps ahead of the slowest) a worker was let
     * train at */
    uint64_t ep_stale_sum, ep_stale_n, ep_stale_max, ep_lead_max;
    uint64_t ep_moved; /* async and ssp: samples moved to workers done with theirs (rebalance) */
    /* streamed steps (train.stream, bsp, one psd): the store's chunks
     * travel one by one and each is stepped once every contributor's copy
     * is here. The step opens (st_open) with its first chunk: its
     * contributors (st_mem, rank order) are then fixed and its next version
     * is built in st_next. */
    bool stream;
    size_t st_cf;         /* floats per chunk (ps_chunk_floats) */
    int st_nc;            /* chunks (store.n_chunks) */
    int *st_have;         /* per chunk: contributors whose copy is here */
    uint8_t *st_done;     /* per chunk: stepped (reduced, with clipping) */
    int st_n_done, st_n_made; /* chunks stepped, chunks whose new values are made */
    int st_tchunks[PS_MAX_TENSORS]; /* chunks of each tensor */
    int st_tfirst[PS_MAX_TENSORS];  /* and the index of its first */
    int st_tmade[PS_MAX_TENSORS];   /* of which made */
    int st_tord[PS_MAX_TENSORS], st_n_tord; /* tensors made, in that order (replies go in it) */
    int *st_ready;        /* chunks to step now (ST_BATCH) */
    int *st_rq, st_rq_head, st_rq_tail; /* chunks every contributor has, in the order they became so */
    bool st_rescan;       /* the contributors changed: find the ready chunks again */
    const void **st_src;  /* their gradients: ST_BATCH x MAX_WORKERS */
    int *st_mem, st_k;    /* contributors (slots) */
    bool st_open;
    bool st_void;         /* every contributor left before any chunk was stepped: no step (step_done) */
    /* the batches of contributors lost before any chunk took the step: they
     * count as trained once it is taken, and are handed out again if it is
     * void (stream_settle_lost) */
    uint64_t *st_lost_pos;
    size_t st_lost_n, st_lost_cap;
    double st_lost_loss;
    uint64_t st_lost_correct;
    psd_arena_t *st_next;
    /* progress: a live line on a terminal, else a plain line every progress_every s */
    bool tty;
    double progress_next;
    double last_loss;     /* mean training loss of the last step */
    psd_diverge_t dv;     /* the steps' losses and norms, checked for divergence (step_done) */
    double *step_wt;      /* and their weights */
    psd_rowgrad_t *step_rows; /* and their table rows (lazy tables) */
    bool table_on_psd;    /* ctr.worker_table_mb: workers hold only their batches' rows (CtrTask.table_on_psd) */
    ps_arena_t rx_arena;  /* decoded headers of received messages (one at a time) */
    uint8_t rx_buf[64 << 10];
    bool cur_bad;         /* the message being handled was dropped */
    const char *cur_peer; /* its sender's address, for the log */
    /* connections that sent bad messages in a row (see bad_peer) */
    struct {
        uint8_t ident[PS_MAX_IDENTITY];
        size_t ident_len;
        uint32_t bad;
        double cut_at;    /* when psd cut its connection, 0 = not yet */
    } bad[32];
    int n_bad;
    uint64_t cut;         /* connections psd closed for bad messages */
    /* same-host transport: NULL when off or unavailable */
    psd_shm_t *shm;
    char shm_name[64];
    char host_id[128];
    /* checkpoints */
    psd_ckpt_writer_t *ckpt;
    /* the checkpoint being taken: step, version; with psd shards, shard 0's
     * part is written (ck_open) and every shard's confirmation awaited */
    uint64_t ck_step, ck_version;
    bool ck_open;
    int ck_rc;            /* shard 0's part: 0 or -errno */
    char ck_path[PS_PATH_MAX];
    char ck_fail[400];    /* the first shard's failure to write its part ("": none) */
    uint64_t ck_safe;     /* psd shards: the newest step every shard confirmed (or resumed at): its files are
                           * never pruned, so that a resume always finds a step all have (0: none) */
    /* --resume with psd shards: the directory resumed from and its steps up to
     * the one resumed at, newest first: each shard resumes at the newest of
     * them it has, and all go back to the oldest any shard resumed at */
    char resume_dir[PS_PATH_MAX];
    uint64_t resume_steps[PSD_RESUME_STEPS_MAX];
    size_t n_resume_steps;
    bool resume_agreed;   /* every shard resumed at shard 0's step: training may begin */
    bool ckpt_again;      /* another one was asked for while writing */
    /* ... and it was the end of epoch again_epoch, at again_steps steps: an
     * epoch's end still, if taken before anything trained since */
    bool again_epoch_done;
    uint32_t again_epoch;
    uint64_t again_steps;
    int stopping;         /* signal number that asked to stop, or -1 for --stop-after-epoch */
    bool stop_when_written;
    bool end_when_written; /* psd shards: the run ends once every part of its last checkpoint is written */
    char run_dir[PS_PATH_MAX]; /* checkpoint.dir/run-<run id>: this run's checkpoints */
    /* step intervals, to show what a checkpoint being written costs */
    double last_step_t;
    double int_sum[2];    /* [0] no checkpoint being written, [1] while one is */
    uint64_t int_n[2];
} srv_t;

static void maybe_step(srv_t *s);
static void on_control(srv_t *s, ps_msg_t *m);
static void request_stop(srv_t *s, int signum, const char *what);
static void control_reply(srv_t *s, const uint8_t *ident, size_t len, bool ok, const char *text, const char *json);
static void end_validation(srv_t *s);
static void take_checkpoint(srv_t *s, bool epoch_done);

static int live_workers(const srv_t *s)
{
    int n = 0;
    for (int i = 0; i < s->n; i++) n += s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED;
    return n;
}

/* Slot of a peer: the one with that identity. A worker that rejoins keeps
 * its identity and gets another slot (or its own back); on_register makes
 * any other slot forget the identity, so that there is one. */
static worker_t *find_worker(srv_t *s, const uint8_t *ident, size_t len)
{
    for (int i = s->n - 1; i >= 0; i--)
        if (s->w[i].ident_len == len && memcmp(s->w[i].ident, ident, len) == 0) return &s->w[i];
    return NULL;
}

/* A message dropped: counted; true if it is logged (the first 20, then
 * every 1000th), so that a flood of bad messages costs no formatting. */
static bool drop_logged(srv_t *s)
{
    s->dropped++;
    s->cur_bad = true;
    return s->dropped <= 20 || s->dropped % 1000 == 0;
}

/* Log a dropped message from `who` ("rank 3 (host pid 12)", "psd shard 1
 * (...)"), or NULL: a peer psd does not know (its address if libzmq gave one). */
static void vdrop(srv_t *s, const char *who, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    const char *more = s->dropped == 20 ? " (further drops logged every 1000th)" : "";
    if (who)
        PS_WARN("dropped a message from %s: %s%s", who, msg, more);
    else
        PS_WARN("dropped a message from an unknown peer%s%s: %s%s", s->cur_peer && s->cur_peer[0] ? " at " : "",
                s->cur_peer ? s->cur_peer : "", msg, more);
}

static void drop(srv_t *s, const worker_t *w, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void drop(srv_t *s, const worker_t *w, const char *fmt, ...)
{
    if (!drop_logged(s)) return;
    char who[128];
    if (w) snprintf(who, sizeof who, "rank %u (%s pid %u)", w->rank, w->hostname, w->pid);
    va_list ap;
    va_start(ap, fmt);
    vdrop(s, w ? who : NULL, fmt, ap);
    va_end(ap);
}

/* the same for a message from psd shard i (> 0) */
static void drop_shard(srv_t *s, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void drop_shard(srv_t *s, int i, const char *fmt, ...)
{
    if (!drop_logged(s)) return;
    char who[128];
    snprintf(who, sizeof who, "psd shard %d (%s pid %u)", i, s->shards[i].hostname, s->shards[i].pid);
    va_list ap;
    va_start(ap, fmt);
    vdrop(s, who, fmt, ap);
    va_end(ap);
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
    w->sent_at = ps_now();
    if (rc < 0)
        PS_WARN("cannot send %s to rank %u (%s pid %u): %s", ps_msg_type_name((int)h->type), w->rank,
                w->hostname, w->pid, zmq_strerror(-rc));
    return rc;
}

/* A HEARTBEAT header of this epoch (hb: its body, the caller's). */
static void heartbeat_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Heartbeat *hb)
{
    hdr_for(s, w, h, PSD__MSG_TYPE__MSG_HEARTBEAT);
    psd__heartbeat__init(hb);
    hb->epoch = s->epoch;
    h->body_case = PSD__HEADER__BODY_HEARTBEAT;
    h->heartbeat = hb;
}

/* Workers that wait on psd (at their barrier, for the next epoch, for the
 * reply to a push that waits for slower workers, held back in ssp) hear
 * from it at least every second, so that a long wait is not taken for a
 * psd that is gone (the worker gives psd step_timeout_s of silence). */
static void keep_alive(srv_t *s, double now)
{
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state < W_READY || w->state > W_VALIDATED || now - w->sent_at < 1.0) continue;
        Psd__Header h;
        Psd__Heartbeat hb;
        heartbeat_hdr(s, w, &h, &hb);
        send_to(s, w, &h, NULL, 0);
    }
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

/* A SHUTDOWN header for w (sd: its body, the caller's). */
static void shutdown_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Shutdown *sd, int code, const char *reason)
{
    hdr_for(s, w, h, PSD__MSG_TYPE__MSG_SHUTDOWN);
    sd->exit_code = code;
    sd->reason = (char *)reason;
    h->body_case = PSD__HEADER__BODY_SHUTDOWN;
    h->shutdown = sd;
}

static void send_shutdown(srv_t *s, worker_t *w, int code, const char *reason)
{
    Psd__Header h;
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    shutdown_hdr(s, w, &h, &sd, code, reason);
    send_to(s, w, &h, NULL, 0);
}

/* ---- psd shards (shard 0's side) ---------------------------------------- */

static bool sharded(const srv_t *s) { return s->n_shards > 1; }

static int shards_joined(const srv_t *s)
{
    int n = 0;
    for (int i = 1; i < s->n_shards; i++) n += s->shards[i].joined;
    return n;
}

static bool all_shards(const srv_t *s) { return shards_joined(s) == s->n_shards - 1; }

/* Every shard joined and, after a resume, resumed its part at shard 0's step:
 * workers are sent their ASSIGN (which names every shard) from then on. */
static bool shards_ready(const srv_t *s) { return all_shards(s) && (!s->opts.resume_dir || s->resume_agreed); }

/* After a resume: every shard resumed its part at shard 0's step. */
static bool shards_resumed(const srv_t *s)
{
    for (int i = 1; i < s->n_shards; i++)
        if (!s->shards[i].joined || !s->shards[i].resumed || s->shards[i].resumed_step != s->store.steps)
            return false;
    return true;
}

/* Bits of the shards 1..n-1 (bit i: shard i). */
static uint32_t shard_bits(const srv_t *s) { return ((1u << s->n_shards) - 1u) & ~1u; }

static int send_shard(srv_t *s, int i, Psd__Header *h, const ps_frame_t *fr, int n)
{
    shard_t *sh = &s->shards[i];
    h->run_id = s->run_id;
    h->rank = (uint32_t)i;
    h->seq = ++sh->seq_out;
    int rc = ps_msg_send(s->sock, sh->ident, sh->ident_len, h, fr, n);
    if (rc < 0)
        PS_WARN("cannot send %s to shard %d (%s pid %u): %s", ps_msg_type_name((int)h->type), i, sh->hostname,
                sh->pid, zmq_strerror(-rc));
    return rc;
}

static void shards_send_all(srv_t *s, Psd__Header *h)
{
    for (int i = 1; i < s->n_shards; i++)
        if (s->shards[i].joined) send_shard(s, i, h, NULL, 0);
}

/* A push counts once this part of it is complete and every other shard
 * has its part (SHARD_HAVE): sets and returns has_push. */
static bool push_check(const srv_t *s, worker_t *w)
{
    w->has_push = w->own_push && (w->shard_have & shard_bits(s)) == shard_bits(s);
    return w->has_push;
}

/* Tell every shard about a worker: its rank and token. */
static void shards_worker(srv_t *s, const worker_t *w)
{
    Psd__Header h;
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_WORKER;
    sw.rank = w->rank;
    sw.token.data = (uint8_t *)w->shard_token;
    sw.token.len = sizeof w->shard_token;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    shards_send_all(s, &h);
}

/* Weights frames of the current version, sent without copying (as f32, or
 * from the version's bfloat16 copy with train.wire_weights: bf16); for a
 * worker on shared memory none: *slot (1-based) names the version's slot,
 * which the worker holds until it is sent another. With --x-verify-weights
 * *crc is the CRC-32 of what the worker gets, else 0. */
static int weights_frames(srv_t *s, worker_t *w, ps_frame_t *fr, uint32_t *slot, uint32_t *crc)
{
    *slot = 0;
    *crc = 0;
    if (w->shm) {
        if (w->hold) psd_store_frame_free(NULL, w->hold);
        w->hold = psd_store_ref_current(&s->store);
        *slot = (uint32_t)psd_store_slot(&s->store, w->hold) + 1;
        if (s->opts.verify_weights) *crc = psd_store_current_crc(&s->store);
        return 0;
    }
    const uint16_t *w16 = s->cfg.wire_weights == PS_WIRE_BF16 ? psd_store_current_bf16(&s->store) : NULL;
    if (s->cfg.wire_weights == PS_WIRE_BF16 && !w16) PS_WARN("out of memory for bfloat16 weights: sending f32");
    int n = psd_store_frames(&s->store, w16, fr, s->opts.verify_weights && (w16 || sharded(s)) ? crc : NULL);
    for (int i = 0; i < n; i++) s->ep_bytes_out += fr[i].nbytes;
    if (s->opts.verify_weights && !w16 && !sharded(s)) *crc = psd_store_current_crc(&s->store);
    if (s->layout.table < 0) ps_frames_small_first(fr, n); /* the CRCs are in tensor order */
    return n;
}

/* The table on psd: a message's frames sent as copies, so that no reply
 * in flight holds a reference on the version: a step would then go out of
 * place and copy the whole table into the next arena. The frames are the
 * MLP's and a batch's rows, small next to the table. */
static int send_copied(srv_t *s, worker_t *w, Psd__Header *h, ps_frame_t *fr, int n)
{
    for (int i = 0; i < n; i++) fr[i].copy = true;
    return send_to(s, w, h, fr, n);
}

/* The table's frame *fr (a reference on the current version) becomes rows
 * ids[0, n) of it, gathered into vals (n x dim; copied by ZeroMQ at send),
 * with the epoch's byte and row counts. */
static void table_rows_frame(srv_t *s, ps_frame_t *fr, const uint32_t *ids, size_t n, float *vals)
{
    const ps_layout_t *l = &s->layout;
    const size_t D = (size_t)l->t[l->table].cols;
    const float *E = s->store.cur->w + l->t[l->table].offset;
    if (fr->ffn) fr->ffn((void *)fr->data, fr->hint); /* its reference to the version */
    s->ep_bytes_out -= fr->nbytes;
    psd_rows_gather(vals, E, D, ids, n);
    *fr = (ps_frame_t){.data = vals, .nbytes = n * D * sizeof(float), .id = (uint32_t)l->table,
                       .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)n, .cols = (uint32_t)D};
    s->ep_bytes_out += fr->nbytes;
    s->ep_rows_out += n;
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
    int n = weights_frames(s, w, fr, &wt.shm_slot, &wt.crc);
    if ((w->want.has || s->table_on_psd) && !w->shm && s->cfg.wire_weights == PS_WIRE_F32 && n > 0 &&
        fr[n - 1].id == (uint32_t)s->layout.table) {
        /* only the table rows its next batch reads (a shard: those in its piece, none maybe);
         * with the table on psd, none when it asked for none. The table is the last tensor,
         * so the last frame. */
        table_rows_frame(s, &fr[n - 1], w->want.ids, w->want.n, w->want.vals);
        s->ep_rows_replies++;
        wt.rows = true;
        wt.crc = 0;
    }
    w->want.n = 0;
    w->want.has = false;
    if (s->table_on_psd)
        send_copied(s, w, &h, fr, n);
    else
        send_to(s, w, &h, fr, n);
}

/* ---- consistency modes (train.sync) ------------------------------------- */

/* async and ssp: mean staleness of the gradients applied this epoch */
static double stale_mean(const srv_t *s) { return s->ep_stale_n ? (double)s->ep_stale_sum / (double)s->ep_stale_n : 0.0; }

/* ssp: the clock (pushes applied this epoch) of the slowest worker still
 * training, UINT64_MAX if none is */
static uint64_t min_clock(const srv_t *s)
{
    uint64_t m = UINT64_MAX;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_TRAIN && s->w[i].clock < m) m = s->w[i].clock;
    return m;
}

/* ssp: w may not train its next step before the slowest (clock m) catches
 * up: it has already done train.staleness steps more */
static bool ssp_held(const srv_t *s, const worker_t *w, uint64_t m)
{
    return s->cfg.sync == PS_SYNC_SSP && m != UINT64_MAX && w->clock > m + (uint64_t)s->cfg.staleness;
}

static void rebalance(srv_t *s, worker_t *w);

/* w asked for weights to train on: send them, or with ssp hold them back
 * while it is too far ahead (ssp_release answers it later) */
static void answer_pull(srv_t *s, worker_t *w)
{
    if (s->cfg.sync == PS_SYNC_SSP) {
        uint64_t m = min_clock(s);
        if (ssp_held(s, w, m)) {
            w->ssp_wait = true;
            return;
        }
        uint64_t lead = m != UINT64_MAX && w->clock > m ? w->clock - m : 0;
        if (lead > s->ep_lead_max) s->ep_lead_max = lead;
    }
    w->ssp_wait = false;
    rebalance(s, w); /* before the weights: w has not begun its next batch */
    send_weights(s, w);
}

/* ssp: answer the workers held back that the slowest has come close enough
 * to (it pushed, reached its barrier, or was lost). psd's own waiting is not
 * the worker's silence: its timeout counts from here. */
static void ssp_release(srv_t *s)
{
    if (s->cfg.sync != PS_SYNC_SSP) return;
    uint64_t m = min_clock(s); /* answering a worker moves no clock */
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (!w->ssp_wait) continue;
        if (w->state != W_TRAIN) {
            w->ssp_wait = false;
            continue;
        }
        if (ssp_held(s, w, m)) continue;
        w->last_seen = ps_now();
        answer_pull(s, w);
    }
}

/* One psd's weights file, from the current version (psd shards write theirs
 * as the parts come: begin_save, fetch_next). */
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

/* Its gradients come as bfloat16: on the wire with train.wire_gradients: bf16. */
static bool wire_bf16(const srv_t *s, const worker_t *w)
{
    return !w->shm && s->cfg.wire_gradients == PS_WIRE_BF16;
}

static void release_push(worker_t *w)
{
    for (int t = 0; t < PS_MAX_TENSORS; t++)
        if ((w->grad_mask & ~w->grad_shm) & (1ull << t) && !(w->grad_rows && t == w->sp_table)) zmq_msg_close(&w->grad[t]);
    w->grad_mask = w->grad_shm = 0;
    w->grad_rows = false;
    if (w->n_gch > 0) {
        for (int c = 0; c < w->n_gch_cap; c++)
            if (w->gch_in[c] == 1) zmq_msg_close(&w->gch[c]);
        memset(w->gch_in, 0, (size_t)w->n_gch_cap);
    }
    w->n_gch = 0;
    w->st_member = w->st_req = false;
    w->st_sent = 0;
    w->has_push = w->push_started = w->push_pull = w->own_push = false;
    w->shard_have = 0;
}

/* End the run: tell every live worker, stop the loop. Workers lost for
 * their silence that have not registered again (their identity is still
 * their slot's) are told too, where their connection still stands (no
 * complaint where it does not): one that was only frozen or slow would
 * otherwise wait for a psd that is gone for its whole --retry-for. */
static void finish(srv_t *s, int code, const char *reason)
{
    if (s->phase == PHASE_DONE) return;
    if (s->tty) ps_log_status(NULL);
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state != W_GONE) {
            send_shutdown(s, w, code, reason);
        } else if (w->lost_silent && w->ident_len > 0) {
            Psd__Header h;
            Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
            shutdown_hdr(s, w, &h, &sd, code, reason);
            ps_msg_send(s->sock, w->ident, w->ident_len, &h, NULL, 0);
        }
    }
    if (sharded(s)) {
        Psd__Header h;
        Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHUTDOWN;
        sd.exit_code = code;
        sd.reason = (char *)reason;
        h.body_case = PSD__HEADER__BODY_SHUTDOWN;
        h.shutdown = &sd;
        shards_send_all(s, &h);
    }
    s->phase = PHASE_DONE;
    s->exit_code = code;
    ps_weights_abort(s->wr); /* a weights file not finished is not left behind */
    s->wr = NULL;
    uv_stop(&s->loop);
}

/* ---- positions of the epoch --------------------------------------------- */

static int ranges_add(worker_t *w, uint64_t b, uint64_t e)
{
    if (w->n_ranges > 0 && w->ranges[w->n_ranges - 1].end == b) {
        w->ranges[w->n_ranges - 1].end = e;
    } else {
        if (w->n_ranges == w->cap_ranges) {
            int cap = w->cap_ranges ? 2 * w->cap_ranges : 8;
            prange_t *r = realloc(w->ranges, (size_t)cap * sizeof *r);
            if (!r) return -ENOMEM;
            w->ranges = r;
            w->cap_ranges = cap;
        }
        w->ranges[w->n_ranges++] = (prange_t){b, e};
    }
    w->assigned += e - b;
    return 0;
}

/* Call fn on positions [from, from+count) of w's assignment, in order. */
static void walk_positions(const worker_t *w, uint64_t from, uint64_t count, void (*fn)(void *, uint64_t),
                           void *ud)
{
    uint64_t skip = from;
    for (int i = 0; i < w->n_ranges && count > 0; i++) {
        uint64_t len = w->ranges[i].end - w->ranges[i].begin;
        if (skip >= len) {
            skip -= len;
            continue;
        }
        for (uint64_t p = w->ranges[i].begin + skip; p < w->ranges[i].end && count > 0; p++, count--) fn(ud, p);
        skip = 0;
    }
}

static void mark_seen(void *ud, uint64_t p)
{
    srv_t *s = ud;
    const uint8_t bit = (uint8_t)(1u << (p % 8));
    s->ep_twice += (s->seen[p / 8] & bit) != 0;
    s->seen[p / 8] |= bit;
}

typedef struct {
    uint64_t *out;
    size_t n;
} collect_t;

static void collect_pos(void *ud, uint64_t p)
{
    collect_t *c = ud;
    c->out[c->n++] = p;
}

/* Positions [from, from+n) of w's assignment, in a new array (NULL: out of memory). */
static uint64_t *positions_of(const worker_t *w, uint64_t from, size_t n)
{
    uint64_t *pos = malloc((n ? n : 1) * sizeof *pos);
    if (!pos) return NULL;
    collect_t c = {pos, 0};
    walk_positions(w, from, n, collect_pos, &c);
    return pos;
}

/* An EPOCH header for w in the current epoch (ep: its body, the caller's, initialised here). */
static void epoch_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Epoch *ep, bool append)
{
    psd__epoch__init(ep);
    hdr_for(s, w, h, PSD__MSG_TYPE__MSG_EPOCH);
    ep->epoch = s->epoch;
    ep->world = (uint32_t)live_workers(s);
    ep->version = s->store.cur->version;
    ep->append = append;
    h->body_case = PSD__HEADER__BODY_EPOCH;
    h->epoch = ep;
}

/* Give positions pos[0..n) (sorted or not) to w: EPOCH message (append:
 * more for the current epoch) with the ranges and the sample ids. */
static int give_positions(srv_t *s, worker_t *w, const uint64_t *pos, size_t n, bool append)
{
    uint32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return -ENOMEM;
    if (!append) {
        w->n_ranges = 0;
        w->assigned = w->consumed = 0;
    }
    int first_range = w->n_ranges;
    for (size_t i = 0; i < n; i++) {
        if (ranges_add(w, pos[i], pos[i] + 1) != 0) {
            free(ids);
            return -ENOMEM;
        }
        ids[i] = s->perm[pos[i]];
    }
    uint32_t on_host = 0;
    for (int j = 0; j < s->n; j++)
        on_host += s->w[j].state != W_GONE && strcmp(s->w[j].host_id, w->host_id) == 0;
    Psd__Header h;
    Psd__Epoch ep;
    int nr = w->n_ranges - first_range;
    Psd__Range *rs = calloc((size_t)(nr > 0 ? nr : 1), sizeof *rs);
    Psd__Range **rp = calloc((size_t)(nr > 0 ? nr : 1), sizeof *rp);
    if (!rs || !rp) {
        free(ids);
        free(rs);
        free(rp);
        return -ENOMEM;
    }
    for (int i = 0; i < nr; i++) {
        psd__range__init(&rs[i]);
        rs[i].begin = w->ranges[first_range + i].begin;
        rs[i].end = w->ranges[first_range + i].end;
        rp[i] = &rs[i];
    }
    epoch_hdr(s, w, &h, &ep, append);
    ep.workers_on_host = on_host;
    ep.ranges = rp;
    ep.n_ranges = (size_t)nr;
    ps_frame_t fr = {.data = ids, .nbytes = 4 * n, .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)n};
    if (!append) w->clock = 0; /* ssp's clocks start again each epoch */
    else if (w->state != W_TRAIN) { /* (re)joining the epoch: level with the slowest, so nobody waits for
                                     * it, nor it (back from its barrier) for them */
        uint64_t m = min_clock(s);
        if (m != UINT64_MAX) w->clock = m;
    }
    w->state = w->consumed < w->assigned || !append ? W_TRAIN : w->state;
    w->last_seen = ps_now();
    send_to(s, w, &h, &fr, n ? 1 : 0);
    free(ids);
    free(rs);
    free(rp);
    return 0;
}

/* Split positions among the given workers, contiguously, in slot order. */
static void spread(srv_t *s, const uint64_t *pos, size_t n, worker_t **to, int k, bool append)
{
    for (int i = 0; i < k; i++) {
        size_t b = n * (size_t)i / (size_t)k, e = n * (size_t)(i + 1) / (size_t)k;
        if (append && e == b) continue;
        if (give_positions(s, to[i], pos + b, e - b, append) != 0) {
            PS_ERROR("out of memory assigning samples");
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
    }
}

/* ---- async and ssp: samples of slower workers to those done with theirs -- */

/* Cut w's positions of the epoch to the first keep (0 < keep <= assigned). */
static void ranges_trim(worker_t *w, uint64_t keep)
{
    uint64_t have = 0;
    for (int i = 0; i < w->n_ranges; i++) {
        uint64_t len = w->ranges[i].end - w->ranges[i].begin;
        if (have + len >= keep) {
            w->ranges[i].end = w->ranges[i].begin + (keep - have);
            w->n_ranges = i + 1;
            break;
        }
        have += len;
    }
    w->assigned = keep;
}

/* async and ssp (train.rebalance): w is about to get the weights of its next
 * batch and has more than that batch left, while other workers wait at their
 * barrier with nothing to train. The samples after its next batch are shared
 * among w and them in proportion to their speeds (batches a second from
 * their compute times), in whole batches: the epoch ends when the slowest
 * finishes, and no fast worker waits for it with nothing to do. w learns of
 * its shorter share (EPOCH keep) before the weights, so it never begins a
 * batch it no longer has; the others get theirs as lost workers' samples
 * are given (EPOCH append). */
static void rebalance(srv_t *s, worker_t *w)
{
    if (s->cfg.sync == PS_SYNC_BSP || !s->cfg.rebalance || s->phase != PHASE_TRAIN || w->state != W_TRAIN)
        return;
    const uint64_t B = (uint64_t)s->cfg.batch_size, left = w->assigned - w->consumed;
    if (left <= B) return; /* nothing to spare after its next batch */
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_BARRIER && !s->w[i].conn_closed && &s->w[i] != w) to[k++] = &s->w[i];
    if (k == 0) return;
    bool timed = w->compute_ewma > 0;
    for (int i = 0; i < k; i++) timed = timed && to[i]->compute_ewma > 0;
    double rate[MAX_WORKERS], sum = timed ? 1.0 / w->compute_ewma : 1.0;
    for (int i = 0; i < k; i++) sum += rate[i] = timed ? 1.0 / to[i]->compute_ewma : 1.0;
    const uint64_t spare = left - B;
    uint64_t give[MAX_WORKERS], moved = 0;
    for (int i = 0; i < k; i++) {
        give[i] = (uint64_t)((double)spare * rate[i] / sum / (double)B) * B; /* sum of them <= spare */
        moved += give[i];
    }
    if (moved == 0) return;
    const uint64_t keep = w->assigned - moved;
    uint64_t *pos = positions_of(w, keep, (size_t)moved);
    if (!pos) {
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    ranges_trim(w, keep);
    Psd__Header h;
    Psd__Epoch ep;
    epoch_hdr(s, w, &h, &ep, true);
    ep.keep = keep;
    send_to(s, w, &h, NULL, 0);
    PS_DEBUG("rank %u gives %" PRIu64 " of its %" PRIu64 " samples left in epoch %u to %d worker%s done with theirs",
             w->rank, moved, left, s->epoch + 1, k, k == 1 ? "" : "s");
    uint64_t off = 0;
    for (int i = 0; i < k && s->phase == PHASE_TRAIN; i++) {
        if (give[i] && give_positions(s, to[i], pos + off, (size_t)give[i], true) != 0)
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
        off += give[i];
    }
    s->ep_moved += moved;
    free(pos);
}

/* ---- epochs, steps, validation ------------------------------------------ */

static void start_epoch(srv_t *s)
{
    uint64_t T = s->train_count;
    ps_rng_permutation(s->perm, T, s->cfg.seed, 1000 + s->epoch);
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED) to[k++] = &s->w[i];
    /* positions not trained yet: all of them, or what a resumed epoch has left */
    uint64_t *pos = malloc((T ? T : 1) * sizeof *pos);
    if (!pos) {
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    size_t n = 0;
    if (!s->resumed_mid_epoch) memset(s->seen, 0, (T + 7) / 8);
    for (uint64_t p = 0; p < T; p++)
        if (!(s->seen[p / 8] & (1u << (p % 8)))) pos[n++] = p;
    if (!s->resumed_mid_epoch) {
        s->epoch_step = 0;
        s->ep_loss = 0;
        s->ep_correct = s->ep_samples = 0;
    }
    s->ep_compute_s = s->ep_wait_s = 0;
    s->ep_timed = 0;
    s->ep_step_s0 = s->store.step_s;
    s->ep_in_place0 = s->store.in_place;
    s->ep_step_n = 0;
    s->bytes_in_done += s->ep_bytes_in;
    s->bytes_out_done += s->ep_bytes_out;
    s->ep_bytes_in = s->ep_bytes_out = 0;
    s->ep_rows_in = s->ep_rows_pushes = 0;
    s->ep_rows_out = s->ep_rows_replies = 0;
    s->resumed_mid_epoch = false;
    uint64_t longest = k ? (T + (uint64_t)k - 1) / (uint64_t)k : T;
    s->spe = (double)((longest + (uint64_t)s->cfg.batch_size - 1) / (uint64_t)s->cfg.batch_size);
    if (s->cfg.sync != PS_SYNC_BSP) s->spe *= k ? k : 1; /* a step per push, not per round of pushes */
    if (s->spe < 1) s->spe = 1;
    s->ep_stale_sum = s->ep_stale_n = s->ep_stale_max = s->ep_lead_max = 0;
    s->ep_moved = 0;
    s->ep_twice = 0;
    s->phase = PHASE_TRAIN;
    s->t_epoch = ps_now();
    s->n_pool = 0;
    for (int i = 0; i < s->n; i++) s->w[i].n_ranges = 0, s->w[i].assigned = s->w[i].consumed = 0;
    if (k == 0) { /* everyone left: the next worker to come takes them all */
        memcpy(s->pool, pos, n * sizeof *pos);
        s->n_pool = n;
        s->orphan_deadline = ps_now() + s->cfg.start_timeout;
        PS_WARN("no workers for epoch %u; waiting up to %.0f s for one to join", s->epoch + 1,
                s->cfg.start_timeout);
    } else {
        spread(s, pos, n, to, k, false);
    }
    free(pos);
    if (n == 0) maybe_step(s); /* nothing left to train (resumed at the end of an epoch) */
}

/* The table on psd: VALIDATE's table frame (the last one, a reference on
 * the version) becomes the rows its range's examples read: their ids, then
 * the rows (gathered, copied by ZeroMQ at send). Once per validation part,
 * so the buffers are allocated here; out of memory, the worker gets none
 * and fails its part. */
static void range_rows_send(srv_t *s, worker_t *w, Psd__Header *h, ps_frame_t *fr, int n)
{
    Psd__Validate *v = h->validate;
    const size_t per = (size_t)s->cfg.ctr_fields * (size_t)s->cfg.ctr_per_field;
    const size_t count = (size_t)(v->end - v->begin), D = (size_t)s->layout.t[s->layout.table].cols;
    uint32_t *buf = malloc((count * per > 0 ? count * per : 1) * sizeof *buf);
    float *vals = NULL;
    size_t k = 0;
    if (buf) {
        ps_ctr_t g;
        ps_ctr_from_config(&s->cfg, &g);
        uint8_t label;
        for (size_t i = 0; i < count; i++) /* test examples come after the training ones */
            ps_ctr_example(&g, (uint64_t)s->cfg.ctr_train + v->begin + i, buf + i * per, NULL, &label);
        k = ps_sort_unique_u32(buf, count * per);
        vals = malloc((k * D > 0 ? k * D : 1) * sizeof *vals);
    }
    if (!vals) {
        PS_ERROR("out of memory for the table rows of rank %u's validation part", w->rank);
        k = 0;
    }
    static const uint32_t none[1];
    const uint32_t *ids = buf ? buf : none; /* none: k is 0 */
    /* the values of the rows in this psd's piece of the table (a shard:
     * a slice of the sorted ids, none maybe; the worker asks the other
     * shards for theirs) */
    const ps_piece_t *own = &s->store.own[s->layout.table];
    size_t r0 = 0, r1 = 0, a = 0, b = k;
    if (own->n && ps_piece_rows(&s->layout, own, &r0, &r1)) {
        while (a < k && ids[a] < r0) a++;
        for (b = a; b < k && ids[b] < r1; b++) {}
    } else {
        b = a;
    }
    if (n > 0 && fr[n - 1].id == (uint32_t)s->layout.table) {
        table_rows_frame(s, &fr[n - 1], ids + a, b - a, vals);
    } else { /* a shard holding none of the table */
        fr[n++] = (ps_frame_t){.data = vals, .nbytes = 0, .id = (uint32_t)s->layout.table,
                               .dtype = PSD__DTYPE__DT_F32, .rows = 0, .cols = (uint32_t)D};
    }
    fr[n] = fr[n - 1];
    fr[n - 1] = (ps_frame_t){.data = ids, .nbytes = k * sizeof *ids, .id = (uint32_t)s->layout.table,
                             .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)k};
    s->ep_bytes_out += k * sizeof *ids;
    v->rows = true;
    v->crc = 0;
    send_copied(s, w, h, fr, n + 1);
    free(buf);
    free(vals);
}

static void send_validate(srv_t *s, worker_t *w, vpart_t *p)
{
    Psd__Header h;
    Psd__Validate v = PSD__VALIDATE__INIT;
    ps_frame_t fr[PS_MAX_TENSORS + 1]; /* the table on psd: its rows' ids too */
    hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_VALIDATE);
    v.epoch = s->epoch;
    v.version = s->store.cur->version;
    v.begin = p->begin;
    v.end = p->end;
    h.body_case = PSD__HEADER__BODY_VALIDATE;
    h.validate = &v;
    p->worker = (int)(w - s->w);
    w->val_pending++;
    w->state = W_VALIDATING;
    w->last_seen = ps_now();
    int n = weights_frames(s, w, fr, &v.shm_slot, &v.crc);
    if (s->table_on_psd) {
        range_rows_send(s, w, &h, fr, n);
        return;
    }
    send_to(s, w, &h, fr, n);
}

/* The live worker with the fewest validation parts pending, or NULL. */
static worker_t *least_busy(srv_t *s)
{
    worker_t *best = NULL;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state < W_READY || w->state > W_VALIDATED || w->conn_closed) continue;
        if (!best || w->val_pending < best->val_pending) best = w;
    }
    return best;
}

/* Validation parts a worker holds at once: its own and one more, so that it
 * has the next at hand when it answers. The parts of workers that left wait
 * on psd (bounded by the parts) rather than pile up on one worker. */
#define PSD_VAL_PENDING_MAX 2

/* The parts no worker holds (their worker left or died) to the least busy
 * live workers, up to PSD_VAL_PENDING_MAX each; the rest wait for an
 * answer or a worker joining. */
static void give_orphans(srv_t *s)
{
    for (int i = 0; i < s->n_parts && s->phase == PHASE_VALIDATE; i++) {
        vpart_t *p = &s->parts[i];
        if (p->done || p->worker >= 0) continue;
        worker_t *to = least_busy(s);
        if (!to || to->val_pending >= PSD_VAL_PENDING_MAX) return;
        send_validate(s, to, p);
    }
}

static void start_validation(srv_t *s)
{
    uint64_t unseen = 0; /* every position trained once: the bookkeeping of samples moved between workers */
    for (uint64_t p = 0; p < s->train_count; p++) unseen += !(s->seen[p / 8] & (1u << (p % 8)));
    if (unseen || s->ep_twice)
        PS_ERROR("epoch %u: %" PRIu64 " training samples were trained twice and %" PRIu64 " not at all (a bug in "
                 "psd's bookkeeping)", s->epoch + 1, s->ep_twice, unseen);
    double dt = ps_now() - s->t_epoch;
    s->train_s_total += dt;
    s->samples_total += s->ep_samples;
    s->phase = PHASE_VALIDATE;
    s->t_epoch = dt; /* the epoch's training time, for the metrics */
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED) to[k++] = &s->w[i];
    int parts = k > 0 ? k : 1;
    free(s->parts);
    s->parts = calloc((size_t)parts, sizeof *s->parts);
    if (!s->parts) {
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    s->n_parts = parts;
    uint64_t T = s->test_count;
    for (int i = 0; i < parts; i++) {
        s->parts[i] = (vpart_t){.begin = T * (uint64_t)i / (uint64_t)parts,
                                .end = T * (uint64_t)(i + 1) / (uint64_t)parts, .worker = -1};
    }
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        w->val_pending = 0;
        if (w->state == W_BARRIER && w->barrier_at > 0) w->barrier_wait_s += ps_now() - w->barrier_at;
        w->barrier_at = 0;
    }
    for (int i = 0; i < k; i++) send_validate(s, to[i], &s->parts[i]);
    if (k == 0) {
        s->orphan_deadline = ps_now() + s->cfg.start_timeout;
        PS_WARN("no workers to validate epoch %u; waiting up to %.0f s for one to join", s->epoch + 1,
                s->cfg.start_timeout);
    }
}

/* samples trained this epoch, with their summed loss and correct count */
static void count_trained(srv_t *s, uint64_t samples, double loss, uint64_t correct)
{
    s->ep_samples += samples;
    s->ep_loss += loss;
    s->ep_correct += correct;
}

/* w's batch is trained: its samples seen, its statistics counted */
static void account_batch(srv_t *s, worker_t *w)
{
    walk_positions(w, w->consumed, w->push_batch, mark_seen, s);
    w->consumed += w->push_batch;
    count_trained(s, w->push_batch, w->push_loss, w->push_correct);
}

/* The statistics of the step's contributors, their pushes released; those
 * that asked get the new version once it is made (step_done). */
static void account_step(srv_t *s, uint64_t total, const worker_t *only)
{
    double step_loss = 0;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (!w->has_push || (only && w != only)) continue;
        account_batch(s, w);
        step_loss += w->push_loss;
        w->want_pull = w->push_pull && !w->st_req; /* a streamed reply has gone out already */
        release_push(w);
    }
    s->last_loss = step_loss / (double)total;
}

/* A step taken: its count, timing and loss curve. */
static void count_step(srv_t *s)
{
    s->ep_step_n++;
    s->step++;
    s->epoch_step++;
    double now = ps_now();
    if (s->last_step_t > 0 && s->epoch_step > 1) {
        int during = s->ckpt != NULL;
        s->int_sum[during] += now - s->last_step_t;
        s->int_n[during]++;
    }
    s->last_step_t = now;
    if (s->curve_every == 0) s->curve_every = 1;
    if (s->step % s->curve_every == 0) {
        if (s->n_curve == PSD_CURVE_MAX) { /* keep every other point, record half as often */
            for (int i = 0; i < PSD_CURVE_MAX / 2; i++) s->curve[i] = s->curve[2 * i + 1];
            s->n_curve = PSD_CURVE_MAX / 2;
            s->curve_every *= 2;
        }
        if (s->step % s->curve_every == 0) {
            s->curve[s->n_curve].step = s->step;
            s->curve[s->n_curve++].loss = (float)s->last_loss;
        }
    }
}

/* The step just counted diverged (psd_diverge.h: its loss against the
 * run's first steps, the norms of its gradient and new weights, this psd's
 * part): the run ends with the reason (exit 1), no weights saved and no
 * checkpoint of it taken. */
static bool diverged(srv_t *s)
{
    psd_amax_t am = psd_store_step_amax(&s->store);
    psd_diverge_verdict_t v = psd_diverge_step(&s->dv, s->cfg.divergence_factor, s->step, s->last_loss,
                                               psd_amax_value(am.g), psd_amax_value(am.w));
    if (v == PSD_DIVERGE_OK) return false;
    char why[512];
    psd_diverge_message(&s->dv, v, s->epoch + 1, why, sizeof why);
    PS_ERROR("%s", why);
    s->ckpt_deferred = false;
    finish(s, PSD_EXIT_ERROR, v == PSD_DIVERGE_RISE ? "training diverged (the loss rose far above its start)"
                                                    : "training diverged (a norm or the loss is not finite)");
    return true;
}

/* The new version is current: count the step, answer the pulls. A streamed
 * step that every contributor left before any chunk took it (void) is no
 * step: not counted, only answered. */
static void step_done(srv_t *s, bool taken)
{
    if (taken) count_step(s);
    if (taken && diverged(s)) return;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        w->shard_have = 0; /* HAVEs name a version: none of them counts for the next (a non-contributor's) */
        if (w->want_pull && w->state == W_TRAIN) {
            w->last_seen = ps_now(); /* psd's own waiting (a deferred pull) is not its silence */
            answer_pull(s, w);
        }
        w->want_pull = false;
    }
    if (taken && s->cfg.ckpt_every_steps > 0 && s->step % (uint64_t)s->cfg.ckpt_every_steps == 0)
        take_checkpoint(s, false);
}

/* Tell the shards to take the same step: contributors, weights, rate. */
static void shards_step(srv_t *s, int k, const double *wt)
{
    uint32_t ranks[MAX_WORKERS];
    int j = 0;
    for (int i = 0; i < s->n && j < k; i++)
        if (s->w[i].has_push) ranks[j++] = s->w[i].rank;
    Psd__Header h;
    Psd__ShardStep st = PSD__SHARD_STEP__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_STEP;
    st.version = s->store.cur->version;
    st.ranks = ranks;
    st.n_ranks = (size_t)j;
    st.weights = (double *)wt;
    st.n_weights = (size_t)k;
    st.lr = s->lr;
    st.clip_norm = s->cfg.clip_norm;
    st.step = s->store.steps;
    h.body_case = PSD__HEADER__BODY_SHARD_STEP;
    h.shard_step = &st;
    shards_send_all(s, &h);
}

/* The learning rate of the step about to be taken. */
static void step_lr(srv_t *s)
{
    double frac = (double)s->epoch_step / s->spe;
    if (frac > 0.999999) frac = 0.999999; /* a redistributed epoch may take a few more steps */
    s->lr = psd_sched_lr(&s->cfg, (double)s->epoch + frac, s->spe);
}

/* Contributor w's table gradient as rows (lazy tables): pushed as rows, or
 * the nonzero rows of the table (this shard's piece of it) it pushed whole
 * (g[table], which the dense step then skips). 0, or -1 (out of memory). */
static int lazy_rows(srv_t *s, worker_t *w, const void **g, bool bf16, psd_rowgrad_t *r)
{
    const int t = s->layout.table;
    const size_t D = (size_t)s->layout.t[t].cols;
    const ps_piece_t *own = &s->store.own[t];
    if (!w->grad_rows && g[t] && psd_rowbuf_dense(&w->sp, g[t], bf16, own->off / D, own->n / D, D) != 0) return -1;
    if (!w->grad_rows && !g[t]) w->sp.n = 0;
    g[t] = NULL;
    *r = psd_rowbuf_grad(&w->sp);
    return 0;
}

/* Reduce the pushes held (every one, or only `only`'s: async and ssp apply
 * each push on its own), apply the optimizer, answer the pulls. Returns
 * with s->stepping set when shards must send their norms first, or with
 * the run ended if no arena was free. */
static void take_step(srv_t *s, worker_t *only)
{
    uint64_t total = 0;
    int k = 0; /* contributors in rank order: the same sums every run */
    const void *(*g)[PS_MAX_TENSORS] = s->step_g; /* made once: no allocation per step */
    double *wt = s->step_wt;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].has_push && (!only || &s->w[i] == only)) total += s->w[i].push_batch;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (!w->has_push || (only && w != only)) continue;
        for (int t = 0; t < s->layout.n_tensors; t++)
            g[k][t] = w->grad_shm & (1ull << t) ? (const void *)(w->shm_grad + s->layout.t[t].offset)
                      : w->grad_rows && t == s->layout.table ? NULL /* its rows: lazy_rows */
                      : w->grad_mask & (1ull << t) ? (const void *)zmq_msg_data(&w->grad[t])
                                                   : NULL;
        s->step_bf16[k] = wire_bf16(s, w);
        wt[k] = (double)w->push_batch / (double)total;
        if (s->store.lazy && lazy_rows(s, w, g[k], s->step_bf16[k], &s->step_rows[k]) != 0) {
            PS_ERROR("out of memory for the table rows of a step");
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        k++;
    }
    step_lr(s);
    if (s->store.lazy && psd_store_rows_room(&s->store, k, s->step_rows, MAX_WORKERS) != 0) {
        PS_ERROR("out of memory for the table rows of a step");
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    if (sharded(s)) shards_step(s, k, wt);
    if (sharded(s) && s->cfg.clip_norm > 0) {
        /* the whole gradient's norm first: this part's blocks now, the
         * other shards' in their NORM messages (on_shard_norm) */
        if (psd_store_reduce_rows(&s->store, k, (const void *const(*)[PS_MAX_TENSORS])g, s->step_bf16, wt,
                                  s->store.lazy ? s->step_rows : NULL) != 0) {
            PS_ERROR("more table rows in a step than psd made room for");
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        account_step(s, total, NULL);
        s->stepping = true;
        s->stepping_since = ps_now();
        for (int i = 1; i < s->n_shards; i++) s->shards[i].norm_in = false;
        return;
    }
    uint64_t computed_on = only ? only->push_version : s->store.cur->version;
    double norm = psd_store_step_rows(&s->store, k, (const void *const(*)[PS_MAX_TENSORS])g, s->step_bf16, wt,
                                      s->store.lazy ? s->step_rows : NULL, s->cfg.clip_norm, s->lr);
    if (norm < 0) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    if (only) { /* versions applied since the one it was computed on */
        uint64_t stale = s->store.cur->version - 1 - computed_on;
        s->ep_stale_sum += stale;
        s->ep_stale_n++;
        if (stale > s->ep_stale_max) s->ep_stale_max = stale;
        only->clock++;
    }
    account_step(s, total, only);
    step_done(s, true);
}

/* ---- streamed steps (train.stream) ---------------------------------------- */

#define ST_BATCH 64 /* chunks stepped in one pool run */

/* The checkpoint asked for while a step was half taken: now. */
static void deferred_checkpoint(srv_t *s)
{
    if (!s->ckpt_deferred) return;
    s->ckpt_deferred = false;
    take_checkpoint(s, false);
    if (!s->ckpt && !s->ck_open && s->stop_when_written)
        finish(s, PSD_EXIT_ERROR, "psd was stopped; the checkpoint failed");
}


/* Contributor j's weight (its share of the step's samples) and wire type. */
static void stream_weights(srv_t *s)
{
    uint64_t total = 0;
    for (int j = 0; j < s->st_k; j++) total += s->w[s->st_mem[j]].push_batch;
    for (int j = 0; j < s->st_k; j++) {
        const worker_t *w = &s->w[s->st_mem[j]];
        s->step_wt[j] = (double)w->push_batch / (double)total;
        s->step_bf16[j] = wire_bf16(s, w);
    }
}

/* Send w the tensors made since the last it got, whole (so that it uses
 * them where they arrive), with the CRC-32 of the version in the message
 * that completes it (--x-verify-weights). */
static void stream_send(srv_t *s, worker_t *w, psd_arena_t *a, bool complete)
{
    if (w->st_sent == s->st_n_tord) return;
    ps_frame_t fr[PS_MAX_TENSORS];
    int n = 0;
    for (; w->st_sent < s->st_n_tord; w->st_sent++, n++) {
        psd_store_tensor_frame(&s->store, a, s->st_tord[w->st_sent], &fr[n]);
        s->ep_bytes_out += fr[n].nbytes;
    }
    Psd__Header h;
    Psd__Weights wt = PSD__WEIGHTS__INIT;
    hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_WEIGHTS);
    wt.version = s->st_open ? s->store.cur->version + 1 : s->store.cur->version;
    wt.step = s->step + 1;
    wt.parts = (uint32_t)s->layout.n_tensors;
    if (complete && s->opts.verify_weights) wt.crc = psd_store_current_crc(&s->store);
    h.body_case = PSD__HEADER__BODY_WEIGHTS;
    h.weights = &wt;
    send_to(s, w, &h, fr, n);
}

/* Chunk c's new values are made: its tensor is complete with its last. */
static void stream_made(srv_t *s, int c)
{
    int t = s->store.chunks[c].t;
    s->st_n_made++;
    if (++s->st_tmade[t] == s->st_tchunks[t]) s->st_tord[s->st_n_tord++] = t;
}

/* The step's contributors are every worker that began its push; they are
 * fixed from here, and the next version is built in st_next. */
static bool stream_open(srv_t *s)
{
    psd_arena_t *next = psd_store_stream_begin(&s->store);
    if (!next) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return false;
    }
    s->st_next = next;
    s->st_open = true;
    s->st_k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].push_started) {
            s->st_mem[s->st_k++] = i;
            s->w[i].st_member = true;
        }
    stream_weights(s);
    step_lr(s);
    return true;
}

/* No chunk of the streamed step under way has taken it yet: with clipping
 * none does before the whole gradient's norm is known. */
static bool stream_none_applied(const srv_t *s) { return s->cfg.clip_norm > 0 || s->st_n_done == 0; }

static void hand_out(srv_t *s, const uint64_t *pos, size_t n, const char *what);

/* w, a contributor lost before any chunk took the step, with others left:
 * whether its batch is trained depends on whether the step is taken, so it
 * is set aside (its samples are not handed out with the rest of w's).
 * 0, or -1 out of memory. */
static int stream_set_lost_aside(srv_t *s, worker_t *w)
{
    size_t need = s->st_lost_n + w->push_batch;
    if (need > s->st_lost_cap) { /* only when a contributor is lost: never per step */
        uint64_t *p = realloc(s->st_lost_pos, need * sizeof *p);
        if (!p) return -1;
        s->st_lost_pos = p;
        s->st_lost_cap = need;
    }
    collect_t c = {s->st_lost_pos + s->st_lost_n, 0};
    walk_positions(w, w->consumed, w->push_batch, collect_pos, &c);
    s->st_lost_n += c.n;
    w->consumed += w->push_batch;
    s->st_lost_loss += w->push_loss;
    s->st_lost_correct += w->push_correct;
    return 0;
}

/* The streamed step has ended: the batches set aside count as trained if it
 * was taken (their gradients are in it), else they are handed out again. */
static void stream_settle_lost(srv_t *s)
{
    if (s->st_lost_n == 0) return;
    if (s->st_void) {
        PS_WARN("the streamed step took no step: the %zu samples of the contributors lost in it are trained again",
                s->st_lost_n);
        hand_out(s, s->st_lost_pos, s->st_lost_n, "the lost contributors'");
    } else {
        for (size_t i = 0; i < s->st_lost_n; i++) mark_seen(s, s->st_lost_pos[i]);
        count_trained(s, s->st_lost_n, s->st_lost_loss, s->st_lost_correct);
    }
    s->st_lost_n = 0;
    s->st_lost_loss = 0;
    s->st_lost_correct = 0;
}

/* Step every chunk that every contributor has sent; send the new values to
 * the workers waiting for them; once all are made, the version is current
 * and the step done. */
static void stream_progress(srv_t *s)
{
    const bool clip = s->cfg.clip_norm > 0;
    if (!s->st_open) { /* every worker training must have begun its push */
        int k = 0;
        for (int i = 0; i < s->n; i++) {
            if (s->w[i].push_started) k++;
            else if (s->w[i].state == W_TRAIN) return;
        }
        if (k == 0) return;
        s->st_k = k;
        s->st_rescan = true;
    }
    if (s->st_rescan) { /* once per step (and per contributor lost); then stream_take queues them */
        s->st_rq_head = s->st_rq_tail = 0;
        for (int c = 0; c < s->st_nc; c++)
            if (!s->st_done[c] && s->st_have[c] == s->st_k) s->st_rq[s->st_rq_tail++] = c;
        s->st_rescan = false;
    }
    if (s->st_open && s->st_k == 0) { /* every contributor was lost: the rest take no step */
        if (stream_none_applied(s)) { /* nor did any chunk */
            psd_store_stream_void(&s->store);
            s->st_void = true;
        }
        for (int c = 0; c < s->st_nc; c++) {
            if (s->st_done[c] && !clip) continue;
            psd_store_stream_keep(&s->store, s->st_next, c);
            s->st_done[c] = 1;
            stream_made(s, c);
        }
        s->st_n_done = s->st_nc;
        s->st_rq_head = s->st_rq_tail = 0; /* kept: none of them is stepped (with no contributor) */
    }
    for (;;) {
        int m = 0;
        while (s->st_rq_head < s->st_rq_tail && m < ST_BATCH) s->st_ready[m++] = s->st_rq[s->st_rq_head++];
        if (m == 0) break;
        if (!s->st_open && !stream_open(s)) return;
        for (int j = 0; j < m; j++) {
            int c = s->st_ready[j];
            for (int k = 0; k < s->st_k; k++) {
                const worker_t *w = &s->w[s->st_mem[k]];
                s->st_src[(size_t)j * (size_t)s->st_k + (size_t)k] =
                    w->gch_in[c] == 2 ? (const void *)(w->shm_grad + s->store.chunks[c].off)
                                      : (const void *)zmq_msg_data(&w->gch[c]);
            }
        }
        psd_store_stream_chunks(&s->store, s->st_next, s->st_ready, m, s->st_k, s->st_src, s->step_bf16, s->step_wt,
                                clip, s->lr);
        for (int j = 0; j < m; j++) {
            int c = s->st_ready[j];
            s->st_done[c] = 1;
            s->st_n_done++;
            if (!clip) stream_made(s, c);
            for (int k = 0; k < s->st_k; k++) { /* its frames are no longer needed */
                worker_t *w = &s->w[s->st_mem[k]];
                if (w->gch_in[c] == 1) zmq_msg_close(&w->gch[c]);
                w->gch_in[c] = 3;
            }
        }
    }
    if (!s->st_open) return;
    if (clip && s->st_n_made == 0 && s->st_n_done == s->st_nc) { /* the global norm is known: apply */
        psd_store_stream_apply(&s->store, s->st_next, s->cfg.clip_norm, s->lr);
        for (int c = 0; c < s->st_nc; c++) stream_made(s, c);
    }
    psd_arena_t *a = s->st_next;
    bool complete = s->st_n_made == s->st_nc;
    if (complete) {
        psd_store_stream_end(&s->store, a);
        s->st_open = false;
    }
    for (int i = 0; i < s->n; i++)
        if (s->w[i].st_req && s->w[i].state != W_GONE) stream_send(s, &s->w[i], a, complete);
    if (!complete) return;
    uint64_t total = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].has_push) total += s->w[i].push_batch;
    memset(s->st_have, 0, (size_t)s->st_nc * sizeof *s->st_have);
    memset(s->st_done, 0, (size_t)s->st_nc);
    s->st_n_done = s->st_n_made = s->st_n_tord = 0;
    s->st_rq_head = s->st_rq_tail = 0;
    memset(s->st_tmade, 0, sizeof s->st_tmade);
    stream_settle_lost(s);
    if (total > 0) account_step(s, total, NULL); /* none: every contributor was lost (counted then) */
    step_done(s, !s->st_void);
    s->st_void = false;
    deferred_checkpoint(s);
}

/* w is gone: its chunks of the step no longer count. If it was a
 * contributor of the step under way, its gradient is in the chunks stepped
 * (or, with clipping, reduced) already and cannot be taken out again: the
 * remaining chunks are stepped with the other contributors' gradients,
 * weighted among themselves, and its batch counts as trained. With
 * clipping (no chunk takes the step before the end) that holds only if the
 * step is taken: its batch is set aside until the step ends
 * (stream_settle_lost). If it was the last contributor and no chunk has
 * taken the step, the step is void (stream_progress) and its batch is
 * still to be trained, as a gradient lost before a whole step. (A
 * contributor is one from the step's first chunks on: it is in some.) */
static void stream_forget(srv_t *s, worker_t *w)
{
    if (!w->gch) return;
    for (int c = 0; c < s->st_nc; c++)
        if ((w->gch_in[c] == 1 || w->gch_in[c] == 2) && !s->st_done[c]) s->st_have[c]--;
    if (!w->st_member) return;
    if (s->st_k == 1 && stream_none_applied(s))
        PS_WARN("rank %u, the last contributor of a streamed step, was lost in the middle of it, before any chunk "
                "took the step: no step is taken, and its batch of %u is still to be trained", w->rank,
                w->push_batch);
    else if (stream_none_applied(s)) { /* reduced into some chunks, applied only if the step is taken */
        PS_WARN("rank %u was lost in the middle of a streamed step, before any chunk took the step: its gradient is in "
                "%d of %d chunks, the others go on without it; its batch of %u counts as trained if the step is taken, "
                "else it is trained again", w->rank, s->st_n_done, s->st_nc, w->push_batch);
        if (stream_set_lost_aside(s, w) != 0) finish(s, PSD_EXIT_ERROR, "psd out of memory");
    } else {
        PS_WARN("rank %u was lost in the middle of a streamed step: its gradient is in %d of %d chunks, the others "
                "are stepped without it; its batch of %u counts as trained", w->rank, s->st_n_done, s->st_nc,
                w->push_batch);
        account_batch(s, w);
    }
    int k = 0;
    for (int j = 0; j < s->st_k; j++)
        if (&s->w[s->st_mem[j]] != w) s->st_mem[k++] = s->st_mem[j];
    s->st_k = k;
    s->st_rescan = true;
    w->st_member = false;
    if (k > 0) stream_weights(s);
}

/* Check a streamed PUSH's frames (chunks) and tensors in shared memory
 * (every chunk of them), then keep them: 0, or -1 when it was dropped. */
static int stream_take(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Push *p = m->hdr->push;
    const ps_layout_t *l = &s->layout;
    if (!w->gch) {
        drop(s, w, "streamed PUSH before its assignment");
        return -1;
    }
    if (s->st_open && !w->st_member) {
        drop(s, w, "PUSH for a step it is not part of");
        return -1;
    }
    uint64_t in_shm = 0;
    for (size_t i = 0; i < p->n_shm_tensors; i++) {
        uint32_t t = p->shm_tensors[i];
        bool bad = t >= (uint32_t)l->n_tensors || (in_shm & (1ull << t)); /* every chunk of it still to come */
        for (int c = bad ? 0 : s->st_tfirst[t], e = bad ? 0 : c + s->st_tchunks[t]; c < e && !bad; c++)
            bad = w->gch_in[c] != 0;
        if (bad) {
            drop(s, w, "PUSH of tensor %u: not in the model or already received", t);
            return -1;
        }
        in_shm |= 1ull << t;
    }
    int cs[PS_MAX_FRAMES];
    const bool bf16 = wire_bf16(s, w);
    for (int i = 0; i < m->n_frames; i++) {
        const Psd__TensorDesc *d = m->hdr->tensors[i];
        size_t n = 0;
        bool ok = bf16 ? ps_msg_bf16(m, i, &n) != NULL : ps_msg_f32(m, i, &n) != NULL;
        int c = ok && d->id < (uint32_t)l->n_tensors ? ps_chunk_find(l, s->st_cf, (int)d->id, d->offset, n) : -1;
        if (c < 0) {
            drop(s, w, "PUSH frame %d is no chunk of the model (tensor %u, %zu %s at %" PRIu64
                 "; train.stream: chunks of %zu)", i, d->id, n, bf16 ? "bf16" : "f32", d->offset, s->st_cf);
            return -1;
        }
        bool dup = w->gch_in[c] != 0 || (in_shm & (1ull << d->id)); /* not twice, nor also in shared memory */
        for (int j = 0; j < i; j++) dup |= cs[j] == c;
        if (dup) {
            drop(s, w, "PUSH of chunk %d of tensor %u: already received", c, d->id);
            return -1;
        }
        cs[i] = c;
    }
    for (int t = 0; t < l->n_tensors; t++) {
        if (!(in_shm & (1ull << t))) continue;
        for (int c = s->st_tfirst[t], e = c + s->st_tchunks[t]; c < e; c++) {
            w->gch_in[c] = 2;
            w->n_gch++;
            if (++s->st_have[c] == s->st_k && s->st_open) s->st_rq[s->st_rq_tail++] = c;
        }
    }
    for (int i = 0; i < m->n_frames; i++) {
        int c = cs[i];
        s->ep_bytes_in += zmq_msg_size(&m->frames[i]);
        zmq_msg_init(&w->gch[c]);
        zmq_msg_move(&w->gch[c], &m->frames[i]);
        w->gch_in[c] = 1;
        w->n_gch++;
        if (++s->st_have[c] == s->st_k && s->st_open) s->st_rq[s->st_rq_tail++] = c;
    }
    if (p->pull && !w->shm && s->cfg.wire_weights == PS_WIRE_F32) w->st_req = true;
    return 0;
}

/* bsp: once every worker still training has pushed for this version,
 * reduce and apply. async and ssp: apply each push as it completes. */
static void maybe_step(srv_t *s)
{
    if (s->phase != PHASE_TRAIN || s->stepping) return;
    if (s->cfg.sync != PS_SYNC_BSP) {
        for (int i = 0; i < s->n && s->phase == PHASE_TRAIN; i++)
            if (s->w[i].has_push) take_step(s, &s->w[i]);
        if (s->phase != PHASE_TRAIN) return;
        ssp_release(s);
    } else if (s->stream) {
        stream_progress(s);
        if (s->phase != PHASE_TRAIN || s->st_open) return;
        for (int i = 0; i < s->n; i++)
            if (s->w[i].push_started) return; /* the step waits for a worker to begin its push */
    } else {
        int pending = 0;
        for (int i = 0; i < s->n; i++) {
            worker_t *w = &s->w[i];
            if (w->state == W_TRAIN && !w->has_push) return; /* still waiting for it */
            if (w->own_push && !w->has_push) return;        /* or for a shard to have all of its push */
            pending += w->has_push;
        }
        if (pending > 0) take_step(s, NULL);
        if (s->phase != PHASE_TRAIN || s->stepping) return;
    }
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_TRAIN) return;
    if (s->n_pool > 0) return; /* samples wait for a worker to join */
    start_validation(s);
}

/* Forget a worker's shared memory (after release_push). */
static void shm_forget(srv_t *s, worker_t *w)
{
    if (w->hold) psd_store_frame_free(NULL, w->hold);
    w->hold = NULL;
    if (w->shm_grad) munmap((void *)w->shm_grad, s->layout.n_params * sizeof(float));
    w->shm_grad = NULL;
    w->shm = false;
}

/* A worker's table buffers: its gradient rows and the rows it asked for. */
static void rows_free(worker_t *w)
{
    psd_rowbuf_free(&w->sp);
    psd_want_free(&w->want);
}

/* Samples waiting for a worker (the pool) to ready worker w, in training:
 * true if it took them. */
static bool take_pool(srv_t *s, worker_t *w)
{
    if (s->phase != PHASE_TRAIN || s->n_pool == 0 || w->state != W_READY || w->conn_closed) return false;
    PS_INFO("rank %u takes the %zu samples that were waiting for a worker", w->rank, s->n_pool);
    size_t n = s->n_pool;
    s->n_pool = 0;
    if (give_positions(s, w, s->pool, n, false) != 0) finish(s, PSD_EXIT_ERROR, "psd out of memory");
    return true;
}

/* Untrained samples of the epoch (positions pos[0..n), `what` for the log)
 * to the workers training or at their barrier, else to a worker that
 * joined during the epoch and waits for the next one, else they wait for a
 * worker to join. */
static void hand_out(srv_t *s, const uint64_t *pos, size_t n, const char *what)
{
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if ((s->w[i].state == W_TRAIN || s->w[i].state == W_BARRIER) && !s->w[i].conn_closed) to[k++] = &s->w[i];
    if (k > 0) {
        PS_INFO("%s %zu samples of epoch %u go to %d other worker%s", what, n, s->epoch + 1, k, k == 1 ? "" : "s");
        spread(s, pos, n, to, k, true);
        return;
    }
    memcpy(s->pool + s->n_pool, pos, n * sizeof *pos);
    s->n_pool += n;
    bool taken = false;
    for (int i = 0; i < s->n && !taken; i++) taken = take_pool(s, &s->w[i]);
    if (!taken) {
        s->orphan_deadline = ps_now() + s->cfg.start_timeout;
        PS_WARN("no worker left in epoch %u: %zu samples wait up to %.0f s for a worker to join", s->epoch + 1,
                s->n_pool, s->cfg.start_timeout);
    }
}

/* A worker is gone (lost, left, failed): its samples and validation parts go
 * to the others, or to a worker waiting for the next epoch, or wait for the
 * next worker to join. */
static void worker_gone(srv_t *s, worker_t *w)
{
    wstate_t was = w->state;
    if (was != W_GONE) s->workers_lost++;
    if (s->stream) stream_forget(s, w);
    release_push(w); /* a gradient from a worker declared gone is never applied (streamed: see stream_forget) */
    shm_forget(s, w);
    rows_free(w); /* the rows sent were copied at send */
    w->state = W_GONE;
    w->gone_at = ps_now();
    if (s->phase == PHASE_TRAIN && (was == W_TRAIN || was == W_BARRIER) && w->consumed < w->assigned) {
        size_t n = (size_t)(w->assigned - w->consumed);
        uint64_t *pos = positions_of(w, w->consumed, n);
        if (!pos) {
            finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        hand_out(s, pos, n, "its remaining");
        free(pos);
        w->assigned = w->consumed;
        maybe_step(s);
    } else if (s->phase == PHASE_VALIDATE && w->val_pending > 0) {
        w->val_pending = 0;
        for (int i = 0; i < s->n_parts; i++)
            if (!s->parts[i].done && s->parts[i].worker == (int)(w - s->w)) s->parts[i].worker = -1;
        give_orphans(s);
        if (!least_busy(s)) s->orphan_deadline = ps_now() + s->cfg.start_timeout;
    } else if (s->phase == PHASE_TRAIN) {
        maybe_step(s);
    }
}

static int want_take(srv_t *s, worker_t *w, ps_msg_t *m);

static void on_pull(srv_t *s, worker_t *w, ps_msg_t *m)
{
    if (w->state != W_TRAIN) {
        drop(s, w, "PULL while %s", wstate_name[w->state]);
        return;
    }
    uint64_t v = m->hdr->pull->min_version;
    if (v > s->store.cur->version) {
        drop(s, w, "PULL of version %" PRIu64 ", current is %" PRIu64, v, s->store.cur->version);
        return;
    }
    if (m->hdr->pull->want_rows && want_take(s, w, m) != 0) return;
    if (w->own_push) { /* its last push still waits for the step (it was given more samples since, or
                        * with shards, this asks for the step's version after a push's last part):
                        * answer with the version that step makes; its gradient, in flight or in
                        * its shared region, must not be overwritten before */
        w->push_pull = true;
        return;
    }
    if (s->st_open || s->stepping) { /* a streamed step is half taken (maybe in place), or psd shards
                                       * take a step (clipping: waiting for their norms): the version it
                                       * makes, not the one its push would be stale against */
        w->want_pull = true;
        return;
    }
    answer_pull(s, w);
}

/* The most table rows one batch can read: min(rows, batch x fields x values). */
static size_t batch_rows(const srv_t *s)
{
    size_t n = (size_t)s->cfg.batch_size * (size_t)s->cfg.ctr_fields * (size_t)s->cfg.ctr_per_field;
    size_t R = (size_t)s->layout.t[s->layout.table].rows;
    return n < R ? n : R;
}

/* ids[0..n) are rows of the table, strictly increasing, n >= 1 */
static bool table_ids(const srv_t *s, const uint32_t *ids, size_t n)
{
    return ps_rows_valid(ids, n, (uint64_t)s->layout.t[s->layout.table].rows);
}

/* Frames i (u32 ids) and i + 1 (f32 rows) of a PUSH are rows of the
 * table's gradient: ids strictly increasing and below its row count, rows
 * of its width, f32 gradients; on a psd shard, rows of its piece of the
 * table (whole rows), none maybe. The table is stepped by rows. 0, or -1. */
static int rows_check(const srv_t *s, const worker_t *w, const ps_msg_t *m, int i)
{
    if (wire_bf16(s, w) || !s->store.lazy) return -1; /* its step reads bfloat16, or the table whole */
    const ps_layout_t *l = &s->layout;
    const uint32_t *ids;
    size_t n = 0, nv = 0;
    return l->table >= 0 && (int)m->hdr->tensors[i]->id == l->table && ps_msg_rows(m, i, &ids, &n, &nv) &&
                   psd_rows_fit(l, &s->store.own[l->table], ids, n, nv, sharded(s))
               ? 0
               : -1;
}

/* Keep the checked rows (frames i, i + 1) for the step, which merges them.
 * Allocates only the first time (room for any batch's rows) and when a
 * push has more rows than any before. 0, or -1 (dropped, logged). */
static int rows_take(srv_t *s, worker_t *w, ps_msg_t *m, int i)
{
    const ps_layout_t *l = &s->layout;
    const size_t D = (size_t)l->t[l->table].cols;
    size_t n = 0, nv = 0;
    const uint32_t *ids = ps_msg_u32(m, i, &n);
    const float *v = ps_msg_f32(m, i + 1, &nv);
    if (psd_rowbuf_set(&w->sp, ids, v, n, D, batch_rows(s)) != 0) {
        drop(s, w, "PUSH of table rows: out of memory");
        return -1;
    }
    w->sp_table = l->table;
    w->grad_rows = true;
    s->ep_rows_in += n;
    s->ep_rows_pushes++;
    return 0;
}

/* The last frame of a PUSH with want_rows: the table rows the worker's
 * next batch reads (strictly increasing, below the table's rows), kept for
 * the reply. 0, or -1 (dropped, logged). Allocates only when a list is
 * longer than any before. */
static int want_take(srv_t *s, worker_t *w, ps_msg_t *m)
{
    const ps_layout_t *l = &s->layout;
    size_t n = 0;
    const uint32_t *ids = m->n_frames > 0 && l->table >= 0 &&
                                  m->hdr->tensors[m->n_frames - 1]->id == (uint32_t)l->table
                              ? ps_msg_u32(m, m->n_frames - 1, &n)
                              : NULL;
    const bool push = m->hdr->body_case == PSD__HEADER__BODY_PUSH;
    const char *what = push ? "PUSH" : "PULL";
    size_t r0 = 0, r1 = 0; /* a shard: rows of its piece, none maybe */
    bool rows_ok = ids && (sharded(s) ? ps_piece_rows(l, &s->store.own[l->table], &r0, &r1) && r0 < r1 &&
                                            psd_rows_in(ids, n, r0, r1)
                                      : table_ids(s, ids, n));
    if (!rows_ok || n > batch_rows(s) || (push && !m->hdr->push->pull)) {
        drop(s, w, "%s asking for table rows that are not rows of the table (strictly increasing ids below its "
                   "row count, of this shard's piece, at most a batch's, in its last frame) or without asking for "
                   "the next version", what);
        return -1;
    }
    if (psd_want_keep(&w->want, ids, n, batch_rows(s), (size_t)l->t[l->table].cols) != 0) {
        drop(s, w, "%s asking for table rows: out of memory", what);
        return -1;
    }
    return 0;
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
    if (s->cfg.sync == PS_SYNC_BSP ? p->version != s->store.cur->version : p->version > s->store.cur->version) {
        drop(s, w, "PUSH computed on version %" PRIu64 ", current is %" PRIu64, p->version,
             s->store.cur->version);
        return;
    }
    uint64_t left = w->assigned - w->consumed;
    if (p->batch == 0 || p->batch > (uint32_t)s->cfg.batch_size || p->batch > left) {
        drop(s, w, "PUSH of a batch of %u (batch size %d, %" PRIu64 " samples left)", p->batch,
             s->cfg.batch_size, left);
        return;
    }
    if (!isfinite(p->loss_sum)) {
        /* not a bad message: the model diverged. Dropping it would only get
         * the workers declared lost one after the other. */
        PS_ERROR("training diverged at step %" PRIu64 " (epoch %u): rank %u's batch loss is %s; lower "
                 "optimizer.lr, add warm-up (schedule.warmup_epochs) or clip (optimizer.clip_norm)",
                 s->step + 1, s->epoch + 1, w->rank, isnan(p->loss_sum) ? "NaN" : "infinite");
        finish(s, PSD_EXIT_ERROR, "training diverged (loss not finite)");
        return;
    }
    if (p->loss_sum < 0 || p->correct > p->batch) {
        drop(s, w, "PUSH with invalid statistics");
        return;
    }
    if (w->push_started && (p->batch != w->push_batch || p->correct != w->push_correct ||
                            p->loss_sum != w->push_loss || p->version != w->push_version)) {
        drop(s, w, "PUSH part for another batch than the parts before it");
        return;
    }
    if (m->n_frames < 1 && p->n_shm_tensors < 1) {
        drop(s, w, "PUSH without tensors");
        return;
    }
    if (p->n_shm_tensors > 0 && !w->shm) {
        drop(s, w, "PUSH of tensors in shared memory psd does not share with it");
        return;
    }
    bool complete;
    if (s->stream) {
        if (stream_take(s, w, m) != 0) return;
        complete = w->n_gch == s->st_nc;
    } else {
        uint64_t mask = 0, in_shm = 0;
        for (size_t i = 0; i < p->n_shm_tensors; i++) {
            uint32_t t = p->shm_tensors[i];
            if (t >= (uint32_t)l->n_tensors || ((w->grad_mask | in_shm) & (1ull << t))) {
                drop(s, w, "PUSH of tensor %u: not in the model or already received", t);
                return;
            }
            in_shm |= 1ull << t;
        }
        mask = in_shm;
        const int nf = m->n_frames - (p->want_rows && m->n_frames > 0); /* gradient frames; then the rows wanted */
        int rows_at = -1; /* the table's gradient as rows: frames rows_at (ids) and rows_at + 1 */
        for (int i = 0; i < nf; i++) {
            size_t n = 0;
            const Psd__TensorDesc *d = m->hdr->tensors[i];
            uint32_t t = d->id;
            if (t >= (uint32_t)l->n_tensors || ((w->grad_mask | mask) & (1ull << t))) {
                drop(s, w, "PUSH of tensor %u: not in the model or already received", t);
                return;
            }
            if (d->dtype == PSD__DTYPE__DT_U32) {
                if (rows_check(s, w, m, i) != 0) {
                    drop(s, w, "PUSH of rows of tensor %u that are not rows of the table (strictly increasing "
                               "ids below its row count, of this shard's piece, then their f32 rows)", t);
                    return;
                }
                rows_at = i++;
                mask |= 1ull << t;
                continue;
            }
            /* in the worker's wire type: f32, or bf16 with train.wire_gradients: bf16 */
            bool bf16 = wire_bf16(s, w);
            bool ok = bf16 ? ps_msg_bf16(m, i, &n) != NULL : ps_msg_f32(m, i, &n) != NULL;
            const ps_piece_t *pc = &s->store.own[t];
            if (!ok || d->offset != pc->off || n != pc->n || pc->n == 0) {
                drop(s, w, "PUSH tensor %u does not match %s (%zu %s at %" PRIu64 ", want %zu %s at %zu)", t,
                     sharded(s) ? "this shard's part" : "the model", n,
                     d->dtype == PSD__DTYPE__DT_BF16 ? "bf16" : "elements", d->offset, pc->n, bf16 ? "bf16" : "f32",
                     pc->off);
                return;
            }
            mask |= 1ull << t;
        }
        if (p->want_rows && want_take(s, w, m) != 0) return;
        if (rows_at >= 0 && rows_take(s, w, m, rows_at) != 0) {
            w->want.n = 0;
            w->want.has = false;
            return;
        }
        /* keep the frames without copying: reduced in rank order once everyone has pushed */
        for (int i = 0; i < m->n_frames; i++) {
            uint32_t t = m->hdr->tensors[i]->id;
            s->ep_bytes_in += zmq_msg_size(&m->frames[i]);
            if (i >= nf) continue; /* the rows wanted: kept by want_take */
            if (rows_at >= 0 && (i == rows_at || i == rows_at + 1)) continue; /* copied by rows_take */
            zmq_msg_init(&w->grad[t]);
            zmq_msg_move(&w->grad[t], &m->frames[i]);
        }
        w->grad_mask |= mask;
        w->grad_shm |= in_shm;
        uint64_t all = 0;
        for (int t = 0; t < l->n_tensors; t++)
            if (s->store.own[t].n) all |= 1ull << t;
        complete = w->grad_mask == all;
    }
    w->push_pull |= p->pull;
    if (p->release && w->hold) { /* it reads no more of its slot: the step may update it in place */
        psd_store_frame_free(NULL, w->hold);
        w->hold = NULL;
    }
    if (!w->push_started) {
        w->push_started = true;
        w->push_version = p->version;
        w->push_batch = p->batch;
        w->push_loss = p->loss_sum;
        w->push_correct = p->correct;
    }
    if (!complete) { /* more parts to come */
        if (s->stream) maybe_step(s); /* its chunks may complete some */
        return;
    }
    w->own_push = true;
    w->own_push_at = ps_now();
    push_check(s, w);
    /* the worker's step time, from the part that completes the push */
    if (isfinite(p->compute_s) && isfinite(p->wait_s) && p->compute_s >= 0 && p->wait_s >= 0 &&
        p->compute_s < 1e6 && p->wait_s < 1e6) {
        s->ep_compute_s += p->compute_s;
        s->ep_wait_s += p->wait_s;
        s->ep_timed++;
        w->compute_ewma = w->compute_ewma > 0 ? 0.9 * w->compute_ewma + 0.1 * p->compute_s : p->compute_s;
        int bw = 0, bc = 0;
        while (bw < PSD_HIST_N && p->wait_s > hist_le[bw]) bw++;
        while (bc < PSD_HIST_N && p->compute_s > hist_le[bc]) bc++;
        w->h_wait[bw]++;
        w->h_compute[bc]++;
        w->h_wait_sum += p->wait_s;
        w->h_compute_sum += p->compute_s;
    }
    if (w->has_push) maybe_step(s);
}

/* The last epoch is validated (and every part of the weights is here). */
static void end_run(srv_t *s)
{
    if (sharded(s) && (s->ckpt || s->ck_open)) { /* the shards write their parts of the last checkpoint: they
                                                   * are told the run is over once each confirmed it */
        s->end_when_written = true;
        s->phase = PHASE_WAIT;
        s->phase_deadline = INFINITY;
        return;
    }
    s->end_when_written = false;
    double sps = s->train_s_total > 0 ? (double)s->samples_total / s->train_s_total : 0;
    double wall = ps_now() - s->t_start;
    if (!sharded(s)) save_weights(s); /* shards: written already (fetch_next) */
    const char *partial = psd_metrics_incomplete(&s->metrics) ? " (its metrics file is INCOMPLETE)" : "";
    if (s->val_epoch_last)
        PS_INFO("run finished: %d epochs, %" PRIu64 " steps, val_acc %.4f, %.0f samples/s, %.1f s%s", s->cfg.epochs,
                s->step, s->val_acc_last, sps, wall, partial);
    else /* resumed at its end: nothing was trained or validated by this psd */
        PS_INFO("run finished: %d epochs, %" PRIu64 " steps (all before this resume), %.1f s", s->cfg.epochs, s->step,
                wall);
    if (s->int_n[1] > 0)
        PS_INFO("step interval %.2f ms over %" PRIu64 " steps without a checkpoint being written, "
                "%.2f ms over %" PRIu64 " steps while one was",
                1e3 * s->int_sum[0] / (double)(s->int_n[0] ? s->int_n[0] : 1), s->int_n[0],
                1e3 * s->int_sum[1] / (double)s->int_n[1], s->int_n[1]);
    int code = s->exit_code;
    finish(s, 0, "training finished");
    s->exit_code = code;
}

static bool begin_save(srv_t *s);
static void fetch_next(srv_t *s);

/* The last epoch is done: with psd shards and --save the other shards'
 * parts come for the weights file first (fetch_next then ends the run). */
static void run_end(srv_t *s)
{
    if (sharded(s) && s->cfg.save[0] && begin_save(s)) {
        s->phase = PHASE_WAIT; /* nothing to do but wait for them */
        s->phase_deadline = INFINITY;
        fetch_next(s);
        return;
    }
    end_run(s);
}

/* An epoch's figures, for its metrics line. */
typedef struct {
    double train_loss, train_acc, val_loss, val_acc, sps, ep_sps, wall, auc;
    uint64_t correct, count;
    int workers;
} epoch_stats_t;

/* The epoch's line of the metrics file (README "Metrics file", schema 2):
 * built whole, then written and synced in one go (psd_metrics.h). */
static void write_metrics_line(srv_t *s, const epoch_stats_t *e)
{
    char *line = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&line, &len);
    if (!f) {
        psd_metrics_failed(&s->metrics, errno, "build");
        return;
    }
    fprintf(f,
            "{\"schema\":2,\"run_id\":\"%016" PRIx64 "\",\"epoch\":%u,\"step\":%" PRIu64
            ",\"train_loss\":%.9g,\"train_acc\":%.9g,\"train_samples\":%" PRIu64
            ",\"val_loss\":%.9g,\"val_acc\":%.9g,\"val_correct\":%" PRIu64 ",\"val_samples\":%" PRIu64
            ",\"samples_per_s\":%.6g,\"epoch_samples_per_s\":%.6g,\"train_s\":%.6g,\"wall_s\":%.6g"
            ",\"workers\":%d,\"lr\":%.9g,\"worker_step_ms\":%.6g,\"worker_wait_frac\":%.6g,\"psd_step_ms\":%.6g"
            ",\"wire_bytes_in\":%" PRIu64 ",\"wire_bytes_out\":%" PRIu64 ",\"sync\":\"%s\""
            ",\"staleness_max\":%" PRIu64 ",\"staleness_mean\":%.6g,\"ssp_lead_max\":%" PRIu64
            ",\"psd_steps_in_place\":%" PRIu64 ",\"samples_moved\":%" PRIu64,
            s->run_id, s->epoch + 1, s->step, e->train_loss, e->train_acc, s->ep_samples, e->val_loss,
            e->val_acc, e->correct, e->count, e->sps, e->ep_sps, s->train_s_total, e->wall, e->workers, s->lr,
            s->ep_timed ? 1e3 * (s->ep_compute_s + s->ep_wait_s) / (double)s->ep_timed : 0.0,
            s->ep_compute_s + s->ep_wait_s > 0 ? s->ep_wait_s / (s->ep_compute_s + s->ep_wait_s) : 0.0,
            s->ep_step_n ? 1e3 * (s->store.step_s - s->ep_step_s0) / (double)s->ep_step_n : 0.0, s->ep_bytes_in, s->ep_bytes_out,
            ps_sync_name(s->cfg.sync), s->ep_stale_max, stale_mean(s), s->ep_lead_max,
            s->store.in_place - s->ep_in_place0, s->ep_moved);
    if (s->cfg.kind == PS_MODEL_CTR)
        fprintf(f,
                ",\"optimum_loss\":%.9g,\"constant_loss\":%.9g,\"val_auc\":%.9g,\"optimum_auc\":%.9g"
                ",\"table_rows_in\":%" PRIu64 ",\"table_row_pushes\":%" PRIu64 ",\"table_rows_out\":%" PRIu64
                ",\"table_row_replies\":%" PRIu64,
                s->ctr_opt_loss, s->ctr_const_loss, e->auc, s->ctr_opt_auc, s->ep_rows_in, s->ep_rows_pushes,
                s->ep_rows_out, s->ep_rows_replies);
    if (s->resumed) fprintf(f, ",\"resumed_from_step\":%" PRIu64, s->resumed_step);
    fputs("}\n", f);
    if (fclose(f) != 0 || !line) {
        free(line);
        psd_metrics_failed(&s->metrics, ENOMEM, "build");
        return;
    }
    psd_metrics_write(&s->metrics, line, len);
    free(line);
    if (s->opts.die_after_metrics > 0 && s->epoch + 1 == (uint32_t)s->opts.die_after_metrics)
        raise(SIGKILL); /* tests only: killed between an epoch's metrics line and its checkpoint */
}

static void end_validation(srv_t *s)
{
    if (s->tty) ps_log_status(NULL); /* the epoch's line takes its place */
    double loss = 0;
    uint64_t correct = 0, count = 0;
    for (int i = 0; i < s->n_parts; i++) { /* part order: the same sums every run */
        loss += s->parts[i].loss;
        correct += s->parts[i].correct;
        count += s->parts[i].count;
    }
    double val_loss = count ? loss / (double)count : 0, val_acc = count ? (double)correct / (double)count : 0;
    double train_loss = s->ep_samples ? s->ep_loss / (double)s->ep_samples : 0;
    double train_acc = s->ep_samples ? (double)s->ep_correct / (double)s->ep_samples : 0;
    double ep_sps = s->t_epoch > 0 ? (double)s->ep_samples / s->t_epoch : 0;
    double sps = s->train_s_total > 0 ? (double)s->samples_total / s->train_s_total : 0;
    double wall = ps_now() - s->t_start;
    int workers = live_workers(s);
    PS_INFO("epoch %u/%d step %" PRIu64 " train_loss %.4f train_acc %.4f val_loss %.4f val_acc %.4f "
            "(%" PRIu64 "/%" PRIu64 ") %.0f samples/s lr %.5g",
            s->epoch + 1, s->cfg.epochs, s->step, train_loss, train_acc, val_loss, val_acc, correct,
            count, ep_sps, s->lr);
    double auc = s->cfg.kind == PS_MODEL_CTR ? ps_auc(s->val_scores, s->test_labels, s->test_count, s->auc_order) : 0;
    if (s->cfg.kind == PS_MODEL_CTR)
        PS_INFO("epoch %u: val log-loss %.4f, %.4f above the planted model's %.4f; AUC %.4f (planted %.4f)",
                s->epoch + 1, val_loss, val_loss - s->ctr_opt_loss, s->ctr_opt_loss, auc, s->ctr_opt_auc);
    if (s->cfg.sync != PS_SYNC_BSP) {
        char lead[128] = "";
        if (s->cfg.sync == PS_SYNC_SSP)
            snprintf(lead, sizeof lead, "; workers trained at most %" PRIu64 " steps ahead of the slowest (bound %d)",
                     s->ep_lead_max, s->cfg.staleness);
        PS_INFO("epoch %u: %s, staleness of the %" PRIu64 " gradients applied: max %" PRIu64 " mean %.2f versions%s",
                s->epoch + 1, ps_sync_name(s->cfg.sync), s->ep_stale_n, s->ep_stale_max, stale_mean(s), lead);
        if (s->ep_moved > 0) {
            char who[512];
            size_t at = 0;
            for (int i = 0; i < s->n && at < sizeof who; i++)
                if (s->w[i].state != W_GONE || s->w[i].consumed > 0)
                    at += (size_t)snprintf(who + at, sizeof who - at, "%s rank %u %" PRIu64 "%s", at ? "," : "",
                                           s->w[i].rank, s->w[i].consumed,
                                           s->w[i].state == W_GONE ? " (lost)" : "");
            PS_INFO("epoch %u: %" PRIu64 " samples moved from slower workers to those done with theirs; trained:%s",
                    s->epoch + 1, s->ep_moved, who);
        }
    }
    if (s->metrics.fd >= 0) {
        epoch_stats_t e = {.train_loss = train_loss, .train_acc = train_acc, .val_loss = val_loss, .val_acc = val_acc,
                           .sps = sps, .ep_sps = ep_sps, .wall = wall, .auc = auc, .correct = correct, .count = count,
                           .workers = workers};
        write_metrics_line(s, &e);
    }
    bool last = s->epoch + 1 >= (uint32_t)s->cfg.epochs;
    bool stop = s->opts.stop_after_epoch > 0 && s->epoch + 1 == (uint32_t)s->opts.stop_after_epoch && !last;
    if (s->cfg.ckpt_dir[0] && (last || stop || (s->cfg.ckpt_every_epochs > 0 &&
                                                 (s->epoch + 1) % (uint32_t)s->cfg.ckpt_every_epochs == 0)))
        take_checkpoint(s, true);
    s->val_acc_last = val_acc;
    s->val_loss_last = val_loss;
    s->val_epoch_last = s->epoch + 1;
    if (s->val_curve && s->n_val_curve < s->cfg.epochs) {
        s->val_curve[s->n_val_curve].epoch = s->epoch + 1;
        s->val_curve[s->n_val_curve].step = s->step;
        s->val_curve[s->n_val_curve].train_loss = (float)train_loss;
        s->val_curve[s->n_val_curve].val_loss = (float)val_loss;
        s->val_curve[s->n_val_curve++].val_acc = (float)val_acc;
    }
    if (last) {
        run_end(s);
        return;
    }
    if (stop) {
        PS_INFO("stopping after epoch %u as asked (--stop-after-epoch); resume with --resume %s",
                s->epoch + 1, s->cfg.ckpt_dir[0] ? s->run_dir : "DIR");
        if (s->ckpt || s->ck_open) {
            s->stop_when_written = true;
            s->phase = PHASE_WAIT; /* nothing more to do but write */
            s->phase_deadline = INFINITY;
        } else {
            finish(s, 0, "psd stopped after the epoch it was asked to");
        }
        return;
    }
    s->epoch++;
    start_epoch(s);
}

/* ---- checkpoints -------------------------------------------------------- */

static void take_checkpoint(srv_t *s, bool epoch_done)
{
    if (!s->cfg.ckpt_dir[0]) return;
    if (s->stepping || s->st_open) { /* between a sharded step's halves (every shard checkpoints the same
                                      * step after it), or in a streamed step: once the step is taken */
        s->ckpt_deferred = true;
        return;
    }
    if (s->ckpt || s->ck_open) { /* one at a time: with shards, until each confirmed its part */
        s->ckpt_again = true;
        if (epoch_done) {
            s->again_epoch_done = true;
            s->again_epoch = s->epoch;
            s->again_steps = s->store.steps;
        }
        return;
    }
    if (sharded(s) && !shards_ready(s)) { /* a part alone is no checkpoint, and nothing has trained yet */
        PS_WARN("no checkpoint taken: not every psd shard has joined (and resumed) yet");
        return;
    }
    psd_ckpt_meta_t m = {
        .run_id = s->run_id, .config_hash = s->config_hash, .seed = s->cfg.seed,
        .step = s->store.steps, .version = s->store.cur->version, .epoch = s->epoch,
        .epoch_done = epoch_done, .epoch_step = s->epoch_step, .steps_per_epoch = s->spe,
        .ep_loss = s->ep_loss, .ep_correct = s->ep_correct, .ep_samples = s->ep_samples,
        .train_s_total = s->train_s_total + (s->phase == PHASE_TRAIN ? ps_now() - s->t_epoch : 0),
        .samples_total = s->samples_total, .lr = s->lr, .train_count = s->train_count,
        .n_sizes = s->layout.n_sizes, .opt_kind = (uint32_t)s->cfg.opt,
        .n_slots = (uint32_t)psd_optim_slots(&s->store.opt), .n_params = s->layout.n_params,
        .shard = 0, .shards = (uint32_t)s->n_shards, .keep_step = sharded(s) ? s->ck_safe : 0};
    memcpy(m.sizes, s->layout.sizes, sizeof m.sizes);
    if (s->layout.table >= 0) {
        m.table_rows = (uint64_t)s->layout.t[s->layout.table].rows;
        m.table_dim = (uint32_t)s->layout.t[s->layout.table].cols;
    }
    int rc = psd_ckpt_begin(&s->ckpt, s->run_dir, psd_ckpt_keep(&s->cfg, s->n_shards), &m, s->seen, &s->store);
    if (rc != 0) {
        PS_ERROR("cannot start a checkpoint in %s: %s", s->run_dir, strerror(-rc));
        s->ckpt = NULL;
        return;
    }
    s->ck_step = m.step;
    s->ck_version = m.version;
    s->ck_fail[0] = '\0';
    for (int i = 1; i < s->n_shards; i++) s->shards[i].ck_acked = false;
    if (sharded(s)) { /* every shard writes its part of the same step */
        Psd__Header h;
        Psd__ShardCkpt ck = PSD__SHARD_CKPT__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_CKPT;
        ck.step = s->store.steps;
        ck.version = s->store.cur->version;
        ck.keep_step = s->ck_safe;
        h.body_case = PSD__HEADER__BODY_SHARD_CKPT;
        h.shard_ckpt = &ck;
        shards_send_all(s, &h);
    }
}

/* The checkpoint asked for while another was written: now (an epoch's end
 * if it was one and nothing trained since). */
static void take_again(srv_t *s)
{
    bool epoch_done = s->again_epoch_done && s->again_epoch == s->epoch && s->again_steps == s->store.steps;
    s->ckpt_again = false;
    s->again_epoch_done = false;
    take_checkpoint(s, epoch_done);
}

/* psctl checkpoint: answer whoever waits (why "": written). */
static void ctl_answer(srv_t *s, const char *why)
{
    char msg[PS_PATH_MAX + 480];
    snprintf(msg, sizeof msg, !why[0] ? "checkpoint written: %s" : "checkpoint failed: %s", !why[0] ? s->ck_path : why);
    for (int i = 0; i < s->n_ctl_wait; i++)
        control_reply(s, s->ctl_wait[i].ident, s->ctl_wait[i].ident_len, !why[0], msg, NULL);
    s->n_ctl_wait = 0;
}

/* The checkpoint is written, or failed: every part of it (shard 0's, then
 * each shard's confirmation). Stop if asked, start the next one if asked,
 * answer psctl once none is coming. `unconfirmed`: psd exits without
 * every shard's confirmation (a failure: the parts may be missing). */
static void ckpt_complete(srv_t *s, bool unconfirmed)
{
    s->ck_open = false;
    char why[sizeof s->ck_fail];
    if (s->ck_rc != 0) snprintf(why, sizeof why, "%s", strerror(-s->ck_rc));
    else if (s->ck_fail[0]) snprintf(why, sizeof why, "%s", s->ck_fail);
    else if (unconfirmed) snprintf(why, sizeof why, "psd exited before every psd shard confirmed its part");
    else why[0] = '\0';
    if (unconfirmed && !s->ck_rc && !s->ck_fail[0])
        PS_WARN("psd exits before every psd shard confirmed its part of checkpoint %" PRIu64, s->ck_step);
    if (!why[0]) {
        if (sharded(s)) PS_INFO("checkpoint of step %" PRIu64 " written by all %d psd shards", s->ck_step, s->n_shards);
        s->ckpts_written++;
        s->ckpt_last_t = ps_now();
        s->ck_safe = s->ck_step;
    }
    if (s->stop_when_written && s->ckpt_again && !why[0]) {
        /* asked for while another was written (the stop itself, or the
         * epoch's end before --stop-after-epoch): the stop's checkpoint is
         * of the state now, not of the one written */
        take_again(s);
        if (s->ckpt || s->ckpt_deferred) return;
        snprintf(why, sizeof why, "the checkpoint of the state at the stop could not be started");
    }
    if (s->stop_when_written) {
        ctl_answer(s, why);
        if (why[0]) /* nothing to resume from: say so, and fail */
            finish(s, PSD_EXIT_ERROR, "psd stopped; its checkpoint failed");
        else
            finish(s, 0,
                   s->stopping > 0 ? "psd was stopped; checkpoint saved" : "psd stopped as asked; checkpoint saved");
        return;
    }
    if (s->ckpt_again) {
        if (sharded(s) && s->phase == PHASE_DONE) { /* the shards have stopped: a part alone is no checkpoint */
            s->ckpt_again = false;
            PS_WARN("the checkpoint asked for while another was written is not taken: the psd shards have stopped");
        } else {
            take_again(s);
        }
    }
    if (!s->ckpt && !s->ckpt_deferred) ctl_answer(s, why); /* none coming for them: this was theirs */
    if (s->end_when_written && !s->ckpt && s->phase != PHASE_DONE) end_run(s);
}

/* The writer finished: log; once every shard confirmed its part (wait:
 * psd exits, it does not wait for them), the checkpoint is complete. */
static void poll_checkpoint(srv_t *s, bool wait)
{
    if (s->ckpt) {
        if (!wait && !psd_ckpt_done(s->ckpt)) return;
        double secs = 0;
        uint64_t bytes = 0, peak = 0;
        s->ck_rc = psd_ckpt_end(&s->ckpt, s->ck_path, sizeof s->ck_path, &secs, &bytes, &peak);
        s->ck_open = true;
        if (s->ck_rc != 0) PS_ERROR("checkpoint failed: %s", strerror(-s->ck_rc));
        else
            PS_INFO("checkpoint %s: %.1f MB in %.2f s, peak extra memory %.1f MB%s", s->ck_path, (double)bytes / 1e6,
                    secs, (double)peak / 1e6, sharded(s) ? " (shard 0's part)" : "");
    }
    if (!s->ck_open) return;
    bool confirmed = true;
    for (int i = 1; i < s->n_shards; i++) confirmed &= s->shards[i].ck_acked;
    if (confirmed || wait) ckpt_complete(s, !confirmed && s->ck_rc == 0);
}

/* A shard's part of the checkpoint being taken is written, or failed. */
static void on_shard_ckpt_done(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardCkpt *ck = m->hdr->shard_ckpt;
    shard_t *sh = &s->shards[i];
    if ((!s->ckpt && !s->ck_open) || ck->step != s->ck_step || sh->ck_acked) {
        drop_shard(s, i, "CKPT_DONE for step %" PRIu64 " (taking %s%" PRIu64 ")", ck->step,
             s->ckpt || s->ck_open ? "" : "none after ", s->ck_step);
        return;
    }
    sh->ck_acked = true;
    if (ck->error && ck->error[0]) {
        PS_ERROR("psd shard %d (%s pid %u) could not write its part of checkpoint %" PRIu64 ": %s", i, sh->hostname,
                 sh->pid, ck->step, ck->error);
        if (!s->ck_fail[0])
            snprintf(s->ck_fail, sizeof s->ck_fail, "psd shard %d could not write its part: %.300s", i, ck->error);
    }
    poll_checkpoint(s, false);
}

/* ---- message handlers --------------------------------------------------- */

static void send_assign(srv_t *s, worker_t *w)
{
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
    Psd__CtrTask ct = PSD__CTR_TASK__INIT;
    if (s->cfg.kind == PS_MODEL_CTR) { /* no files: the generator */
        a.n_files = 0;
        ct.fields = (uint32_t)s->cfg.ctr_fields;
        ct.per_field = (uint32_t)s->cfg.ctr_per_field;
        ct.vocab = (uint64_t)s->cfg.ctr_vocab;
        ct.zipf = s->cfg.ctr_zipf;
        ct.rows = (uint64_t)s->cfg.ctr_rows;
        ct.dim = (uint32_t)s->cfg.ctr_dim;
        ct.mean = s->cfg.ctr_mean;
        ct.weight_std = s->cfg.ctr_weight_std;
        ct.bias = s->cfg.ctr_bias;
        ct.seed = s->cfg.ctr_seed;
        ct.train = (uint64_t)s->cfg.ctr_train;
        ct.test = (uint64_t)s->cfg.ctr_test;
        ct.table_on_psd = s->table_on_psd;
        a.ctr = &ct;
    }
    hy.batch_size = (uint32_t)s->cfg.batch_size;
    hy.val_batch_size = (uint32_t)s->cfg.val_batch_size;
    hy.norm_mean = s->cfg.norm_mean;
    hy.norm_std = s->cfg.norm_std;
    hy.train_limit = (uint64_t)s->cfg.train_limit;
    hy.epochs = (uint32_t)s->cfg.epochs;
    hy.seed = s->cfg.seed;
    hy.sync = (uint32_t)s->cfg.sync;
    hy.staleness = (uint32_t)s->cfg.staleness;
    hy.sparse_threshold = s->cfg.sparse_threshold;
    a.hyper = &hy;
    /* how long a worker waits for psd before it registers again */
    a.start_timeout_s = s->cfg.start_timeout + 10;
    a.step_timeout_s = s->silence * 3 + 10;
    a.silence_s = s->silence;
    a.tcp_congestion = s->cfg.tcp_congestion;
    a.grad_dtype = s->cfg.wire_gradients == PS_WIRE_BF16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32;
    a.weight_dtype = s->cfg.wire_weights == PS_WIRE_BF16 ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32;
    if (s->stream) a.stream_chunk_bytes = (uint64_t)s->store.chunk_bytes;
    char *eps[PS_MAX_SHARDS];
    if (sharded(s)) { /* where its other parts are */
        for (int i = 1; i < s->n_shards; i++) eps[i - 1] = s->shards[i].endpoint;
        a.shard_endpoints = eps;
        a.n_shard_endpoints = (size_t)(s->n_shards - 1);
        a.shard_token.data = w->shard_token;
        a.shard_token.len = sizeof w->shard_token;
    }
    if (s->shm && strcmp(w->host_id, s->host_id) == 0) { /* same host: offer shared memory */
        a.shm_socket = s->shm_name;
        a.shm_token.data = w->shm_token;
        a.shm_token.len = sizeof w->shm_token;
    }
    h.body_case = PSD__HEADER__BODY_ASSIGN;
    h.assign = &a;
    send_to(s, w, &h, NULL, 0);
}

/* A slot for a new worker: the next one never used, or once all
 * max_workers were taken, the one gone longest whose worker has given psd
 * up and that holds nothing: no push or chunks of one, no parameter slot,
 * no shared region, no validation part. A worker waits s->silence * 3 + 10
 * s for psd while it trains (ASSIGN's step timeout), then registers again;
 * one that sends after its slot was given away is told to register again
 * as a stranger of this run (handle). The gone slot of the registering
 * worker's own identity (`own`, maybe NULL) is taken first, whatever its
 * age: that worker is the one registering. NULL: none. */
static bool slot_holds_nothing(const srv_t *s, const worker_t *w)
{
    if (w->state != W_GONE || w->has_push || w->push_started || w->st_member || w->n_gch || w->grad_mask ||
        w->hold || w->shm_grad || w->val_pending)
        return false;
    for (int j = 0; j < s->n_parts; j++)
        if (!s->parts[j].done && s->parts[j].worker == (int)(w - s->w)) return false;
    return true;
}

/* A connection of the ROUTER closed (its monitor's event): the workers
 * whose messages came on it are lost at the next tick (reap_closed), not
 * here: this runs inside a message's handling too (note_conn). */
static void conn_closed(void *arg, int fd)
{
    srv_t *s = arg;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].conn == fd + 1 && s->w[i].state != W_GONE) {
            s->w[i].conn = 0;
            s->w[i].conn_closed = true;
        }
    for (int i = 1; i < s->n_shards; i++)
        if (s->shards[i].conn == fd + 1 && s->shards[i].joined) {
            s->shards[i].conn = 0;
            s->shards[i].conn_closed = true;
        }
}

static void poll_monitor(srv_t *s) { psd_router_monitor(s->mon, &s->hs_failed, conn_closed, s); }

/* The connection a peer's (a worker's, a shard's) message m came on, into
 * *conn. A new one (its first message, or it reconnected) is taken once the
 * monitor's events so far are read: an event about an fd number is then
 * about a connection that held it before, whose close the monitor reported
 * before this one could open. It gets server.tcp_congestion then. */
static void note_conn(srv_t *s, int *conn, const ps_msg_t *m)
{
    if (m->srcfd < 0 || *conn == m->srcfd + 1) return;
    if (s->mon) poll_monitor(s);
    ps_tcp_cc_conn(conn, m->srcfd, s->cfg.tcp_congestion, true); /* sets *conn unless the setting is off */
    *conn = m->srcfd + 1;
}

static void drain(srv_t *s);

/* A worker whose connection closed is lost at once (a process that ends,
 * killed or crashed, has its connections closed by its kernel): nobody
 * waits worker_timeout for it; a psd shard's closed connection ends the
 * run at once, as its silence would. One still alive reconnects, is told it was
 * declared lost, and registers again, as after a timeout. Workers lost in
 * the same tick are given nothing of each other's (hand_out, take_pool and
 * least_busy pass over conn_closed). */
static void reap_closed(srv_t *s, double now)
{
    bool any = false;
    for (int i = 0; i < s->n; i++) any |= s->w[i].conn_closed;
    for (int i = 1; i < s->n_shards; i++) any |= s->shards[i].conn_closed;
    if (!any) return;
    drain(s); /* their last words first (a LEAVE, an ERROR): queued before their connection closed */
    for (int i = 1; i < s->n_shards && s->phase != PHASE_DONE; i++) {
        shard_t *sh = &s->shards[i];
        if (!sh->conn_closed) continue;
        sh->conn_closed = false;
        if (!sh->joined) continue;
        PS_ERROR("psd shard %d (%s pid %u) lost: its connection closed, %.1f s after its last message; its part of "
                 "the parameters is gone, so the run stops", i, sh->hostname, sh->pid, now - sh->last_seen);
        sh->joined = false;
        finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was lost");
        return;
    }
    for (int i = 0; i < s->n && s->phase != PHASE_DONE; i++) {
        worker_t *w = &s->w[i];
        if (!w->conn_closed) continue;
        w->conn_closed = false;
        if (w->state == W_GONE) continue;
        PS_WARN("rank %u (%s pid %u) lost: its connection closed, %.1f s after its last message, while %s; going "
                "on without it",
                w->rank, w->hostname, w->pid, now - w->last_seen, wstate_name[w->state]);
        worker_gone(s, w);
    }
}

static worker_t *free_slot(srv_t *s, worker_t *own)
{
    if (s->n < s->max_workers) return &s->w[s->n];
    if (own && slot_holds_nothing(s, own)) return own;
    const double now = ps_now(), after = s->silence * 3 + 10;
    worker_t *best = NULL;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (now - w->gone_at >= after && slot_holds_nothing(s, w) && (!best || w->gone_at < best->gone_at)) best = w;
    }
    return best;
}

static void on_register(srv_t *s, ps_msg_t *m)
{
    Psd__Register *r = m->hdr->reg;
    const char *host = r->hostname && r->hostname[0] ? r->hostname : "?";
    worker_t *w = find_worker(s, m->ident, m->ident_len);
    if (w && w->state == W_ASSIGNED) { /* its REGISTER was sent twice: answer again */
        if (!w->assign_wait) send_assign(s, w);
        return;
    }
    if (w && w->state != W_GONE) { /* registering again while psd counts it in: it lost us */
        PS_WARN("rank %u (%s pid %u) registers again; taking it as a new worker", w->rank, w->hostname, w->pid);
        worker_gone(s, w);
    }
    worker_t *const own = w; /* its gone slot, if it had one */
    w = s->phase == PHASE_DONE ? NULL : free_slot(s, w);
    if (!w) {
        PS_WARN("refused a worker from %s pid %u: %s", host, r->pid,
                s->phase != PHASE_DONE ? "no free worker slot" : "the run is over");
        send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED,
                         s->phase != PHASE_DONE ? "psd has no free worker slot" : "the run is over");
        return;
    }
    const bool reused = w < s->w + s->n;
    const double gone_for = ps_now() - w->gone_at;
    { /* a reused slot's buffers are kept for the new worker, emptied */
        prange_t *ranges = w->ranges;
        zmq_msg_t *gch = w->gch;
        uint8_t *gch_in = w->gch_in;
        int cap_ranges = w->cap_ranges, n_gch_cap = w->n_gch_cap;
        memset(w, 0, sizeof *w);
        w->ranges = ranges;
        w->cap_ranges = cap_ranges;
        w->gch = gch;
        w->gch_in = gch_in;
        w->n_gch_cap = n_gch_cap;
        if (gch_in) memset(gch_in, 0, (size_t)n_gch_cap);
    }
    for (int i = 0; i < s->n; i++) /* a gone slot of the same identity (a worker that registers again) is
                                    * forgotten: its messages are this one's now, wherever the slots lie */
        if (&s->w[i] != w && s->w[i].ident_len == m->ident_len && memcmp(s->w[i].ident, m->ident, m->ident_len) == 0)
            s->w[i].ident_len = 0;
    memcpy(w->ident, m->ident, m->ident_len);
    w->ident_len = m->ident_len;
    w->rank = (uint32_t)(w - s->w);
    snprintf(w->hostname, sizeof w->hostname, "%s", host);
    snprintf(w->host_id, sizeof w->host_id, "%s", r->host_id && r->host_id[0] ? r->host_id : host);
    snprintf(w->device, sizeof w->device, "%s", r->device && r->device[0] ? r->device : "cpu");
    w->pid = r->pid;
    if (s->stream && !w->gch) { /* its chunks of a step (made once per worker slot) */
        w->gch = calloc((size_t)s->st_nc, sizeof *w->gch);
        w->gch_in = calloc((size_t)s->st_nc, 1);
        w->n_gch_cap = s->st_nc;
        if (!w->gch || !w->gch_in) {
            free(w->gch);
            free(w->gch_in);
            free(w->ranges);
            memset(w, 0, sizeof *w);
            if (reused) { /* free again, with nothing */
                w->state = W_GONE;
                w->gone_at = ps_now();
            }
            PS_WARN("refused a worker from %s pid %u: out of memory", host, r->pid);
            send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED, "psd is out of memory");
            return;
        }
    }
    w->state = W_ASSIGNED;
    if (s->shm && getrandom(w->shm_token, sizeof w->shm_token, 0) != (ssize_t)sizeof w->shm_token)
        memset(w->shm_token, 0, sizeof w->shm_token); /* an all-zero token is never accepted */
    if (sharded(s) && getrandom(w->shard_token, sizeof w->shard_token, 0) != (ssize_t)sizeof w->shard_token) {
        PS_ERROR("getrandom: %s", strerror(errno));
        finish(s, PSD_EXIT_ERROR, "psd failed");
        return;
    }
    w->last_seen = ps_now();
    w->seq_in = m->hdr->seq;
    note_conn(s, &w->conn, m);
    if (!reused) s->n++;
    s->registrations++;
    if (reused && w == own)
        PS_INFO("rank %u registers again in its own slot: every one of psd's %d worker slots was taken (%" PRIu64
                " registrations this run)",
                w->rank, s->max_workers, s->registrations);
    else if (reused)
        PS_INFO("rank %u is given to a new worker: every one of psd's %d worker slots was taken, and its last "
                "worker was lost %.0f s ago (%" PRIu64 " registrations this run)",
                w->rank, s->max_workers, gone_for, s->registrations);
    char dev[48];
    if (r->device_index >= 0) snprintf(dev, sizeof dev, "%s:%d", w->device, r->device_index);
    else snprintf(dev, sizeof dev, "%s", w->device);
    PS_INFO("worker registered: rank %u, %s pid %u, %s%s%s%s (%d ready before it)", w->rank, w->hostname, w->pid, dev,
            r->identity_hint && r->identity_hint[0] ? ", task " : "", r->identity_hint ? r->identity_hint : "",
            m->hdr->run_id ? ", rejoining" : "", live_workers(s));
    if (sharded(s) && !shards_ready(s)) { /* its ASSIGN names every shard */
        w->assign_wait = true;
        if (all_shards(s)) PS_INFO("rank %u waits for the psd shards to resume", w->rank);
        else
            PS_INFO("rank %u waits for %d more psd shard%s", w->rank, s->n_shards - 1 - shards_joined(s),
                    s->n_shards - 1 - shards_joined(s) == 1 ? "" : "s");
        return;
    }
    if (sharded(s)) shards_worker(s, w);
    send_assign(s, w);
}

/* ---- messages of the psd shards ----------------------------------------- */

static int find_shard(const srv_t *s, const uint8_t *ident, size_t len)
{
    for (int i = 1; i < s->n_shards; i++)
        if (s->shards[i].ident_len == len && memcmp(s->shards[i].ident, ident, len) == 0) return i;
    return -1;
}

static void refuse_shard(srv_t *s, ps_msg_t *m, const char *why)
{
    PS_ERROR("refused a psd shard: %s", why);
    send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED, why);
}

/* again: the shard said HELLO before and was answered (its answer may have
 * been lost): answer again, without logging a second join */
static void shards_go(srv_t *s);

static void on_shard_hello(srv_t *s, ps_msg_t *m, bool again)
{
    Psd__ShardHello *h = m->hdr->shard_hello;
    char why[320];
    if (!sharded(s)) {
        refuse_shard(s, m, "this psd was not started as shard 0 of several (--shard 0/N)");
        return;
    }
    if (s->zap && !psd_zap_is_self(s->zap, m->user)) { /* with keys: only psd's own key is a shard */
        refuse_shard(s, m, "a psd shard must connect with psd's own key (--key), not a worker's");
        return;
    }
    int i = (int)h->shard;
    if (h->shards != (uint32_t)s->n_shards || i < 1 || i >= s->n_shards) {
        snprintf(why, sizeof why, "it is shard %u/%u, this run has %d shards", h->shard, h->shards, s->n_shards);
        refuse_shard(s, m, why);
        return;
    }
    if (h->config_hash != s->config_hash || h->n_params != s->layout.n_params) {
        snprintf(why, sizeof why, "shard %d was started with another config (hash %016" PRIx64 ", shard 0's %016" PRIx64
                 "): give every shard the same config", i, h->config_hash, s->config_hash);
        refuse_shard(s, m, why);
        return;
    }
    bool resumed = s->opts.resume_dir != NULL;
    if ((bool)h->resume != resumed) {
        snprintf(why, sizeof why, resumed ? "shard 0 resumed run %016" PRIx64 " at step %" PRIu64
                                            ": start shard %d with --resume DIR too"
                                          : "shard 0 starts run %016" PRIx64 " (step %" PRIu64 "), but shard %d was "
                                            "started with --resume: resume shard 0 too, or start the shard without it",
                 s->run_id, s->store.steps, i);
        refuse_shard(s, m, why);
        return;
    }
    shard_t *sh = &s->shards[i];
    if (sh->joined) {
        snprintf(why, sizeof why, "shard %d has already joined (from %s pid %u)", i, sh->hostname, sh->pid);
        refuse_shard(s, m, why);
        return;
    }
    if (!h->endpoint || !h->endpoint[0] || strlen(h->endpoint) >= sizeof sh->endpoint) {
        refuse_shard(s, m, "no endpoint for the workers");
        return;
    }
    memcpy(sh->ident, m->ident, m->ident_len);
    sh->ident_len = m->ident_len;
    snprintf(sh->endpoint, sizeof sh->endpoint, "%s", h->endpoint);
    snprintf(sh->hostname, sizeof sh->hostname, "%s", h->hostname ? h->hostname : "?");
    sh->pid = h->pid;
    sh->last_seen = ps_now();
    sh->joined = true;
    sh->conn = 0; /* a new connection maybe under an fd number the last one had */
    note_conn(s, &sh->conn, m);
    Psd__Header r;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&r);
    r.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
    rb.shard = (uint32_t)i;
    rb.shards = (uint32_t)s->n_shards;
    rb.config_hash = s->config_hash;
    rb.n_params = s->layout.n_params;
    rb.resume = resumed;
    rb.resume_step = s->store.steps;
    rb.resume_version = s->store.cur->version;
    if (resumed) { /* it resumes at the newest of shard 0's steps it has */
        rb.resume_steps = s->resume_steps;
        rb.n_resume_steps = s->n_resume_steps;
        sh->resumed = false;
    }
    r.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    r.shard_hello = &rb;
    send_shard(s, i, &r, NULL, 0);
    if (again)
        PS_DEBUG("psd shard %d/%d said hello again (pid %u): answered again", i, s->n_shards, sh->pid);
    else
        PS_INFO("psd shard %d/%d joined from %s pid %u; workers reach it at %s", i, s->n_shards, sh->hostname,
                sh->pid, sh->endpoint);
    shards_go(s);
}

/* Every shard is there (and resumed): the workers that waited get their
 * ASSIGN. */
static void shards_go(srv_t *s)
{
    if (!shards_ready(s)) return;
    for (int j = 0; j < s->n; j++) { /* the workers that waited for it */
        worker_t *w = &s->w[j];
        if (w->state == W_GONE) continue;
        shards_worker(s, w);
        if (w->assign_wait) {
            w->assign_wait = false;
            w->last_seen = ps_now();
            send_assign(s, w);
        }
    }
}

static int resume_at(srv_t *s, uint64_t at_most);

/* Ask shard j to resume again, at the newest of shard 0's steps up to the
 * one it is at now. */
static void send_resume(srv_t *s, int j)
{
    Psd__Header h;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_RESUME;
    rb.shard = (uint32_t)j;
    rb.shards = (uint32_t)s->n_shards;
    rb.resume = true;
    rb.resume_step = s->store.steps;
    rb.resume_version = s->store.cur->version;
    rb.resume_steps = s->resume_steps;
    rb.n_resume_steps = s->n_resume_steps;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &rb;
    s->shards[j].resumed = false;
    send_shard(s, j, &h, NULL, 0);
}

/* Shard i resumed its part at a step (the newest of shard 0's it has), or
 * cannot. All go back to the oldest step any shard resumed at. */
static void on_shard_resumed(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardCkpt *ck = m->hdr->shard_ckpt;
    shard_t *sh = &s->shards[i];
    if (!s->opts.resume_dir || sh->resumed || shards_ready(s) || s->phase != PHASE_WAIT) {
        drop_shard(s, i, "RESUMED, which psd does not wait for");
        return;
    }
    if (ck->error && ck->error[0]) {
        PS_ERROR("psd shard %d (%s pid %u) cannot resume: %s", i, sh->hostname, sh->pid, ck->error);
        finish(s, PSD_EXIT_USAGE, "a psd shard cannot resume");
        return;
    }
    if (ck->step > s->store.steps) { /* it chose from a list shard 0 has gone back from since */
        PS_DEBUG("psd shard %d resumed at step %" PRIu64 "; shard 0 has gone back to %" PRIu64 ": again", i, ck->step,
                 s->store.steps);
        send_resume(s, i);
        return;
    }
    sh->resumed = true;
    sh->resumed_step = ck->step;
    sh->resumed_version = ck->version;
    if (ck->step < s->store.steps) { /* it has none as new: shard 0 and the others go back */
        PS_WARN("psd shard %d has no checkpoint of step %" PRIu64 " (its newest usable one is of step %" PRIu64
                "): every shard goes back to a step all of them have", i, s->store.steps, ck->step);
        if (resume_at(s, ck->step) != 0) {
            finish(s, PSD_EXIT_USAGE, "the psd shards have no checkpoint of one step");
            return;
        }
        for (int j = 1; j < s->n_shards; j++) {
            shard_t *o = &s->shards[j];
            if (o->joined && o->resumed && o->resumed_step != s->store.steps) send_resume(s, j);
        }
    }
    if (!shards_resumed(s)) return;
    for (int j = 1; j < s->n_shards; j++)
        if (s->shards[j].resumed_version != s->store.cur->version) {
            PS_ERROR("psd shard %d resumed step %" PRIu64 " at version %" PRIu64 ", shard 0 at %" PRIu64
                     ": their checkpoints are not of one run", j, s->store.steps, s->shards[j].resumed_version,
                     s->store.cur->version);
            finish(s, PSD_EXIT_USAGE, "the psd shards' checkpoints are not of one run");
            return;
        }
    PS_INFO("all %d psd shards resumed at step %" PRIu64, s->n_shards, s->store.steps);
    s->resume_agreed = true;
    s->ck_safe = s->store.steps; /* every shard has it */
    if (s->epoch >= (uint32_t)s->cfg.epochs) { /* the end of the run: only the weights file is left to write */
        PS_INFO("the shards' checkpoints are at the end of the run (%d epochs): nothing to train", s->cfg.epochs);
        s->epoch--; /* the last epoch trained, as the end of the run writes it */
        s->t_start = ps_now();
        run_end(s);
        return;
    }
    shards_go(s);
}

static void on_shard_norm(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardNorm *n = m->hdr->shard_norm;
    if (!s->stepping || n->version != s->store.cur->version || s->shards[i].norm_in) {
        drop_shard(s, i, "NORM for version %" PRIu64 " (current %" PRIu64 ")", n->version,
             s->store.cur->version);
        return;
    }
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, i, s->n_shards, p);
    size_t want = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) want += (p[t].n + PSD_NORM_BLOCK - 1) / PSD_NORM_BLOCK;
    if (n->n_block_sq != want) {
        drop_shard(s, i, "NORM with %zu blocks, it has %zu", n->n_block_sq, want);
        return;
    }
    for (size_t j = 0; j < want; j++)
        if (n->block_sq[j] < 0) { /* sums of squares (NaN or inf: a diverging gradient, as with one psd) */
            drop_shard(s, i, "NORM with a negative sum of squares");
            return;
        }
    size_t j = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) {
        size_t b = ps_layout_first_block(&s->layout, t) + p[t].off / PSD_NORM_BLOCK;
        for (size_t o = 0; o < p[t].n; o += PSD_NORM_BLOCK) s->store.blk_sq[b++] = n->block_sq[j++];
    }
    s->shards[i].norm_in = true;
    for (int k = 1; k < s->n_shards; k++)
        if (!s->shards[k].norm_in) return;
    /* every block's norm is in: the same sum, in the same order, as one psd */
    double sumsq = psd_store_sumsq(&s->store);
    Psd__Header h;
    Psd__ShardApply ap = PSD__SHARD_APPLY__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_APPLY;
    ap.version = s->store.cur->version;
    ap.sumsq = sumsq;
    h.body_case = PSD__HEADER__BODY_SHARD_APPLY;
    h.shard_apply = &ap;
    shards_send_all(s, &h);
    s->stepping = false;
    if (psd_store_apply(&s->store, sumsq, s->cfg.clip_norm, s->lr) != 0) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    step_done(s, true);
    deferred_checkpoint(s);
    maybe_step(s);
}

static void end_run(srv_t *s);

/* The sharded weights file cannot be finished: why, and no file. */
static void save_failed(srv_t *s, const char *why)
{
    PS_ERROR("%s", why);
    s->exit_code = PSD_EXIT_ERROR;
    ps_weights_abort(s->wr);
    s->wr = NULL;
}

/* The end of a sharded run with --save: the weights file is begun with this
 * shard's part; false (the error logged, the exit code set) when it cannot
 * be. */
static bool begin_save(srv_t *s)
{
    char err[512];
    ps_weights_meta_t meta = {.run_id = s->run_id, .step = s->step, .epoch = s->epoch};
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, 0, s->n_shards, p);
    s->wr = ps_weights_begin(s->cfg.save, &s->layout, &meta, err, sizeof err);
    bool ok = s->wr != NULL;
    for (int t = 0; ok && t < s->layout.n_tensors; t++)
        ok = ps_weights_put(s->wr, t, p[t].off, s->store.cur->w + s->layout.t[t].offset + p[t].off, p[t].n, err,
                            sizeof err) == 0;
    if (!ok) {
        save_failed(s, err);
        return false;
    }
    s->fetch_k = 0; /* fetch_next goes on to shard 1 */
    s->fetch_size = s->fetch_from = s->fetch_chunks = 0;
    return true;
}

/* Ask for the next chunk of the shards' parts, or, all in, write the file's
 * end and end the run. */
static void fetch_next(srv_t *s)
{
    while (s->fetch_from >= s->fetch_size && ++s->fetch_k < s->n_shards) { /* the next shard's part */
        ps_shard_pieces(&s->layout, s->fetch_k, s->n_shards, s->fetch_part);
        s->fetch_size = ps_part_size(s->fetch_part, s->layout.n_tensors);
        s->fetch_from = 0;
    }
    if (s->fetch_k < s->n_shards) {
        Psd__Header h;
        Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_FETCH;
        f.version = s->store.cur->version;
        f.from = s->fetch_from;
        const uint64_t chunk = s->opts.fetch_floats ? s->opts.fetch_floats : PSD_FETCH_FLOATS;
        f.count = s->fetch_count = s->fetch_size - s->fetch_from < chunk ? s->fetch_size - s->fetch_from : chunk;
        h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
        h.shard_fetch = &f;
        s->fetching_since = ps_now();
        s->fetch_chunks++;
        send_shard(s, s->fetch_k, &h, NULL, 0);
        return;
    }
    char err[512];
    int rc = ps_weights_commit(s->wr, err, sizeof err); /* frees it either way */
    s->wr = NULL;
    if (rc != 0)
        save_failed(s, err);
    else
        PS_INFO("saved weights (version %" PRIu64 ") to %s; the other shards' parts came in %" PRIu64 " chunks",
                s->store.cur->version, s->cfg.save, s->fetch_chunks);
    end_run(s);
}

/* A chunk of a shard's part of the final version (SHARD_FETCH): into the
 * weights file. */
static void on_shard_weights(srv_t *s, int i, ps_msg_t *m)
{
    if (!s->wr || i != s->fetch_k || m->hdr->weights->version != s->store.cur->version) {
        drop_shard(s, i, "WEIGHTS that psd did not ask for");
        return;
    }
    ps_piece_t r[PS_MAX_TENSORS];
    int nr = ps_part_range(s->fetch_part, s->layout.n_tensors, s->fetch_from, s->fetch_count, r);
    bool ok = nr == m->n_frames;
    for (int f = 0; ok && f < nr; f++) {
        size_t n = 0;
        const float *src = ps_msg_f32(m, f, &n);
        ok = src && m->hdr->tensors[f]->id == (uint32_t)r[f].t && m->hdr->tensors[f]->offset == r[f].off &&
             n == r[f].n;
        char err[512];
        if (ok && ps_weights_put(s->wr, r[f].t, r[f].off, src, n, err, sizeof err) != 0) {
            save_failed(s, err);
            end_run(s);
            return;
        }
    }
    if (!ok) { /* it answers a FETCH once: without its part there are no final weights */
        PS_ERROR("psd shard %d sent final weights that do not match its part of the parameters; the run stops", i);
        finish(s, PSD_EXIT_SHARD_LOST, "a psd shard sent a broken part of the weights");
        return;
    }
    s->fetch_from += s->fetch_count;
    fetch_next(s);
}

static void on_shard_have(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardHave *hv = m->hdr->shard_have;
    worker_t *w = hv->rank < (uint32_t)s->n ? &s->w[hv->rank] : NULL;
    if (!w || (w->state != W_TRAIN && w->state != W_BARRIER) || s->stepping || hv->version != s->store.cur->version) {
        /* a worker lost meanwhile, or declared gone: nothing to wait for */
        PS_DEBUG("shard %d has rank %u's push for version %" PRIu64 "; not needed", i, hv->rank, hv->version);
        return;
    }
    w->shard_have |= 1u << i;
    if (push_check(s, w)) maybe_step(s);
}

static void on_shard(srv_t *s, int i, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO) {
        bool again = false, was = i > 0 && s->shards[i].joined;
        if (i > 0) { /* its HELLO again: the answer was lost? answer again */
            const Psd__ShardHello *hh = m->hdr->shard_hello;
            again = was && s->shards[i].pid == hh->pid && hh->shard == (uint32_t)i;
            if (was && !again) {
                drop_shard(s, i, "HELLO on its connection as shard %u pid %u", hh->shard, hh->pid);
                return;
            }
            s->shards[i].joined = false;
        }
        on_shard_hello(s, m, again);
        if (was && !s->shards[i].joined) { /* refused now: it is no longer watched */
            PS_ERROR("psd shard %d said hello again and was refused; its part of the parameters is gone, so the "
                     "run stops", i);
            finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was refused");
        }
        return;
    }
    if (i < 0) return;
    shard_t *sh = &s->shards[i];
    if (h->run_id != s->run_id || h->rank != (uint32_t)i) {
        drop_shard(s, i, "run %016" PRIx64 " rank %u", h->run_id, h->rank);
        return;
    }
    sh->last_seen = ps_now();
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_HEARTBEAT: break;
    case PSD__MSG_TYPE__MSG_SHARD_HAVE: on_shard_have(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_NORM: on_shard_norm(s, i, m); break;
    case PSD__MSG_TYPE__MSG_WEIGHTS: on_shard_weights(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE: on_shard_ckpt_done(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_RESUMED: on_shard_resumed(s, i, m); break;
    case PSD__MSG_TYPE__MSG_ERROR:
        PS_ERROR("psd shard %d (%s pid %u) failed: %s", i, sh->hostname, sh->pid,
                 h->error->message ? h->error->message : "(no message)");
        sh->joined = false;
        finish(s, PSD_EXIT_SHARD_LOST, "a psd shard failed");
        break;
    default: drop_shard(s, i, "%s is not a message shards send", ps_msg_type_name((int)h->type));
    }
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
        shm_forget(s, w); /* its region, if it sent its hello: unmapped, and the slot free for reuse */
        rows_free(w);
        w->state = W_GONE;
        w->gone_at = ps_now();
        return;
    }
    if (r->shm && !w->shm_grad) {
        drop(s, w, "READY with shared memory psd did not set up");
        return;
    }
    if (r->shm) {
        w->shm = true;
        PS_INFO("rank %u exchanges tensors with psd through shared memory", w->rank);
    } else if (w->shm_grad) {
        shm_forget(s, w); /* it gave up on its side */
    }
    w->state = W_READY;
    if (s->stop_when_written || s->end_when_written || s->wr)
        return; /* stopping, writing the weights or the last checkpoint: nothing more to train */
    if (s->phase == PHASE_WAIT) {
        if (live_workers(s) >= s->cfg.workers) {
            if (s->epoch)
                PS_INFO("%d workers ready; training epochs %u to %d", live_workers(s), s->epoch + 1, s->cfg.epochs);
            else
                PS_INFO("%d workers ready; training %d epochs", live_workers(s), s->cfg.epochs);
            s->t_start = ps_now();
            start_epoch(s);
        }
        return;
    }
    /* joining a run under way: take samples waiting for a worker at once,
     * else wait for the next epoch */
    if (take_pool(s, w)) return;
    if (s->phase == PHASE_VALIDATE) {
        give_orphans(s); /* it is the least busy */
        if (w->state == W_VALIDATING) return;
    }
    PS_INFO("rank %u joins from epoch %u", w->rank, s->epoch + 2);
}

static void on_push(srv_t *s, worker_t *w, ps_msg_t *m);

static void on_barrier(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Barrier *b = m->hdr->barrier;
    if (b->epoch != s->epoch || (w->state != W_TRAIN && w->state != W_BARRIER)) {
        drop(s, w, "BARRIER for epoch %u while %s in epoch %u", b->epoch, wstate_name[w->state], s->epoch + 1);
        return;
    }
    if (b->samples < w->assigned) return; /* sent before it got more samples: it will come again */
    uint64_t done = w->consumed + (w->own_push ? w->push_batch : 0);
    if (b->samples != w->assigned || done != w->assigned) {
        drop(s, w, "BARRIER after %" PRIu64 " samples, psd counted %" PRIu64 " of %" PRIu64, b->samples, done,
             w->assigned);
        return;
    }
    if (w->state == W_TRAIN) {
        w->state = W_BARRIER;
        w->barrier_at = ps_now();
        maybe_step(s);
    }
}

static void on_val_result(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__ValResult *v = m->hdr->val_result;
    vpart_t *p = NULL;
    for (int i = 0; i < s->n_parts && s->phase == PHASE_VALIDATE; i++)
        if (s->parts[i].begin == v->begin && s->parts[i].worker == (int)(w - s->w) && !s->parts[i].done)
            p = &s->parts[i];
    if (!p || w->state != W_VALIDATING || v->epoch != s->epoch || v->version != s->store.cur->version) {
        drop(s, w, "VAL_RESULT for epoch %u version %" PRIu64 " from %" PRIu64 " while %s", v->epoch + 1,
             v->version, v->begin, wstate_name[w->state]);
        return;
    }
    if (v->count != p->end - p->begin || v->correct > v->count || !isfinite(v->loss_sum) || v->loss_sum < 0) {
        drop(s, w, "VAL_RESULT with invalid sums (count %" PRIu64 ", expected %" PRIu64 ")", v->count,
             p->end - p->begin);
        return;
    }
    if (s->cfg.kind == PS_MODEL_CTR && v->count > 0) { /* the click probabilities of the range, for the AUC */
        size_t n = 0;
        const float *sc = m->n_frames == 1 ? ps_msg_f32(m, 0, &n) : NULL;
        bool ok = sc && n == v->count;
        for (size_t i = 0; ok && i < n; i++) ok = sc[i] >= 0 && sc[i] <= 1; /* NaN fails too */
        if (!ok) {
            drop(s, w, "VAL_RESULT without the range's %" PRIu64 " scores in [0, 1]", v->count);
            return;
        }
        memcpy(s->val_scores + p->begin, sc, n * sizeof *sc);
    }
    p->loss = v->loss_sum;
    p->correct = v->correct;
    p->count = v->count;
    p->done = true;
    if (--w->val_pending == 0) w->state = W_VALIDATED;
    give_orphans(s);
    for (int i = 0; i < s->n_parts; i++)
        if (!s->parts[i].done) return;
    end_validation(s);
}

static void on_worker_error(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Error *e = m->hdr->error;
    PS_ERROR("rank %u (%s pid %u) failed: %s", w->rank, w->hostname, w->pid,
             e->message ? e->message : "(no message)");
    worker_gone(s, w);
}

static void on_leave(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Leave *l = m->hdr->leave;
    PS_INFO("rank %u (%s pid %u) left the run: %s", w->rank, w->hostname, w->pid,
            l->reason && l->reason[0] ? l->reason : "planned departure");
    worker_gone(s, w);
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
        const bool shard = h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO;
        if (shard) {
            host = h->shard_hello->hostname ? h->shard_hello->hostname : "?";
            pid = h->shard_hello->pid;
        }
        PS_WARN("refused a %s from %s pid %u: it speaks protocol %u, psd %u", shard ? "psd shard" : "worker", host, pid,
                h->protocol, PS_PROTOCOL_VERSION);
        char msg[128];
        snprintf(msg, sizeof msg, "psd speaks protocol %u, this %s %u", PS_PROTOCOL_VERSION,
                 shard ? "psd shard" : "worker", h->protocol);
        send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_PROTOCOL, msg);
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_CONTROL) {
        on_control(s, m);
        return;
    }
    int si = sharded(s) ? find_shard(s, m->ident, m->ident_len) : -1;
    if (si > 0 || h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO) {
        if (si > 0) note_conn(s, &s->shards[si].conn, m);
        on_shard(s, si, m);
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_REGISTER) {
        if (h->run_id != 0 && h->run_id != s->run_id) {
            char msg[160];
            snprintf(msg, sizeof msg, "this psd runs run %016" PRIx64 ", the worker belongs to run %016" PRIx64,
                     s->run_id, h->run_id);
            PS_WARN("refused a worker from %s pid %u: %s", h->reg->hostname ? h->reg->hostname : "?",
                    h->reg->pid, msg);
            send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_RUN, msg);
            return;
        }
        on_register(s, m);
        return;
    }
    worker_t *w = find_worker(s, m->ident, m->ident_len);
    if (!w) {
        drop(s, NULL, "%s from a peer that never registered", ps_msg_type_name((int)h->type));
        /* a worker of this run whose slot went to another (free_slot), or
         * from before a restart: told to register again (at most 10 a
         * second: a stranger's messages cost no more than one reply) */
        const double now = ps_now();
        if (h->run_id == s->run_id && h->type != PSD__MSG_TYPE__MSG_ERROR && h->type != PSD__MSG_TYPE__MSG_LEAVE &&
            now - s->stranger_reply_t >= 0.1) {
            s->stranger_reply_t = now;
            send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_LOST,
                             "psd does not know this worker (lost, its slot given to another); register again");
        }
        return;
    }
    if (w->state == W_GONE) {
        /* e.g. a worker that was frozen past the deadline wakes up: its
         * messages are never used; tell it, so that it registers again */
        if (w->lost_replies++ < 3 && h->type != PSD__MSG_TYPE__MSG_ERROR &&
            h->type != PSD__MSG_TYPE__MSG_LEAVE) {
            PS_WARN("rank %u (%s pid %u) was declared gone %.1f s ago; ignoring its %s", w->rank, w->hostname,
                    w->pid, ps_now() - w->gone_at, ps_msg_type_name((int)h->type));
            send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_LOST,
                             "psd declared this worker lost; register again to rejoin");
        }
        return;
    }
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
    note_conn(s, &w->conn, m);
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_READY: on_ready(s, w, m); break;
    case PSD__MSG_TYPE__MSG_PULL: on_pull(s, w, m); break;
    case PSD__MSG_TYPE__MSG_PUSH: on_push(s, w, m); break;
    case PSD__MSG_TYPE__MSG_BARRIER: on_barrier(s, w, m); break;
    case PSD__MSG_TYPE__MSG_VAL_RESULT: on_val_result(s, w, m); break;
    case PSD__MSG_TYPE__MSG_ERROR: on_worker_error(s, w, m); break;
    case PSD__MSG_TYPE__MSG_LEAVE: on_leave(s, w, m); break;
    case PSD__MSG_TYPE__MSG_HEARTBEAT: break; /* last_seen is all it is for */
    default: drop(s, w, "%s is not a message workers send", ps_msg_type_name((int)h->type));
    }
}

/* A peer that sends PS_BAD_IN_A_ROW bad messages in a row (malformed, or not
 * valid in its state) is cut off: libzmq 4.3 has no call to disconnect one
 * peer of a ROUTER, so psd shuts down the TCP connection the message came
 * from (ZMQ_SRCFD) after checking that the fd is still that peer's socket;
 * libzmq sees the connection end and forgets the peer. A registered worker cut
 * off is lost like any other (training goes on); an unknown peer may connect
 * again and is cut off again (logged at most every 1000th time). */
#define PS_BAD_IN_A_ROW 16

static bool same_peer(int fd, const char *addr)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (fd < 0 || getpeername(fd, (struct sockaddr *)&ss, &len) != 0) return false;
    char ip[INET6_ADDRSTRLEN] = "";
    if (ss.ss_family == AF_INET)
        inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, ip, sizeof ip);
    else if (ss.ss_family == AF_INET6)
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, ip, sizeof ip);
    else
        return ss.ss_family == AF_UNIX; /* ipc://: no address to compare */
    return addr[0] && strcmp(ip, addr) == 0;
}

static int bad_slot(srv_t *s, const ps_msg_t *m)
{
    for (int i = 0; i < s->n_bad; i++)
        if (s->bad[i].ident_len == m->ident_len && memcmp(s->bad[i].ident, m->ident, m->ident_len) == 0)
            return i;
    return -1;
}

static void bad_peer(srv_t *s, const ps_msg_t *m)
{
    if (m->ident_len == 0) return;
    int i = bad_slot(s, m);
    if (i < 0) {
        if (s->n_bad < (int)(sizeof s->bad / sizeof s->bad[0])) i = s->n_bad++;
        else { /* full: forget the peer with the fewest bad messages */
            i = 0;
            for (int j = 1; j < s->n_bad; j++)
                if (s->bad[j].bad < s->bad[i].bad) i = j;
        }
        memcpy(s->bad[i].ident, m->ident, m->ident_len);
        s->bad[i].ident_len = m->ident_len;
        s->bad[i].bad = 0;
        s->bad[i].cut_at = 0;
    }
    if (++s->bad[i].bad < PS_BAD_IN_A_ROW) return;
    uint32_t n = s->bad[i].bad;
    /* what it sent before its connection was cut is still arriving: libzmq
     * may already have closed that fd and given its number to a new peer */
    double t = ps_now();
    if (s->bad[i].cut_at > 0 && t - s->bad[i].cut_at < 2.0) return;
    s->bad[i].bad = 0;
    s->bad[i].cut_at = t;
    if (!same_peer(m->srcfd, m->peer)) return; /* its connection is already gone */
    worker_t *w = find_worker(s, m->ident, m->ident_len);
    s->cut++;
    if (s->cut <= 20 || s->cut % 1000 == 0) {
        if (w)
            PS_WARN("disconnected rank %u (%s pid %u, %s): %u bad messages in a row", w->rank, w->hostname, w->pid,
                    m->peer[0] ? m->peer : "?", n);
        else
            PS_WARN("disconnected a peer at %s: %u bad messages in a row%s", m->peer[0] ? m->peer : "?", n,
                    s->cut == 20 ? " (further ones logged every 1000th)" : "");
    }
    shutdown(m->srcfd, SHUT_RDWR);
    if (w && w->state != W_GONE) worker_gone(s, w);
}

static void good_peer(srv_t *s, const ps_msg_t *m)
{
    int i = bad_slot(s, m);
    if (i >= 0) s->bad[i] = s->bad[--s->n_bad];
}

static void drain(srv_t *s)
{
    while (s->phase != PHASE_DONE) {
        int events = 0;
        size_t len = sizeof events;
        if (zmq_getsockopt(s->sock, ZMQ_EVENTS, &events, &len) != 0) return;
        if (!(events & ZMQ_POLLIN)) return;
        ps_msg_t m;
        char why[256];
        int rc = ps_msg_recv_arena(s->sock, &m, true, ZMQ_DONTWAIT, &s->rx_arena, why, sizeof why);
        if (rc == -EAGAIN || rc == -EINTR) continue;
        s->cur_peer = m.peer;
        if (rc == -EPROTO) {
            drop(s, find_worker(s, m.ident, m.ident_len), "%s", why);
            bad_peer(s, &m);
            s->cur_peer = NULL;
            continue;
        }
        if (rc < 0) {
            PS_ERROR("receive failed: %s", zmq_strerror(-rc));
            finish(s, PSD_EXIT_ERROR, "psd failed");
            return;
        }
        s->cur_bad = false;
        handle(s, &m);
        if (s->cur_bad) bad_peer(s, &m);
        else if (s->n_bad) good_peer(s, &m);
        s->cur_peer = NULL;
        ps_msg_deinit(&m);
    }
}

static void on_poll(uv_poll_t *p, int status, int events)
{
    (void)status;
    (void)events;
    drain(p->data);
}

static void fmt_duration(char *out, size_t n, double s)
{
    long t = s > 0 && s < 1e7 ? (long)(s + 0.5) : 0;
    if (t >= 3600) snprintf(out, n, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(out, n, "%ld:%02ld", t / 60, t % 60);
}

/* "epoch 3/15 step 120/469 (26%) 31400 samples/s ETA 0:12 loss 0.4123
 * slowest rank 1 (12.3 ms)": where the epoch stands and who holds it up */
static void progress_text(srv_t *s, char *buf, size_t n, double now)
{
    double el = now - s->t_epoch, sps = el > 0 ? (double)s->ep_samples / el : 0;
    double left = s->spe - (double)s->epoch_step, eta = s->epoch_step ? el / (double)s->epoch_step * left : 0;
    char when[32], slow[64] = "";
    fmt_duration(when, sizeof when, eta);
    const worker_t *sw = NULL;
    int live = 0;
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        if (w->state != W_TRAIN && w->state != W_BARRIER) continue;
        live++;
        if (w->compute_ewma > 0 && (!sw || w->compute_ewma > sw->compute_ewma)) sw = w;
    }
    if (sw && live > 1) snprintf(slow, sizeof slow, " slowest rank %u (%.1f ms)", sw->rank, 1e3 * sw->compute_ewma);
    snprintf(buf, n, "epoch %u/%d step %" PRIu64 "/%.0f (%.0f%%) %.0f samples/s ETA %s loss %.4f%s", s->epoch + 1,
             s->cfg.epochs, s->epoch_step, s->spe, 100.0 * (double)s->epoch_step / s->spe, sps,
             s->epoch_step ? when : "?", s->last_loss, slow);
}

/* On a terminal a live line (refreshed by the 100 ms timer), else a plain
 * log line every server.progress_every seconds while an epoch trains. */
static void progress(srv_t *s, double now)
{
    char line[256];
    if (s->tty) {
        if (s->phase == PHASE_TRAIN) {
            progress_text(s, line, sizeof line, now);
            ps_log_status(line);
        } else if (s->phase == PHASE_VALIDATE) {
            int done = 0;
            for (int i = 0; i < s->n_parts; i++) done += s->parts[i].done;
            snprintf(line, sizeof line, "epoch %u/%d validating: %d/%d parts", s->epoch + 1, s->cfg.epochs, done,
                     s->n_parts);
            ps_log_status(line);
        }
        return;
    }
    if (s->cfg.progress_every <= 0 || s->phase != PHASE_TRAIN) {
        s->progress_next = 0;
        return;
    }
    if (s->progress_next == 0) s->progress_next = now + s->cfg.progress_every; /* not at the epoch's start */
    if (now < s->progress_next) return;
    s->progress_next = now + s->cfg.progress_every;
    progress_text(s, line, sizeof line, now);
    PS_INFO("%s", line);
}

/* Silence is counted only over time psd was there to hear (ps_hearing_t):
 * after its event loop was held up, peers' messages may wait unread in its
 * queue, and libuv runs the overdue timer before it reads them. (Only
 * hold-ups of half the limit on every tick, psd stepping that long each
 * time, would delay a silent worker's loss.) */
static double heard_at(const srv_t *s, double last) { return ps_heard_at(&s->hearing, last); }

static void on_timer(uv_timer_t *t)
{
    srv_t *s = t->data;
    double now = ps_now();
    double held = ps_hearing_tick(&s->hearing, now, s->silence);
    if (held >= s->silence) /* long enough to have lost everyone it waits for */
        PS_WARN("psd's event loop was held up for %.1f s; nobody is taken for lost for silence before %.1f s "
                "from now", held, s->silence);
    if (s->mon) poll_monitor(s);
    reap_closed(s, now);
    poll_checkpoint(s, false);
    psd_shm_expire(s->shm, now);
    progress(s, now);
    if (s->phase != PHASE_DONE) keep_alive(s, now);
    if (sharded(s) && s->phase != PHASE_DONE) {
        if (now - s->shard_hb >= 1.0) { /* they stop when shard 0 falls silent */
            Psd__Header h;
            Psd__Heartbeat hb;
            heartbeat_hdr(s, NULL, &h, &hb);
            shards_send_all(s, &h);
            s->shard_hb = now;
        }
        for (int i = 1; i < s->n_shards; i++) {
            shard_t *sh = &s->shards[i];
            /* an answer shard 0 waits for: its norms (clipping), its part of the final weights */
            const char *owed = NULL;
            double since = 0;
            if (s->stepping && !sh->norm_in)
                owed = "its part of the gradient's norm", since = s->stepping_since;
            else if (s->wr && i == s->fetch_k)
                owed = "its part of the final weights", since = s->fetching_since;
            if (owed && now - heard_at(s, since) >= s->silence) {
                PS_ERROR("psd shard %d (%s pid %u) did not send %s in %.1f s; the run stops", i, sh->hostname, sh->pid,
                         owed, now - since);
                finish(s, PSD_EXIT_SHARD_LOST, "a psd shard stopped answering");
                return;
            }
            if (!sh->joined || now - heard_at(s, sh->last_seen) < s->silence) continue;
            PS_ERROR("psd shard %d (%s pid %u) lost: nothing from it for %.1f s; its part of the parameters is "
                     "gone, so the run stops", i, sh->hostname, sh->pid, now - sh->last_seen);
            sh->joined = false;
            finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was lost");
            return;
        }
    }
    if (s->phase == PHASE_WAIT) {
        if (now > s->phase_deadline) {
            int ready = 0;
            for (int i = 0; i < s->n; i++) ready += s->w[i].state == W_READY;
            PS_ERROR("start timeout: %d of %d workers registered, %d ready after %.0f s%s", s->n, s->cfg.workers,
                     ready, s->cfg.start_timeout, sharded(s) && !all_shards(s)    ? " (not every psd shard joined)"
                     : sharded(s) && !shards_ready(s) ? " (not every psd shard resumed)"
                                                      : "");
            finish(s, PSD_EXIT_START_TIMEOUT, "not all workers came in time");
        }
    } else if (s->phase == PHASE_TRAIN || s->phase == PHASE_VALIDATE) {
        for (int i = 0; i < s->n && s->phase != PHASE_DONE; i++) {
            worker_t *w = &s->w[i];
            bool waited_for = (w->state == W_TRAIN && !w->has_push && !w->ssp_wait && !w->want_pull) ||
                              w->state == W_VALIDATING;
            if (w->own_push && !w->has_push && now - heard_at(s, w->own_push_at) >= s->silence) {
                /* a shard never got all of its push: it died between its messages */
                PS_WARN("rank %u (%s pid %u) lost: psd shards are missing part of its push for %.1f s; going on "
                        "without it", w->rank, w->hostname, w->pid, now - w->own_push_at);
                worker_gone(s, w);
                w->lost_silent = true;
                continue;
            }
            if (w->state == W_ASSIGNED && now - w->last_seen > s->cfg.start_timeout) {
                /* registered and never said its data was ready: its slot is not waited for */
                PS_WARN("rank %u (%s pid %u) registered %.0f s ago and never said it was ready; forgetting it",
                        w->rank, w->hostname, w->pid, now - w->last_seen);
                worker_gone(s, w);
                w->lost_silent = true;
                continue;
            }
            if (!waited_for || now - heard_at(s, w->last_seen) < s->silence) continue;
            time_t last = time(NULL) - (time_t)(now - w->last_seen);
            struct tm tm;
            char when[32];
            gmtime_r(&last, &tm);
            strftime(when, sizeof when, "%H:%M:%SZ", &tm);
            PS_WARN("rank %u (%s pid %u) lost: nothing from it for %.1f s (last message at %s) while %s; "
                    "going on without it",
                    w->rank, w->hostname, w->pid, now - w->last_seen, when, wstate_name[w->state]);
            worker_gone(s, w);
            w->lost_silent = true;
        }
        bool waiting = s->n_pool > 0 && live_workers(s) == 0, orphans = false;
        for (int i = 0; i < s->n_parts && s->phase == PHASE_VALIDATE; i++)
            orphans |= !s->parts[i].done && s->parts[i].worker < 0;
        waiting |= orphans && !least_busy(s); /* with live workers they wait for one to answer */
        if (waiting && s->phase != PHASE_DONE && now > s->orphan_deadline) {
            PS_ERROR("no worker came back within %.0f s to finish epoch %u", s->cfg.start_timeout, s->epoch + 1);
            take_checkpoint(s, false);
            poll_checkpoint(s, true);
            finish(s, PSD_EXIT_WORKER_LOST, "no workers left");
        }
    }
    drain(s);
}

/* ---- HTTP: /metrics, /status, /healthz ---------------------------------- */

static const char *phase_name(phase_t p)
{
    static const char *n[] = {"waiting", "training", "validating", "done"};
    return n[p];
}

static void metric(FILE *f, const char *name, const char *type, const char *help, double v)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
    if (isnan(v)) fprintf(f, "%s NaN\n", name); /* the exposition format's spelling */
    else fprintf(f, "%s %.17g\n", name, v);
}

static void histogram(FILE *f, const srv_t *s, const char *name, const char *help, bool wait)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        const uint64_t *h = wait ? w->h_wait : w->h_compute;
        uint64_t cum = 0;
        for (int b = 0; b <= PSD_HIST_N; b++) {
            cum += h[b];
            if (b < PSD_HIST_N) fprintf(f, "%s_bucket{rank=\"%u\",le=\"%g\"} %" PRIu64 "\n", name, w->rank, hist_le[b], cum);
            else fprintf(f, "%s_bucket{rank=\"%u\",le=\"+Inf\"} %" PRIu64 "\n", name, w->rank, cum);
        }
        fprintf(f, "%s_sum{rank=\"%u\"} %.9g\n%s_count{rank=\"%u\"} %" PRIu64 "\n", name, w->rank,
                wait ? w->h_wait_sum : w->h_compute_sum, name, w->rank, cum);
    }
}

static double epoch_sps(const srv_t *s, double now)
{
    if (s->phase != PHASE_TRAIN) return s->t_epoch > 0 && s->phase == PHASE_VALIDATE ? (double)s->ep_samples / s->t_epoch : 0;
    double el = now - s->t_epoch;
    return el > 0 ? (double)s->ep_samples / el : 0;
}

static void render_metrics(srv_t *s, FILE *f)
{
    double now = ps_now();
    int live = live_workers(s);
    metric(f, "psd_info", "gauge", "psd's run: 1 (labels in /status)", 1);
    metric(f, "psd_steps_total", "counter", "Optimizer steps applied in the run.", (double)s->step);
    metric(f, "psd_steps_in_place_total", "counter",
           "Versions made by updating the current parameters in place (nothing referenced them).",
           (double)s->store.in_place);
    metric(f, "psd_epoch", "gauge", "Epoch in progress, 1-based.", s->epoch + 1);
    metric(f, "psd_epochs", "gauge", "Epochs the run trains.", s->cfg.epochs);
    metric(f, "psd_epoch_progress_ratio", "gauge", "Part of the epoch's steps done.",
           s->spe > 0 ? (double)s->epoch_step / s->spe : 0);
    metric(f, "psd_train_loss", "gauge", "Mean training loss of the last step.", s->last_loss);
    metric(f, "psd_train_samples_total", "counter", "Training samples trained on in the run.",
           (double)(s->samples_total + (s->phase == PHASE_TRAIN ? s->ep_samples : 0)));
    metric(f, "psd_samples_per_second", "gauge", "Training samples per second in this epoch.", epoch_sps(s, now));
    metric(f, "psd_val_accuracy", "gauge", "Validation accuracy of the last validated epoch (NaN before one).",
           s->val_epoch_last ? s->val_acc_last : NAN);
    metric(f, "psd_val_loss", "gauge", "Validation loss of the last validated epoch (NaN before one).",
           s->val_epoch_last ? s->val_loss_last : NAN);
    metric(f, "psd_wire_received_bytes_total", "counter", "Tensor bytes received on the wire.",
           (double)(s->bytes_in_done + s->ep_bytes_in));
    metric(f, "psd_wire_sent_bytes_total", "counter", "Tensor bytes sent on the wire.",
           (double)(s->bytes_out_done + s->ep_bytes_out));
    metric(f, "psd_workers_live", "gauge", "Workers taking part in the run.", live);
    metric(f, "psd_workers_lost_total", "counter", "Workers lost, left or failed in the run.", (double)s->workers_lost);
    metric(f, "psd_shards", "gauge", "psd shards holding the parameters.", s->n_shards);
    if (s->cfg.sync != PS_SYNC_BSP) {
        metric(f, "psd_staleness_max", "gauge",
               "Most versions between a gradient's weights and the version it was applied to, this epoch.",
               (double)s->ep_stale_max);
        metric(f, "psd_staleness_mean", "gauge", "Mean staleness of the gradients applied this epoch (versions).",
               stale_mean(s));
    }
    metric(f, "psd_checkpoints_total", "counter", "Checkpoints written in this process.", (double)s->ckpts_written);
    metric(f, "psd_checkpoint_age_seconds", "gauge", "Seconds since the last checkpoint was written (NaN: none yet).",
           s->ckpt_last_t > 0 ? now - s->ckpt_last_t : NAN);
    fprintf(f, "# HELP psd_worker_up A worker of the run: 1 while it takes part.\n# TYPE psd_worker_up gauge\n");
    for (int i = 0; i < s->n; i++)
        fprintf(f, "psd_worker_up{rank=\"%u\",state=\"%s\"} %d\n", s->w[i].rank, wstate_name[s->w[i].state],
                s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED);
    histogram(f, s, "psd_worker_pull_wait_seconds",
              "Per worker: from asking for weights to receiving them (push, psd's step, the other workers).", true);
    histogram(f, s, "psd_worker_compute_seconds", "Per worker: from receiving weights to pushing the gradient.", false);
    fprintf(f, "# HELP psd_worker_barrier_wait_seconds_total Per worker: time spent waiting at epoch barriers.\n"
               "# TYPE psd_worker_barrier_wait_seconds_total counter\n");
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        double b = w->barrier_wait_s + (w->state == W_BARRIER && w->barrier_at > 0 ? now - w->barrier_at : 0);
        fprintf(f, "psd_worker_barrier_wait_seconds_total{rank=\"%u\"} %.9g\n", w->rank, b);
    }
}

static void json_str(FILE *f, const char *v)
{
    char buf[512];
    ps_json_escape(buf, sizeof buf, v);
    fprintf(f, "\"%s\"", buf);
}

static void json_num(FILE *f, double v) /* JSON has no NaN: null */
{
    if (isfinite(v)) fprintf(f, "%.9g", v);
    else fputs("null", f);
}

static void render_status(srv_t *s, FILE *f)
{
    double now = ps_now();
    fprintf(f, "{\"version\":\"%s\",\"protocol\":%u,\"run_id\":\"%016" PRIx64 "\",\"phase\":\"%s\"", PSD_VERSION,
            PS_PROTOCOL_VERSION, s->run_id, phase_name(s->phase));
    fprintf(f, ",\"epoch\":%u,\"epochs\":%d,\"step\":%" PRIu64 ",\"epoch_step\":%" PRIu64 ",\"steps_per_epoch\":",
            s->epoch + 1, s->cfg.epochs, s->step, s->epoch_step);
    json_num(f, s->spe);
    fputs(",\"train_loss\":", f);
    json_num(f, s->last_loss);
    fputs(",\"samples_per_s\":", f);
    json_num(f, epoch_sps(s, now));
    fprintf(f, ",\"val_epoch\":%u,\"val_acc\":", s->val_epoch_last);
    json_num(f, s->val_epoch_last ? s->val_acc_last : NAN);
    fputs(",\"val_loss\":", f);
    json_num(f, s->val_epoch_last ? s->val_loss_last : NAN);
    fprintf(f, ",\"lr\":");
    json_num(f, s->lr);
    fprintf(f, ",\"wire_bytes_in\":%" PRIu64 ",\"wire_bytes_out\":%" PRIu64 ",\"checkpoints\":%" PRIu64
               ",\"checkpoint_age_s\":",
            s->bytes_in_done + s->ep_bytes_in, s->bytes_out_done + s->ep_bytes_out, s->ckpts_written);
    json_num(f, s->ckpt_last_t > 0 ? now - s->ckpt_last_t : NAN);
    fprintf(f, ",\"uptime_s\":%.3f,\"workers_live\":%d,\"workers_lost\":%" PRIu64 ",\"workers\":[", now - s->t_boot,
            live_workers(s), s->workers_lost);
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        fprintf(f, "%s{\"rank\":%u,\"host\":", i ? "," : "", w->rank);
        json_str(f, w->hostname);
        fprintf(f, ",\"pid\":%u,\"device\":", w->pid);
        json_str(f, w->device);
        fprintf(f, ",\"state\":\"%s\",\"compute_ms\":", wstate_name[w->state]);
        json_num(f, 1e3 * w->compute_ewma);
        uint64_t steps = 0;
        for (int b = 0; b <= PSD_HIST_N; b++) steps += w->h_wait[b];
        fprintf(f, ",\"steps\":%" PRIu64 ",\"wait_ms_mean\":", steps);
        json_num(f, steps ? 1e3 * w->h_wait_sum / (double)steps : NAN);
        fprintf(f, ",\"samples\":%" PRIu64 ",\"assigned\":%" PRIu64 "}", w->consumed, w->assigned);
    }
    fprintf(f, "],\"config\":{\"layers\":[");
    for (int i = 0; i < s->cfg.n_sizes; i++) fprintf(f, "%s%d", i ? "," : "", s->cfg.sizes[i]);
    fprintf(f, "],\"params\":%zu,\"optimizer\":\"%s\",\"lr\":", s->layout.n_params, ps_opt_name(s->cfg.opt));
    json_num(f, s->cfg.lr);
    fprintf(f, ",\"schedule\":\"%s\",\"batch_size\":%d,\"workers\":%d,\"shards\":%d,\"seed\":%" PRIu64
               ",\"train_samples\":%zu,\"test_samples\":%zu,\"sync\":\"%s\",\"staleness\":%d}}\n",
            ps_sched_name(s->cfg.sched), s->cfg.batch_size, s->cfg.workers, s->n_shards, (uint64_t)s->cfg.seed,
            s->train_count, s->test_count, ps_sync_name(s->cfg.sync), s->cfg.staleness);
}

static int http_render(void *ud, const char *path, char **body, size_t *len, const char **ctype)
{
    srv_t *s = ud;
    FILE *f = open_memstream(body, len);
    if (!f) return 500;
    int code = 200;
    if (strcmp(path, "/metrics") == 0) {
        *ctype = "text/plain; version=0.0.4; charset=utf-8";
        render_metrics(s, f);
    } else if (strcmp(path, "/status") == 0) {
        *ctype = "application/json";
        render_status(s, f);
    } else if (strcmp(path, "/history") == 0) {
        *ctype = "application/json";
        fputs("{\"loss\":[", f);
        for (int i = 0; i < s->n_curve; i++)
            fprintf(f, "%s[%" PRIu64 ",%.6g]", i ? "," : "", s->curve[i].step,
                    isfinite(s->curve[i].loss) ? (double)s->curve[i].loss : 0.0);
        fputs("],\"epochs\":[", f);
        for (int i = 0; i < s->n_val_curve; i++)
            fprintf(f, "%s{\"epoch\":%u,\"step\":%" PRIu64 ",\"train_loss\":%.6g,\"val_loss\":%.6g,\"val_acc\":%.6g}",
                    i ? "," : "", s->val_curve[i].epoch, s->val_curve[i].step, (double)s->val_curve[i].train_loss,
                    (double)s->val_curve[i].val_loss, (double)s->val_curve[i].val_acc);
        fputs("]}\n", f);
    } else if (strcmp(path, "/") == 0 || strcmp(path, "/index.html") == 0) {
        *ctype = "text/html; charset=utf-8";
        fwrite(psd_page_html, 1, psd_page_html_len, f);
    } else if (strcmp(path, "/healthz") == 0) {
        fputs(s->phase == PHASE_DONE ? "done\n" : "ok\n", f);
    } else {
        code = 404;
        fputs("not found: /, /metrics, /status, /history, /healthz\n", f);
    }
    if (fclose(f) != 0) {
        free(*body);
        *body = NULL;
        return 500;
    }
    return code;
}

/* ---- psctl (MSG_CONTROL) ---------------------------------------------------- */

static void control_reply(srv_t *s, const uint8_t *ident, size_t len, bool ok, const char *text, const char *json)
{
    Psd__Header h;
    Psd__ControlReply r = PSD__CONTROL_REPLY__INIT;
    hdr_for(s, NULL, &h, PSD__MSG_TYPE__MSG_CONTROL_REPLY);
    r.ok = ok;
    r.text = (char *)(text ? text : "");
    r.json = (char *)(json ? json : "");
    h.body_case = PSD__HEADER__BODY_CONTROL_REPLY;
    h.control_reply = &r;
    ps_msg_send(s->sock, ident, len, &h, NULL, 0);
}

/* status and workers for people */
static void render_human(srv_t *s, FILE *f, bool workers_only)
{
    double now = ps_now();
    if (!workers_only) {
        fprintf(f, "psd %s run %016" PRIx64 ": %s, epoch %u/%d, step %" PRIu64 " (%" PRIu64 "/%.0f in the epoch)\n",
                PSD_VERSION, s->run_id, phase_name(s->phase), s->epoch + 1, s->cfg.epochs, s->step, s->epoch_step,
                s->spe);
        fprintf(f, "train loss %.4f, %.0f samples/s", s->last_loss, epoch_sps(s, now));
        if (s->val_epoch_last) fprintf(f, ", val_acc %.4f after epoch %u", s->val_acc_last, s->val_epoch_last);
        fprintf(f, "\nworkers %d live, %" PRIu64 " lost; shards %d; checkpoints %" PRIu64, live_workers(s),
                s->workers_lost, s->n_shards, s->ckpts_written);
        if (s->ckpt_last_t > 0) fprintf(f, " (last %.0f s ago)", now - s->ckpt_last_t);
        fputc('\n', f);
        if (s->cfg.sync != PS_SYNC_BSP) {
            fprintf(f, "%s", ps_sync_name(s->cfg.sync));
            if (s->cfg.sync == PS_SYNC_SSP) fprintf(f, " (staleness bound %d)", s->cfg.staleness);
            fprintf(f, ": staleness this epoch max %" PRIu64 ", mean %.2f versions\n", s->ep_stale_max,
                    stale_mean(s));
        }
    }
    fprintf(f, "%-5s %-20s %-8s %-10s %-11s %10s %10s %12s\n", "rank", "host", "pid", "device", "state", "compute",
            "wait", "samples");
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        uint64_t steps = 0;
        for (int b = 0; b <= PSD_HIST_N; b++) steps += w->h_wait[b];
        fprintf(f, "%-5u %-20.20s %-8u %-10.10s %-11s %8.1fms %8.1fms %5" PRIu64 "/%-6" PRIu64 "\n", w->rank,
                w->hostname, w->pid, w->device, wstate_name[w->state], 1e3 * w->compute_ewma,
                steps ? 1e3 * w->h_wait_sum / (double)steps : 0.0, w->consumed, w->assigned);
    }
}

static void on_control(srv_t *s, ps_msg_t *m)
{
    const char *cmd = m->hdr->control->command ? m->hdr->control->command : "";
    PS_DEBUG("psctl %s from %s", cmd, m->peer[0] ? m->peer : "?");
    if (strcmp(cmd, "status") == 0 || strcmp(cmd, "workers") == 0) {
        char *text = NULL, *json = NULL;
        size_t tl = 0, jl = 0;
        FILE *ft = open_memstream(&text, &tl), *fj = open_memstream(&json, &jl);
        if (ft) render_human(s, ft, cmd[0] == 'w');
        if (fj) render_status(s, fj);
        int bad = (ft ? fclose(ft) != 0 : 1) | (fj ? fclose(fj) != 0 : 1);
        bool ok = !bad;
        control_reply(s, m->ident, m->ident_len, ok, ok ? text : "out of memory", ok ? json : NULL);
        free(text);
        free(json);
        return;
    }
    if (strcmp(cmd, "checkpoint") == 0) {
        if (!s->cfg.ckpt_dir[0] || s->phase == PHASE_DONE) {
            control_reply(s, m->ident, m->ident_len, false,
                          s->phase == PHASE_DONE ? "the run is over" : "checkpoints are off (checkpoint.dir is empty)",
                          NULL);
            return;
        }
        if (s->n_ctl_wait == (int)(sizeof s->ctl_wait / sizeof s->ctl_wait[0])) {
            control_reply(s, m->ident, m->ident_len, false, "too many checkpoint requests waiting", NULL);
            return;
        }
        memcpy(s->ctl_wait[s->n_ctl_wait].ident, m->ident, m->ident_len);
        s->ctl_wait[s->n_ctl_wait++].ident_len = m->ident_len;
        PS_INFO("psctl asks for a checkpoint");
        take_checkpoint(s, false); /* answered when written (poll_checkpoint) */
        if (!s->ckpt && !s->ck_open && !s->ckpt_deferred) { /* could not start (else: started, or queued) */
            s->n_ctl_wait--;
            control_reply(s, m->ident, m->ident_len, false, "the checkpoint could not start (see psd's log)", NULL);
        }
        return;
    }
    if (strcmp(cmd, "stop") == 0) {
        control_reply(s, m->ident, m->ident_len, true,
                      s->cfg.ckpt_dir[0] ? "stopping: a checkpoint, then the workers are told to stop"
                                         : "stopping: the workers are told to stop (checkpoints are off)",
                      NULL);
        request_stop(s, SIGTERM, "psctl stop");
        return;
    }
    char msg[160];
    snprintf(msg, sizeof msg, "unknown command '%.40s' (status, workers, checkpoint, stop)", cmd);
    drop(s, NULL, "CONTROL: %s", msg);
    control_reply(s, m->ident, m->ident_len, false, msg, NULL);
}

/* server.http: start the endpoint (token from server.http_token_file;
 * beyond loopback only with a token, or --insecure). 0 or an exit code. */
static int start_http(srv_t *s)
{
    const ps_config_t *c = &s->cfg;
    char err[512];
    if (c->http_token_file[0]) {
        FILE *f = fopen(c->http_token_file, "r");
        struct stat st;
        if (!f || fstat(fileno(f), &st) != 0) {
            PS_ERROR("server.http_token_file %s: %s", c->http_token_file, strerror(errno));
            if (f) fclose(f);
            return PSD_EXIT_USAGE;
        }
        if (st.st_mode & 077) {
            PS_ERROR("server.http_token_file %s is readable by others (mode %03o): chmod 600 it", c->http_token_file,
                     (unsigned)(st.st_mode & 0777));
            fclose(f);
            return PSD_EXIT_USAGE;
        }
        if (!fgets(s->http_token, sizeof s->http_token, f)) s->http_token[0] = '\0';
        fclose(f);
        s->http_token[strcspn(s->http_token, "\r\n")] = '\0';
        if (strlen(s->http_token) < 16) {
            PS_ERROR("server.http_token_file %s: the token (its first line) must have at least 16 characters",
                     c->http_token_file);
            return PSD_EXIT_USAGE;
        }
    }
    bool loopback = false;
    if (psd_http_check(c->http, &loopback, err, sizeof err) != 0) {
        PS_ERROR("%s", err);
        return PSD_EXIT_USAGE;
    }
    if (!loopback && !s->http_token[0]) {
        if (!c->insecure) {
            PS_ERROR("refusing HTTP on %s without a token: set server.http_token_file (requests then need "
                     "\"Authorization: Bearer <token>\"), use a loopback address, or --insecure",
                     c->http);
            return PSD_EXIT_USAGE;
        }
        PS_WARN("*** --insecure: HTTP on %s without a token ***", c->http);
    }
    if (psd_http_start(&s->http, &s->loop, c->http, s->http_token, http_render, s, err, sizeof err) != 0) {
        PS_ERROR("%s", err);
        return PSD_EXIT_USAGE;
    }
    PS_INFO("HTTP on %s (port %d): / (live page) /metrics /status /history /healthz%s", c->http, psd_http_port(s->http),
            s->http_token[0] ? "; a bearer token is needed but for /healthz" : "");
    return 0;
}

/* SIGINT/SIGTERM or psctl stop (signum SIGTERM, what "psctl stop"):
 * checkpoint, tell the workers, exit 0; a second one exits at once. */
static void request_stop(srv_t *s, int signum, const char *what)
{
    if (s->stopping > 0 || !s->cfg.ckpt_dir[0]) {
        if (s->stopping > 0) PS_WARN("received %s again: exiting now", what);
        else PS_WARN("received %s: telling the workers to stop", what);
        finish(s, s->stopping > 0 ? 128 + signum : 0, "psd was stopped");
        return;
    }
    if (sharded(s) && !shards_ready(s)) { /* workers train only once every shard is there */
        PS_WARN("received %s before every psd shard joined: nothing trained since psd started, nothing to "
                "checkpoint", what);
        finish(s, 0, "psd was stopped before training began");
        return;
    }
    PS_WARN("received %s: writing a checkpoint, then telling the workers to stop (again to exit now)", what);
    s->stopping = signum;
    s->stop_when_written = true;
    if (s->ckpt || s->ck_open) s->ckpt_again = true; /* one of the state now, once that one is written */
    if (sharded(s)) { /* a shard stopped too waits for this checkpoint, however long it takes */
        Psd__Header h;
        Psd__ShardCkpt ck = PSD__SHARD_CKPT__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_CKPT;
        ck.stop = true; /* step 0: no checkpoint of its own (take_checkpoint asks for that) */
        h.body_case = PSD__HEADER__BODY_SHARD_CKPT;
        h.shard_ckpt = &ck;
        shards_send_all(s, &h);
    }
    if (s->ckpt || s->ck_open) return; /* its turn comes when that one is written (ckpt_complete) */
    take_checkpoint(s, false);
    if (!s->ckpt && !s->ckpt_deferred) finish(s, PSD_EXIT_ERROR, "psd was stopped; the checkpoint failed");
}

static void on_signal(uv_signal_t *h, int signum)
{
    srv_t *s = h->data;
    if (signum == SIGHUP) {
        char err[512];
        if (!s->zap) PS_WARN("received SIGHUP: no allow-list to reload (no authentication)");
        else if (psd_zap_reload(s->zap, err, sizeof err) != 0) PS_ERROR("allow-list not reloaded: %s", err);
        return;
    }
    if (signum == SIGUSR1) {
        PS_INFO("received SIGUSR1: writing a checkpoint");
        take_checkpoint(s, false);
        drain(s);
        return;
    }
    if (ps_stop_signal_note(signum) == 0) { /* the first one again at once: one request */
        PS_INFO("received %s again at once: the same request (timeout(1) signals a command and its process group)",
                strsignal(signum));
        return;
    }
    request_stop(s, signum, strsignal(signum));
    drain(s);
}

/* ---- set-up ------------------------------------------------------------- */

/* model.kind ctr: examples from the generator, no files. Logs the best
 * log-loss reachable on the test examples (the planted model's) and a
 * constant's (the test click rate's), the yardsticks of the validation loss. */
static int ctr_setup(srv_t *s)
{
    ps_ctr_t g;
    ps_ctr_from_config(&s->cfg, &g);
    s->train_count = (size_t)s->cfg.ctr_train;
    if (s->cfg.train_limit > 0 && (size_t)s->cfg.train_limit < s->train_count)
        s->train_count = (size_t)s->cfg.train_limit;
    s->test_count = (size_t)s->cfg.ctr_test;
    uint32_t rows[PS_CTR_MAX_IDS];
    double opt = 0;
    uint64_t clicks = 0;
    s->val_scores = malloc(s->test_count * sizeof *s->val_scores);
    s->test_labels = malloc(s->test_count);
    s->auc_order = malloc(s->test_count * sizeof *s->auc_order);
    if (!s->val_scores || !s->test_labels || !s->auc_order) {
        PS_ERROR("out of memory for %zu test examples", s->test_count);
        return -1;
    }
    for (size_t i = 0; i < s->test_count; i++) {
        double p = ps_ctr_example(&g, (uint64_t)s->cfg.ctr_train + i, rows, NULL, &s->test_labels[i]);
        opt += ps_logloss(p, s->test_labels[i]);
        clicks += s->test_labels[i];
        s->val_scores[i] = (float)p;
    }
    s->ctr_opt_auc = ps_auc(s->val_scores, s->test_labels, s->test_count, s->auc_order);
    double r = (double)clicks / (double)s->test_count;
    s->ctr_opt_loss = opt / (double)s->test_count;
    s->ctr_const_loss = ps_logloss(r, 1) * r + ps_logloss(r, 0) * (1 - r);
    PS_INFO("ctr task: %d fields x %d values from %lld (zipf %.2f), table %lld x %d; on the %zu test examples "
            "the planted model's log-loss is %.4f (AUC %.4f), a constant's %.4f (click rate %.4f)",
            g.fields, g.per_field, (long long)s->cfg.ctr_vocab, g.zipf, (long long)s->cfg.ctr_rows,
            s->cfg.ctr_dim, s->test_count, s->ctr_opt_loss, s->ctr_opt_auc, s->ctr_const_loss, r);
    return 0;
}

static int check_data(srv_t *s)
{
    if (s->cfg.kind == PS_MODEL_CTR) return ctr_setup(s);
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

static void close_cb(uv_handle_t *h) { (void)h; }

/* A worker's shared-memory hello (psd_shm.c): the worker it names must be
 * one psd offered shared memory to, still checking its data, with the
 * token of its ASSIGN; its region must be a size-sealed memfd of the
 * gradient's size. */
static int shm_hello(void *ud, const ps_shm_hello_t *h, int fd, char *why, size_t n)
{
    srv_t *s = ud;
    worker_t *w = h->rank < (uint32_t)s->n ? &s->w[h->rank] : NULL;
    uint8_t diff = 0;
    static const uint8_t zero[PS_SHM_TOKEN];
    if (w)
        for (int i = 0; i < PS_SHM_TOKEN; i++) diff |= (uint8_t)(h->token[i] ^ w->shm_token[i]);
    if (h->run_id != s->run_id || !w || diff || memcmp(w->shm_token, zero, sizeof zero) == 0 ||
        strcmp(w->host_id, s->host_id) != 0) {
        snprintf(why, n, "rank %u, run %016" PRIx64 ": no such worker was offered shared memory with that token",
                 h->rank, h->run_id);
        return -EACCES;
    }
    if (w->state != W_ASSIGNED || w->shm_grad) {
        snprintf(why, n, "rank %u is %s%s", w->rank, wstate_name[w->state], w->shm_grad ? " and has a region" : "");
        return -EALREADY;
    }
    size_t bytes = s->layout.n_params * sizeof(float);
    char bad[96];
    if (h->grad_bytes != bytes || ps_shm_check_sealed(fd, bytes, bad, sizeof bad) != 0) {
        snprintf(why, n, "rank %u's gradient region: %s", w->rank,
                 h->grad_bytes != bytes ? "wrong size" : bad);
        return -EINVAL;
    }
    void *p = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        snprintf(why, n, "rank %u's gradient region: mmap: %s", w->rank, strerror(e));
        return -e;
    }
    w->shm_grad = p;
    return 0;
}

/* Parameters in shared slots and the socket where workers on this host ask
 * for them. Without either, everyone uses the wire. */
static void start_shm(srv_t *s)
{
    ps_host_id(s->host_id, sizeof s->host_id);
    int rc = psd_store_share(&s->store);
    if (rc == 0) {
        snprintf(s->shm_name, sizeof s->shm_name, "psd-%016" PRIx64 "-%d", s->run_id, (int)getpid());
        rc = psd_shm_listen(&s->shm, &s->loop, s->shm_name, s->store.shm_ro_fd, PSD_MAX_ARENAS,
                            s->store.shm_slot_floats * sizeof(float), shm_hello, s);
    }
    if (rc != 0)
        PS_WARN("no shared memory for workers on this host (%s): they use the wire", strerror(-rc));
    else
        PS_INFO("shared memory for workers on this host: socket @%s", s->shm_name);
}

static void log_line(const char *line) { PS_WARN("%s", line); }

/* Checkpoints live in DIR/run-<run id>/, so that a new run in the same DIR
 * never mixes with (or prunes) another run's. --resume takes a run
 * directory, or DIR itself: then the run whose newest checkpoint is newest. */
static int resolve_resume_dir(const char *dir, char *out, size_t n)
{
    DIR *d = opendir(dir);
    if (!d) return -errno;
    struct dirent *e;
    double best_t = -1;
    bool has_ckpt = false;
    char best[PS_PATH_MAX] = "";
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "ckpt-", 5) == 0) has_ckpt = true;
        if (strncmp(e->d_name, "run-", 4) != 0) continue;
        char sub[PS_PATH_MAX];
        snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
        DIR *sd = opendir(sub);
        if (!sd) continue;
        struct dirent *f;
        while ((f = readdir(sd)) != NULL) {
            if (strncmp(f->d_name, "ckpt-", 5) != 0) continue;
            char fp[PS_PATH_MAX + 300];
            struct stat st;
            snprintf(fp, sizeof fp, "%s/%s", sub, f->d_name);
            if (stat(fp, &st) != 0) continue;
            double t = (double)st.st_mtim.tv_sec + 1e-9 * (double)st.st_mtim.tv_nsec;
            if (t > best_t) {
                best_t = t;
                snprintf(best, sizeof best, "%s", sub);
            }
        }
        closedir(sd);
    }
    closedir(d);
    snprintf(out, n, "%s", has_ckpt || !best[0] ? dir : best);
    return 0;
}

/* Why checkpoint m cannot be resumed as shard 0 of `shards` with model l and
 * optimizer o (resume and --check-config --resume alike), in why; NULL if
 * it can. The data's size is checked by resume only (it needs the data). */
static const char *ckpt_misfit(const psd_ckpt_meta_t *m, const ps_layout_t *l, const psd_optim_t *o, int shards,
                               char *why, size_t n)
{
    if (m->shards && (m->shard != 0 || m->shards != (uint32_t)shards)) { /* its other parts are elsewhere */
        snprintf(why, n, "it holds the part of psd shard %u of %u, and this psd is shard 0 of %d: resume with the "
                 "layout it was written with (--shard I/%u)", m->shard, m->shards, shards, m->shards);
        return why;
    }
    uint64_t rows = l->table >= 0 ? (uint64_t)l->t[l->table].rows : 0;
    if (m->n_params != l->n_params || m->n_sizes != l->n_sizes || memcmp(m->sizes, l->sizes, sizeof m->sizes) != 0 ||
        m->table_rows != rows || (rows && (int)m->table_dim != l->t[l->table].cols))
        return "its model does not match this config";
    if (m->n_slots != (uint32_t)psd_optim_slots(o) || m->opt_kind != (uint32_t)o->kind)
        return "its optimizer does not match this config";
    return NULL;
}

/* A checkpoint read (path) into the store and the run, if it fits: 0, or
 * PSD_EXIT_USAGE after saying why not. */
static int resume_apply(srv_t *s, const psd_ckpt_meta_t *m, const uint8_t *seen, const float *weights,
                        float *const slots[2], const char *path)
{
    char why[256];
    const char *misfit = ckpt_misfit(m, &s->layout, &s->store.opt, s->n_shards, why, sizeof why);
    if (m->config_hash != s->config_hash && !s->opts.force_resume) {
        PS_ERROR("cannot resume from %s: it was written with another config (hash %016" PRIx64
                 ", this one %016" PRIx64 "); use --force-resume to resume anyway",
                 path, m->config_hash, s->config_hash);
        return PSD_EXIT_USAGE;
    }
    if (misfit || m->train_count != s->train_count) {
        PS_ERROR("cannot resume from %s: %s", path, misfit ? misfit : "its data does not match this config");
        return PSD_EXIT_USAGE;
    }
    if (m->config_hash != s->config_hash) PS_WARN("resuming with another config, as forced");
    psd_store_load_part(&s->store, weights, (const float *const *)slots, m->n_slots); /* a shard: its part only */
    s->store.steps = m->step;
    s->store.cur->version = m->version;
    s->run_id = m->run_id;
    s->step = m->step;
    s->lr = m->lr;
    s->train_s_total = m->train_s_total;
    s->samples_total = m->samples_total;
    if (m->epoch_done) {
        s->epoch = m->epoch + 1;
        s->resumed_mid_epoch = false;
    } else {
        s->epoch = m->epoch;
        s->epoch_step = m->epoch_step;
        s->spe = m->steps_per_epoch;
        s->ep_loss = m->ep_loss;
        s->ep_correct = m->ep_correct;
        s->ep_samples = m->ep_samples;
        memcpy(s->seen, seen, (s->train_count + 7) / 8);
        s->resumed_mid_epoch = true;
    }
    PS_INFO("resuming run %016" PRIx64 " from %s: step %" PRIu64 ", epoch %u%s", s->run_id, path, s->step,
            s->epoch + 1, s->resumed_mid_epoch ? " (part done)" : "");
    /* epochs logged after that checkpoint are trained and logged again: the
     * metrics file keeps each epoch once */
    char err[PS_PATH_MAX + 200];
    if (s->cfg.metrics[0] && psd_metrics_trim(&s->metrics, s->cfg.metrics, s->run_id, s->epoch, err, sizeof err) < 0) {
        PS_ERROR("cannot resume: %s", err);
        return PSD_EXIT_USAGE;
    }
    s->resumed = true;
    s->resumed_step = m->step;
    /* the steps the psd shards may resume at: this one and older */
    s->n_resume_steps = psd_ckpt_steps(s->resume_dir, m->step, s->resume_steps, PSD_RESUME_STEPS_MAX);
    return 0;
}

/* This run's weights and metrics files are its own (psd_lock.h): 0, or
 * PSD_EXIT_USAGE after saying which file another psd holds. */
static int hold_outputs(srv_t *s)
{
    char err[PS_PATH_MAX + 400];
    const char *files[] = {s->cfg.save, s->cfg.metrics};
    for (int i = 0; i < 2; i++)
        if (files[i][0] && psd_lock_beside(&s->locks, files[i], err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            return PSD_EXIT_USAGE;
        }
    return 0;
}

/* --resume DIR: the newest valid checkpoint into the store and the run. */
static int resume(srv_t *s)
{
    psd_ckpt_meta_t m;
    uint8_t *seen = NULL;
    float *weights = NULL, *slots[2] = {NULL, NULL};
    char path[PS_PATH_MAX], err[512];
    int r = resolve_resume_dir(s->opts.resume_dir, s->resume_dir, sizeof s->resume_dir);
    if (r != 0) {
        PS_ERROR("cannot resume from %s: %s", s->opts.resume_dir, strerror(-r));
        return PSD_EXIT_USAGE;
    }
    /* a run still going writes there: refused. One only read (a copy on a
     * read-only disk) cannot be locked, and needs not be */
    if ((r = psd_lock_dir(&s->locks, s->resume_dir, err, sizeof err)) == -EWOULDBLOCK) {
        PS_ERROR("cannot resume from %s: %s", s->resume_dir, err);
        return PSD_EXIT_USAGE;
    }
    if (psd_ckpt_load_newest(s->resume_dir, &m, &seen, &weights, slots, path, sizeof path, log_line, err,
                             sizeof err) != 0) {
        PS_ERROR("cannot resume: %s", err);
        return PSD_EXIT_USAGE;
    }
    int rc = resume_apply(s, &m, seen, weights, slots, path);
    free(seen);
    free(weights);
    free(slots[0]);
    free(slots[1]);
    return rc;
}

/* psd shards: a shard has no checkpoint as new as the one shard 0 resumed
 * at. Back to the newest of shard 0's at or before step at_most: 0, or -1
 * after saying why none. Nothing has trained yet (workers wait for every
 * shard to resume). */
static int resume_at(srv_t *s, uint64_t at_most)
{
    uint64_t steps[PSD_RESUME_STEPS_MAX];
    size_t n = psd_ckpt_steps(s->resume_dir, at_most, steps, PSD_RESUME_STEPS_MAX);
    for (size_t k = 0; k < n; k++) {
        psd_ckpt_meta_t m;
        uint8_t *seen = NULL;
        float *weights = NULL, *slots[2] = {NULL, NULL};
        char path[PS_PATH_MAX], err[PS_PATH_MAX + 300];
        if (psd_ckpt_load_step(s->resume_dir, steps[k], &m, &seen, &weights, slots, path, sizeof path, err,
                               sizeof err) != 0) {
            PS_WARN("%s; trying an older one", err);
            continue;
        }
        int rc = m.run_id == s->run_id ? resume_apply(s, &m, seen, weights, slots, path) : PSD_EXIT_USAGE;
        if (m.run_id != s->run_id) PS_ERROR("%s is of another run than the one resumed", path);
        free(seen);
        free(weights);
        free(slots[0]);
        free(slots[1]);
        return rc == 0 ? 0 : -1;
    }
    PS_ERROR("cannot resume: shard 0 has no valid checkpoint in %s of step %" PRIu64 " or older, which every psd shard "
             "would need", s->resume_dir, at_most);
    return -1;
}

/* Close psd's sockets and end its ZeroMQ context, which returns once what
 * was queued (the workers' SHUTDOWN) is sent, or after the router's
 * linger: linger_ms, or -1 for the one set when it was opened (1 s). */
static void zmq_end(srv_t *s, int linger_ms)
{
    if (s->sock && linger_ms >= 0) zmq_setsockopt(s->sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
    ps_zmq_close_monitored(s->sock, s->mon);
    s->sock = s->mon = NULL;
    psd_zap_stop(&s->zap);
    if (s->zctx) zmq_ctx_term(s->zctx);
    s->zctx = NULL;
}

bool psd_table_on_psd(const ps_config_t *c, const ps_layout_t *l, bool lazy)
{
    return l->table >= 0 && lazy && (double)l->t[l->table].numel * 4.0 / 1048576.0 > c->ctr_worker_table_mb &&
           c->wire_weights == PS_WIRE_F32 && c->wire_gradients == PS_WIRE_F32;
}

int psd_ckpt_keep(const ps_config_t *c, int shards) { return shards > 1 && c->ckpt_keep < 2 ? 2 : c->ckpt_keep; }

/* Threads are sized by the CPUs psd may use (ps_cpus_usable: its affinity
 * mask and cgroup quota), not the host's: psd bound to 4 cores of a 64-core
 * node runs 4 step threads, not 16. */
int psd_step_threads(const ps_config_t *c)
{
    if (c->threads > 0) return c->threads;
    int cores = ps_cpus_usable(NULL, NULL);
    return cores > 16 ? 16 : cores;
}

int psd_io_threads(const ps_config_t *c)
{
    /* ZeroMQ's I/O threads receive and send the tensors: with several workers
     * pushing at once one thread is the bottleneck (2 workers over tcp: 3.0
     * GB/s with 1, 3.5 with 2 on a 2-core VM) */
    return c->io_threads > 0 ? c->io_threads : psd_io_threads_for(ps_cpus_usable(NULL, NULL));
}

int psd_io_threads_for(int cores) { return cores < 2 ? 1 : cores / 4 > 4 ? 4 : cores / 4 < 2 ? 2 : cores / 4; }

void *psd_zmq_context(const ps_config_t *c)
{
    void *ctx = zmq_ctx_new();
    int io = psd_io_threads(c);
    if (ctx && zmq_ctx_set(ctx, ZMQ_IO_THREADS, io) != 0)
        PS_WARN("zeromq: cannot use %d I/O threads: %s", io, zmq_strerror(zmq_errno()));
    return ctx;
}

double psd_transfer_s(size_t n_params)
{
    double s = 4.0 * (double)n_params / 40e6;
    return s < 57.0 ? s : 57.0;
}

double psd_silence_limit(const ps_config_t *c, size_t n_params)
{
    return c->worker_timeout + 2.0 * psd_transfer_s(n_params);
}

/* psd's ROUTER socket on `listen`: CURVE with the allow-list (failing
 * closed) when there is a key, else the loopback rule; socket options; bind.
 * allow_self: also let in psd's own key (psd shards). 0, or the exit code
 * (logged). */
int psd_router_open(void *zctx, const ps_config_t *c, const char *listen, int no_zap, size_t n_params, bool allow_self,
                    bool watch_closed, psd_locks_t *locks, void **sockp, psd_zap_t **zapp, void **monp)
{
    char why[400];
    int mon_events = watch_closed ? ZMQ_EVENT_DISCONNECTED : 0;
    *sockp = NULL;
    if (ps_endpoint_bindable(listen, why, sizeof why) != 0) { /* before keys: the first thing to fix */
        PS_ERROR("cannot listen on %s", why);
        return PSD_EXIT_USAGE;
    }
    *sockp = zctx ? zmq_socket(zctx, ZMQ_ROUTER) : NULL;
    if (!*sockp) {
        PS_ERROR("zeromq: %s", zmq_strerror(zmq_errno()));
        return PSD_EXIT_ERROR;
    }
    /* authentication: CURVE with an allow-list, failing closed */
    if (c->key_file[0]) {
        char err[512];
        ps_keypair_t kp;
        if (!c->allow_dir[0]) {
            PS_ERROR("server.key is set but server.allow is not: give the directory of allowed worker keys (--allow DIR)");
            return PSD_EXIT_USAGE;
        }
        if (ps_auth_load_secret(c->key_file, &kp, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            return PSD_EXIT_USAGE;
        }
        if (!no_zap) {
            *zapp = psd_zap_start(zctx, c->allow_dir, err, sizeof err);
            if (*zapp && allow_self) psd_zap_allow_self(*zapp, kp.public_z85);
            if (!*zapp) {
                PS_ERROR("%s", err);
                memset(&kp, 0, sizeof kp);
                return PSD_EXIT_USAGE;
            }
        }
        int on = 1;
        zmq_setsockopt(*sockp, ZMQ_CURVE_SERVER, &on, sizeof on);
        zmq_setsockopt(*sockp, ZMQ_CURVE_SECRETKEY, kp.secret_z85, 40);
        zmq_setsockopt(*sockp, ZMQ_ZAP_DOMAIN, "psd", 3);
        /* no handler (or a crashed one) means nobody gets in */
        int enforce = zmq_setsockopt(*sockp, ZMQ_ZAP_ENFORCE_DOMAIN, &on, sizeof on);
        memset(&kp, 0, sizeof kp);
        /* handshakes that fail before the ZAP handler sees them (a client
         * without encryption, or with the wrong server key) are logged too */
        mon_events |= ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL;
        if (enforce != 0) { /* fail closed: without it a missing handler would let everyone in */
            PS_ERROR("this libzmq cannot enforce authentication (ZMQ_ZAP_ENFORCE_DOMAIN: %s); refusing to run",
                     zmq_strerror(zmq_errno()));
            return PSD_EXIT_ERROR;
        }
    } else if (!ps_endpoint_is_loopback(listen)) {
        if (!c->insecure) {
            PS_ERROR("refusing to listen on %s without authentication. Make keys: `psd keygen server` and, per "
                     "worker host, `psd keygen worker1`; put worker1.pub in a directory DIR; run `psd --key "
                     "server.key --allow DIR` and `pworker --key worker1.key --server-key server.pub`. Or listen "
                     "on loopback (--listen tcp://127.0.0.1:PORT), or pass --insecure on a network you trust",
                     listen);
            return PSD_EXIT_USAGE;
        }
        PS_WARN("*** --insecure: listening on %s WITHOUT AUTHENTICATION: anyone who can reach this port can "
                "read the model or change it with one push ***",
                listen);
    }
    /* ZeroMQ's heartbeat counts only whole messages as traffic (libzmq issue
     * 2709): a peer whose PONG waits behind a message of the whole model
     * must not be taken for dead while it goes. 3 s, plus the model's
     * transfer time (a 1.28 GB model: 32 s), at most 60 s; the peer's TTL
     * twice that, at most 65 s (ZMTP carries it in deciseconds, 16 bits). */
    int one = 1, linger = 1000, hwm = 1000, ivl = 1000, tmo = (int)(3000 + 1000 * psd_transfer_s(n_params)),
        ttl = 2 * tmo < 65000 ? 2 * tmo : 65000;
    zmq_setsockopt(*sockp, ZMQ_ROUTER_MANDATORY, &one, sizeof one);
    zmq_setsockopt(*sockp, ZMQ_ROUTER_HANDOVER, &one, sizeof one); /* a worker reconnecting keeps its id */
    zmq_setsockopt(*sockp, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(*sockp, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(*sockp, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(*sockp, ZMQ_HEARTBEAT_IVL, &ivl, sizeof ivl);
    zmq_setsockopt(*sockp, ZMQ_HEARTBEAT_TIMEOUT, &tmo, sizeof tmo);
    zmq_setsockopt(*sockp, ZMQ_HEARTBEAT_TTL, &ttl, sizeof ttl);
    /* a message larger than the biggest legitimate one disconnects its sender */
    int64_t maxmsg = (int64_t)(4 * n_params + (size_t)(4 << 20));
    if (c->kind == PS_MODEL_CTR) maxmsg += 4 * c->ctr_test; /* a VAL_RESULT's scores */
    zmq_setsockopt(*sockp, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    ps_zmq_endpoint_opts(*sockp, listen);
    if (mon_events) *monp = ps_zmq_monitor(zctx, *sockp, "inproc://psd-monitor", mon_events);
    /* ZeroMQ would take over an ipc:// path another psd listens on (it
     * removes the socket file): refused as tcp's "address in use" is */
    char lerr[PS_PATH_MAX + 400];
    if (strncmp(listen, "ipc://", 6) == 0 && psd_lock_beside(locks, listen + 6, lerr, sizeof lerr) != 0) {
        PS_ERROR("cannot listen on '%s': %s", listen, lerr);
        return PSD_EXIT_USAGE;
    }
    if (zmq_bind(*sockp, listen) != 0) {
        PS_ERROR("cannot listen on '%s': %s", listen, zmq_strerror(zmq_errno()));
        return PSD_EXIT_USAGE;
    }
    return 0;
}

void psd_router_monitor(void *mon, uint64_t *refused, void (*on_closed)(void *arg, int fd), void *arg)
{
    uint16_t event;
    uint32_t value;
    while (ps_zmq_monitor_event(mon, &event, &value) == 0) {
        if (event == ZMQ_EVENT_DISCONNECTED) {
            if (on_closed) on_closed(arg, (int)value);
            continue;
        }
        ++*refused;
        if (*refused <= 20 || *refused % 1000 == 0)
            PS_WARN("refused a connection: %s handshake failed (code 0x%x): a client without encryption, or "
                    "with the wrong server key%s",
                    event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ? "CURVE" : "the", value,
                    *refused == 20 ? " (further ones logged every 1000th)" : "");
    }
}

int psd_server_run(const ps_config_t *c, const psd_run_opts_t *opts)
{
    srv_t *s = calloc(1, sizeof *s);
    if (!s) return PSD_EXIT_ERROR;
    int code = PSD_EXIT_ERROR;
    bool loop_ok = false;
    s->cfg = *c;
    s->opts = *opts;
    psd_metrics_init(&s->metrics);
    s->config_hash = ps_config_hash(c);
    s->run_id = make_run_id();
    s->w = calloc(MAX_WORKERS, sizeof *s->w);
    s->max_workers = opts->max_workers > 0 && opts->max_workers < MAX_WORKERS ? opts->max_workers : MAX_WORKERS;
    if (!s->w) goto out;
    if (ps_config_layout(c, &s->layout) != 0) {
        PS_ERROR("invalid model.layers");
        code = PSD_EXIT_USAGE;
        goto out;
    }
    if (check_data(s) != 0) {
        code = PSD_EXIT_USAGE;
        goto out;
    }
    size_t T = s->train_count ? s->train_count : 1;
    s->perm = malloc(T * sizeof *s->perm);
    s->pool = malloc(T * sizeof *s->pool);
    s->seen = calloc((T + 7) / 8, 1);
    s->step_g = calloc(MAX_WORKERS, sizeof *s->step_g);
    s->step_bf16 = calloc(MAX_WORKERS, sizeof *s->step_bf16);
    s->step_wt = calloc(MAX_WORKERS, sizeof *s->step_wt);
    s->step_rows = calloc(MAX_WORKERS, sizeof *s->step_rows);
    ps_arena_init(&s->rx_arena, s->rx_buf, sizeof s->rx_buf);
    psd_optim_t opt;
    psd_optim_from_config(&opt, c);
    if (!s->perm || !s->pool || !s->seen || !s->step_g || !s->step_bf16 || !s->step_wt || !s->step_rows || psd_store_init_part(&s->store, &s->layout, &opt, c->seed, 0, opts->shards) != 0) {
        PS_ERROR("out of memory for %zu parameters", s->layout.n_params);
        goto out;
    }
    int threads = psd_step_threads(c);
    if (psd_store_set_parallel(&s->store, threads, (size_t)c->chunk_bytes) != 0) {
        PS_ERROR("out of memory for the step's threads");
        goto out;
    }
    s->n_shards = opts->shards > 1 ? opts->shards : 1; /* the store owns shard 0's part (psd_store_init_part) */
    /* psd_main refuses streamed steps with shards. With an embedding table
     * they would step and send the table whole: the table's rows are worth
     * far more than overlapping the step (a 1M x 32 table: 128 MB a push
     * against a batch's rows), so psd steps whole and says so. */
    s->stream = c->stream && s->n_shards == 1 && s->layout.table < 0;
    if (c->stream && s->layout.table >= 0)
        PS_WARN("train.stream: the model has an embedding table, so steps are whole (not streamed): the table "
                "goes by rows, which a streamed step would send whole");
    /* the table stepped row by row (psd_rows.h): one psd, steps not
     * streamed, or psd shards whose pieces of it are all whole rows (else
     * rows straddle two shards: the table goes whole and is stepped densely) */
    if (s->layout.table >= 0 && !s->stream && (s->n_shards == 1 || ps_shards_table_rows(&s->layout, s->n_shards)) &&
        psd_store_lazy_table(&s->store, (size_t)c->workers * batch_rows(s), MAX_WORKERS) != 0) {
        PS_ERROR("out of memory for the table's row steps");
        goto out;
    }
    if (s->layout.table >= 0) {
        const double mb = (double)s->layout.t[s->layout.table].numel * 4.0 / 1048576.0;
        bool big = mb > c->ctr_worker_table_mb;
        s->table_on_psd = psd_table_on_psd(c, &s->layout, s->store.lazy);
        if (s->table_on_psd)
            PS_INFO("the embedding table (%.0f MiB) stays on psd: workers hold only the rows of their batch, "
                    "over the wire (ctr.worker_table_mb %g)", mb, c->ctr_worker_table_mb);
        else if (big)
            PS_WARN("the embedding table (%.0f MiB, over ctr.worker_table_mb %g) goes to every worker whole: a table "
                    "only psd holds needs its rows stepped lazily (one psd, or shards whose pieces are whole rows), "
                    "steps not streamed and f32 weights and gradients", mb,
                    c->ctr_worker_table_mb);
    }
    if (s->stream) {
        s->st_cf = ps_chunk_floats((size_t)c->chunk_bytes);
        s->st_nc = s->store.n_chunks;
        for (int t = 0, k = 0; t < s->layout.n_tensors; k += s->st_tchunks[t], t++) {
            s->st_tfirst[t] = k;
            s->st_tchunks[t] = (int)((s->layout.t[t].numel + s->st_cf - 1) / s->st_cf);
        }
        s->st_have = calloc((size_t)s->st_nc, sizeof *s->st_have);
        s->st_done = calloc((size_t)s->st_nc, 1);
        s->st_ready = calloc(ST_BATCH, sizeof *s->st_ready);
        s->st_rq = calloc((size_t)s->st_nc, sizeof *s->st_rq);
        s->st_src = calloc((size_t)ST_BATCH * MAX_WORKERS, sizeof *s->st_src);
        s->st_mem = calloc(MAX_WORKERS, sizeof *s->st_mem);
        if (!s->st_have || !s->st_done || !s->st_ready || !s->st_rq || !s->st_src || !s->st_mem) {
            PS_ERROR("out of memory for streamed steps");
            goto out;
        }
    }
    if ((code = hold_outputs(s)) != 0 || (opts->resume_dir && (code = resume(s)) != 0)) goto out;
    code = PSD_EXIT_ERROR;
    if (s->epoch >= (uint32_t)c->epochs && sharded(s)) /* the shards may hold older steps only: they decide */
        PS_INFO("shard 0's checkpoint is at the end of the run (%d epochs): waiting for the other shards' parts",
                c->epochs);
    else if (s->epoch >= (uint32_t)c->epochs) {
        PS_INFO("the checkpoint is at the end of the run (%d epochs): nothing to train", c->epochs);
        s->epoch--; /* the last epoch trained, as the end of the run writes it */
        save_weights(s);
        code = s->exit_code;
        goto out;
    }
    snprintf(s->run_dir, sizeof s->run_dir, "%s/run-%016" PRIx64, c->ckpt_dir, s->run_id);
    if (c->ckpt_dir[0] && ((mkdir(c->ckpt_dir, 0755) != 0 && errno != EEXIST) ||
                           (mkdir(s->run_dir, 0755) != 0 && errno != EEXIST))) {
        PS_ERROR("checkpoint directory %s: %s", s->run_dir, strerror(errno));
        code = PSD_EXIT_USAGE;
        goto out;
    }
    char err[PS_PATH_MAX + 400];
    if ((c->ckpt_dir[0] && psd_lock_dir(&s->locks, s->run_dir, err, sizeof err) != 0) ||
        (c->metrics[0] && psd_metrics_open(&s->metrics, c->metrics, err, sizeof err) != 0)) {
        PS_ERROR("%s", err);
        code = PSD_EXIT_USAGE;
        goto out;
    }
    s->zctx = psd_zmq_context(c);
    if ((code = psd_router_open(s->zctx, c, c->listen, opts->no_zap, s->layout.n_params, sharded(s), true, &s->locks, &s->sock, &s->zap,
                                &s->mon)) != 0)
        goto out;
    s->silence = psd_silence_limit(c, s->layout.n_params);
    code = PSD_EXIT_ERROR;
    char ep[256] = "";
    size_t eplen = sizeof ep;
    zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, ep, &eplen);
    PS_INFO("psd %s (protocol %u): run %016" PRIx64 ", listening on %s, waiting for %d workers", PSD_VERSION,
            PS_PROTOCOL_VERSION, s->run_id, ep, c->workers);
    PS_INFO("model %zu parameters, %zu training / %zu test samples, optimizer %s, schedule %s",
            s->layout.n_params, s->train_count, s->test_count, ps_opt_name(c->opt), ps_sched_name(c->sched));
    bool bound = false;
    int usable = ps_cpus_usable(&bound, NULL);
    PS_INFO("threads: %d for the step, %d ZeroMQ I/O; %d usable CPU%s%s", threads, psd_io_threads(c), usable,
            usable == 1 ? "" : "s", bound ? " (this process's affinity or cgroup quota, not the host's)" : "");
    PS_DEBUG("steps: %d chunks on %d threads", s->store.n_chunks, threads);
    if (s->stream)
        PS_INFO("streamed steps: %d chunks of up to %zu KiB, each stepped as soon as every worker has sent it",
                s->st_nc, s->st_cf * sizeof(float) / 1024);
    if (sharded(s)) PS_INFO("psd shard 0 of %d: waiting for shards 1..%d to join", s->n_shards, s->n_shards - 1);
    if (s->silence > c->worker_timeout + 0.5)
        PS_INFO("a silent worker is lost after %.1f s: server.worker_timeout %.1f s plus %.1f s each way for a "
                "message of the whole model (%.0f MB at 40 MB/s)",
                s->silence, c->worker_timeout, psd_transfer_s(s->layout.n_params),
                4.0 * (double)s->layout.n_params / 1e6);

    int fd;
    size_t fdlen = sizeof fd;
    zmq_getsockopt(s->sock, ZMQ_FD, &fd, &fdlen);
    uv_loop_init(&s->loop);
    loop_ok = true;
    uv_poll_init(&s->loop, &s->poll, fd);
    uv_timer_init(&s->loop, &s->timer);
    uv_signal_init(&s->loop, &s->sigint);
    uv_signal_init(&s->loop, &s->sigterm);
    uv_signal_init(&s->loop, &s->sigusr1);
    uv_signal_init(&s->loop, &s->sighup);
    s->poll.data = s->timer.data = s->sigint.data = s->sigterm.data = s->sigusr1.data = s->sighup.data = s;
    uv_poll_start(&s->poll, UV_READABLE, on_poll);
    uv_timer_start(&s->timer, on_timer, 100, 100);
    uv_signal_start(&s->sigint, on_signal, SIGINT);
    uv_signal_start(&s->sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->sigusr1, on_signal, SIGUSR1);
    uv_signal_start(&s->sighup, on_signal, SIGHUP);
    /* with shards: every tensor on the wire; the table on psd: rows go over the wire */
    if (c->shared_memory && !sharded(s) && !s->table_on_psd) start_shm(s);
    s->t_boot = ps_now();
    s->val_curve = calloc((size_t)c->epochs, sizeof *s->val_curve);
    if (c->http[0] && (code = start_http(s)) != 0) goto out;
    code = PSD_EXIT_ERROR;
    /* the live progress line: on a terminal, unless the log is for a machine (json) */
    s->tty = isatty(STDERR_FILENO) && c->log_format == PS_LOG_TEXT && getenv("TERM") &&
             strcmp(getenv("TERM"), "dumb") != 0;
    s->phase = PHASE_WAIT;
    s->phase_deadline = ps_now() + c->start_timeout;
    /* one that came while psd loaded (counted then): acted on now, as
     * on_signal would have */
    int early = ps_early_stop_signal();
    if (early) request_stop(s, early, strsignal(early));
    drain(s);
    if (s->phase != PHASE_DONE) uv_run(&s->loop, UV_RUN_DEFAULT);
    if (s->tty) ps_log_status(NULL);
    code = s->exit_code;
out:
    if (s->ckpt || s->ck_open) { /* a last checkpoint still being written: let it finish */
        if (s->stopping > 0 && code >= 128 && s->ckpt) { /* a second signal: exit at once */
            /* the workers' SHUTDOWN (a few bytes each) is queued: end
             * ZeroMQ as at any exit, with a short linger, so that it goes
             * out (or they would wait for a psd that is not coming back),
             * then leave the checkpoint's writer behind */
            zmq_end(s, 250);
            _exit(code);
        }
        /* the one under way, then the one asked for while it was written
         * (the run's last, maybe): each waited for */
        for (int i = 0; i < 3 && (s->ckpt || s->ck_open); i++) poll_checkpoint(s, true);
    }
    if (loop_ok) {
        psd_http_stop(&s->http);
        psd_shm_close(s->shm);
        uv_close((uv_handle_t *)&s->poll, close_cb);
        uv_close((uv_handle_t *)&s->timer, close_cb);
        uv_close((uv_handle_t *)&s->sigint, close_cb);
        uv_close((uv_handle_t *)&s->sigterm, close_cb);
        uv_close((uv_handle_t *)&s->sigusr1, close_cb);
        uv_close((uv_handle_t *)&s->sighup, close_cb);
        /* a uv_stop before the loop ever ran (a stop while loading) makes
         * the first uv_run return at once: run it until the closes are done */
        for (int i = 0; i < 3 && uv_run(&s->loop, UV_RUN_DEFAULT) != 0; i++)
            ;
        if (uv_loop_close(&s->loop) != 0) PS_WARN("psd's event loop did not close cleanly");
    }
    if (s->w)
        for (int i = 0; i < s->n; i++) {
            release_push(&s->w[i]);
            shm_forget(s, &s->w[i]);
            free(s->w[i].ranges);
            rows_free(&s->w[i]);
            free(s->w[i].gch);
            free(s->w[i].gch_in);
        }
    if (s->sock) ps_msg_drain(s->sock, 0.1, 1.0); /* what workers sent before they saw SHUTDOWN */
    zmq_end(s, -1);
    psd_metrics_close(&s->metrics);
    if (psd_metrics_incomplete(&s->metrics) && code == PSD_EXIT_OK) {
        PS_ERROR("exit %d: the run's metrics file %s is incomplete: %u epoch line%s not written (%s)",
                 PSD_EXIT_METRICS, s->cfg.metrics, s->metrics.lost, s->metrics.lost == 1 ? "" : "s",
                 strerror(s->metrics.err));
        code = PSD_EXIT_METRICS;
    }
    psd_locks_release(&s->locks);
    psd_store_deinit(&s->store);
    free(s->perm);
    free(s->val_scores);
    free(s->test_labels);
    free(s->auc_order);
    free(s->step_g);
    free(s->step_rows);
    free(s->step_bf16);
    free(s->step_wt);
    free(s->st_have);
    free(s->st_done);
    free(s->st_ready);
    free(s->st_rq);
    free(s->st_src);
    free(s->st_mem);
    free(s->st_lost_pos);
    if (s->rx_arena.fallbacks)
        PS_DEBUG("%" PRIu64 " decoded headers did not fit the receive arena", s->rx_arena.fallbacks);
    free(s->pool);
    free(s->seen);
    free(s->parts);
    free(s->val_curve);
    free(s->w);
    free(s);
    return code;
}

int psd_resume_check(const char *dir, const ps_config_t *c, int force, int shards)
{
    psd_ckpt_meta_t m;
    uint8_t *seen = NULL;
    float *weights = NULL, *slots[2] = {NULL, NULL};
    char path[PS_PATH_MAX], err[512], rdir[PS_PATH_MAX];
    int r = resolve_resume_dir(dir, rdir, sizeof rdir);
    if (r != 0) {
        fprintf(stderr, "psd: cannot resume from %s: %s\n", dir, strerror(-r));
        return PSD_EXIT_USAGE;
    }
    if (psd_ckpt_load_newest(rdir, &m, &seen, &weights, slots, path, sizeof path, log_line, err, sizeof err) != 0) {
        fprintf(stderr, "psd: cannot resume: %s\n", err);
        return PSD_EXIT_USAGE;
    }
    free(seen);
    free(weights);
    free(slots[0]);
    free(slots[1]);
    uint64_t h = ps_config_hash(c);
    if (m.config_hash != h && !force) {
        fprintf(stderr, "psd: cannot resume from %s: it was written with another config (hash %016" PRIx64
                        ", this one %016" PRIx64 "); use --force-resume to resume anyway\n",
                path, m.config_hash, h);
        return PSD_EXIT_USAGE;
    }
    ps_layout_t l;
    psd_optim_t o;
    psd_optim_from_config(&o, c);
    char why[256];
    const char *misfit = ps_config_layout(c, &l) != 0
                             ? "this config's model is invalid"
                             : ckpt_misfit(&m, &l, &o, shards > 1 ? shards : 1, why, sizeof why);
    if (misfit) {
        fprintf(stderr, "psd: cannot resume from %s: %s\n", path, misfit);
        return PSD_EXIT_USAGE;
    }
    printf("psd: would resume run %016" PRIx64 " from %s: step %" PRIu64 ", epoch %u%s\n", m.run_id, path, m.step,
           m.epoch + 1, m.epoch_done ? " done" : " in progress");
    return 0;
}
