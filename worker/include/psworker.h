/* psworker.h - the worker side of the psd protocol, as a small C library.
 *
 * pworker is built on it; any training program can be a psd worker with it:
 *
 *   psw_client_t *c = psw_client_new("tcp://host:5555", &info, err, sizeof err);
 *   psw_client_register(c, &assign, timeout, err, sizeof err);  // rank, the tensor table, data
 *   ... check data, psw_client_ready(c, ...) ...
 *   for (;;) switch (psw_client_next(c, &ev, timeout, ...)) {
 *       EPOCH: sample ids; WEIGHTS: compute, psw_client_push_v(c, &push);
 *       VALIDATE: psw_client_val_result(...); SHUTDOWN: exit }
 *
 * The run's model is a table of named tensors (psw_assign_t.tensors): the
 * built-in models' (fc1.weight, ...), one psd's config lists, or, with
 * model.kind from_worker, the one the first worker offers (psw_info_t.offer).
 * Tensors are named by their index in that table. examples/c/fm_worker.c is
 * a whole worker of a model psd has never heard of. Version 2 of the
 * library (libpsworker.so.2): the table, and the push as one struct;
 * version 3: the data's fingerprint in READY, validation on a held-out
 * split (psw_event_t.split, val_ids) and named sums (psw_val_t); psd's
 * reduced figures of its last validation in EPOCH and SHUTDOWN events
 * (psw_event_t.last_val), and a worker that ends the run
 * (psw_client_end_run).
 *
 * Every call is blocking with a deadline; nothing waits forever. Functions
 * return 0 or a negative errno (-ETIMEDOUT when psd stayed silent, -EPROTO for
 * a protocol mismatch or refusal, with a message in err). The client owns one
 * ZeroMQ context and DEALER socket; not thread-safe. */
#ifndef PSWORKER_H
#define PSWORKER_H

#include <stddef.h>
#include <stdint.h>

#define PSW_MAX_LAYERS 16
#define PSW_MAX_TENSORS 16384 /* tensors in a run's table */
#define PSW_NAME_MAX 255     /* bytes of a tensor's name */
#define PSW_MAX_DIMS 8
#define PSW_PATH_MAX 1024

/* One tensor of the run's model, as psd's table has it (ASSIGN, protocol
 * 7). Pushes and events name tensors by their index in the table. */
typedef struct {
    char name[PSW_NAME_MAX + 1];
    int ndim;                      /* 0: a scalar */
    uint64_t shape[PSW_MAX_DIMS];
    uint64_t numel;
    int sparse_rows;               /* stepped by rows (an embedding table) */
    uint64_t offset;               /* ASSIGN: where psd lays it out, in floats from the model's start (small
                                    * tensors packed one after another): gradients in one buffer laid out so
                                    * are pushed without a copy (psw_client_push_v); not read in an offer */
} psw_tensor_t;

typedef struct psw_client psw_client_t;

typedef struct {
    const char *device;        /* "cpu" */
    int device_index;          /* -1 for cpu */
    const char *identity_hint; /* e.g. SLURM_PROCID, may be NULL */
    unsigned threads;          /* user's --threads, 0 = default */
    unsigned protocol;         /* 0 = this library's protocol (tests override) */
    uint64_t run_id;           /* rejoining run run_id after psd was lost; 0 = new */
    uint32_t prev_rank;        /* with run_id: the rank held before */
    const char *curve_public;  /* CurveZMQ: this worker's key pair and psd's public key, Z85 */
    const char *curve_secret;  /* (40 characters each); all NULL = no encryption */
    const char *curve_server;
    const void *identity;      /* ZeroMQ routing id, stable for the process (may be NULL) */
    size_t identity_len;       /* 1..255 bytes */
    int no_shm;                /* never use shared memory with psd, even on its host */
    /* this worker's own model, offered at registration (psd's model.kind
     * from_worker: the first worker to register gives the run its model;
     * every later one's table must be the same): n_offer tensors (name,
     * ndim, shape, sparse_rows; numel is not read) and each one's initial
     * values (numel floats, read during psw_client_register only) */
    int n_offer;
    const psw_tensor_t *offer;
    const float *const *offer_values;
    /* (the optimizer offered with the model is not a field here, which would
     * change this struct's size for programs built against libpsworker.so.3:
     * psw_client_offer_config, between psw_client_new and _register) */
} psw_info_t;
#define PSW_OFFER_CONFIG_MAX 16384 /* psd's PS_OFFER_MAX */

