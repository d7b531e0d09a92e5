/* psd_core.h - the coordinator's state (srv_t) and the functions its files
 * share. The coordinator (shard 0, or the one psd) is these files, in
 * layers: each calls only the files below it (bash tests/layers.sh draws
 * the graph and fails on a circle; the "server-layers" test runs it):
 *   psd_server.c   the shell: set-up and teardown, the loop (timer,
 *                  signals, socket), message dispatch (handle), peer
 *                  hygiene, psctl
 *   psd_run.c      the run's phases: register, ready, barrier, leave, lost; epochs,
 *                  validation, the end of the run, checkpoints, resume; the
 *                  only file that acts on events (psd_run_events)
 *   psd_offer.c    model.kind from_worker: the model the first worker offers
 *   psd_model.c    the model's set-up: store, holder, tensor table, streamed
 *                  chunks (at start, or when the first worker's values come)
 *   psd_shard0.c   shard 0's side of the psd shard protocol: joining, the
 *                  shards' initial values, the weights file from their parts
 *   psd_push.c     pushes, pulls, the shards' HAVE and NORM, psd_push_maybe_step
 *   psd_stream.c   streamed steps (train.stream)
 *   psd_step.c     the step, its accounting, pull answers, weights replies
 *   psd_give.c     positions of the epoch to workers (EPOCH messages)
 *   psd_peers.c    headers, sends, drops, connections, ASSIGN, the end of
 *                  the run
 *   psd_status.c   /metrics, /status, psctl text, the progress line (reads
 *                  srv_t only)
 * Below them, knowing nothing of srv_t: psd_samples.c (the sample
 * accounting, plain data), psd_hold.c (the parameter holder, shared with
 * shards 1..n-1: psd_shard.c), psd_contrib.c (a contributor's push in a
 * step: its state, head and frames; shared with them too), psd_store.c, psd_ckpt.c, psd_net.c,
 * psd_metrics.c, psd_lock.c, psd_diverge.c, psd_http.c.
 * A lower file that needs the run to act raises an event (PSD_EV_*, below).
 *
 * Ownership: one srv_t per psd process, made and freed by psd_server_run;
 * everything in it belongs to the loop thread. Its parts (net, sh, ck, ep,
 * st, smp, holder, ...) each belong to the file named at their type, which
 * sets them up and resets them; other files read them and set the few
 * fields noted there. */
#ifndef PSD_CORE_H
#define PSD_CORE_H

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
#include "ps_tsched.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"
#include "psd_best.h"
#include "psd_ckpt.h"
#include "ps_data.h"
#include "psd_diverge.h"
#include "psd_optim.h"
#include "psd_contrib.h"
#include "psd_hold.h"
#include "psd_http.h"
#include "psd_lock.h"
#include "psd_metrics.h"
#include "psd_samples.h"
#include "psd_net.h"
#include "psd_shm.h"
#include "psd_store.h"
#include "psd_zap.h"
#include "ps_auth.h"
#include "ps_config.h"
#include "ps_tcp.h"
#include "psd_opts.h"

#define MAX_WORKERS 1024
#define ST_BATCH 64 /* streamed steps: chunks stepped in one pool run */
/* the live page's curves: at most this many (step, loss) points, thinned
 * by half (and recorded half as often) whenever full */
#define PSD_CURVE_MAX 2048
extern const char *const psd_page_html;
extern const size_t psd_page_html_len;


typedef enum {
    W_ASSIGNED = 0, /* registered, checking its data */
    W_READY,        /* data checked, waiting for an epoch */
    W_TRAIN,        /* has samples left in this epoch */
    W_BARRIER,      /* its samples of the epoch are done */
    W_VALIDATING,   /* evaluating parts of the test set */
    W_VALIDATED,    /* its parts are done */
    W_GONE,         /* lost, left or failed; never waited for */
} wstate_t;

extern const char *const psd_wstate_name[]; /* a wstate_t's name, for logs and /status */

/* How a worker's run ended (docs/usage.md "How a worker's run ends"): it
 * left (LEAVE, e.g. SIGTERM), failed (its own ERROR), was lost (its
 * connection closed, or silent), or psd refused a message of it (its run
 * ended with psd's reason, exit 2). Done is the run's own end. */
typedef enum { WEND_NONE = 0, WEND_LEFT, WEND_FAILED, WEND_LOST, WEND_REFUSED, WEND_N } wend_t;
extern const char *const psd_wend_name[]; /* "left", "failed", "lost", "refused" (for /status, metrics) */

