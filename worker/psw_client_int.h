/* psw_client_int.h - the worker library's client state, shared by its
 * files: psw_client.c (the connection: registration, requests, pushes, the
 * socket's messages), psw_client_rx.c (what comes back: weights, rows and
 * validation parts, whole or streamed, into events) and
 * psw_client_shards.c (psd shards: their connections, pushes split by
 * piece, weights put together from their parts). What differs between one
 * psd and shards is pswc_ops_t, chosen at registration. Private to the
 * library: psworker.h is the public API. One psw_client_t per worker, used
 * by one thread. */
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

/* psd shards (ASSIGN names shards 1..n-1; psw_client_shards.c): a DEALER
 * to each, the pieces every shard holds (ps_shard_pieces), and the weights
 * put together from their parts: an event is returned once every shard's
 * part of its version is in wbuf. Zero but n with one psd. */
struct psw_shards {
    int n;                  /* 1: one psd */
    void *sock[PS_MAX_SHARDS]; /* [0] unused: psw_client.sock */
    void *mon[PS_MAX_SHARDS];  /* PAIR receiving sock[k]'s connection events ([0] unused: psw_client.mon) */
    ps_piece_t pieces[PS_MAX_SHARDS][PS_MAX_TENSORS];
    int rows;               /* every shard's piece of the table is whole rows: row pushes go to the shards */
    float *wbuf;
    float *tbuf;            /* the table on psd: the rows asked for (want's order), put together */
    size_t tbuf_cap;        /* rows tbuf has room for */
    uint64_t got[PS_MAX_SHARDS]; /* version + 1 of each shard's part in wbuf (0: none) */
    uint32_t rows_part;          /* shards whose last part was rows only (the rest of their piece is older) */
    pswc_event_t pend;      /* WEIGHTS/VALIDATE from shard 0 waiting for the other parts */
    int pending;
    /* VALIDATEs from shard 0 that came while one waited for the other
     * shards' parts (psd may give a worker several parts at once): taken
     * in order once it is returned, so that the shards' replies answer
     * the part they were asked for */
    ps_msg_t *defer;        /* PSW_MAX_DEFER of them, made at the first */
    int n_defer;
};

/* A sparse-rows unit's gradient as rows: n >= 1 strictly increasing ids
 * and their rows (n x its width); ids NULL: the unit goes whole. */
typedef struct {
    const uint32_t *ids;
    const float *vals;
    size_t n;
} pswc_rows_t;

/* What the client does one way with one psd and another with psd shards:
 * one table each (pswc_one_ops: psw_client.c, psw_client_rx.c;
 * pswc_shards_ops: psw_client_shards.c), chosen once at registration
 * (assign_setup, after pswc_shards_connect) and called as c->ops->... */
typedef struct pswc_ops {
    const char *name;
    bool stream;            /* streamed steps (ASSIGN's stream_chunk_bytes): one psd only */
    /* receiving: poll_add adds the mode's sockets to it[ni..] (returns the
     * new count); recv_polled reads one of them that poll found readable
     * (it: those it added) into c->cur: PSWC_GOT, PSWC_AGAIN (dropped: poll
     * again), PSWC_NONE (none: psd's own socket next), or < 0 (err) */
    int (*poll_add)(psw_client_t *c, zmq_pollitem_t *it, int ni);
    int (*recv_polled)(psw_client_t *c, const zmq_pollitem_t *it, char *err, size_t errlen);
    /* the next message for next_event (a held one first): 0 or < 0 */
    int (*next_msg)(psw_client_t *c, double deadline, double timeout_s, char *err, size_t errlen);
    /* a WEIGHTS or VALIDATE in c->cur (or, with shards, any message from
     * shard k > 0): 1: *ev is an event to return; 0: wait for more; < 0: error */
    int (*take)(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen);
    /* a PUSH over the wire (h made by push_header; rows NULL: the tensors whole) */
    int (*push)(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                const size_t *numel, const pswc_rows_t *rows, const uint32_t *want, size_t n_want);
    int (*pull)(psw_client_t *c, uint64_t min_version);
    int (*pull_rows)(psw_client_t *c, uint64_t min_version, size_t n); /* the rows: c->want[0..n) */
    int (*rows_room)(psw_client_t *c, size_t n); /* where n rows asked for go (pswc_keep_want): 0 or -ENOMEM */
    bool (*rows_ok)(const psw_client_t *c);      /* row pushes possible (psw_client_rows_ok's part) */
    void (*close)(psw_client_t *c);              /* the mode's connections and buffers (then pswc_one_ops) */
} pswc_ops_t;

enum { PSWC_NONE = 0, PSWC_GOT = 1, PSWC_AGAIN = 2 };

extern const pswc_ops_t pswc_one_ops, pswc_shards_ops;

/* Announced pushes (psw_client_room.c): the push whose tensors wait for
 * psd's GO, and messages that came before it */
