/* psw_client_int.h - the worker library's client state, shared by its two
 * files: psw_client.c (the connection: registration, requests, pushes and
 * their shards, the socket's messages) and psw_client_rx.c (what comes
 * back: weights, rows and validation parts, whole, by shard or streamed,
 * into events). Private to the library: psworker.h is the public API. One
 * psw_client_t per worker, used by one thread. */
#ifndef PSW_CLIENT_INT_H
#define PSW_CLIENT_INT_H

#include "psworker.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>
#include <zlib.h>

#include "ps_log.h"
#include "ps_ctr.h"
#include "ps_model.h"
#include "ps_rng.h"
#include "ps_shm.h"
#include "ps_tcp.h"
#include "ps_util.h"
#include "ps_wire.h"

/* An event as the client puts it together: tensors by unit of the layout
 * (ps_model.h); psw_client_next gives it to the caller by tensor of the
 * table (pswc_event_t -> psw_event_t). */
typedef struct {
    psw_event_kind_t kind;
    uint32_t epoch;
    uint64_t version;
    uint64_t step;
    uint32_t world, workers_on_host;
    const uint32_t *samples;
    size_t n_samples;
    int append;
    uint64_t keep;
    int n_tensors; /* units */
    const float *tensors[PS_MAX_TENSORS];
    size_t tensor_numel[PS_MAX_TENSORS];
    uint64_t val_begin, val_end;
    psw_split_t split;
    int final;
    const uint32_t *val_ids; /* c->val_ids */
    size_t n_val_ids;
    const uint32_t *row_ids;
    size_t n_row_ids;
    int exit_code;
    char message[256];
    int has_last_val;       /* EPOCH, SHUTDOWN: psd's last validation (psw_event_t.last_val; names: c->lv_names) */
    psw_val_t last_val;
    int last_val_final;
} pswc_event_t;

/* A connection's fd as noted when it connected, and what it was then (fstat):
 * fd -1 none */
typedef struct {
    int fd;
    dev_t dev;
    ino_t ino;
} pswc_conn_t;

struct psw_client {
    /* the table rows the last push asked for (Push.want_rows), and the
     * worker's replica of the table the replies' rows are scattered into */
    uint32_t *want;
    /* the last VALIDATE's samples (psw_event_t.val_ids): its ids, or its test range's */
    uint32_t *val_ids;
    size_t val_ids_cap;
    size_t n_want, want_cap;
    float *replica;
    int table_on_psd;       /* CtrTask.table_on_psd: no replica; events bring the rows asked for */
    float *tbuf;            /* the table on psd, with shards: the rows asked for (want's order), put together */
    size_t tbuf_cap;        /* rows tbuf has room for */
    void *ctx, *sock;
    void *mon;              /* PAIR receiving the DEALER's socket events */
    int connected;          /* a connection to psd has been up */
    int hs_failed;          /* handshakes failed without detail in a row, before any succeeded */
    int32_t prev_rank;      /* rank before psd was lost, -1 */
    char endpoint[256];
    psw_info_t info;
    char *offer_config; /* psw_client_offer_config's copy, owned (NULL: none) */
    unsigned protocol;
    uint64_t run_id;
    int shutdown_code;      /* a SHUTDOWN that came instead of the assignment: psd's exit code */
    uint32_t rank;
    uint64_t seq;
    ps_msg_t cur;           /* last received message (event data borrowed from it) */
    uint64_t verified;      /* weights messages checked against psd's CRC-32 */
    /* step timing, reported with every push: t_req when weights were asked
     * for, t_weights when they arrived, wait = the latter minus the former */
    double t_req, t_weights, wait;
    atomic_int push_inflight; /* gradient frames ZeroMQ still holds */
    pthread_mutex_t push_mu;  /* with push_cv: psw_client_push_wait sleeps until push_inflight is 0 (the */
    pthread_cond_t push_cv;   /* I/O thread that frees the last frame signals) */
    /* same host (ps_shm.h): the model's layout, this worker's gradient
     * region (read by psd) and psd's parameter slots (read-only) */
    ps_layout_t layout;
    int shm;                /* both regions mapped: tensors go through them */
    bool release_on_push;   /* psw_client_release_on_push: a pull releases the slot last given */
    bool weights_due;       /* weights asked for (pull, push with pull) and not yet returned */
    float *shm_grad;
    const float *shm_w;
    size_t shm_w_bytes, slot_floats;
    uint32_t slots;
    /* reduced precision on the wire (train.wire_*: bf16): conversion buffers
     * laid out like the model (gconv sent without copying: see push_done) */
    int grad_bf16, weight_bf16;
    uint16_t *gconv;
    float *wconv;
    /* psd shards (ASSIGN names shards 1..n-1): a DEALER to each, the pieces
     * every shard holds (ps_shard_pieces), and the weights put together
     * from their parts: an event is returned once every shard's part of
     * its version is in wbuf */
    int n_shards;           /* 1: one psd */
    void *ssock[PS_MAX_SHARDS]; /* [0] unused: sock */
    ps_piece_t pieces[PS_MAX_SHARDS][PS_MAX_TENSORS];
    int rows_shards;        /* every shard's piece of the table is whole rows: row pushes go to the shards */
    float *wbuf;
    uint64_t got[PS_MAX_SHARDS]; /* version + 1 of each shard's part in wbuf (0: none) */
    uint32_t rows_part;          /* shards whose last part was rows only (the rest of their piece is older) */
    int from;               /* shard the message in cur came from */
    pswc_event_t pend;      /* WEIGHTS/VALIDATE from shard 0 waiting for the other parts */
    /* the table, by tensor (the layout's units pack small ones): what
     * ASSIGN and events give the caller, and a push's packed units */
    psw_tensor_t *tab;      /* ps_layout_ntab of them (psw_assign_t.tensors) */
    pswc_event_t iev;       /* the event by unit */
    psw_sum_t lv_sums[PSW_MAX_SUMS];                     /* the event's last_val.sums */
    char lv_names[PSW_MAX_SUMS][PSW_SUM_NAME_MAX + 1];   /* and their names */
    const float **ev_t;     /* and by tensor of the table (psw_event_t.tensors) */
    size_t *ev_n;
    float *pack;            /* packed units' gradients put together (laid out like the model) */
    const float **pk_src;   /* a push: each tensor of the table given in this call, or NULL */
    uint8_t *pk_in;         /* tensors of packed units given since their unit was last sent */
    int pk_have[PS_MAX_TENSORS]; /* how many of each unit's */
    int pending;
    /* the connections' fds, closed in forked children (psw_fork.c): conn[k]
     * the connection to psd shard k (0: psd) as its socket's monitor told it
     * (mon, smon[k]); written under psw_fork.c's lock, read without it by
     * this client's thread only */
    pswc_conn_t conn[PS_MAX_SHARDS];
    void *smon[PS_MAX_SHARDS];  /* PAIR receiving ssock[k]'s connection events ([0] unused: mon) */
    int mon_rc;                 /* check_monitor's result when it was read for the fds: the next pswc_recv_msg's */
    psw_client_t *fork_prev, *fork_next; /* psw_fork.c's list of live clients */
    /* VALIDATEs from shard 0 that came while one waited for the other
     * shards' parts (psd may give a worker several parts at once): taken
     * in order once it is returned, so that the shards' replies answer
     * the part they were asked for */
    ps_msg_t *defer;        /* PSW_MAX_DEFER of them, made at the first */
    int n_defer;
    /* streamed steps (ASSIGN's stream_chunk_bytes): gradients go out in
     * chunks of stream_cf floats, one message each; the weights come a few
     * whole tensors at a time, kept where they arrived: sheld[t] holds
     * tensor t of version sver - 1 (smask: those in; sdone: all were, and
     * returned as an event), scrc is the CRC-32 psd sent for it */
    size_t stream_cf;
    /* server.tcp_congestion from ASSIGN ("" until then: off), and the
     * connection to psd (0) and to each shard given it (fd + 1, 0: none) */
    char tcp_cc[PS_TCP_CC_MAX];
    int tcp_fd[PS_MAX_SHARDS];
    zmq_msg_t sheld[PS_MAX_TENSORS];
    uint64_t smask;
    int sdone;
    uint64_t sver;
    uint32_t scrc;
};

