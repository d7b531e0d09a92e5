/* ps_config.h - the run description owned by psd.
 *
 * One struct holds everything that defines a run. It is filled from built-in
 * defaults, then a YAML file, then command-line flags (ps_config_set), and is
 * checked by ps_config_validate. The key table in ps_config.c is the single
 * source of truth for keys, types, defaults and the YAML printed by
 * ps_config_write_yaml. */
#ifndef PS_CONFIG_H
#define PS_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ps_groups.h"
#include "ps_tensor.h"

#define PS_MAX_LAYERS 16 /* dense layers; sizes[] holds PS_MAX_LAYERS + 1 */
#define PS_MAX_BATCH (1 << 20) /* train.batch_size and train.val_batch_size: at most */
#define PS_PATH_MAX 1024
#define PS_ENDPOINT_MAX 256

typedef enum { PS_OPT_SGD = 0, PS_OPT_ADAM, PS_OPT_ADAMW, PS_OPT_ADAGRAD } ps_opt_kind_t;
typedef enum {
    PS_SCHED_CONSTANT = 0,
    PS_SCHED_STEP,
    PS_SCHED_COSINE,
    PS_SCHED_ONECYCLE,
    PS_SCHED_TORCH /* schedule.torch: a PyTorch scheduler (ps_tsched.h) */
} ps_sched_kind_t;
typedef enum { PS_INTERVAL_EPOCH = 0, PS_INTERVAL_STEP } ps_interval_t; /* schedule.interval */
/* Where a key's value came from (ps_config_t.from): the key table's
 * default (or, for a user's model, PyTorch's: ps_config_user_defaults),
 * the config file or a flag, or the first worker's offer
 * (ps_config_adopt). */
typedef enum { PS_FROM_DEFAULT = 0, PS_FROM_CONFIG, PS_FROM_WORKER } ps_from_t;
#define PS_CONFIG_KEYS_MAX 128
#define PS_OFFER_MAX 16384 /* bytes of a worker's offered optimizer (psworker.h's PSW_OFFER_CONFIG_MAX) */
typedef enum { PS_ACT_RELU = 0 } ps_act_t;
typedef enum { PS_MODEL_MLP = 0, PS_MODEL_CTR, PS_MODEL_TENSORS, PS_MODEL_FROM_WORKER } ps_model_kind_t; /* model.kind */
typedef enum { PS_WIRE_F32 = 0, PS_WIRE_BF16 } ps_wire_dtype_t; /* tensors on the wire */
typedef enum { PS_SYNC_BSP = 0, PS_SYNC_ASYNC, PS_SYNC_SSP } ps_sync_t; /* consistency mode */
typedef enum { PS_LOG_ERROR = 0, PS_LOG_WARN, PS_LOG_INFO, PS_LOG_DEBUG } ps_log_level_t;
typedef enum { PS_LOG_TEXT = 0, PS_LOG_JSON } ps_log_format_t;

/* checkpoint.keep's largest value (psd_ckpt.h: shards resuming compare
 * every file a run keeps) */
#define PS_CKPT_KEEP_MAX 1000

/* Which way a metric improves (train.keep_best.mode, train.early_stop.mode):
 * auto is max for val_acc and val_auc, min for the others. */
typedef enum { PS_BEST_AUTO = 0, PS_BEST_MIN, PS_BEST_MAX } ps_best_mode_t;