typedef struct {
    uint8_t ident[PS_MAX_IDENTITY];
    size_t ident_len;
    uint32_t rank;        /* = its slot (reused once every slot was taken: free_slot) */
    char hostname[64], host_id[128], device[32];
    uint32_t pid;
    wstate_t state;
    wend_t end;           /* once gone: how (psd_run_worker_gone counts it); set by who ends it */
    double last_seen;     /* time of its last valid message */
    double sent_at;       /* time of psd's last message to it (keep_alive) */
    double gone_at;
    uint64_t seq_in, seq_out;
    int conn;             /* the connection its messages come on (fd + 1, 0: not known), given
                           * server.tcp_congestion when first seen (psd_peers_note_conn) */
    bool conn_closed;     /* that connection closed (the ROUTER's monitor): lost at the next tick */
    uint64_t lost_replies;
    bool lost_silent;     /* gone for its silence: it may be alive and connected (told when the run ends) */
    psd_share_t share;    /* this epoch: its positions (ranges, in order), given and trained (psd_samples.h) */
    /* its push of the step in progress (psd_contrib.h: its state, head,
     * frames, the other shards' word and the pull it is owed): its tensors
     * may come in several PUSH messages (a GPU worker sends each layer's
     * gradient as soon as its backward is done), kept as received until the
     * step */
    psd_contrib_t contrib;
    int val_pending;      /* validation parts given and not answered */
    double compute_ewma;  /* its compute time per step (from its pushes), for "slowest worker" */
    /* same host (psd_shm.h): its gradient region, mapped read-only, and the
     * parameter slot it reads from, held until it is sent a newer one */
    uint8_t shm_token[PS_SHM_TOKEN];
    const float *shm_grad; /* NULL: no region */
    bool shm;             /* READY confirmed: tensors go through shared memory (push.shm: which) */
    psd_arena_t *hold;
    /* psd shards: the token it presents to shards 1..n-1, and whether its
     * ASSIGN waits for every shard to join */
    uint8_t shard_token[PS_SHM_TOKEN];
    bool assign_wait;
    /* async and ssp (train.sync): its pushes applied this epoch (ssp's
     * clock), and whether psd holds back its weights because it is
     * train.staleness steps ahead of the slowest */
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
    psd_hist_t h_wait, h_compute;
    double barrier_at, barrier_wait_s;
} worker_t;

typedef struct {
    uint64_t begin, end;  /* test samples, or positions in the list of validation ids (s->vl.split) */
    int worker;           /* slot it is given to, -1 if waiting for one */
    bool done;
    double loss;
    uint64_t correct, count;
    double sums[PS_MAX_SUMS]; /* the workers' named sums (s->vl.names) */
} vpart_t;

/* Validation figures: sums over a set's samples, reduced in part order. */
typedef struct {
    bool have;
    double loss;
    uint64_t correct, count;
    double sums[PS_MAX_SUMS];
} psd_figs_t;

/* An epoch's figures, for its metrics line. */
typedef struct {
    double train_loss, train_acc, val_loss, val_acc, sps, ep_sps, wall, auc;
    uint64_t correct, count;
    int workers;
} epoch_stats_t;

/* Validation, the held-out split and the run's closing test (psd_valid.c) */
typedef enum { VAL_EPOCH = 0, VAL_TEST_LAST, VAL_TEST_BEST } val_kind_t;
typedef struct {
    /* the data: the training set's split (data.val_fraction, data.val_size), fixed once its size is known */
    bool known;                /* sizes (and fingerprint) known: from the config's files or sizes, a checkpoint,
                                * or the first worker's READY */
    bool id_known;           /* data_id: a checkpoint's or the first worker's (never the config's) */
    char data_id[PS_DATA_ID_MAX + 1];
    size_t n_val;              /* held-out samples (0: validation is on the test set) */
    uint32_t *val_ids;         /* n_val of them, increasing */
    uint32_t *train_ids;       /* the others, increasing (NULL without a split: the ids are the positions) */
    /* the parts out now */
    val_kind_t kind;
    int split;                 /* Psd__Split of the parts */
    uint64_t version;          /* weights they are on */
    uint32_t epoch;            /* 0-based epoch they belong to (the best's for VAL_TEST_BEST) */
    float *best_w;             /* VAL_TEST_BEST: the best epoch's weights, read back from its file */
    uint16_t *best_w16;        /* and as bfloat16 (train.wire_weights bf16) */
    /* the workers' named sums: the first answer's names, the same in every later one */
    bool sums_known;
    int n_sums;
    char names[PS_MAX_SUMS][PS_SUM_NAME_MAX + 1];
    double last_means[PS_MAX_SUMS]; /* of the last validated epoch (/metrics, /status) */
    /* the last epoch's figures, held for its metrics line until the closing test is in */
    epoch_stats_t held;        /* the last epoch's line, held */
    psd_figs_t held_figs;
    psd_figs_t test_last, test_best;
    bool line_held;
    /* train.keep_best, train.early_stop */
    psd_best_t keep, stop;
    uint64_t best_version;     /* the weights version of keep's best epoch */
    bool stopped_early;
    bool closing;              /* PSD_EV_VALIDATED of the run's last epoch (its closing test made) */
    bool stop_asked;           /* PSD_EV_VALIDATED of the epoch --stop-after-epoch names */
    /* the last finished validation (an epoch's, or the closing test's) as the workers are told it in EPOCH
     * and SHUTDOWN (ValSums: the figures of its metrics line; names: names[]). told_have: one finished since
     * psd started (not in a checkpoint: a resumed psd tells none until it validates) */
    bool told_have;
    Psd__ValSums told;
    Psd__NamedSum told_sums[PS_MAX_SUMS];
    Psd__NamedSum *told_p[PS_MAX_SUMS];
} psd_val_part_t;

typedef enum { PHASE_WAIT = 0, PHASE_TRAIN, PHASE_VALIDATE, PHASE_DONE } phase_t;

