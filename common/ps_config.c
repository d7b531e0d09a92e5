/* ps_config.c - defaults, YAML loading, flags, validation and YAML output.
 *
 * Everything is driven by one table, keys[], in the style of redis'
 * standardConfig: each entry names a dotted key, its type, where it lives in
 * ps_config_t, its range and its default. Defaults are written as the text a
 * flag would give and go through the same parser as flags and YAML, so the
 * table is checked every time ps_config_defaults runs.
 *
 * YAML is read with libyaml's event parser (not the document loader) so every
 * message can name the line of the offending key or value. */
#include "ps_config.h"
#include "ps_ctr.h"
#include "ps_data.h"
#include "ps_util.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "ps_assert.h"

#define PS_CFG_ASSERT PS_ASSERT

/* Enum fields are read and written as int. */
_Static_assert(sizeof(ps_opt_kind_t) == sizeof(int), "enum size");
_Static_assert(sizeof(ps_sched_kind_t) == sizeof(int), "enum size");
_Static_assert(sizeof(ps_act_t) == sizeof(int), "enum size");
_Static_assert(sizeof(ps_model_kind_t) == sizeof(int), "enum size");
_Static_assert(sizeof(ps_log_level_t) == sizeof(int), "enum size");

#define MAX_LAYER_SIZE (1 << 20)
#define MAX_FILE_BYTES (16u << 20) /* a config file; anything bigger is a mistake */
#define SHOW "%.80s"               /* how much of an offending value a message quotes */

/* ---------------------------------------------------------------- table */

typedef enum {
    KT_INT,    /* int */
    KT_INT64,  /* int64_t */
    KT_UINT64, /* uint64_t, full range */
    KT_DOUBLE, /* double, finite */
    KT_BOOL,   /* bool */
    KT_STRING, /* char[size], NUL-terminated; longer text is an error */
    KT_ENUM,   /* an enum stored as int, 0..n-1 = names[] */
    KT_LAYERS, /* model.layers: n_sizes + sizes[] */
    KT_TENSORS, /* model.tensors: n_tensors + tensors[] (YAML only) */
    KT_GROUPS,  /* optimizer.groups: n_groups + groups[] (YAML only) */
} key_type_t;

enum {
    F_OPEN_MIN = 1u << 0, /* KT_DOUBLE: value must be > dmin, not >= */
    F_OPEN_MAX = 1u << 1, /* KT_DOUBLE: value must be < dmax, not <= */
    F_NONEMPTY = 1u << 2, /* KT_STRING: "" is not allowed */
    F_UNHASHED = 1u << 3, /* not part of the config hash: changes how, not what, is trained */
    F_CTR = 1u << 4,      /* part of the hash only with model.kind ctr (an MLP's hash stays what it was) */
    F_OFF = 1u << 5,      /* KT_DOUBLE: "off" is also a value, stored as 0 (and written as off) */
    F_TENSORS = 1u << 6,  /* part of the hash only with model.kind tensors */
    F_KIND = 1u << 7,     /* part of the hash unless model.kind is mlp */
    F_SET = 1u << 8,      /* KT_DOUBLE, KT_INT64, KT_ENUM: part of the hash only when not 0, KT_STRING: when not
                           * "" (keys added later: the hashes of the runs before them stay what they were) */
};

typedef struct {
    const char *key;          /* "section.name" */
    key_type_t type;
    size_t off;               /* offset of the field in ps_config_t */
    size_t size;              /* KT_STRING: buffer size including the NUL */
    int64_t imin, imax;       /* KT_INT, KT_INT64; KT_LAYERS: each size */
    double dmin, dmax;        /* KT_DOUBLE; +-INFINITY = unbounded */
    unsigned flags;           /* F_* */
    const char *const *names; /* KT_ENUM: NULL-terminated */
    const char *def;          /* default, as a flag would spell it */
} key_spec_t;

static const char *const opt_names[] = {"sgd", "adam", "adamw", "adagrad", NULL};
static const char *const wire_names[] = {"f32", "bf16", NULL};
static const char *const sync_names[] = {"bsp", "async", "ssp", NULL};
static const char *const log_format_names[] = {"text", "json", NULL};
static const char *const sched_names[] = {"constant", "step", "cosine", "onecycle", "torch", NULL};
static const char *const interval_names[] = {"epoch", "step", NULL};
static const char *const act_names[] = {"relu", NULL};
static const char *const kind_names[] = {"mlp", "ctr", "tensors", "from_worker", NULL};
static const char *const log_names[] = {"error", "warn", "info", "debug", NULL};
static const char *const best_mode_names[] = {"auto", "min", "max", NULL};

/* Sections in the order they are written; every key's prefix is one of them. */
static const char *const sections[] = {"run",      "model",    "ctr",    "data",       "train",
                                       "optimizer", "schedule", "server", "checkpoint", NULL};

/* Compile-time check that field f of ps_config_t has type T; adds 0. */
#define FIELD_IS(f, T) (0 * sizeof(_Generic(&((ps_config_t *)0)->f, T *: 1)))
#define OFF(f, T) (offsetof(ps_config_t, f) + FIELD_IS(f, T))

#define K_INTF(k, f, lo, hi, fl, d) \
    {.key = k, .type = KT_INT, .off = OFF(f, int), .imin = lo, .imax = hi, .flags = fl, .def = d}
#define K_INT(k, f, lo, hi, d) K_INTF(k, f, lo, hi, 0, d)
#define K_INT64F(k, f, lo, hi, fl, d) \
    {.key = k, .type = KT_INT64, .off = OFF(f, int64_t), .imin = lo, .imax = hi, .flags = fl, .def = d}
#define K_INT64(k, f, lo, hi, d) K_INT64F(k, f, lo, hi, 0, d)
#define K_UINT64F(k, f, fl, d) {.key = k, .type = KT_UINT64, .off = OFF(f, uint64_t), .flags = fl, .def = d}
#define K_UINT64(k, f, d) K_UINT64F(k, f, 0, d)
#define K_DOUBLE(k, f, lo, hi, fl, d)                                                      \
    {.key = k, .type = KT_DOUBLE, .off = OFF(f, double), .dmin = lo, .dmax = hi, .flags = fl, \
     .def = d}
#define K_BOOLF(k, f, fl, d) {.key = k, .type = KT_BOOL, .off = OFF(f, bool), .flags = fl, .def = d}
#define K_BOOL(k, f, d) K_BOOLF(k, f, 0, d)
#define K_STRING(k, f, fl, d)                                                             \
    {.key = k, .type = KT_STRING, .off = offsetof(ps_config_t, f),                        \
     .size = sizeof(((ps_config_t *)0)->f), .flags = fl, .def = d}
#define K_ENUMF(k, f, T, n, fl, d) {.key = k, .type = KT_ENUM, .off = OFF(f, T), .names = n, .flags = fl, .def = d}
#define K_ENUM(k, f, T, n, d) K_ENUMF(k, f, T, n, 0, d)

#define FMNIST "/usr/share/datasets/fashion-mnist/"