typedef struct {
    char role[32];
    char path[PSW_PATH_MAX];
    uint64_t size, hash;
} psw_file_t;


typedef enum {
    PSW_MODEL_MLP = 0,   /* the built-in MLP on IDX image files (sizes, files) */
    PSW_MODEL_CTR,       /* the built-in click-through model (sizes, ctr) */
    PSW_MODEL_TENSORS,   /* the user's model: the table only; the worker brings its data */
} psw_model_kind_t;

typedef struct {
    uint32_t rank;
    uint64_t run_id;
    psw_model_kind_t model;
    int n_tensors;                 /* the model's tensors, in order (every model) */
    const psw_tensor_t *tensors;   /* n_tensors of them: the client's, until it registers again or is destroyed */
    int n_sizes;                   /* the built-in models' MLP sizes (0 for PSW_MODEL_TENSORS) */
    int sizes[PSW_MAX_LAYERS + 1];
    int n_files;
    psw_file_t files[4];       /* train_images, train_labels, test_images, test_labels */
    uint32_t batch_size, val_batch_size;
    double norm_mean, norm_std;
    uint64_t train_limit;
    uint32_t epochs;
    uint64_t seed;
    uint32_t sync;             /* train.sync: 0 bsp, 1 async, 2 ssp */
    uint32_t staleness;        /* train.staleness (ssp) */
    double sparse_threshold;   /* train.sparse_threshold: see psw_grad_t.row_ids */
    double start_timeout_s;    /* how long to wait for the first epoch */
    double step_timeout_s;     /* how long to wait for any later reply */
    double silence_s;          /* psd takes a worker it waits for and hears nothing from this long for lost */
    int shm;                   /* tensors go through shared memory with psd (same host) */
    int stream;                /* train.stream: pushes and weights go in chunks (psw_client_push_v splits them) */
    /* model.kind: ctr when ctr.fields > 0 (n_files 0): examples come from the generator of
     * common/ps_ctr.h, training ones are indices [0, train), test ones [train, train + test);
     * the model has an embedding table E (rows x dim) after the MLP's tensors */
    struct {
        int fields, per_field, dim, mean;
        uint64_t vocab, rows, seed, train, test;
        double zipf, weight_std, bias;
        int table_on_psd;      /* the table stays on psd: events bring the rows asked for (psw_client_pull_rows) */
    } ctr;
    uint32_t world;            /* workers in the run: psd's server.workers, or the live workers with this one when
                                * more (each EPOCH event's world after); 0 from a psd that does not say */
} psw_assign_t;

typedef enum {
    PSW_EV_EPOCH = 1,   /* samples[]: this worker's training sample ids for the epoch */
    PSW_EV_WEIGHTS,     /* tensors[]: new weights at `version` */
    PSW_EV_VALIDATE,    /* tensors[] + the samples val_ids[] of the set `split` to evaluate them on */
    PSW_EV_SHUTDOWN,    /* exit with exit_code */
} psw_event_kind_t;

/* Which data a VALIDATE event is on. */
typedef enum {
    PSW_SPLIT_TEST = 0, /* the test set: val_ids are test sample ids (val_begin..val_end-1) */
    PSW_SPLIT_VAL = 1,  /* the held-out validation part of the training set (psd's data.val_fraction or
                         * data.val_size): val_ids are training sample ids; psd never trains on them */
} psw_split_t;

#define PSW_MAX_SUMS 16   /* named sums in one validation result */
#define PSW_SUM_NAME_MAX 32

/* A named sum of a validation result: name 1 to PSW_SUM_NAME_MAX of
 * [a-z0-9_], not loss, acc, correct, count, samples or auc; value finite. */