typedef struct {
    char role[16];
    char path[PS_PATH_MAX];
    uint64_t size, hash;
} datafile_t;

/* A psd shard i > 0, as shard 0 sees it (its own state is psd_shard.c's
 * shard_self_t). */
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
    bool told_wait;       /* its HELLO came before the model (from_worker): told to wait (logged once) */
    bool valued;          /* a run not resumed: its part of the initial values is all in (SHARD_INIT_DONE) */
    uint64_t init_from, init_chunks; /* floats of its part sent so far (SHARD_INIT_FETCH asks in order), chunks */
} shard_peer_t;

/* The parts of srv_t, each kept by the file named (it sets the part up and
 * resets it; the fields other files set are noted). */

/* The sockets and the loop, and the hygiene of what comes in (psd_server.c;
 * psd_peers.c sends and drops through it). */
typedef struct {
    void *zctx, *sock;
    uv_loop_t loop;
    uv_poll_t poll;
    uv_timer_t timer;
    uv_signal_t sigint, sigterm, sigusr1, sighup;
    psd_zap_t *zap;       /* authentication handler, NULL without keys */
    void *mon;            /* PAIR with the ROUTER's events: closed connections, failed handshakes */
    uint64_t hs_failed;
    double stranger_reply_t; /* the last ERR_LOST to a peer of this run psd does not know */
    ps_arena_t rx_arena;  /* decoded headers of received messages (one at a time) */
    uint8_t rx_buf[64 << 10];
    bool cur_bad;         /* the message being handled was dropped */
    int refuse;           /* ... and it came from this registered worker (its slot + 1; 0: none): its run
                           * ends (psd_run_refuse_worker) */
    char refuse_why[400]; /* why (psd_peers_drop's words) */
    const char *cur_peer; /* its sender's address, for the log */
    uint64_t dropped;     /* bad messages, for rate-limited logging */
    /* connections that sent bad messages in a row (see bad_peer) */
    struct {
        uint8_t ident[PS_MAX_IDENTITY];
        size_t ident_len;
        uint32_t bad;
        double cut_at;    /* when psd cut its connection, 0 = not yet */
    } bad[32];
    int n_bad;
    uint64_t cut;         /* connections psd closed for bad messages */
    /* HTTP endpoint (server.http) */
    psd_http_t *http;
    char http_token[256];
    /* same-host transport: NULL when off or unavailable */
    psd_shm_t *shm;
    char shm_name[64];
    char host_id[128];
    bool shm_later;       /* model.kind from_worker: start it once the model is set up */
} psd_net_part_t;

/* psd shards (--shard 0/n) as shard 0 sees them: this psd coordinates,
 * shards 1..n-1 hold the other parts of the parameters (psd_shard0.c;
 * psd_run.c sets the resume fields, which a single psd's --resume uses
 * too, and the shards' resumed/ck_acked; psd_push.c and psd_step.c their
 * norm_in; psd_server.c their joined/conn_closed). */
typedef struct {
    int n;                /* shards; 1: one psd */
    shard_peer_t shard[PS_MAX_SHARDS];
    double hb;            /* when shard 0 last sent them a heartbeat */
    bool said_one_host;   /* "every shard is on this host" logged (once a run) */
    /* end of the run with --save: the weights file (wr; not NULL while it is
     * written) is written as the other shards' parts come, PSD_FETCH_FLOATS at
     * a time from shard fetch_k, whose part is fetch_part (never the whole
     * model in memory) */
    ps_weights_writer_t *wr;
    double fetching_since; /* the last chunk asked for */
    int fetch_k;
    ps_piece_t fetch_part[PS_MAX_TENSORS];
    uint64_t fetch_size, fetch_from, fetch_count, fetch_chunks;
    /* --resume: the directory resumed from and its steps up to the one
     * resumed at, newest first: each shard resumes at the newest of them it
     * has, and all go back to the oldest any shard resumed at */
    char resume_dir[PS_PATH_MAX];
    uint64_t resume_steps[PSD_RESUME_STEPS_MAX];
    size_t n_resume_steps;
    bool resume_agreed;   /* every shard resumed at shard 0's step: training may begin */
    /* a run not resumed whose initial values are not the config's to draw
     * (model.init's file, the first worker's): the other shards' pieces of
     * them, laid out as the model (pages of shard 0's own part never
     * taken), kept until every shard has fetched its part; NULL: none */
    float *init;
    size_t init_bytes;    /* its mapping's length */
} psd_shards_part_t;

/* Checkpoints: the one being written and those asked for meanwhile
 * (psd_run.c; psd_server.c's stop and psctl set stop_when_written, again,
 * ctl_wait; a diverged step clears deferred). */