static const key_spec_t keys[] = {
    K_UINT64("run.seed", seed, "42"),
    K_INT("run.epochs", epochs, 1, 1000000, "15"),

    {.key = "model.layers", .type = KT_LAYERS, .off = offsetof(ps_config_t, sizes),
     .imin = 1, .imax = MAX_LAYER_SIZE, .def = "784,512,256,10"},
    K_ENUM("model.activation", activation, ps_act_t, act_names, "relu"),
    K_ENUMF("model.kind", kind, ps_model_kind_t, kind_names, F_KIND, "mlp"),
    {.key = "model.tensors", .type = KT_TENSORS, .off = offsetof(ps_config_t, tensors), .flags = F_TENSORS,
     .def = "[]"},
    K_STRING("model.init", init_file, F_TENSORS, ""),
    K_INT64F("model.max_params", max_params, 1, INT64_C(1) << 40, F_TENSORS, "268435456"),

    K_INTF("ctr.fields", ctr_fields, 1, PS_CTR_MAX_IDS, F_CTR, "8"),
    K_INTF("ctr.per_field", ctr_per_field, 1, PS_CTR_MAX_IDS, F_CTR, "1"),
    K_INT64F("ctr.vocab", ctr_vocab, 1, INT64_C(1) << 40, F_CTR, "100000"),
    K_DOUBLE("ctr.zipf", ctr_zipf, 0.0, 10.0, F_OPEN_MIN | F_CTR, "1.1"),
    K_INT64F("ctr.rows", ctr_rows, 1, UINT32_MAX, F_CTR, "65536"),
    K_INTF("ctr.dim", ctr_dim, 1, 4096, F_CTR, "16"),
    K_BOOLF("ctr.mean", ctr_mean, F_CTR, "true"),
    K_DOUBLE("ctr.weight_std", ctr_weight_std, 0.0, 100.0, F_CTR, "1"),
    K_DOUBLE("ctr.bias", ctr_bias, -100.0, 100.0, F_CTR, "-1.5"),
    K_UINT64F("ctr.seed", ctr_seed, F_CTR, "1"),
    K_INT64F("ctr.train", ctr_train, 1, UINT32_MAX, F_CTR, "200000"),
    K_INT64F("ctr.test", ctr_test, 1, UINT32_MAX, F_CTR, "20000"),
    K_DOUBLE("ctr.worker_table_mb", ctr_worker_table_mb, 0.0, INFINITY, F_UNHASHED, "256"),

    K_STRING("data.train_images", train_images, F_NONEMPTY, FMNIST "train-images-idx3-ubyte.gz"),
    K_STRING("data.train_labels", train_labels, F_NONEMPTY, FMNIST "train-labels-idx1-ubyte.gz"),
    K_STRING("data.test_images", test_images, F_NONEMPTY, FMNIST "t10k-images-idx3-ubyte.gz"),
    K_STRING("data.test_labels", test_labels, F_NONEMPTY, FMNIST "t10k-labels-idx1-ubyte.gz"),
    K_DOUBLE("data.normalize_mean", norm_mean, -INFINITY, INFINITY, 0, "0.2860"),
    K_DOUBLE("data.normalize_std", norm_std, 0.0, INFINITY, F_OPEN_MIN, "0.3530"),
    K_INT64("data.train_limit", train_limit, 0, INT64_MAX, "0"),
    K_INT64F("data.train_size", train_size, 0, UINT32_MAX, F_TENSORS, "0"),
    K_INT64F("data.test_size", test_size, 0, UINT32_MAX, F_TENSORS, "0"),
    K_DOUBLE("data.val_fraction", val_fraction, 0.0, 1.0, F_OPEN_MAX | F_SET, "0"),
    K_INT64F("data.val_size", val_size, 0, UINT32_MAX, F_SET, "0"),

    K_INT("train.batch_size", batch_size, 1, PS_MAX_BATCH, "64"),
    K_INT("train.val_batch_size", val_batch_size, 1, PS_MAX_BATCH, "500"),
    K_ENUM("train.wire_gradients", wire_gradients, ps_wire_dtype_t, wire_names, "f32"),
    K_ENUM("train.wire_weights", wire_weights, ps_wire_dtype_t, wire_names, "f32"),
    K_ENUM("train.sync", sync, ps_sync_t, sync_names, "bsp"),
    K_INT("train.staleness", staleness, 0, 1000000, "2"),
    K_BOOL("train.stream", stream, "false"),
    K_BOOLF("train.rebalance", rebalance, F_UNHASHED, "true"),
    K_DOUBLE("train.sparse_threshold", sparse_threshold, 0.0, 1.0, F_UNHASHED, "0.3"),
    /* what is kept of a run and when it ends, not what it trains: not in the hash */
    K_STRING("train.keep_best.metric", best_metric, F_UNHASHED, ""),
    K_ENUMF("train.keep_best.mode", best_mode, ps_best_mode_t, best_mode_names, F_UNHASHED, "auto"),
    K_STRING("train.keep_best.path", best_path, F_UNHASHED, "psd-best.safetensors"),
    K_STRING("train.early_stop.metric", stop_metric, F_UNHASHED, ""),
    K_ENUMF("train.early_stop.mode", stop_mode, ps_best_mode_t, best_mode_names, F_UNHASHED, "auto"),
    K_INTF("train.early_stop.patience", stop_patience, 1, 1000000, F_UNHASHED, "5"),
    K_DOUBLE("train.early_stop.min_delta", stop_min_delta, 0.0, INFINITY, F_UNHASHED, "0"),
    /* whether a run is let go on, not what it trains: not in the hash (a run
     * stopped by it can be resumed with another) */
    K_DOUBLE("train.divergence.factor", divergence_factor, 1.0, INFINITY, F_OPEN_MIN | F_OFF | F_UNHASHED, "100"),

    K_ENUM("optimizer.name", opt, ps_opt_kind_t, opt_names, "sgd"),
    K_DOUBLE("optimizer.lr", lr, 0.0, INFINITY, F_OPEN_MIN, "0.1"),
    K_DOUBLE("optimizer.momentum", momentum, 0.0, 1.0, F_OPEN_MAX, "0.9"),
    K_BOOL("optimizer.nesterov", nesterov, "true"),
    K_DOUBLE("optimizer.weight_decay", weight_decay, 0.0, INFINITY, 0, "5e-4"),
    K_DOUBLE("optimizer.beta1", beta1, 0.0, 1.0, F_OPEN_MAX, "0.9"),
    K_DOUBLE("optimizer.beta2", beta2, 0.0, 1.0, F_OPEN_MAX, "0.999"),
    K_DOUBLE("optimizer.eps", eps, 0.0, INFINITY, F_OPEN_MIN, "1e-8"),
    K_DOUBLE("optimizer.clip_norm", clip_norm, 0.0, INFINITY, 0, "0"),
    /* in the hash only when given (the hash of a config without groups stays what it was) */
    {.key = "optimizer.groups", .type = KT_GROUPS, .off = offsetof(ps_config_t, groups), .def = "[]"},

    K_ENUM("schedule.name", sched, ps_sched_kind_t, sched_names, "onecycle"),
    K_DOUBLE("schedule.warmup_epochs", warmup_epochs, 0.0, INFINITY, 0, "0"),
    K_DOUBLE("schedule.step_epochs", step_epochs, 0.0, INFINITY, F_OPEN_MIN, "5"),
    K_DOUBLE("schedule.gamma", gamma, 0.0, INFINITY, F_OPEN_MIN, "0.1"),
    K_DOUBLE("schedule.min_lr", min_lr, 0.0, INFINITY, 0, "0"),
    K_DOUBLE("schedule.pct_start", pct_start, 0.0, 1.0, 0, "0.25"),
    K_DOUBLE("schedule.div_factor", div_factor, 0.0, INFINITY, F_OPEN_MIN, "25"),
    K_DOUBLE("schedule.final_div_factor", final_div_factor, 0.0, INFINITY, F_OPEN_MIN, "1e4"),
    K_STRING("schedule.torch", sched_torch, F_SET, ""),
    K_ENUMF("schedule.interval", sched_interval, ps_interval_t, interval_names, F_SET, "epoch"),

    K_STRING("server.listen", listen, F_NONEMPTY, "tcp://0.0.0.0:5555"),
    K_INT("server.workers", workers, 1, 1024, "2"),
    K_DOUBLE("server.start_timeout", start_timeout, 0.0, INFINITY, F_OPEN_MIN, "300"),
    K_DOUBLE("server.worker_timeout", worker_timeout, 0.0, INFINITY, F_OPEN_MIN, "5"),
    K_STRING("server.metrics", metrics, 0, "psd-metrics.jsonl"),
    K_STRING("server.save", save, 0, "psd-weights.bin"),
    K_ENUM("server.log_level", log_level, ps_log_level_t, log_names, "info"),
    K_ENUM("server.log_format", log_format, ps_log_format_t, log_format_names, "text"),
    K_DOUBLE("server.progress_every", progress_every, 0.0, 86400.0, 0, "10"),
    K_STRING("server.key", key_file, 0, ""),
    K_STRING("server.allow", allow_dir, 0, ""),
    K_BOOL("server.insecure", insecure, "false"),
    K_INT("server.threads", threads, 0, 64, "0"),
    K_INT64("server.chunk_bytes", chunk_bytes, 65536, INT64_C(1) << 30, "1048576"),
    K_BOOL("server.shared_memory", shared_memory, "true"),
    K_INT("server.grad_room", grad_room, 0, 1024, "2"),
    K_INT("server.io_threads", io_threads, 0, 16, "0"),
    K_STRING("server.tcp_congestion", tcp_congestion, F_NONEMPTY, "auto"),
    K_STRING("server.http", http, 0, ""),
    K_STRING("server.http_token_file", http_token_file, 0, ""),
    K_STRING("checkpoint.dir", ckpt_dir, 0, "psd-checkpoints"),
    K_INT("checkpoint.every_epochs", ckpt_every_epochs, 0, 1000000, "1"),
    K_INT64("checkpoint.every_steps", ckpt_every_steps, 0, INT64_MAX, "0"),
    K_INT("checkpoint.keep", ckpt_keep, 1, PS_CKPT_KEEP_MAX, "3"),
};