typedef struct {
    const char *name;
    double value;
} psw_sum_t;

/* The answer to a VALIDATE event: its part's sums over its samples. psd
 * adds the parts up in a fixed order and reports each sum as a mean per
 * sample: loss_sum as val_loss, correct as val_acc, sums[i] as
 * val_<name> (test_... for the closing test evaluation). Every answer of
 * a run names the same sums in the same order. scores: NULL, or
 * (model.kind ctr, where psd needs them for the AUC) each example's click
 * probability, count floats in the part's order. */
typedef struct {
    uint32_t epoch;        /* these four: the event's (psw_val_for) */
    uint64_t version;
    uint64_t begin;
    psw_split_t split;
    double loss_sum;
    uint64_t correct;
    uint64_t count;        /* the part's samples: n_val_ids */
    const float *scores;
    int n_sums;
    const psw_sum_t *sums;
} psw_val_t;

typedef struct {
    psw_event_kind_t kind;
    uint32_t epoch;
    uint64_t version;
    uint64_t step;
    uint32_t world, workers_on_host;
    const uint32_t *samples;   /* borrowed until the next psw_client_next */
    size_t n_samples;
    int append;                /* EPOCH: more samples for the current epoch, after the ones given */
    uint64_t keep;             /* EPOCH with append: > 0: the current epoch's samples end after the first
                                * keep (async/ssp: psd gave the rest to workers done with theirs) */
    int n_tensors;                 /* WEIGHTS, VALIDATE: every tensor of the table, in order */
    const float *const *tensors;   /* borrowed until the next psw_client_next (with
                                    * psw_client_release_on_push: until a push with pull) */
    const size_t *tensor_numel;
    /* VALIDATE: evaluate tensors on samples val_ids[0, n_val_ids) of the
     * set `split` (borrowed until the next psw_client_next) and answer with
     * psw_client_val_result (psw_val_for fills in what identifies it);
     * [val_begin, val_end) names the part (test: the ids themselves;
     * val: positions in psd's list of validation ids). final: the run's
     * closing test evaluation (of the last weights, or of the best epoch's:
     * `version` and `epoch` are then that epoch's) */
    uint64_t val_begin, val_end;
    psw_split_t split;
    const uint32_t *val_ids;
    size_t n_val_ids;
    int final;
    /* the table on psd (ctr.table_on_psd): tensors[table] holds these rows
     * (strictly increasing), n_row_ids x dim floats: a WEIGHTS event the
     * rows asked for with the push or pull that asked for it, a VALIDATE
     * event the rows its range's examples read */
    const uint32_t *row_ids;
    size_t n_row_ids;
    int exit_code;
    char message[256];
    /* EPOCH (not append) and SHUTDOWN: psd's last finished validation of the
     * run, has_last_val 1 where psd sent one (none before the first, nor
     * from a psd resumed from a checkpoint until it validates again): the
     * whole set's sums as psd reduced them for its metrics line (val_loss =
     * loss_sum / count, val_acc = correct / count, val_<name> = sums[i].value
     * / count). epoch (0-based), split, loss_sum, correct, count, n_sums and
     * sums are set; version and begin are 0, scores NULL. last_val_final:
     * it was the run's closing test (psw_event_t.final of its VALIDATE).
     * sums[] and their names are the client's, valid until the next
     * psw_client_next (copy what is kept). */
    int has_last_val;
    psw_val_t last_val;
    int last_val_final;
} psw_event_t;

/* Connect (lazily: ZeroMQ connects in the background). NULL + err on a bad
 * endpoint. Caller owns (psw_client_destroy).
 * fork(): a forked child must not use a client of its parent (nor destroy
 * it); its connections are closed in the child (the parent's stay), so that
 * psd hears at once when the worker dies while a child lives (a torch
 * DataLoader's reader processes). A child that runs psd work makes its own
 * client. */
psw_client_t *psw_client_new(const char *endpoint, const psw_info_t *info, char *err, size_t errlen);
void psw_client_destroy(psw_client_t **c);