typedef struct ps_config {
    /* run: */
    uint64_t seed;  /* run.seed: weights init and data order */
    int epochs;     /* run.epochs */

    /* model: an MLP sizes[0] -> sizes[1] -> ... -> sizes[n_sizes-1] */
    int n_sizes;                   /* model.layers: number of entries (>= 2) */
    int sizes[PS_MAX_LAYERS + 1];  /* model.layers: [784, 512, 256, 10] */
    ps_act_t activation;           /* model.activation: relu */
    ps_model_kind_t kind;          /* model.kind: mlp (images) | ctr (embedding bags, then the MLP) |
                                    * tensors (a table of named tensors the user's workers train) |
                                    * from_worker (the table and its initial values offered by the first worker) */
    int n_tensors;                 /* model.tensors (model.kind tensors): the table, in order */
    ps_tensor_spec_t *tensors;     /* n_tensors of them, owned (ps_config_free; a copy by value is a view) */
    char init_file[PS_PATH_MAX];   /* model.init: a safetensors file of initial values (model.kind tensors; without
                                    * model.tensors the table is the file's), "" = the tensors' inits */
    int64_t max_params;            /* model.max_params (from_worker): the most floats psd takes from a worker */

    /* ctr: the click-through task (model.kind: ctr; common/ps_ctr.h): examples made from
     * (seed, index), no files; the MLP's input is fields x dim, its output 2 classes */
    int ctr_fields;        /* ctr.fields: categorical fields per example */
    int ctr_per_field;     /* ctr.per_field: values per field and example (a bag) */
    int64_t ctr_vocab;     /* ctr.vocab: distinct values per field */
    double ctr_zipf;       /* ctr.zipf: exponent of the values' Zipf distribution */
    int64_t ctr_rows;      /* ctr.rows: rows of the embedding table (field, value) pairs hash into */
    int ctr_dim;           /* ctr.dim: floats per embedding row */
    bool ctr_mean;         /* ctr.mean: a bag is the mean of its rows (false: the sum) */
    double ctr_weight_std; /* ctr.weight_std: spread of the planted weights */
    double ctr_bias;       /* ctr.bias: planted bias (sets the click rate) */
    uint64_t ctr_seed;     /* ctr.seed: the generator's seed (planted weights and examples) */
    int64_t ctr_train;     /* ctr.train: training examples (indices 0..train-1) */
    int64_t ctr_test;      /* ctr.test: test examples (indices train..train+test-1) */
    double ctr_worker_table_mb; /* ctr.worker_table_mb: a table larger than this (MiB) stays on psd: workers
                                 * hold only the rows of their batch (0: always) */

    /* data: IDX files, gzipped or raw */
    char train_images[PS_PATH_MAX]; /* data.train_images */
    char train_labels[PS_PATH_MAX]; /* data.train_labels */
    char test_images[PS_PATH_MAX];  /* data.test_images */
    char test_labels[PS_PATH_MAX];  /* data.test_labels */
    double norm_mean;               /* data.normalize_mean: x = (pixel/255 - mean)/std */
    double norm_std;                /* data.normalize_std (> 0) */
    int64_t train_limit;            /* data.train_limit: use the first K training samples, 0 = all */
    int64_t train_size;             /* data.train_size (model.kind tensors, from_worker): training samples the
                                     * workers hold; 0: what the first worker says in READY */
    int64_t test_size;              /* data.test_size (model.kind tensors): test samples; 0: the first worker's */
    double val_fraction;            /* data.val_fraction: hold this part of the training set out for validation */
    int64_t val_size;               /* data.val_size: or this many samples (0: val_fraction decides) */

    /* train: */
    int batch_size;     /* train.batch_size: per worker, per step */
    int val_batch_size; /* train.val_batch_size */
    ps_wire_dtype_t wire_gradients; /* train.wire_gradients: f32 | bf16 (workers on the wire) */
    ps_wire_dtype_t wire_weights;   /* train.wire_weights: f32 | bf16 */
    ps_sync_t sync;                 /* train.sync: bsp | async | ssp */
    int staleness;                  /* train.staleness: ssp's bound k (steps ahead of the slowest) */
    bool stream;                    /* train.stream: gradients and weights in chunks, each stepped as it comes */
    bool rebalance;                 /* train.rebalance: async/ssp: a worker done with its samples takes some
                                     * of a slower one's */
    double sparse_threshold;        /* train.sparse_threshold: an embedding table's gradient goes as (ids, rows)
                                     * when a batch touches fewer than this fraction of its rows; 0 = always whole */
    char best_metric[48];           /* train.keep_best.metric: keep the weights of the epoch best by it ("": off) */
    ps_best_mode_t best_mode;       /* train.keep_best.mode */
    char best_path[PS_PATH_MAX];    /* train.keep_best.path: where (.safetensors: safetensors, else psd's format) */
    char stop_metric[48];           /* train.early_stop.metric: end the run when it stops improving ("": off) */
    ps_best_mode_t stop_mode;       /* train.early_stop.mode */
    int stop_patience;              /* train.early_stop.patience: epochs without improvement before it ends */
    double stop_min_delta;          /* train.early_stop.min_delta: an improvement is by more than this */
    double divergence_factor;       /* train.divergence.factor: the run stops as diverged when the mean loss of
                                     * its last steps is over this many times its first steps' (> 1; 0 = off:
                                     * only NaN and infinities stop it; psd_diverge.h) */

    /* optimizer: (server side) */
    ps_opt_kind_t opt;   /* optimizer.name: sgd | adam | adamw */
    double lr;           /* optimizer.lr: base (peak for onecycle) learning rate */
    double momentum;     /* optimizer.momentum (sgd) */
    bool nesterov;       /* optimizer.nesterov (sgd) */
    double weight_decay; /* optimizer.weight_decay: L2 for sgd/adam, decoupled for adamw */
    double beta1;        /* optimizer.beta1 */
    double beta2;        /* optimizer.beta2 */
    double eps;          /* optimizer.eps */
    double clip_norm;    /* optimizer.clip_norm: global-norm clipping, 0 = off */
    int n_groups;        /* optimizer.groups: per-tensor weight_decay / lr_scale by name (ps_groups.h) */
    ps_group_t groups[PS_GROUPS_MAX];

    /* schedule: all positions are in epochs (fractional), independent of N */
    ps_sched_kind_t sched;   /* schedule.name: constant | step | cosine | onecycle */
    double warmup_epochs;    /* schedule.warmup_epochs: linear warm-up, 0 = none */
    double step_epochs;      /* schedule.step_epochs: step: multiply by gamma every this many epochs */
    double gamma;            /* schedule.gamma */
    double min_lr;           /* schedule.min_lr: cosine floor */
    double pct_start;        /* schedule.pct_start: onecycle rising fraction */
    double div_factor;       /* schedule.div_factor: onecycle initial lr = lr/div_factor */
    double final_div_factor; /* schedule.final_div_factor: onecycle final = initial/final_div_factor */
    char sched_torch[2048];  /* schedule.torch (name torch): the scheduler's constructor text (ps_tsched.h) */
    ps_interval_t sched_interval; /* schedule.interval (name torch): epoch | step: what one scheduler step is */

    /* server: */
    char listen[PS_ENDPOINT_MAX]; /* server.listen */
    int workers;                  /* server.workers: worker processes to wait for */
    double start_timeout;         /* server.start_timeout: seconds */
    double worker_timeout;        /* server.worker_timeout: seconds of silence before a worker is lost */
    char metrics[PS_PATH_MAX];    /* server.metrics: JSON lines file, "" = none */
    char save[PS_PATH_MAX];       /* server.save: trained weights file, "" = none */
    ps_log_level_t log_level;     /* server.log_level: error | warn | info | debug */
    char key_file[PS_PATH_MAX];   /* server.key: psd's CurveZMQ secret key file, "" = no authentication */
    char allow_dir[PS_PATH_MAX];  /* server.allow: directory of allowed worker public keys (*.pub) */
    bool insecure;                /* server.insecure: listen beyond loopback without keys */
    int threads;                  /* server.threads: threads of a step (reduce + optimizer), 0 = all cores */
    int64_t chunk_bytes;          /* server.chunk_bytes: unit of a step's parallel work (rounded to 64 KiB) */
    bool shared_memory;           /* server.shared_memory: workers on psd's host exchange tensors in shared memory */
    int grad_room;                /* server.grad_room: wire gradients psd holds at once in bsp (0 = no bound, else >= 2) */
    ps_log_format_t log_format;   /* server.log_format: text | json (one object a line) */
    double progress_every;        /* server.progress_every: seconds between progress lines when stderr is not a terminal (0 = none) */
    char tcp_congestion[16];      /* server.tcp_congestion: auto, off or a name (ps_tcp.h) */
    char http[64];                /* server.http: HOST:PORT of the HTTP endpoint (/metrics, /status, /healthz, /), "" = off */
    char http_token_file[PS_PATH_MAX]; /* server.http_token_file: file whose first line is the bearer token HTTP asks for */
    int io_threads;               /* server.io_threads: ZeroMQ I/O threads, 0 = 2, or cores/4 up to 4 from 12 cores on */

    /* checkpoint: (not part of the config hash) */
    char ckpt_dir[PS_PATH_MAX]; /* checkpoint.dir: "" = no checkpoints */
    int ckpt_every_epochs;      /* checkpoint.every_epochs: 0 = not by epoch */
    int64_t ckpt_every_steps;   /* checkpoint.every_steps: 0 = not by step */
    int ckpt_keep;              /* checkpoint.keep: newest files kept (1-PS_CKPT_KEEP_MAX) */

    uint8_t from[PS_CONFIG_KEYS_MAX]; /* ps_from_t of each key, in the key table's order */
} ps_config_t;