#define N_KEYS (sizeof keys / sizeof keys[0])
_Static_assert(N_KEYS <= PS_CONFIG_KEYS_MAX, "ps_config_t.from holds a byte for every key");
#define N_SECTIONS (sizeof sections / sizeof sections[0] - 1)

/* ---------------------------------------------------------------- helpers */

#define set_err ps_set_err

static const key_spec_t *find_key(const char *key)
{
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].key, key) == 0) return &keys[i];
    return NULL;
}

static int find_section(const char *name)
{
    for (size_t i = 0; i < N_SECTIONS; i++)
        if (strcmp(sections[i], name) == 0) return (int)i;
    return -1;
}

/* Length of the section part of a dotted key ("optimizer.lr" -> 9). */
static size_t section_len(const char *key)
{
    const char *dot = strchr(key, '.');
    PS_CFG_ASSERT(dot);
    return (size_t)(dot - key);
}

static void *field(ps_config_t *c, const key_spec_t *e) { return (char *)c + e->off; }
static const void *cfield(const ps_config_t *c, const key_spec_t *e)
{
    return (const char *)c + e->off;
}

static int enum_count(const char *const *names)
{
    int n = 0;
    while (names[n]) n++;
    return n;
}

static const char *enum_name(const char *const *names, int v)
{
    return v >= 0 && v < enum_count(names) ? names[v] : "?";
}

/* "expected ..." text for a key's type: "a number", "one of sgd, adam, adamw". */
static void describe_type(const key_spec_t *e, char *buf, size_t n)
{
    switch (e->type) {
    case KT_INT:
    case KT_INT64:
    case KT_UINT64: snprintf(buf, n, "an integer"); return;
    case KT_DOUBLE: snprintf(buf, n, e->flags & F_OFF ? "a number or off" : "a number"); return;
    case KT_BOOL: snprintf(buf, n, "true or false"); return;
    case KT_STRING: snprintf(buf, n, "a string"); return;
    case KT_LAYERS: snprintf(buf, n, "a list of layer sizes"); return;
    case KT_TENSORS: snprintf(buf, n, "a list of tensors"); return;
    case KT_GROUPS: snprintf(buf, n, "a list of groups"); return;
    case KT_ENUM: {
        size_t used = (size_t)snprintf(buf, n, "one of");
        for (int i = 0; e->names[i] && used < n; i++)
            used += (size_t)snprintf(buf + used, n - used, "%s %s", i ? "," : "", e->names[i]);
        return;
    }
    }
    PS_CFG_ASSERT(!"unknown key type");
}

/* "must be in [0, 1)", "must be > 0", "" when unbounded. */
static void describe_range(const key_spec_t *e, char *buf, size_t n)
{
    buf[0] = '\0';
    if (e->type == KT_DOUBLE) {
        char lo[32], hi[32];
        ps_fmt_double(e->dmin, lo, sizeof lo);
        ps_fmt_double(e->dmax, hi, sizeof hi);
        const bool has_lo = isfinite(e->dmin), has_hi = isfinite(e->dmax);
        const bool olo = e->flags & F_OPEN_MIN, ohi = e->flags & F_OPEN_MAX;
        const char *off = e->flags & F_OFF ? ", or off" : "";
        if (has_lo && has_hi)
            snprintf(buf, n, " (must be in %c%s, %s%c%s)", olo ? '(' : '[', lo, hi, ohi ? ')' : ']', off);
        else if (has_lo)
            snprintf(buf, n, " (must be %s %s%s)", olo ? ">" : ">=", lo, off);
        else if (has_hi)
            snprintf(buf, n, " (must be %s %s%s)", ohi ? "<" : "<=", hi, off);
    } else if (e->type == KT_INT || e->type == KT_INT64 || e->type == KT_LAYERS) {
        if (e->imax == INT64_MAX)
            snprintf(buf, n, " (must be >= %lld)", (long long)e->imin);
        else
            snprintf(buf, n, " (must be in [%lld, %lld])", (long long)e->imin,
                     (long long)e->imax);
    }
}

static bool double_in_range(const key_spec_t *e, double v)
{
    if (!isfinite(v)) return false;
    if ((e->flags & F_OFF) && v == 0.0) return true; /* off */
    if (e->flags & F_OPEN_MIN ? v <= e->dmin : v < e->dmin) return false;
    if (e->flags & F_OPEN_MAX ? v >= e->dmax : v > e->dmax) return false;
    return true;
}

/* One entry of model.layers. Messages start with the key. */
static int parse_layer_size(const key_spec_t *e, const char *s, int *out, char *msg, size_t n)
{
    int64_t v;
    int rc = ps_parse_i64(s, &v);
    if (rc == -1) {
        set_err(msg, n, "%s: expected an integer layer size, got '" SHOW "'", e->key, s);
        return -1;
    }
    if (rc == -2 || v < e->imin || v > e->imax) {
        char range[64];
        describe_range(e, range, sizeof range);
        set_err(msg, n, "%s: layer size " SHOW " is out of range%s", e->key, s, range);
        return -1;
    }
    *out = (int)v;
    return 0;
}

static int check_layer_count(const key_spec_t *e, int n_sizes, char *msg, size_t n)
{
    if (n_sizes > PS_MAX_LAYERS + 1) {
        set_err(msg, n, "%s: too many layer sizes (at most %d)", e->key, PS_MAX_LAYERS + 1);
        return -1;
    }
    if (n_sizes < 2) {
        set_err(msg, n, "%s: expected at least 2 sizes (input and output), got %d", e->key,
                n_sizes);
        return -1;
    }
    return 0;
}

static void store_layers(ps_config_t *c, const int *sizes, int n_sizes)
{
    memset(c->sizes, 0, sizeof c->sizes);
    memcpy(c->sizes, sizes, (size_t)n_sizes * sizeof *sizes);
    c->n_sizes = n_sizes;
}

/* "784,256,10" or "[784, 256, 10]", spaces allowed around entries. */
static int parse_layers_text(const key_spec_t *e, const char *text, ps_config_t *c, char *msg,
                             size_t n)
{
    int sizes[PS_MAX_LAYERS + 1];
    int n_sizes = 0;
    const char *p = text, *stop = text + strlen(text);
    while (p < stop && isspace((unsigned char)*p)) p++;
    while (stop > p && isspace((unsigned char)stop[-1])) stop--;
    if (p < stop && *p == '[') {
        if (stop[-1] != ']' || stop - p < 2) {
            set_err(msg, n, "%s: missing ']' in '" SHOW "'", e->key, text);
            return -1;
        }
        p++;
        stop--;
    }
    for (;;) {
        const char *comma = memchr(p, ',', (size_t)(stop - p));
        const char *end = comma ? comma : stop;
        const char *a = p, *b = end;
        while (a < b && isspace((unsigned char)*a)) a++;
        while (b > a && isspace((unsigned char)b[-1])) b--;
        char tok[32];
        if (b == a || (size_t)(b - a) >= sizeof tok) {
            set_err(msg, n, "%s: expected comma-separated integers, got '" SHOW "'", e->key, text);
            return -1;
        }
        if (n_sizes == PS_MAX_LAYERS + 1) return check_layer_count(e, n_sizes + 1, msg, n);
        memcpy(tok, a, (size_t)(b - a));
        tok[b - a] = '\0';
        if (parse_layer_size(e, tok, &sizes[n_sizes], msg, n) != 0) return -1;
        n_sizes++;
        if (!comma) break;
        p = comma + 1;
    }
    if (check_layer_count(e, n_sizes, msg, n) != 0) return -1;
    store_layers(c, sizes, n_sizes);
    return 0;
}