typedef struct {
    psd_ckpt_writer_t *writer;
    /* the checkpoint being taken: step, version; with psd shards, shard 0's
     * part is written (open) and every shard's confirmation awaited */
    uint64_t step, version;
    bool open;
    int rc;               /* shard 0's part: 0 or -errno */
    char path[PS_PATH_MAX];
    char fail[400];       /* the first shard's failure to write its part ("": none) */
    uint64_t safe;        /* psd shards: the newest step every shard confirmed (or resumed at): its files are
                           * never pruned, so that a resume always finds a step all have (0: none) */
    bool deferred;        /* asked for while stepping: taken once the step is applied */
    bool again;           /* another one was asked for while writing */
    /* ... and it was the end of epoch again_epoch, at again_steps steps: an
     * epoch's end still, if taken before anything trained since */
    bool again_epoch_done;
    uint32_t again_epoch;
    uint64_t again_steps;
    bool stop_when_written;
    bool end_when_written; /* psd shards: the run ends once every part of its last checkpoint is written */
    char run_dir[PS_PATH_MAX]; /* checkpoint.dir/run-<run id>: this run's checkpoints */
    uint64_t written;
    double last_t;
    /* psctl checkpoint: who waits for the checkpoint being written */
    struct {
        uint8_t ident[PS_MAX_IDENTITY];
        size_t ident_len;
    } ctl_wait[8];
    int n_ctl_wait;
} psd_ckpt_part_t;

/* This epoch's statistics: reset by psd_run.c when it begins (and set by a
 * resume), counted by the step's files (psd_step.c, psd_push.c,
 * psd_stream.c, psd_give.c). */
typedef struct {
    double loss;
    uint64_t correct, samples;
    double compute_s, wait_s; /* workers' step times this epoch (from their pushes) */
    uint64_t timed;
    double step_s0;       /* store.step_s when the epoch began, and the epoch's steps: psd's own step */
    uint64_t step_n;
    uint64_t in_place0;   /* store.in_place when the epoch began */
    uint64_t bytes_in, bytes_out; /* tensor bytes received / sent on the wire this epoch */
    uint64_t rows_in, rows_pushes; /* table rows received in row-sparse pushes, and those pushes */
    uint64_t rows_out, rows_replies; /* table rows sent in replies that carry only the rows asked for */
    /* async and ssp: staleness of the gradients applied this epoch (versions
     * between the one a push was computed on and the one it was applied to),
     * and ssp's largest lead (steps ahead of the slowest) a worker was let
     * train at */
    uint64_t stale_sum, stale_n, stale_max, lead_max;
    uint64_t moved;       /* async and ssp: samples moved to workers done with theirs (psd_give_rebalance) */
    uint64_t ahead;       /* pushes begun while a lower rank still training had not begun its own */
} psd_epoch_part_t;

/* Streamed steps (train.stream, bsp, one psd; psd_stream.c): the store's
 * chunks travel one by one and each is stepped once every contributor's
 * copy is here. The step opens (open) with its first chunk: its
 * contributors (mem, rank order) are then fixed and its next version is
 * built in next. */
typedef struct {
    size_t cf;            /* floats per chunk (ps_chunk_floats) */
    int nc;               /* chunks (store.n_chunks) */
    int *have;            /* per chunk: contributors whose copy is here */
    uint8_t *done;        /* per chunk: stepped (reduced, with clipping) */
    int n_done, n_made;   /* chunks stepped, chunks whose new values are made */
    int tchunks[PS_MAX_TENSORS]; /* chunks of each tensor */
    int tfirst[PS_MAX_TENSORS];  /* and the index of its first */
    int tmade[PS_MAX_TENSORS];   /* of which made */
    int tord[PS_MAX_TENSORS], n_tord; /* tensors made, in that order (replies go in it) */
    int *ready;           /* chunks to step now (ST_BATCH) */
    int *rq, rq_head, rq_tail; /* chunks every contributor has, in the order they became so */
    bool rescan;          /* the contributors changed: find the ready chunks again */
    const void **src;     /* their gradients: ST_BATCH x MAX_WORKERS */
    int *mem, k;          /* contributors (slots) */
    bool open;
    bool voided;          /* every contributor left before any chunk was stepped: no step (psd_step_done) */
    /* the batches of contributors lost before any chunk took the step: they
     * count as trained once it is taken, and are handed out again if it is
     * void (stream_settle_lost) */
    uint64_t *lost_pos;
    size_t lost_n, lost_cap;
    double lost_loss;
    uint64_t lost_correct;
    psd_arena_t *next;
} psd_stream_part_t;