/* Register and wait up to timeout_s for the assignment. -ESHUTDOWN (err
 * says why) when psd ended the run instead (a worker registering again after
 * psd declared it lost, as the run ends): psw_client_shutdown_code() is the
 * exit code psd gave. */
int psw_client_register(psw_client_t *c, psw_assign_t *out, double timeout_s, char *err, size_t errlen);

/* The optimizer and schedule this worker's code offers with its model
 * (psd's model.kind from_worker: the first worker's is the run's, under the
 * keys psd's own config sets; docs/config.md): YAML of optimizer.* and
 * schedule.* keys, at most PSW_OFFER_CONFIG_MAX bytes; NULL or "" = none.
 * Copied; sent by every later psw_client_register. 0, or -1 (why). */
int psw_client_offer_config(psw_client_t *c, const char *yaml, char *err, size_t errlen);
int psw_client_shutdown_code(const psw_client_t *c);

/* Data checked; ready to train: the sizes of this worker's training and
 * test sets, and a fingerprint of their contents the worker computes (a
 * hash of its files, a data set version: up to 255 printable bytes; NULL
 * or "" for none). psd refuses a worker whose sizes or fingerprint differ
 * from the run's (the first worker's, or its config's data.train_size and
 * data.test_size): psw_client_next then gives SHUTDOWN with both named. */
int psw_client_ready(psw_client_t *c, uint64_t train_count, uint64_t test_count, const char *data_id);

/* Wait up to timeout_s for the next instruction from psd. */
int psw_client_next(psw_client_t *c, psw_event_t *ev, double timeout_s, char *err, size_t errlen);

/* Ask for weights of version >= min_version (answered by a WEIGHTS event). */
int psw_client_pull(psw_client_t *c, uint64_t min_version);
/* The same, with the table as rows want[0, n) only (strictly increasing,
 * n >= 1), where psw_client_rows_ok, one psd: how a worker whose table
 * stays on psd gets the rows of a batch its last push did not ask for. */
int psw_client_pull_rows(psw_client_t *c, uint64_t min_version, const uint32_t *want, size_t n);

/* One tensor's gradient in a push: tensor `tensor` of the run's table
 * (psw_assign_t.tensors), whole (data: its numel floats), or, for any
 * of the run's sparse-rows tensors where psw_client_rows_ok, as rows:
 * n_rows ids (strictly increasing, n_rows >= 1) and their gradient rows
 * (row_vals, n_rows x the row's floats); psd takes the other rows'
 * gradient as zero, so the step is the one the whole tensor would give.
 * Each tensor given as rows takes two frames of the message's 64. */
typedef struct {
    uint32_t tensor;
    const float *data;
    const uint32_t *row_ids;
    size_t n_rows;
    const float *row_vals;
} psw_grad_t;

/* A push: the mean gradient of a batch of `batch` samples computed on the
 * weights of `version`, with the batch's summed loss and correct count. A
 * gradient may be pushed in several parts (each layer as soon as its
 * backward is done), every part with the same batch statistics; psd steps
 * once it has every tensor (a part of tensors psd packs with others not
 * pushed yet sends nothing: they go with the part that completes their
 * unit). pull: ask for the next version (on the last part). want (with pull and the table's rows pushed): the table rows,
 * strictly increasing, the next batch reads; the WEIGHTS reply then brings
 * only those (psw_event_t.row_ids). The struct is read during the call;
 * the buffers it points to are sent without copying: do not modify them
 * until psw_client_push_done() returns nonzero (in synchronous mode, any
 * reply of psd implies it). 0, or -EINVAL for a gradient that is not one
 * of the table's (or rows where they cannot go), or -errno. */
typedef struct {
    uint64_t version;
    uint32_t batch;
    double loss_sum;
    uint64_t correct;
    int pull;
    int n_grads;
    const psw_grad_t *grads;
    const uint32_t *want;
    size_t n_want;
} psw_push_t;