/* Parse text as the value of e and store it in c; c is untouched on error.
 * Messages start with the key and name the offending text. */
static int parse_value(const key_spec_t *e, const char *text, ps_config_t *c, char *msg, size_t n)
{
    char want[96], range[96];
    void *dst = field(c, e);
    switch (e->type) {
    case KT_INT:
    case KT_INT64: {
        int64_t v;
        int rc = ps_parse_i64(text, &v);
        if (rc == -1) break;
        if (rc == -2 || v < e->imin || v > e->imax) {
            describe_range(e, range, sizeof range);
            set_err(msg, n, "%s: " SHOW " is out of range%s", e->key, text, range);
            return -1;
        }
        if (e->type == KT_INT) {
            int iv = (int)v;
            memcpy(dst, &iv, sizeof iv);
        } else {
            memcpy(dst, &v, sizeof v);
        }
        return 0;
    }
    case KT_UINT64: {
        uint64_t v;
        int rc = ps_parse_u64(text, &v);
        if (rc == -1) break;
        if (rc == -2) {
            set_err(msg, n, "%s: " SHOW " is out of range (must be in [0, %llu])", e->key, text,
                    (unsigned long long)UINT64_MAX);
            return -1;
        }
        memcpy(dst, &v, sizeof v);
        return 0;
    }
    case KT_DOUBLE: {
        double v;
        int rc = (e->flags & F_OFF) && strcmp(text, "off") == 0 ? (v = 0.0, 0) : ps_parse_double(text, &v);
        if (rc == -1) break;
        if (rc == -2) {
            set_err(msg, n, "%s: expected a finite number, got '" SHOW "'", e->key, text);
            return -1;
        }
        if (!double_in_range(e, v)) {
            describe_range(e, range, sizeof range);
            set_err(msg, n, "%s: " SHOW " is out of range%s", e->key, text, range);
            return -1;
        }
        memcpy(dst, &v, sizeof v);
        return 0;
    }
    case KT_BOOL: {
        static const char *const yes[] = {"true", "yes", "on", "1"};
        static const char *const no[] = {"false", "no", "off", "0"};
        for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
            if (strcasecmp(text, yes[i]) == 0 || strcasecmp(text, no[i]) == 0) {
                bool v = strcasecmp(text, yes[i]) == 0;
                memcpy(dst, &v, sizeof v);
                return 0;
            }
        }
        break;
    }
    case KT_STRING: {
        size_t len = strlen(text);
        if (len >= e->size) {
            set_err(msg, n, "%s: too long (%zu bytes, at most %zu)", e->key, len, e->size - 1);
            return -1;
        }
        if (len == 0 && (e->flags & F_NONEMPTY)) {
            set_err(msg, n, "%s: must not be empty", e->key);
            return -1;
        }
        memcpy(dst, text, len + 1);
        return 0;
    }
    case KT_ENUM:
        for (int i = 0; e->names[i]; i++) {
            if (strcmp(text, e->names[i]) == 0) {
                memcpy(dst, &i, sizeof i);
                return 0;
            }
        }
        break;
    case KT_LAYERS: return parse_layers_text(e, text, c, msg, n);
    case KT_TENSORS:
        if (strcmp(text, "[]") == 0) { /* the default: none (a list given before stays allocated until freed) */
            c->n_tensors = 0;
            return 0;
        }
        set_err(msg, n, "%s: a list of tensors is given in a config file (- {name: ..., shape: [...], init: ...})",
                e->key);
        return -1;
    case KT_GROUPS:
        if (strcmp(text, "[]") == 0) {
            c->n_groups = 0;
            return 0;
        }
        set_err(msg, n, "%s: a list of groups is given in a config file (- {match: \"*.bias\", weight_decay: 0})",
                e->key);
        return -1;
    }
    describe_type(e, want, sizeof want);
    set_err(msg, n, "%s: expected %s, got '" SHOW "'", e->key, want, text);
    return -1;
}

/* ---------------------------------------------------------------- public: defaults, set */

void ps_config_free(ps_config_t *c)
{
    free(c->tensors);
    c->tensors = NULL;
    c->n_tensors = 0;
}

void ps_config_defaults(ps_config_t *c)
{
    PS_CFG_ASSERT(c);
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < N_KEYS; i++) {
        char msg[256];
        if (parse_value(&keys[i], keys[i].def, c, msg, sizeof msg) != 0) {
            fprintf(stderr, "ps_config: bad default in the key table: %s\n", msg);
            abort();
        }
    }
}

int ps_config_set(ps_config_t *c, const char *key, const char *value, char *err, size_t errlen)
{
    PS_CFG_ASSERT(c && key && value);
    const key_spec_t *e = find_key(key);
    if (!e) {
        set_err(err, errlen, "unknown key '" SHOW "'", key);
        return -1;
    }
    if (parse_value(e, value, c, err, errlen) != 0) return -1;
    c->from[e - keys] = PS_FROM_CONFIG;
    return 0;
}

int ps_config_set_from(ps_config_t *c, const char *key, const char *value, ps_from_t from, char *err, size_t errlen)
{
    if (ps_config_set(c, key, value, err, errlen) != 0) return -1;
    c->from[find_key(key) - keys] = (uint8_t)from;
    return 0;
}

int ps_config_reset_key(ps_config_t *c, const char *key)
{
    const key_spec_t *e = find_key(key);
    char msg[256];
    if (!e || e->type == KT_TENSORS || e->type == KT_GROUPS) return -1;
    PS_CFG_ASSERT(parse_value(e, e->def, c, msg, sizeof msg) == 0);
    c->from[e - keys] = PS_FROM_DEFAULT;
    return 0;
}

int ps_config_copy_key(ps_config_t *dst, const ps_config_t *src, const char *key)
{
    const key_spec_t *e = find_key(key);
    if (!e || e->type == KT_TENSORS) return -1;
    size_t n = 0;
    switch (e->type) {
    case KT_INT:
    case KT_ENUM: n = sizeof(int); break;
    case KT_INT64:
    case KT_UINT64: n = sizeof(int64_t); break;
    case KT_DOUBLE: n = sizeof(double); break;
    case KT_BOOL: n = sizeof(bool); break;
    case KT_STRING: n = e->size; break;
    case KT_LAYERS:
        dst->n_sizes = src->n_sizes;
        n = sizeof dst->sizes;
        break;
    case KT_GROUPS:
        dst->n_groups = src->n_groups;
        n = sizeof dst->groups;
        break;
    case KT_TENSORS: return -1;
    }
    memcpy(field(dst, e), cfield(src, e), n);
    dst->from[e - keys] = src->from[e - keys];
    return 0;
}

ps_from_t ps_config_from(const ps_config_t *c, const char *key)
{
    const key_spec_t *e = find_key(key);
    return e ? (ps_from_t)c->from[e - keys] : PS_FROM_DEFAULT;
}

const char *ps_from_name(ps_from_t f)
{
    return f == PS_FROM_CONFIG ? "config" : f == PS_FROM_WORKER ? "worker" : "default";
}

const char *ps_config_key(size_t i) { return i < N_KEYS ? keys[i].key : NULL; }

/* ---------------------------------------------------------------- YAML loading */