typedef struct {
    ps_config_t cfg;
    psd_run_opts_t opts;
    uint64_t run_id, config_hash;
    ps_layout_t layout;
    bool model_ready;     /* layout, store and holder set up (psd_model.c); false only while model.kind
                           * from_worker waits for the first worker's values */
    struct {              /* model.kind from_worker: the offer psd waits for (psd_offer.c) */
        ps_layout_t layout;
        uint8_t ident[PS_MAX_IDENTITY];
        size_t ident_len;
        double at;
        char config[PS_OFFER_MAX + 1]; /* the optimizer it offers (YAML), "" = none */
    } offer;
    char adopted[PS_OFFER_MAX + 1]; /* the optimizer the run took from its first worker (ps_config_adopt), "" = none */
    uint8_t *table_pb;    /* the layout's tensor table packed (ps_table.h): ASSIGN's frame; owned */
    size_t table_pb_len;
    psd_store_t store;
    psd_hold_t holder;    /* psd's part of the parameters and the pushes (psd_hold.h) */
    psd_net_part_t net;   /* sockets, loop, incoming hygiene (psd_server.c, psd_peers.c) */
    psd_shards_part_t sh; /* the other psd shards (psd_shard0.c) */
    psd_ckpt_part_t ck;   /* checkpoints (psd_run.c) */
    psd_epoch_part_t ep;  /* this epoch's statistics */
    psd_stream_part_t st; /* streamed steps (psd_stream.c) */
    psd_samples_t smp;    /* the epoch's permutation, positions trained, the pool (psd_samples.h) */
    psd_metrics_t metrics; /* the metrics file (psd_metrics.h) */
    psd_locks_t locks;     /* this run's hold on its files (psd_lock.h) */
    psd_diverge_t dv;     /* the steps' losses and norms, checked for divergence (psd_step_done) */
    /* workers */
    worker_t *w;          /* MAX_WORKERS slots */
    int n;                /* slots used */
    int max_workers;      /* slots taken before gone ones are reused (MAX_WORKERS; tests: --x-max-workers) */
    uint64_t registrations;
    double silence;       /* a peer psd waits for is lost after this (psd_silence_limit) */
    ps_hearing_t hearing; /* silence counts only while the event loop ran (on_timer's ticks) */
    /* the run */
    phase_t phase;
    int exit_code;
    unsigned events;      /* raised by a lower layer, for psd_run.c (PSD_EV_*) */
    int stopping;         /* signal number that asked to stop, or -1 for --stop-after-epoch */
    datafile_t files[4];
    size_t train_count, test_count;
    double ctr_opt_loss;  /* model.kind ctr: the planted model's log-loss on the test examples */
    double ctr_const_loss; /* and the best constant's (the test click rate) */
    double ctr_opt_auc;   /* the planted probabilities' AUC on the test examples */
    float *val_scores;    /* ctr: the workers' click probabilities of the test examples (VAL_RESULT) */
    uint8_t *test_labels; /* ctr: the test examples' clicks */
    uint32_t *auc_order;  /* ps_auc's scratch */
    vpart_t *parts;       /* validation parts of this epoch */
    int n_parts;
    psd_val_part_t vl;    /* the split, the parts' kind, named sums, the best epoch (psd_valid.c) */
    size_t n_pos;         /* positions an epoch trains: train_count less the held-out samples */
    /* progress */
    uint32_t epoch;       /* 0-based */
    uint64_t step;        /* optimizer steps in the run */
    uint64_t epoch_step;  /* steps in this epoch */
    double spe;           /* steps per epoch (schedule position) */
    double lr;
    double momentum;      /* the step's cycled momentum (OneCycleLR), or -1 */
    ps_tsched_t tsched;   /* schedule.name torch: the scheduler, parsed (psd_model.c) */
    bool resumed_mid_epoch;
    uint64_t resumed_step; /* the step a --resume continued from, for the metrics lines; 0: none */
    bool resumed;
    double t_start, t_epoch, train_s_total, phase_deadline, orphan_deadline, t_boot;
    uint64_t samples_total;
    /* the step */
    bool stepping;        /* psd shards with clipping: waiting for the shards' block norms */
    double stepping_since;
    bool stream;          /* train.stream in force (st) */
    struct {              /* server.grad_room (psd_fold.c): the step's sum made as pushes come */
        bool on;          /* a sum is being made: every worker training has begun its push */
        uint64_t total;   /* the samples of its contributors (their weights' denominator) */
        uint64_t summed;  /* of which in the sum */
        int next;         /* the slot (rank order) to sum next */
        int count;        /* contributors summed */
        psd_push_t push;  /* the sum as the step's one contributor (its tensors: psd_store_sum) */
    } fold;
    bool table_on_psd;    /* ctr.worker_table_mb: workers hold only their batches' rows (CtrTask.table_on_psd) */
    uint8_t *step_bf16;   /* streamed steps: whether each contributor's gradient is bfloat16 */
    double *step_wt;      /* a step's contributors' weights */
    double last_loss;     /* mean training loss of the last step */
    /* step intervals, to show what a checkpoint being written costs */
    double last_step_t;
    double int_sum[2];    /* [0] no checkpoint being written, [1] while one is */
    uint64_t int_n[2];
    /* what /metrics and /status report beyond the state above */
    uint64_t bytes_in_done, bytes_out_done; /* of the epochs before this one */
    double val_acc_last, val_loss_last;
    uint32_t val_epoch_last;              /* epochs validated (0: none yet) */
    uint64_t ended[WEND_N];               /* workers whose run ended, by how (psd_run_worker_gone) */
    int workers_at_start;                 /* live workers when training started */
    bool finished;                        /* the run finished (end_run): psd_run_said_last says what it lost */
    bool batch_told;                      /* the global batch's change was logged (once a run) */
    /* curves for the live page (/history) */
    struct { uint64_t step; float loss; } curve[PSD_CURVE_MAX];
    int n_curve;
    uint64_t curve_every;                 /* record every curve_every-th step */
    struct { uint32_t epoch; uint64_t step; float train_loss, val_loss, val_acc; } *val_curve;
    int n_val_curve;
    /* progress: a live line on a terminal, else a plain line every progress_every s */
    bool tty;
    double progress_next;
} srv_t;