int psw_client_push_v(psw_client_t *c, const psw_push_t *p);
int psw_client_push_done(psw_client_t *c);
/* Sleep until psw_client_push_done (woken by the I/O thread that lets the
 * last buffer go; a caller from Python through ctypes waits without the
 * GIL): 0, or -ETIMEDOUT after timeout_s. With more workers on the wire
 * than psd's server.grad_room, a push may be announced and its buffers kept
 * until psd asks for them (GO): this call, psw_client_next and any other
 * message sent (barrier, pull, validation result) wait for that, keeping
 * what else psd sent meanwhile for psw_client_next. */
int psw_client_push_wait(psw_client_t *c, double timeout_s);
/* Promise (on: nonzero) that once a push asks for the next version (pull),
 * the caller no longer reads the tensors of the last weights psd sent it
 * (a WEIGHTS or VALIDATE event's). On psd's host those tensors are psd's
 * shared parameter slot: told so, psd may update that slot in place
 * instead of filling another (a step reads two arrays and writes one of
 * them instead of reading two and filling a third; docs/benchmarks.md has
 * what it saves). A push made while weights it asked
 * for have not come yet releases nothing (psd might step the slot those
 * name before the caller reads them). Off by default: a caller that keeps
 * reading the tensors until the next event must leave it off. */
void psw_client_release_on_push(psw_client_t *c, int on);
/* bfloat16 on the wire (psd's train.wire_gradients / train.wire_weights:
 * bf16; never through shared memory): whether this run's gradients and
 * weights go as bfloat16 (after psw_client_register; either may be NULL). */
void psw_client_wire_bf16(const psw_client_t *c, int *grads, int *weights);
/* The caller converts to and from bfloat16 itself (on: nonzero; e.g. on
 * its GPU, so that host buffers and copies are half the bytes): where the
 * gradients go as bfloat16, psw_grad_t.data points at the tensor's numel
 * bfloat16 values (uint16_t, rounded by the caller), sent as they are; and
 * where the weights come as bfloat16 the library keeps them as they came
 * (psw_client_weights_bf16) besides widening them for the event. Set it
 * before psw_client_register. Dense whole tensors only (no rows). */
void psw_client_bf16_given(psw_client_t *c, int on);
/* With psw_client_bf16_given on and bfloat16 weights: the last WEIGHTS or
 * VALIDATE event's weights as psd sent them, the model's n_params bfloat16
 * values laid out as psd lays it out (psw_tensor_t offsets), valid until
 * the next event; NULL otherwise. */
const uint16_t *psw_client_weights_bf16(const psw_client_t *c);
/* Whether the run's sparse-rows table may be pushed as rows
 * (psw_grad_t.row_ids): over the wire, whole steps, f32 gradients; with psd
 * shards, when every shard's piece of the table is whole rows (each gets
 * the rows in its piece). With want, each shard holding a piece of the
 * table answers with the rows of its piece; the table is the client's
 * whole-model buffer with them scattered in. */
int psw_client_rows_ok(const psw_client_t *c);
/* On psd's host (shared memory): the region psd reads gradients from, the
 * model's n_params floats in layout order; a gradient computed in place
 * there is pushed without any copy (others are copied in by push). Write it
 * only while psd does not read it: before a push, and after psd's reply to
 * it (the next WEIGHTS event). NULL when tensors go over the wire. */
float *psw_client_push_region(psw_client_t *c);

/* My part of the epoch is done. */
int psw_client_barrier(psw_client_t *c, uint32_t epoch, uint64_t samples);

/* A psw_val_t for VALIDATE event ev, its sums zero. */
psw_val_t psw_val_for(const psw_event_t *ev);
int psw_client_val_result(psw_client_t *c, const psw_val_t *v);

/* Still alive (send while computing for more than a second). */
int psw_client_heartbeat(psw_client_t *c, uint32_t epoch);

/* Planned departure (e.g. SIGTERM): psd gives this worker's remaining
 * samples to the others; not a failure. */
int psw_client_leave(psw_client_t *c, const char *reason);