typedef struct {
    yaml_parser_t parser;
    yaml_event_t ev; /* the current event, valid while have_ev */
    bool have_ev;
    const char *name; /* file name for messages */
    char *err;
    size_t errlen;
    ps_config_t *c;
    const ps_tensor_spec_t *orig_tensors; /* the config's list before this load (freed by the caller) */
    bool key_seen[N_KEYS];
    bool section_seen[N_SECTIONS];
} loader_t;

static size_t ev_line(const loader_t *l) { return l->ev.start_mark.line + 1; }

static void ld_err(loader_t *l, size_t line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void ld_err(loader_t *l, size_t line, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    set_err(l->err, l->errlen, "%s:%zu: %s", l->name, line, msg);
}

/* Advance to the next event; the previous one is freed. */
static int ld_next(loader_t *l)
{
    if (l->have_ev) {
        yaml_event_delete(&l->ev);
        l->have_ev = false;
    }
    if (yaml_parser_parse(&l->parser, &l->ev)) {
        l->have_ev = true;
        return 0;
    }
    const yaml_parser_t *p = &l->parser;
    const char *problem = p->problem ? p->problem : "unknown error";
    switch (p->error) {
    case YAML_MEMORY_ERROR: set_err(l->err, l->errlen, "%s: out of memory", l->name); break;
    case YAML_READER_ERROR:
        set_err(l->err, l->errlen, "%s: byte %zu: %s", l->name, p->problem_offset, problem);
        break;
    default:
        if (p->context)
            ld_err(l, p->problem_mark.line + 1, "YAML syntax error: %s (%s)", problem, p->context);
        else
            ld_err(l, p->problem_mark.line + 1, "YAML syntax error: %s", problem);
        break;
    }
    return -1;
}

static const char *ev_scalar(const loader_t *l) { return (const char *)l->ev.data.scalar.value; }

/* A plain scalar that YAML reads as null: "", "~", "null". */
static bool ev_is_null(const loader_t *l)
{
    if (l->ev.data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return false;
    const char *s = ev_scalar(l);
    return !*s || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") ||
           !strcmp(s, "NULL");
}

static const char *ev_kind(const yaml_event_t *ev)
{
    switch (ev->type) {
    case YAML_SCALAR_EVENT: return "a scalar";
    case YAML_SEQUENCE_START_EVENT: return "a sequence";
    case YAML_MAPPING_START_EVENT: return "a mapping";
    case YAML_ALIAS_EVENT: return "an alias";
    default: return "something else";
    }
}

/* Scalars with an escaped NUL ("\0") would be cut short as C strings. */
static int ld_check_scalar(loader_t *l)
{
    if (strlen(ev_scalar(l)) != l->ev.data.scalar.length) {
        ld_err(l, ev_line(l), "NUL byte in a scalar");
        return -1;
    }
    return 0;
}

/* At SEQUENCE_START of model.layers; consumes through SEQUENCE_END. */
static int ld_layers(loader_t *l, const key_spec_t *e)
{
    const size_t start_line = ev_line(l);
    int sizes[PS_MAX_LAYERS + 1];
    int n_sizes = 0;
    char msg[256];
    for (;;) {
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_SEQUENCE_END_EVENT) break;
        if (l->ev.type != YAML_SCALAR_EVENT) {
            ld_err(l, ev_line(l), "%s: expected an integer layer size, got %s", e->key,
                   ev_kind(&l->ev));
            return -1;
        }
        if (ld_check_scalar(l) != 0) return -1;
        if (n_sizes == PS_MAX_LAYERS + 1) {
            check_layer_count(e, n_sizes + 1, msg, sizeof msg);
            ld_err(l, ev_line(l), "%s", msg);
            return -1;
        }
        if (parse_layer_size(e, ev_scalar(l), &sizes[n_sizes], msg, sizeof msg) != 0) {
            ld_err(l, ev_line(l), "%s", msg);
            return -1;
        }
        n_sizes++;
    }
    if (check_layer_count(e, n_sizes, msg, sizeof msg) != 0) {
        ld_err(l, start_line, "%s", msg);
        return -1;
    }
    store_layers(l->c, sizes, n_sizes);
    return 0;
}

/* At a scalar: its text, or -1 (with the message) when it is not one. */
static const char *ld_scalar(loader_t *l, const char *what)
{
    if (l->ev.type != YAML_SCALAR_EVENT) {
        ld_err(l, ev_line(l), "%s: expected a scalar, got %s", what, ev_kind(&l->ev));
        return NULL;
    }
    return ld_check_scalar(l) == 0 ? ev_scalar(l) : NULL;
}

/* At the value of a tensor's shape: [d0, d1, ...] (or one integer). */
static int ld_shape(loader_t *l, ps_tensor_spec_t *t, int i)
{
    if (l->ev.type == YAML_SCALAR_EVENT || l->ev.type == YAML_SEQUENCE_START_EVENT) {
        const bool seq = l->ev.type == YAML_SEQUENCE_START_EVENT;
        t->ndim = 0;
        for (;;) {
            if (seq && ld_next(l) != 0) return -1;
            if (seq && l->ev.type == YAML_SEQUENCE_END_EVENT) return 0;
            const char *v = ld_scalar(l, "model.tensors: a dimension");
            uint64_t d;
            if (!v) return -1;
            if (t->ndim == PS_MAX_DIMS) {
                ld_err(l, ev_line(l), "model.tensors[%d]: more than %d dimensions", i, PS_MAX_DIMS);
                return -1;
            }
            if (ps_parse_u64(v, &d) != 0 || d == 0 || d > PS_MAX_NUMEL) {
                ld_err(l, ev_line(l), "model.tensors[%d]: dimension '" SHOW "' is not an integer from 1 to 2^61", i, v);
                return -1;
            }
            t->shape[t->ndim++] = d;
            if (!seq) return 0;
        }
    }
    ld_err(l, ev_line(l), "model.tensors[%d]: shape: expected [d0, d1, ...], got %s", i, ev_kind(&l->ev));
    return -1;
}

/* At MAPPING_START of one tensor: {name, shape, init, kind}; consumes it. */
static int ld_tensor(loader_t *l, ps_tensor_spec_t *t, int i)
{
    const size_t line = ev_line(l);
    bool seen[4] = {false, false, false, false};
    static const char *const fields[4] = {"name", "shape", "init", "kind"};
    memset(t, 0, sizeof *t);
    t->init.kind = PS_INIT_ZEROS;
    for (;;) {
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_MAPPING_END_EVENT) break;
        const char *k = ld_scalar(l, "model.tensors: a field");
        if (!k) return -1;
        int f = 0;
        while (f < 4 && strcmp(k, fields[f]) != 0) f++;
        if (f == 4) {
            ld_err(l, ev_line(l), "model.tensors[%d]: unknown field '%.60s' (name, shape, init, kind)", i, k);
            return -1;
        }
        if (seen[f]) {
            ld_err(l, ev_line(l), "model.tensors[%d]: %s given twice", i, fields[f]);
            return -1;
        }
        seen[f] = true;
        if (ld_next(l) != 0) return -1;
        if (f == 1) {
            if (ld_shape(l, t, i) != 0) return -1;
            continue;
        }
        const char *v = ld_scalar(l, "model.tensors: a value");
        char msg[400];
        if (!v) return -1;
        if (f == 0) {
            size_t len = strlen(v);
            if (len == 0 || len > PS_NAME_MAX) {
                ld_err(l, ev_line(l), "model.tensors[%d]: a name of 1 to %d bytes is needed", i, PS_NAME_MAX);
                return -1;
            }
            memcpy(t->name, v, len + 1);
        } else if (f == 2) {
            if (ps_init_parse(v, &t->init, msg, sizeof msg) != 0) {
                ld_err(l, ev_line(l), "model.tensors[%d]: %s", i, msg);
                return -1;
            }
        } else if (strcmp(v, "dense") == 0 || strcmp(v, "sparse_rows") == 0) {
            t->kind = v[0] == 'd' ? PS_TENSOR_DENSE : PS_TENSOR_ROWS;
        } else {
            ld_err(l, ev_line(l), "model.tensors[%d]: kind '%.60s' (dense or sparse_rows)", i, v);
            return -1;
        }
    }
    if (!seen[0] || !seen[1]) {
        ld_err(l, line, "model.tensors[%d]: a tensor needs a name and a shape", i);
        return -1;
    }
    return 0;
}