/* The run's last finished validation for an EPOCH (not append) or a
 * SHUTDOWN's last_val (psd_valid.c keeps it), NULL before the first. */
static inline Psd__ValSums *told_val(srv_t *s) { return s->vl.told_have ? &s->vl.told : NULL; }

/* Workers in the run now: ready, training, at the barrier or validating. */
static inline int live_workers(const srv_t *s)
{
    int n = 0;
    for (int i = 0; i < s->n; i++) n += s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED;
    return n;
}

/* async and ssp: mean staleness of the gradients applied this epoch */
static inline double stale_mean(const srv_t *s) { return s->ep.stale_n ? (double)s->ep.stale_sum / (double)s->ep.stale_n : 0.0; }

static inline bool sharded(const srv_t *s) { return s->sh.n > 1; }

/* server.grad_room (psd_fold.c) is in force for this run: bsp, one psd, not streamed, no table
 * and no tensor pushed as rows (the sum is dense); a worker on the wire (not shared memory)
 * counts against it */
static inline bool psd_fold_roomed(const srv_t *s, const worker_t *w)
{
    return s->cfg.grad_room > 0 && s->cfg.sync == PS_SYNC_BSP && !s->stream && !sharded(s) && s->layout.table < 0 &&
           s->holder.n_sparse == 0 && !w->shm;
}

/* Weights.go for w: its next push may come at once. Yes for every worker when
 * no more train over the wire than the room; else for the grad_room - 1 lowest
 * ranks on the wire (the step's sum takes the last place). */
static inline bool psd_fold_go(const srv_t *s, const worker_t *w)
{
    if (!psd_fold_roomed(s, w)) return true;
    int on_wire = 0, below = 0;
    for (int i = 0; i < s->n; i++) {
        const worker_t *x = &s->w[i];
        if (x->state != W_TRAIN || x->shm) continue;
        on_wire++;
        below += i < (int)(w - s->w);
    }
    return on_wire <= s->cfg.grad_room || below < s->cfg.grad_room - 1;
}

static inline int shards_joined(const srv_t *s)
{
    int n = 0;
    for (int i = 1; i < s->sh.n; i++) n += s->sh.shard[i].joined;
    return n;
}

static inline bool all_shards(const srv_t *s) { return shards_joined(s) == s->sh.n - 1; }

/* Every shard has its part of the initial values (a run not resumed). */
static inline bool shards_valued(const srv_t *s)
{
    for (int i = 1; i < s->sh.n; i++)
        if (!s->sh.shard[i].joined || !s->sh.shard[i].valued) return false;
    return true;
}

/* Every shard joined and holds its part: its initial values, or after a
 * resume, its checkpoint of shard 0's step. Workers are sent their ASSIGN
 * (which names every shard) from then on. */
static inline bool shards_ready(const srv_t *s)
{
    return all_shards(s) && (s->opts.resume_dir ? s->sh.resume_agreed : shards_valued(s));
}

/* Bits of the shards 1..n-1 (bit i: shard i). */
static inline uint32_t shard_bits(const srv_t *s) { return ((1u << s->sh.n) - 1u) & ~1u; }

/* ---- events: what a lower layer tells psd_run.c ----------------------
 * A file below psd_run.c never calls it: where what it did calls for the
 * run to act (a step that trains the epoch's last batch, a step at
 * checkpoint.every_steps, ...), it raises an event (a bit of s->events) and
 * returns; psd_run.c acts on them (psd_run_events) right after each call it
 * makes into a lower layer, and the shell calls psd_run_events after each
 * message, tick and signal. Handled in this order when several are raised. */
enum {
    PSD_EV_CKPT_DUE = 1u << 0,      /* a step reached checkpoint.every_steps: take one (psd_step_done) */
    PSD_EV_STEP_APPLIED = 1u << 1,  /* a step taken in parts (streamed, or shards' norms) is applied: a
                                     * checkpoint asked for meanwhile may be taken */
    PSD_EV_EPOCH_TRAINED = 1u << 2, /* every sample of the epoch is trained: validate (psd_push_maybe_step) */
    PSD_EV_SAVED = 1u << 3,         /* the sharded weights file is written (or failed): end the run */
    PSD_EV_SHARDS_JOINED = 1u << 4, /* a shard joined: workers waiting for every shard may be assigned */
    PSD_EV_VALIDATED = 1u << 5,     /* the epoch is validated and its line written (s->vl.closing: the run's
                                     * last, tested, its line held for psd_valid_write_held): go on (end_validation) */
};
static inline void raise_event(srv_t *s, unsigned ev) { s->events |= ev; }

/* ---- functions shared by the files of the coordinator ----------------
 * Layers, top to bottom (a file calls only those below it; bash
 * tests/layers.sh checks it): psd_server.c, psd_run.c, psd_offer.c,
 * psd_model.c, psd_shard0.c,
 * psd_push.c, psd_stream.c, psd_step.c, psd_give.c, psd_peers.c; beside
 * them psd_status.c (reads srv_t), and below, knowing nothing of srv_t:
 * psd_samples.c, psd_hold.c, psd_store.c, psd_ckpt.c, psd_net.c, ...
 * Each is named psd_<part>_<what>, the part its file's (psd_run_resume,
 * psd_peers_finish): every global of the server is psd_-prefixed, and what
 * no other file uses is static (tests/layers.sh --check). */