/* End the whole run (the worker's own framework decided to stop: an early
 * stop, a smaller epoch count): this worker leaves as with
 * psw_client_leave, and psd ends the run as psctl stop does (a checkpoint
 * where configured, then SHUTDOWN exit 0 to the other workers; psd exits
 * 0). reason (copied; NULL or "" for none) goes into psd's log. Once psd
 * stops, a second worker's call is only its leave. */
int psw_client_end_run(psw_client_t *c, const char *reason);

uint64_t psw_client_run_id(const psw_client_t *c);
/* Weights messages whose tensors were checked against psd's CRC-32 (sent
 * with psd --x-verify-weights; a mismatch is an -EPROTO error). */
uint64_t psw_client_verified(const psw_client_t *c);

/* Return codes of psw_client_next/register besides 0: -ETIMEDOUT (psd
 * silent), -ECONNRESET (connection to psd dropped), -EACCES (psd refused the
 * connection: authentication failed), -ENOLINK (psd declared
 * this worker lost: register again to rejoin), -EPROTO (refused: other
 * protocol or run, or invalid message), -EINTR (a signal). */

/* Tell psd this worker fails (data mismatch, device error) before exiting. */
int psw_client_fail(psw_client_t *c, int data_error, const char *message);

uint32_t psw_client_rank(const psw_client_t *c);

/* sizeof the library's struct `name` ("psw_event_t", ...; 0: no such
 * struct): how a binding that mirrors them (python/psd/_lib.py) checks
 * its copies against the library it loaded. */
size_t psw_struct_size(const char *name);

/* A 16-byte ZeroMQ routing id for psw_info_t.identity, unique to this host,
 * process, moment and salt (several clients in one process: other salts).
 * Keep it for the process: psd recognises a worker reconnecting by it. */
void psw_make_identity(uint8_t id[16], uint64_t salt);

/* For the program (not called by the library itself): keep freed memory for
 * the next message instead of giving it back to the kernel (glibc: one
 * arena, no mmap for large blocks, no trimming), so that every large message
 * received over tcp does not fault in every 4 KiB page (bench/torch_keep_memory.sh
 * measures it; docs/benchmarks.md). The process's memory
 * then stays at its high-water mark. Call it first, before threads start (a
 * psw_client's are ZeroMQ's); pworker does, psd.torch.Worker does unless
 * keep_memory=False. */
void psw_keep_freed_memory(void);

/* psd keygen's key files for psw_info_t.curve_*: this worker's key pair
 * (key_file, mode 0600) and psd's public key, as pworker's --key and
 * --server-key read them: 40 Z85 characters and a NUL into each out. 0, or
 * -EINVAL with the reason in err. */
int psw_load_keys(const char *key_file, const char *server_key_file, char public_z85[41], char secret_z85[41],
                  char server_z85[41], char *err, size_t errlen);

/* The click-through task's generator (model.kind ctr's data, common/ps_ctr.h)
 * for workers that bring their own model of it: examples are a pure function
 * of (generator, index), the same bits as pworker's. psd.ctr in the Python
 * package is this. Training examples are indices [0, train), test ones
 * [train, train + test), as psd gives them. */
typedef struct {
    int fields;          /* categorical fields an example */
    int per_field;       /* values a field (1: one-hot; more: a bag) */
    uint64_t vocab;      /* distinct values a field */
    double zipf;         /* exponent of the values' Zipf distribution */
    uint64_t rows;       /* embedding rows (field, value) pairs are hashed into */
    double weight_std;   /* the planted model's weights' spread */
    double bias;         /* the planted model's bias */
    uint64_t seed;
} psw_ctr_gen_t;

/* Examples index[0..n): rows[i * fields * per_field + f * per_field + j] =
 * the embedding row of field f's j-th value of example i, labels[i] = 0 or
 * 1, p_click[i] (p_click may be NULL) = the planted click probability.
 * 0, or -EINVAL with the reason in err (a generator that cannot be). */
int psw_ctr_examples(const psw_ctr_gen_t *g, const uint64_t *index, size_t n, uint32_t *rows, uint8_t *labels,
                     double *p_click, char *err, size_t errlen);

#endif