/* At SEQUENCE_START of model.tensors; consumes through SEQUENCE_END. */
static int ld_tensors(loader_t *l)
{
    int n = 0, cap = 0;
    ps_tensor_spec_t *t = NULL;
    for (;;) {
        if (ld_next(l) != 0) goto fail;
        if (l->ev.type == YAML_SEQUENCE_END_EVENT) break;
        if (l->ev.type != YAML_MAPPING_START_EVENT) {
            ld_err(l, ev_line(l), "model.tensors[%d]: expected {name: ..., shape: [...], init: ...}, got %s", n,
                   ev_kind(&l->ev));
            goto fail;
        }
        if (n == PS_MAX_TABLE) {
            ld_err(l, ev_line(l), "model.tensors: more than %d tensors", PS_MAX_TABLE);
            goto fail;
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            ps_tensor_spec_t *g = realloc(t, (size_t)cap * sizeof *t);
            if (!g) {
                ld_err(l, ev_line(l), "model.tensors: out of memory");
                goto fail;
            }
            t = g;
        }
        if (ld_tensor(l, &t[n], n) != 0) goto fail;
        n++;
    }
    char why[400];
    if (n > 0 && ps_tensors_unique(t, n, why, sizeof why) != 0) {
        ld_err(l, ev_line(l), "model.tensors: %s", why);
        goto fail;
    }
    if (l->c->tensors != l->orig_tensors) free(l->c->tensors); /* given twice in one load */
    l->c->tensors = t;
    l->c->n_tensors = n;
    return 0;
fail:
    free(t);
    return -1;
}

/* At MAPPING_START of group i: {match, weight_decay, lr_scale}; consumes it. */
static int ld_group(loader_t *l, ps_group_t *g, int i)
{
    const size_t line = ev_line(l);
    static const char *const fields[3] = {"match", "weight_decay", "lr_scale"};
    bool seen[3] = {false, false, false};
    ps_group_clear(g);
    for (;;) {
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_MAPPING_END_EVENT) break;
        const char *k = ld_scalar(l, "optimizer.groups: a field");
        if (!k) return -1;
        int f = 0;
        while (f < 3 && strcmp(k, fields[f]) != 0) f++;
        if (f == 3) {
            ld_err(l, ev_line(l), "optimizer.groups[%d]: unknown field '%.60s' (match, weight_decay, lr_scale; "
                   "momentum, betas and eps are the same for every tensor)", i, k);
            return -1;
        }
        if (seen[f]) {
            ld_err(l, ev_line(l), "optimizer.groups[%d]: %s given twice", i, fields[f]);
            return -1;
        }
        seen[f] = true;
        if (ld_next(l) != 0) return -1;
        const char *v = ld_scalar(l, "optimizer.groups: a value");
        if (!v) return -1;
        if (f == 0) {
            if (strlen(v) > PS_GROUP_MATCH_MAX) {
                ld_err(l, ev_line(l), "optimizer.groups[%d]: match: longer than %d bytes", i, PS_GROUP_MATCH_MAX);
                return -1;
            }
            strcpy(g->match, v);
            continue;
        }
        double d;
        if (ps_parse_double(v, &d) != 0) {
            ld_err(l, ev_line(l), "optimizer.groups[%d]: %s: expected a number, got '" SHOW "'", i, fields[f], v);
            return -1;
        }
        if (f == 1) {
            g->has_wd = true;
            g->weight_decay = d;
        } else {
            g->lr_scale = d;
        }
    }
    char why[400];
    if (!seen[0]) {
        ld_err(l, line, "optimizer.groups[%d]: a group needs a match (a glob on tensor names)", i);
        return -1;
    }
    if (ps_group_check(g, i, why, sizeof why) != 0) {
        ld_err(l, line, "%s", why);
        return -1;
    }
    return 0;
}

/* At SEQUENCE_START of optimizer.groups; consumes through SEQUENCE_END. */
static int ld_groups(loader_t *l)
{
    int n = 0;
    for (;;) {
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_SEQUENCE_END_EVENT) break;
        if (l->ev.type != YAML_MAPPING_START_EVENT) {
            ld_err(l, ev_line(l), "optimizer.groups[%d]: expected {match: GLOB, weight_decay: ..., lr_scale: ...}, "
                   "got %s", n, ev_kind(&l->ev));
            return -1;
        }
        if (n == PS_GROUPS_MAX) {
            ld_err(l, ev_line(l), "optimizer.groups: more than %d groups", PS_GROUPS_MAX);
            return -1;
        }
        if (ld_group(l, &l->c->groups[n], n) != 0) return -1;
        n++;
    }
    l->c->n_groups = n;
    return 0;
}

/* At the event after a key; consumes the whole value. */
static int ld_value(loader_t *l, const key_spec_t *e)
{
    char want[96], msg[512];
    const yaml_event_type_t t = l->ev.type;
    if (e->type == KT_GROUPS) {
        if (t == YAML_SEQUENCE_START_EVENT) return ld_groups(l);
        ld_err(l, ev_line(l), "%s: expected a list of groups (- {match: \"*.bias\", weight_decay: 0}), got %s",
               e->key, ev_kind(&l->ev));
        return -1;
    }
    if (e->type == KT_TENSORS) {
        if (t == YAML_SEQUENCE_START_EVENT) return ld_tensors(l);
        ld_err(l, ev_line(l), "%s: expected a list of tensors (- {name: ..., shape: [...], init: ...}), got %s",
               e->key, ev_kind(&l->ev));
        return -1;
    }
    if (e->type == KT_LAYERS) {
        if (t == YAML_SEQUENCE_START_EVENT) return ld_layers(l, e);
        ld_err(l, ev_line(l), "%s: expected a sequence of layer sizes like [784, 256, 10], got %s",
               e->key, ev_kind(&l->ev));
        return -1;
    }
    if (t != YAML_SCALAR_EVENT) {
        describe_type(e, want, sizeof want);
        ld_err(l, ev_line(l), "%s: expected %s, got %s", e->key, want, ev_kind(&l->ev));
        return -1;
    }
    if (ld_check_scalar(l) != 0) return -1;
    const char *text = e->type == KT_STRING && ev_is_null(l) ? "" : ev_scalar(l);
    if (parse_value(e, text, l->c, msg, sizeof msg) != 0) {
        ld_err(l, ev_line(l), "%s", msg);
        return -1;
    }
    return 0;
}

/* Some key starts with prefix "a.b." (a mapping of keys under a.b). */
static bool is_key_prefix(const char *prefix)
{
    size_t n = strlen(prefix);
    for (size_t i = 0; i < N_KEYS; i++)
        if (strncmp(keys[i].key, prefix, n) == 0) return true;
    return false;
}

/* At MAPPING_START of the keys under prefix ("train", "train.keep_best");
 * consumes through MAPPING_END. A key that is the start of others
 * ("keep_best" of train.keep_best.metric) may hold them as a mapping. */