/* psd_offer.c: model.kind from_worker. psd_offer_gate: whether a REGISTER may
 * go on to psd_run_on_register (true), or was answered (OFFER, or refused) */
bool psd_offer_gate(srv_t *s, ps_msg_t *m);
void psd_offer_on_values(srv_t *s, ps_msg_t *m);
/* The optimizer text a first worker offered (or a checkpoint holds) taken
 * into s->cfg (ps_config_adopt), the config hash made anew: 0, or -1 with
 * why. psd_say_optimizer logs each key the run's optimizer reads and where
 * its value came from. */
int psd_adopt(srv_t *s, const char *text, char *err, size_t n);
void psd_say_optimizer(const ps_config_t *c);
/* psd_model.c: the model set up (values: the first worker's, NULL: the
 * config's inits or model.init). 0, or a PSD_EXIT_* code after a message */
int psd_model_setup(srv_t *s, const float *const *values);
void psd_model_free(srv_t *s); /* at the run's end */

/* psd_run.c: the run's phases, checkpoints, resume; acts on the events */
/* --resume DIR: the directory its checkpoints are in (out), and the run
 * they must be of (*run_id: the one a run-<id> directory is named for, 0
 * where its name says none). 0, or -errno. */
int psd_run_resolve_resume_dir(const char *dir, char *out, size_t n, uint64_t *run_id);
void psd_run_events(srv_t *s);
int psd_run_hold_outputs(srv_t *s);
int psd_run_resume(srv_t *s);
/* The metrics file without the lines of the resumed run's epochs past its
 * checkpoint. 0, or -1 with err. */