#define PSWC_ROOM_DEFER 8
typedef struct {
    bool announce;          /* ASSIGN's announce_pushes */
    bool go;                /* the last WEIGHTS said go: this step's push goes at once */
    bool pending;           /* a push announced, its tensors kept until GO */
    double timeout_s;       /* how long sending anything else waits for the GO (the step timeout) */
    Psd__Push push;         /* its header (pull: any part's) */
    int n;
    int ids[PS_MAX_TENSORS];
    const float *grads[PS_MAX_TENSORS];
    size_t numel[PS_MAX_TENSORS];
    int n_defer;
    ps_msg_t defer[PSWC_ROOM_DEFER];
} pswc_room_t;

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
    int from;               /* psd shard it came from (0: psd) */
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
    /* psw_client_bf16_given: the caller's gradients are bfloat16 already,
     * and the weights are also kept as they came (w16, laid out like the
     * model; psw_client_weights_bf16) */
    bool given16;
    uint16_t *w16;
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
     * (mon, sh.mon[k]); written under psw_fork.c's lock, read without it by
     * this client's thread only */
    pswc_conn_t conn[PS_MAX_SHARDS];
    int mon_rc;                 /* check_monitor's result when it was read for the fds: the next pswc_recv_msg's */
    psw_client_t *fork_prev, *fork_next; /* psw_fork.c's list of live clients */
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
    /* what differs between one psd and psd shards (set at registration:
     * pswc_one_ops until an ASSIGN names shards), and the shards' own state */
    const pswc_ops_t *ops;
    struct psw_shards sh;
    pswc_room_t room;
};

#define PSW_MAX_DEFER 64

/* psw_client.c's, for psw_client_rx.c */
size_t pswc_first_row_at(const uint32_t *ids, size_t n, size_t r);
int pswc_keep_want(psw_client_t *c, const uint32_t *want, size_t n);
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
/* and for psw_client_shards.c: a message's header (PSD__MSG_TYPE_*), a
 * pushed frame's free function, a tensor's check and its frame's cols */
void pswc_header_init(psw_client_t *c, Psd__Header *h, Psd__MsgType type);
void pswc_push_frame_done(void *data, void *hint);
bool pswc_layout_tensor(const psw_client_t *c, int id, size_t numel);
/* A gradient as the wire takes it (f32, or bfloat16 given or rounded into gconv) */
const void *pswc_wire_grad(psw_client_t *c, int id, const float *grad, size_t numel);
uint64_t pswc_tcols(const psw_client_t *c, int t);
/* psw_client_rx.c's: pswc_one_ops.take; and for psw_client_shards.c */
int pswc_one_take(psw_client_t *c, pswc_event_t *ev, char *err, size_t errlen);
void pswc_msg_move(ps_msg_t *dst, ps_msg_t *m);
/* psw_client_room.c: announced pushes. room_push: 1 if the push was kept
 * (announced), 0 if it goes now, < 0 error; room_go: psd's GO; settle:
 * before sending anything else, wait for the GO (others kept for next);
 * drop: the push will not be asked for; next: a kept message into c->cur */
int pswc_room_push(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                   const size_t *numel);
int pswc_room_go(psw_client_t *c);
int pswc_room_settle(psw_client_t *c, double timeout_s, char *err, size_t errlen);
void pswc_room_drop(psw_client_t *c);
bool pswc_room_next(psw_client_t *c);
void pswc_room_free(psw_client_t *c);
int pswc_frames_by_id(const ps_msg_t *m, int nf, int n_tensors, int at[PS_MAX_TENSORS]);
void pswc_scatter_rows(float *E, size_t D, const uint32_t *ids, size_t n, const float *vals);
int pswc_take_val_ids(psw_client_t *c, const Psd__Validate *v, pswc_event_t *ev, char *err, size_t errlen);
/* psw_client_shards.c: connect to the shards ASSIGN names (none: nothing
 * to do), after closing what the mode before held */
int pswc_shards_connect(psw_client_t *c, Psd__Assign *a, double timeout_s, char *err, size_t errlen);
void pswc_stream_release(psw_client_t *c);
bool pswc_table_rows(const psw_client_t *c, const uint32_t *ids, size_t n);

/* psw_fork.c: a forked child closes the fds of every live client's
 * connections. add: c is live (its conn[] none yet; the fork handler
 * registered, once), before its sockets connect; remove: before they close.
 * event: socket k's monitor event (k 0: psd's socket; CONNECTED notes the
 * fd, DISCONNECTED and CLOSED forget it); forget: socket k is closing;
 * drain: every event waiting on sh.mon[k] (k >= 1), noted. */
void pswc_fork_add(psw_client_t *c);
void pswc_fork_remove(psw_client_t *c);
void pswc_fork_event(psw_client_t *c, int k, uint16_t event, uint32_t value);
void pswc_fork_forget(psw_client_t *c, int k);
void pswc_fork_drain(psw_client_t *c, int k);

#endif