static int ld_keys(loader_t *l, const char *prefix, int depth)
{
    for (;;) {
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_MAPPING_END_EVENT) return 0;
        if (l->ev.type != YAML_SCALAR_EVENT) {
            ld_err(l, ev_line(l), "expected a key in %s '%s', got %s", depth ? "mapping" : "section", prefix,
                   ev_kind(&l->ev));
            return -1;
        }
        if (ld_check_scalar(l) != 0) return -1;
        char key[160];
        snprintf(key, sizeof key, "%s.%.100s", prefix, ev_scalar(l));
        const key_spec_t *e = find_key(key);
        if (!e) {
            char sub[170];
            snprintf(sub, sizeof sub, "%s.", key);
            if (depth < 2 && is_key_prefix(sub)) {
                if (ld_next(l) != 0) return -1;
                if (l->ev.type == YAML_SCALAR_EVENT) {
                    ld_err(l, ev_line(l), "unknown key '%s'", key);
                    return -1;
                }
                if (l->ev.type != YAML_MAPPING_START_EVENT) {
                    ld_err(l, ev_line(l), "'%s' must be a mapping of keys, got %s", key, ev_kind(&l->ev));
                    return -1;
                }
                if (ld_keys(l, key, depth + 1) != 0) return -1;
                continue;
            }
            ld_err(l, ev_line(l), "unknown key '%s'", key);
            return -1;
        }
        const size_t i = (size_t)(e - keys);
        if (l->key_seen[i]) {
            ld_err(l, ev_line(l), "duplicate key '%s'", e->key);
            return -1;
        }
        l->key_seen[i] = true;
        if (ld_next(l) != 0) return -1;
        if (ld_value(l, e) != 0) return -1;
        l->c->from[i] = PS_FROM_CONFIG;
    }
}

/* At MAPPING_START of section sec; consumes through MAPPING_END. */
static int ld_section(loader_t *l, int sec) { return ld_keys(l, sections[sec], 0); }

static void list_sections(char *buf, size_t n)
{
    size_t used = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < N_SECTIONS && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%s", i ? ", " : "", sections[i]);
}

/* At MAPPING_START of the document; consumes through MAPPING_END. */
static int ld_top(loader_t *l)
{
    for (;;) {
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_MAPPING_END_EVENT) return 0;
        if (l->ev.type != YAML_SCALAR_EVENT) {
            ld_err(l, ev_line(l), "expected a section name, got %s", ev_kind(&l->ev));
            return -1;
        }
        if (ld_check_scalar(l) != 0) return -1;
        const int sec = find_section(ev_scalar(l));
        if (sec < 0) {
            char list[128];
            list_sections(list, sizeof list);
            ld_err(l, ev_line(l), "unknown section '%.100s' (expected one of %s)", ev_scalar(l),
                   list);
            return -1;
        }
        if (l->section_seen[sec]) {
            ld_err(l, ev_line(l), "duplicate section '%s'", sections[sec]);
            return -1;
        }
        l->section_seen[sec] = true;
        if (ld_next(l) != 0) return -1;
        if (l->ev.type == YAML_MAPPING_START_EVENT) {
            if (ld_section(l, sec) != 0) return -1;
        } else if (l->ev.type == YAML_SCALAR_EVENT && ev_is_null(l)) {
            /* "optimizer:" with nothing under it: an empty section. */
        } else {
            ld_err(l, ev_line(l), "section '%s' must be a mapping of keys, got %s", sections[sec],
                   ev_kind(&l->ev));
            return -1;
        }
    }
}

/* The whole stream: at most one document whose root is a mapping (or empty). */
static int ld_stream(loader_t *l)
{
    if (ld_next(l) != 0) return -1;
    PS_CFG_ASSERT(l->ev.type == YAML_STREAM_START_EVENT);
    if (ld_next(l) != 0) return -1;
    if (l->ev.type == YAML_STREAM_END_EVENT) return 0; /* empty or only comments */
    PS_CFG_ASSERT(l->ev.type == YAML_DOCUMENT_START_EVENT);
    if (ld_next(l) != 0) return -1;
    if (l->ev.type == YAML_MAPPING_START_EVENT) {
        if (ld_top(l) != 0) return -1;
    } else if (!(l->ev.type == YAML_SCALAR_EVENT && ev_is_null(l))) {
        ld_err(l, ev_line(l), "top level must be a mapping of sections, got %s",
               ev_kind(&l->ev));
        return -1;
    }
    if (ld_next(l) != 0) return -1;
    PS_CFG_ASSERT(l->ev.type == YAML_DOCUMENT_END_EVENT);
    if (ld_next(l) != 0) return -1;
    if (l->ev.type != YAML_STREAM_END_EVENT) {
        ld_err(l, ev_line(l), "only one YAML document is allowed");
        return -1;
    }
    return 0;
}

int ps_config_load_string(ps_config_t *c, const char *yaml, size_t len, const char *name,
                          char *err, size_t errlen)
{
    PS_CFG_ASSERT(c && (yaml || len == 0));
    /* Work on a copy so that c is unchanged on error. */
    ps_config_t tmp = *c;
    loader_t l = {.name = name ? name : "<string>", .err = err, .errlen = errlen, .c = &tmp, .orig_tensors = c->tensors};
    if (!yaml_parser_initialize(&l.parser)) {
        set_err(err, errlen, "%s: out of memory", l.name);
        return -1;
    }
    yaml_parser_set_input_string(&l.parser, (const unsigned char *)(yaml ? yaml : ""), len);
    int rc = ld_stream(&l);
    if (l.have_ev) yaml_event_delete(&l.ev);
    yaml_parser_delete(&l.parser);
    if (tmp.tensors != c->tensors) { /* model.tensors was read: the new list replaces c's, or is dropped */
        ps_tensor_spec_t *drop = rc == 0 ? c->tensors : tmp.tensors;
        free(drop);
    }
    if (rc == 0) *c = tmp;
    return rc;
}