int psd_run_resume_metrics(srv_t *s, char *err, size_t n);
void psd_run_on_barrier(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_run_on_leave(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_run_on_ready(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_run_on_register(srv_t *s, ps_msg_t *m);
void psd_run_on_shard_ckpt_done(srv_t *s, int i, ps_msg_t *m);
void psd_run_on_shard_resumed(srv_t *s, int i, ps_msg_t *m);
void psd_run_on_worker_error(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_run_poll_checkpoint(srv_t *s, bool wait);
void psd_run_save_weights(srv_t *s);
void psd_run_take_checkpoint(srv_t *s, bool epoch_done);
void psd_run_worker_gone(srv_t *s, worker_t *w);
void psd_run_refuse_worker(srv_t *s, worker_t *w, const char *why);
void psd_run_said_last(const srv_t *s);
/* the shell's timer: workers whose connection closed, then the tick (lost
 * workers, the start timeout, orphaned epochs) */
void psd_run_closed(srv_t *s, double now);
/* the workers' slots: made at the start, their holdings released at the end, freed */
int psd_run_workers_init(srv_t *s, int max_workers);
void psd_run_workers_release(srv_t *s);
void psd_run_workers_free(srv_t *s);
void psd_run_tick(srv_t *s, double now);

/* psd_valid.c: the data's split, validation parts and their exact reduction, the epochs' metrics lines,
 * the closing test, the best epoch and early stopping */
int psd_valid_data_init(srv_t *s);
int psd_valid_data_setup(srv_t *s, size_t train, size_t test, const char *data_id);
int psd_valid_data_ready_ok(srv_t *s, worker_t *w, const Psd__Ready *r);
void psd_valid_start(srv_t *s);
void psd_valid_give_orphans(srv_t *s);
worker_t *psd_valid_least_busy(srv_t *s);
void psd_valid_on_result(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_valid_write_held(srv_t *s);
void psd_valid_free(srv_t *s);

/* psd_shard0.c: shard 0's side of the shard protocol (joining, the initial values, the weights file's parts) */
bool psd_shard0_begin_save(srv_t *s);
int psd_shard0_check_parts(const srv_t *s);
int psd_shard0_init_new(srv_t *s);
void psd_shard0_init_keep(srv_t *s, const float *const *values);
void psd_shard0_init_free(srv_t *s);
bool psd_shard0_all_resumed(const srv_t *s);
int psd_shard0_find(const srv_t *s, const uint8_t *ident, size_t len);
void psd_shard0_fetch_next(srv_t *s);
bool psd_shard0_on_shard(srv_t *s, int i, ps_msg_t *m);
void psd_shard0_send_resume(srv_t *s, int j);
void psd_shard0_go(srv_t *s);
/* the shell's timer: shards whose connection closed, then the tick
 * (heartbeats, silent shards; false: the run stopped) */
void psd_shard0_closed(srv_t *s, double now);
bool psd_shard0_tick(srv_t *s, double now);

/* psd_push.c: pushes, pulls, the shards' HAVE and NORM, the decision to step */
void psd_push_maybe_step(srv_t *s);
void psd_push_on_pull(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_push_on_push(srv_t *s, worker_t *w, ps_msg_t *m);
void psd_push_on_shard_have(srv_t *s, int i, ps_msg_t *m);
void psd_push_on_shard_norm(srv_t *s, int i, ps_msg_t *m);

/* psd_stream.c: streamed steps; it sets up and frees its part (init: once the model is known) */
int psd_stream_init(srv_t *s, size_t chunk_bytes);
void psd_stream_free(srv_t *s);
int psd_stream_take(srv_t *s, worker_t *w, ps_msg_t *m); /* 1: w's push whole, 0: more to come, -1: dropped */
void psd_stream_forget(srv_t *s, worker_t *w);
void psd_stream_progress(srv_t *s);

/* psd_fold.c: server.grad_room: the step's sum made in rank order as announced pushes come; the
 * rule (which workers announce, which replies say go) is here, read by the ASSIGN and the replies */
bool psd_fold_wanted(const srv_t *s);
bool psd_fold_progress(srv_t *s); /* true: the step was taken */

/* psd_step.c: the step, its accounting, pull answers, weights replies */
bool psd_step_wire_bf16(const srv_t *s, const worker_t *w);
int psd_step_weights_frames(srv_t *s, worker_t *w, ps_frame_t *fr, uint32_t *slot, uint32_t *crc);
void psd_step_account_batch(srv_t *s, worker_t *w);
void psd_step_account_step(srv_t *s, uint64_t total, const worker_t *only);
void psd_step_answer_pull(srv_t *s, worker_t *w);
void psd_step_count_trained(srv_t *s, uint64_t samples, double loss, uint64_t correct);
void psd_step_range_rows_send(srv_t *s, worker_t *w, Psd__Header *h, ps_frame_t *fr, int n);
void psd_step_release_push(srv_t *s, worker_t *w);
int psd_step_init(srv_t *s); /* the step's per-contributor room; psd_step_free */
void psd_step_free(srv_t *s);
void psd_step_note_times(srv_t *s, worker_t *w, double compute_s, double wait_s);
void psd_step_ssp_release(srv_t *s);
void psd_step_done(srv_t *s, bool taken);
void psd_step_lr(srv_t *s);
void psd_step_take(srv_t *s, worker_t *only);

/* psd_give.c: positions of the epoch to workers (the accounting: psd_samples.h) */
bool psd_give_take_pool(srv_t *s, worker_t *w);
uint64_t psd_give_min_clock(const srv_t *s);
void psd_give_hand_out(srv_t *s, const uint64_t *pos, size_t n, const char *what);
void psd_give_rebalance(srv_t *s, worker_t *w);
void psd_give_spread(srv_t *s, const uint64_t *pos, size_t n, worker_t **to, int k, bool append);

/* psd_peers.c: headers, sends, drops, connections, ASSIGN, the end of the run */
int psd_peers_send_shard(srv_t *s, int i, Psd__Header *h, const ps_frame_t *fr, int n);
int psd_peers_send_to(srv_t *s, worker_t *w, Psd__Header *h, const ps_frame_t *fr, int n);
/* a HEARTBEAT header of this epoch for w (NULL: the shards; hb: its body) */
void psd_peers_heartbeat_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Heartbeat *hb);
/* workers waiting on psd hear from it at least every second */
void psd_peers_keep_alive(srv_t *s, double now);
void psd_peers_control_reply(srv_t *s, const uint8_t *ident, size_t len, bool ok, const char *text, const char *json);
void psd_peers_drop(srv_t *s, const worker_t *w, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* psd_peers_drop: a message psd cannot take. From a registered worker in
 * the run, its words are kept for psd_run_refuse_worker (psd_server.c ends
 * that worker's run after the handler returns); psd_peers_drop_stale: a
 * message of a worker's earlier session (another run id, rank, an old
 * sequence number), only logged. */
void psd_peers_refuse_after(srv_t *s, const worker_t *w, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* psd_peers_refuse_after: w's run ends with the reason once the handler
 * returns, as for a message of w that psd_peers_drop() refuses, where the message at hand is not
 * w's (a psd shard's word that it refused one of w's) */
void psd_peers_drop_shard(srv_t *s, int i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void psd_peers_drop_stale(srv_t *s, const worker_t *w, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void psd_peers_finish(srv_t *s, int code, const char *reason);
worker_t *psd_peers_find_worker(srv_t *s, const uint8_t *ident, size_t len);
void psd_peers_hdr_for(srv_t *s, worker_t *w, Psd__Header *h, Psd__MsgType type);
void psd_peers_note_conn(srv_t *s, int *conn, const ps_msg_t *m);
void psd_peers_poll_monitor(srv_t *s);
void psd_peers_rows_free(worker_t *w);
void psd_peers_send_assign(srv_t *s, worker_t *w);
void psd_peers_send_error_ident(srv_t *s, const uint8_t *ident, size_t len, Psd__ErrCode code, const char *msg);
/* The same in a peer's older protocol (0: this build's), so that it shows
 * the words: a refusal of a worker that must be upgraded. */
void psd_peers_send_error_as(srv_t *s, const uint8_t *ident, size_t len, Psd__ErrCode code, const char *msg, uint32_t protocol);
void psd_peers_send_shutdown(srv_t *s, worker_t *w, int code, const char *reason);
void psd_peers_shards_send_all(srv_t *s, Psd__Header *h);
void psd_peers_shards_worker(srv_t *s, const worker_t *w);
void psd_peers_shm_forget(srv_t *s, worker_t *w);

#endif