/* Fill with the built-in defaults: Fashion-MNIST MLP that reaches >= 89%. */
void ps_config_defaults(ps_config_t *c);
/* Free what c owns (model.tensors); c keeps its other values. Safe twice. */
void ps_config_free(ps_config_t *c);

/* Merge a YAML file (or string) over c. On error returns -1, leaves c
 * unchanged and writes a one-line message into err, e.g.
 * "run.yaml:7: unknown key 'optimizer.lrr'". name is used in messages for
 * load_string (NULL: "<string>"). An empty document leaves c as it is. */
int ps_config_load_file(ps_config_t *c, const char *path, char *err, size_t errlen);
int ps_config_load_string(ps_config_t *c, const char *yaml, size_t len, const char *name,
                          char *err, size_t errlen);

/* Set one dotted key ("optimizer.lr", "model.layers" = "784,256,10" or
 * "[784, 256, 10]") from text, as a flag would. -1 + message on error, c
 * unchanged. */
int ps_config_set(ps_config_t *c, const char *key, const char *value, char *err, size_t errlen);

/* Check each key against its range, then the rules between keys
 * (ps_config_check_rules). -1 + message. */
int ps_config_validate(const ps_config_t *c, char *err, size_t errlen);
/* The rules between keys alone (ps_config_rules.c). -1 + message. */
int ps_config_check_rules(const ps_config_t *c, char *err, size_t errlen);