#define PSW_MAX_DEFER 64

/* psw_client.c's, for psw_client_rx.c */
size_t pswc_first_row_at(const uint32_t *ids, size_t n, size_t r);
int pswc_keep_want(psw_client_t *c, const uint32_t *want, size_t n);
/* A sparse-rows unit's gradient as rows: n >= 1 strictly increasing ids
 * and their rows (n x its width); ids NULL: the unit goes whole. */
typedef struct {
    const uint32_t *ids;
    const float *vals;
    size_t n;
} pswc_rows_t;

/* psw_client_push_v's two ways, with the tensors as arrays: whole
 * tensors; and with some sparse-rows tensors' gradients as rows (rows[i]
 * for ids[i]; any number of them) and the rows of the table (l->table)
 * wanted next. Internal: not exported (pswc_). */
int pswc_push(psw_client_t *c, uint64_t version, uint32_t batch, double loss_sum, uint64_t correct, int pull, int n,
              const int *ids, const float *const *grads, const size_t *numel);
int pswc_push_rows(psw_client_t *c, uint64_t version, uint32_t batch, double loss_sum, uint64_t correct, int pull,
                   int n, const int *ids, const float *const *grads, const size_t *numel, const pswc_rows_t *rows,
                   const uint32_t *want, size_t n_want);
int pswc_pull_on(psw_client_t *c, void *sock, uint64_t min_version, const uint32_t *want, size_t n);
int pswc_recv_msg(psw_client_t *c, double deadline, double timeout_s, char *err, size_t errlen);
void pswc_shard_slice(const psw_client_t *c, int k, const uint32_t *want, size_t n, size_t *a, size_t *m);
void pswc_stream_release(psw_client_t *c);
bool pswc_table_rows(const psw_client_t *c, const uint32_t *ids, size_t n);

/* psw_fork.c: a forked child closes the fds of every live client's
 * connections. add: c is live (its conn[] none yet; the fork handler
 * registered, once), before its sockets connect; remove: before they close.
 * event: socket k's monitor event (k 0: psd's socket; CONNECTED notes the
 * fd, DISCONNECTED and CLOSED forget it); forget: socket k is closing;
 * drain: every event waiting on smon[k] (k >= 1), noted. */
void pswc_fork_add(psw_client_t *c);
void pswc_fork_remove(psw_client_t *c);
void pswc_fork_event(psw_client_t *c, int k, uint16_t event, uint32_t value);
void pswc_fork_forget(psw_client_t *c, int k);
void pswc_fork_drain(psw_client_t *c, int k);

#endif