int ps_config_load_file(ps_config_t *c, const char *path, char *err, size_t errlen)
{
    PS_CFG_ASSERT(c && path);
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int rc = -1;
    FILE *f = fopen(path, "rb");
    if (!f) {
        set_err(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    for (;;) {
        if (len == cap) {
            if (cap >= MAX_FILE_BYTES) {
                set_err(err, errlen, "%s: larger than %u bytes, not a config file", path,
                        MAX_FILE_BYTES);
                goto out;
            }
            size_t ncap = cap ? 2 * cap : 4096;
            char *nbuf = realloc(buf, ncap);
            if (!nbuf) {
                set_err(err, errlen, "%s: out of memory", path);
                goto out;
            }
            buf = nbuf;
            cap = ncap;
        }
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
    }
    if (ferror(f)) {
        set_err(err, errlen, "%s: cannot read: %s", path, strerror(errno));
        goto out;
    }
    rc = ps_config_load_string(c, buf, len, path, err, errlen);
out:
    free(buf);
    fclose(f);
    return rc;
}

/* ---------------------------------------------------------------- validation */

int ps_config_validate(const ps_config_t *c, char *err, size_t errlen)
{
    PS_CFG_ASSERT(c);
    char range[96], num[32];
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_spec_t *e = &keys[i];
        const void *src = cfield(c, e);
        switch (e->type) {
        case KT_INT:
        case KT_INT64: {
            int64_t v;
            if (e->type == KT_INT) {
                int iv;
                memcpy(&iv, src, sizeof iv);
                v = iv;
            } else {
                memcpy(&v, src, sizeof v);
            }
            if (v < e->imin || v > e->imax) {
                describe_range(e, range, sizeof range);
                set_err(err, errlen, "%s: %lld is out of range%s", e->key, (long long)v, range);
                return -1;
            }
            break;
        }
        case KT_DOUBLE: {
            double v;
            memcpy(&v, src, sizeof v);
            if (!double_in_range(e, v)) {
                describe_range(e, range, sizeof range);
                ps_fmt_double(v, num, sizeof num);
                set_err(err, errlen, "%s: %s is out of range%s", e->key, num, range);
                return -1;
            }
            break;
        }
        case KT_STRING:
            if (!memchr(src, '\0', e->size)) {
                set_err(err, errlen, "%s: not NUL-terminated", e->key);
                return -1;
            }
            if ((e->flags & F_NONEMPTY) && *(const char *)src == '\0') {
                set_err(err, errlen, "%s: must not be empty", e->key);
                return -1;
            }
            break;
        case KT_ENUM: {
            int v;
            memcpy(&v, src, sizeof v);
            if (v < 0 || v >= enum_count(e->names)) {
                describe_type(e, range, sizeof range);
                set_err(err, errlen, "%s: invalid value %d (expected %s)", e->key, v, range);
                return -1;
            }
            break;
        }
        case KT_LAYERS: {
            if (check_layer_count(e, c->n_sizes, err, errlen) != 0) return -1;
            /* Weights and biases of every layer must fit an int32 index:
             * each size <= 2^20 and <= 16 layers, so int64 cannot overflow. */
            int64_t params = 0;
            for (int j = 0; j < c->n_sizes; j++) {
                const int s = c->sizes[j];
                if (s < e->imin || s > e->imax) {
                    describe_range(e, range, sizeof range);
                    set_err(err, errlen, "%s: layer size %d (entry %d) is out of range%s", e->key,
                            s, j, range);
                    return -1;
                }
                if (j > 0) params += (int64_t)c->sizes[j - 1] * s + s;
            }
            if (params > INT32_MAX) {
                set_err(err, errlen, "%s: %lld parameters, at most %d", e->key,
                        (long long)params, INT32_MAX);
                return -1;
            }
            break;
        }
        case KT_TENSORS: {
            char why[400];
            if (c->n_tensors > 0 && ps_tensors_check(c->tensors, c->n_tensors, why, sizeof why) != 0) {
                set_err(err, errlen, "%s: %s", e->key, why);
                return -1;
            }
            break;
        }
        case KT_GROUPS:
            if (c->n_groups < 0 || c->n_groups > PS_GROUPS_MAX) {
                set_err(err, errlen, "%s: %d groups, at most %d", e->key, c->n_groups, PS_GROUPS_MAX);
                return -1;
            }
            for (int g = 0; g < c->n_groups; g++)
                if (ps_group_check(&c->groups[g], g, err, errlen) != 0) return -1;
            break;
        case KT_UINT64:
        case KT_BOOL: break;
        }
    }
    return ps_config_check_rules(c, err, errlen);
}

/* ---------------------------------------------------------------- output */

static void write_value(FILE *f, const ps_config_t *c, const key_spec_t *e)
{
    const void *src = cfield(c, e);
    char num[32];
    switch (e->type) {
    case KT_INT: {
        int v;
        memcpy(&v, src, sizeof v);
        fprintf(f, "%d", v);
        return;
    }
    case KT_INT64: {
        int64_t v;
        memcpy(&v, src, sizeof v);
        fprintf(f, "%lld", (long long)v);
        return;
    }
    case KT_UINT64: {
        uint64_t v;
        memcpy(&v, src, sizeof v);
        fprintf(f, "%llu", (unsigned long long)v);
        return;
    }
    case KT_DOUBLE: {
        double v;
        memcpy(&v, src, sizeof v);
        if ((e->flags & F_OFF) && v == 0.0) {
            fputs("off", f);
            return;
        }
        ps_fmt_double(v, num, sizeof num);
        fputs(num, f);
        return;
    }
    case KT_BOOL: {
        bool v;
        memcpy(&v, src, sizeof v);
        fputs(v ? "true" : "false", f);
        return;
    }
    case KT_STRING: ps_yaml_quoted(f, src); return;
    case KT_ENUM: {
        int v;
        memcpy(&v, src, sizeof v);
        fputs(enum_name(e->names, v), f);
        return;
    }
    case KT_LAYERS:
        fputc('[', f);
        for (int i = 0; i < c->n_sizes && i <= PS_MAX_LAYERS; i++)
            fprintf(f, "%s%d", i ? ", " : "", c->sizes[i]);
        fputc(']', f);
        return;
    case KT_TENSORS:
        if (c->n_tensors == 0) fputs("[]", f);
        for (int i = 0; i < c->n_tensors; i++) {
            const ps_tensor_spec_t *t = &c->tensors[i];
            char shape[256], init[64];
            ps_shape_str(t->ndim, t->shape, shape, sizeof shape);
            ps_init_str(&t->init, init, sizeof init);
            fputs("\n    - {name: ", f);
            ps_yaml_quoted(f, t->name);
            fprintf(f, ", shape: %s, init: \"%s\"%s}", shape, init, t->kind == PS_TENSOR_ROWS ? ", kind: sparse_rows" : "");
        }
        return;
    case KT_GROUPS:
        if (c->n_groups == 0) fputs("[]", f);
        for (int i = 0; i < c->n_groups; i++) {
            const ps_group_t *g = &c->groups[i];
            fputs("\n    - {match: ", f);
            ps_yaml_quoted(f, g->match);
            if (g->has_wd) {
                ps_fmt_double(g->weight_decay, num, sizeof num);
                fprintf(f, ", weight_decay: %s", num);
            }
            ps_fmt_double(g->lr_scale, num, sizeof num);
            fprintf(f, ", lr_scale: %s}", num);
        }
        return;
    }
}

/* An F_SET key's value is not 0. */
static bool key_set(const ps_config_t *c, const key_spec_t *e)
{
    const char *p = (const char *)c + e->off;
    if (e->type == KT_DOUBLE) return *(const double *)(const void *)p != 0;
    if (e->type == KT_STRING) return p[0] != 0;
    if (e->type == KT_ENUM) return *(const int *)(const void *)p != 0;
    PS_CFG_ASSERT(e->type == KT_INT64);
    return *(const int64_t *)(const void *)p != 0;
}

/* All keys in table order, one "section:" line per section. */
static int write_yaml(const ps_config_t *c, FILE *f, bool with_server)
{
    const char *cur = NULL;
    size_t cur_len = 0;
    for (size_t i = 0; i < N_KEYS; i++) {
        const key_spec_t *e = &keys[i];
        const size_t sl = section_len(e->key);
        /* where and when to save or serve do not change what is trained */
        if (!with_server && (strncmp(e->key, "server.", 7) == 0 || strncmp(e->key, "checkpoint.", 11) == 0))
            continue;
        if (!with_server && ((e->flags & F_UNHASHED) || ((e->flags & F_CTR) && c->kind != PS_MODEL_CTR) ||
                             ((e->flags & F_TENSORS) && c->kind != PS_MODEL_TENSORS &&
                              c->kind != PS_MODEL_FROM_WORKER) ||
                             ((e->flags & F_KIND) && c->kind == PS_MODEL_MLP) ||
                             ((e->flags & F_SET) && !key_set(c, e)) ||
                             (e->type == KT_GROUPS && c->n_groups == 0)))
            continue;
        if (!cur || sl != cur_len || strncmp(cur, e->key, sl) != 0) {
            fprintf(f, "%.*s:\n", (int)sl, e->key);
            cur = e->key;
            cur_len = sl;
        }
        fprintf(f, "  %s: ", e->key + sl + 1);
        write_value(f, c, e);
        fputc('\n', f);
    }
    return ferror(f) ? -1 : 0;
}

void ps_config_value_text(const ps_config_t *c, const char *key, char *buf, size_t n)
{
    const key_spec_t *e = find_key(key);
    char *text = NULL;
    size_t len = 0;
    FILE *f = e ? open_memstream(&text, &len) : NULL;
    if (f) write_value(f, c, e);
    if (f && fclose(f) == 0 && text) snprintf(buf, n, "%s", text);
    else snprintf(buf, n, "?");
    free(text);
}

int ps_config_write_yaml(const ps_config_t *c, FILE *f)
{
    PS_CFG_ASSERT(c && f);
    return write_yaml(c, f, true);
}

uint64_t ps_config_hash(const ps_config_t *c)
{
    PS_CFG_ASSERT(c);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    PS_CFG_ASSERT(f); /* only fails when out of memory */
    int rc = write_yaml(c, f, false);
    if (fclose(f) != 0) rc = -1;
    PS_CFG_ASSERT(rc == 0);
    uint64_t h = ps_fnv1a(0xcbf29ce484222325ULL, text, len); /* FNV-1a 64 */
    free(text);
    return h;
}

/* ---------------------------------------------------------------- names */

const char *ps_opt_name(ps_opt_kind_t k) { return enum_name(opt_names, (int)k); }
const char *ps_sched_name(ps_sched_kind_t k) { return enum_name(sched_names, (int)k); }
const char *ps_sync_name(ps_sync_t k) { return enum_name(sync_names, (int)k); }
const char *ps_log_level_name(ps_log_level_t l) { return enum_name(log_names, (int)l); }