/* Write the whole config as YAML that ps_config_load_* reads back to the
 * same values. Returns 0 or -1 on I/O error. */
int ps_config_write_yaml(const ps_config_t *c, FILE *f);

/* FNV-1a 64 of the YAML ps_config_write_yaml writes, without the server
 * section: identifies what is trained (model, data, optimizer, schedule,
 * seed), not where or how it is served. Aborts only when out of memory. */
uint64_t ps_config_hash(const ps_config_t *c);

/* Where key's value came from (PS_FROM_DEFAULT for an unknown key). */
ps_from_t ps_config_from(const ps_config_t *c, const char *key);
const char *ps_from_name(ps_from_t f); /* "default", "config", "worker" */

/* The keys, in table order: the i-th key's name, or NULL past the last. */
const char *ps_config_key(size_t i);

/* Copy key's value from src to dst (and where it came from). 0, or -1 for
 * an unknown key. */
int ps_config_copy_key(ps_config_t *dst, const ps_config_t *src, const char *key);
/* Set key to the key table's default (PS_FROM_DEFAULT). 0, or -1. */
int ps_config_reset_key(ps_config_t *c, const char *key);
/* ps_config_set that records the value as the worker's (PS_FROM_WORKER) or
 * the default's: what ps_config_user_defaults and ps_config_adopt set. */
int ps_config_set_from(ps_config_t *c, const char *key, const char *value, ps_from_t from, char *err, size_t errlen);

/* key's value as the YAML writes it, into buf (truncated to n). */
void ps_config_value_text(const ps_config_t *c, const char *key, char *buf, size_t n);

/* A user's model (model.kind tensors, from_worker): the optimizer and
 * schedule keys nothing set (PS_FROM_DEFAULT) take PyTorch's defaults for
 * optimizer.name (torch.optim's: sgd lr 0.001, momentum 0, nesterov false,
 * weight_decay 0; adam lr 0.001, betas 0.9/0.999, eps 1e-8, weight_decay 0;
 * adamw the same with weight_decay 0.01; adagrad lr 0.01, eps 1e-10,
 * weight_decay 0) and a constant schedule. The built-in models keep the key
 * table's (tuned) defaults. Call after loading and after ps_config_adopt. */
void ps_config_user_defaults(ps_config_t *c);

/* The first worker's offer (YAML of optimizer.* and schedule.* keys)
 * adopted: each key it gives that the config does not set (not
 * PS_FROM_CONFIG) takes the offered value (PS_FROM_WORKER), then the
 * defaults of ps_config_user_defaults fill the rest. c is unchanged on
 * error: -1 with a message (a key of another section, a bad value, or a
 * result ps_config_validate refuses). */
int ps_config_adopt(ps_config_t *c, const char *yaml, char *err, size_t errlen);

/* The config c would have been before PyTorch's defaults were taken for a
 * user's model (the key table's defaults for the keys that took them):
 * into old, and the keys that differ as `--set KEY=VALUE` flags into
 * flags. Returns how many differ (0: c is what it was). */
int ps_config_before_user_defaults(const ps_config_t *c, ps_config_t *old, char *flags, size_t n);

/* Names for enums (for logs and YAML). */
const char *ps_opt_name(ps_opt_kind_t k);
const char *ps_sched_name(ps_sched_kind_t k);
const char *ps_sync_name(ps_sync_t k);
const char *ps_log_level_name(ps_log_level_t l);

#endif
