/* psd - the parameter server daemon: owns the run description, the master
 * weights and the optimizer state; workers connect and are told what to do. */
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_config.h"
#include "ps_log.h"
#include "ps_model.h"
#include "psmodel.h"
#include "ps_wire.h"
#include "psd_ckpt.h"
#include "psd_eval.h"
#include "ps_weights_st.h"
#include "psd_http.h"
#include "psd_run.h"
#include "psd_server.h"
#include "psd_shard.h"
#include "ps_tcp.h"
#include "ps_util.h"
#include "ps_auth.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: psd [options]            train (the built-in defaults train the Fashion-MNIST MLP)\n"
            "       psd eval WEIGHTS [--config FILE] [--threads N]\n"
            "                                evaluate a weights file (psd's, or .safetensors) on the test set\n"
            "       psd export WEIGHTS OUT.safetensors\n"
            "                                a weights file as safetensors (fc1.weight, fc1.bias, ...)\n"
            "       psd keygen NAME              make a CurveZMQ key pair: NAME.key (0600) and NAME.pub\n"
            "\n"
            "  --config FILE        YAML run description (see README); flags override it\n"
            "  --listen ENDPOINT    where workers connect (default tcp://0.0.0.0:5555; beyond\n"
            "                       loopback only with --key/--allow or --insecure)\n"
            "  --key FILE           psd's secret key (psd keygen): workers must use CURVE\n"
            "  --allow DIR          allowed worker public keys (DIR/*.pub); SIGHUP reloads it\n"
            "  --insecure           listen beyond loopback without keys (trusted networks only)\n"
            "  --workers N          worker processes to wait for (default 2)\n"
            "  --start-timeout S    exit 3 if not all workers are ready after S seconds (default 300)\n"
            "  --worker-timeout S   a worker psd waits for that is silent for S seconds is lost;\n"
            "                       training goes on without it (default 5)\n"
            "  --epochs N           epochs to train\n"
            "  --seed N             seed of the weights and of the data order\n"
            "  --metrics FILE       append one JSON line per epoch (\"\" for none)\n"
            "  --save FILE          write the trained weights here (\"\" for none)\n"
            "  --set KEY=VALUE      set any config key, e.g. --set optimizer.lr=0.05\n"
            "  --resume DIR         continue the run from the newest valid checkpoint in DIR\n"
            "                       (a corrupt one is reported and the one before it used)\n"
            "  --force-resume       resume even if the config differs from the checkpoint's\n"
            "  --stop-after-epoch E write a checkpoint after epoch E and stop (exit 0)\n"
            "  --print-config       print the effective config as YAML and exit\n"
            "  --check-config       run the start's checks (config, flags, input files, endpoints bound\n"
            "                       and closed) and exit 0, or 2 with the error; nothing is written;\n"
            "                       with --resume, also load the checkpoint a resume would use\n"
            "  --log-level LEVEL    error | warn | info | debug (default info)\n"
            "  --log-format FMT     text (default) or json: one JSON object a line, for log collectors\n"
            "  --shard I/N          run as psd shard I of N: each holds part of the parameters and\n"
            "                       its optimizer state; shard 0 runs the run and workers connect\n"
            "                       to it only (they learn the others from it)\n"
            "  --leader ENDPOINT    shards 1..N-1: shard 0's endpoint\n"
            "  --advertise ENDPOINT shards 1..N-1: where workers reach this shard (default --listen)\n"
            "  --http HOST:PORT     HTTP endpoint: /metrics (Prometheus), /status (JSON), /healthz;\n"
            "                       beyond loopback only with server.http_token_file (or --insecure)\n"
            "  --help               this text\n"
            "  --version            version, protocol version and git commit\n"
            "\n"
            "exit codes: 0 done, 1 runtime error, 2 bad flags/config/data, 3 start timeout,\n"
            "4 no worker left to finish the run, 5 a psd shard was lost or failed, 6 the run\n"
            "finished but its metrics file is incomplete (a write failed; see the log),\n"
            "128+N stopped at once by a second signal N\n"
            "SIGINT/SIGTERM: checkpoint, stop the workers, exit 0; SIGUSR1: checkpoint and go on\n");
}

typedef struct {
    const char *key, *value;
} override_t;

/* --FLAG's integer in [lo, hi] into *out: 0, or -1 with a message. */
static int int_opt(const char *flag, const char *arg, long lo, long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (*end || end == arg || errno || v < lo || v > hi) {
        fprintf(stderr, "psd: --%s: expected an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, arg);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* A file psd writes (what: how the user named it), created anew beside it
 * and renamed over it (save), or appended to (metrics): no directory; its
 * directory is there and psd may write in it, unless it is appended to and
 * is there, writable. 0, or -1 with a message. */
static int check_out_file(const char *what, const char *file, bool append, char *err, size_t errlen)
{
    struct stat st;
    bool there = stat(file, &st) == 0;
    if (there && S_ISDIR(st.st_mode)) {
        snprintf(err, errlen, "%s %s: is a directory, not a file", what, file);
        return -1;
    }
    if (there && append) {
        if (access(file, W_OK) == 0) return 0;
        snprintf(err, errlen, "%s %s: cannot append to it: %s", what, file, strerror(errno));
        return -1;
    }
    char buf[PS_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", file);
    const char *dir = dirname(buf); /* as ps_atomic_commit finds the directory */
    if (access(dir, W_OK | X_OK) != 0) {
        snprintf(err, errlen, "%s %s: cannot write in %s: %s", what, file, dir, strerror(errno));
        return -1;
    }
    return 0;
}

/* checkpoint.dir d: a directory psd may write in, or one it can create:
 * psd (shard 0) makes d itself (its parent must be there), other shards
 * make every missing directory of the path (the nearest one there must be
 * writable). 0, or -1 with a message. */
static int check_ckpt_dir(const char *d, bool make_parents, char *err, size_t errlen)
{
    struct stat st;
    if (stat(d, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) {
            snprintf(err, errlen, "checkpoint.dir %s: not a directory", d);
            return -1;
        }
        if (access(d, W_OK | X_OK) != 0) {
            snprintf(err, errlen, "checkpoint.dir %s: cannot write in it: %s", d, strerror(errno));
            return -1;
        }
        return 0;
    }
    if (errno != ENOENT) {
        snprintf(err, errlen, "checkpoint.dir %s: %s", d, strerror(errno));
        return -1;
    }
    char buf[PS_PATH_MAX];
    snprintf(buf, sizeof buf, "%s", d);
    const char *up = dirname(buf); /* dirname ends at "/" or "." */
    while (make_parents && stat(up, &st) != 0 && errno == ENOENT && strcmp(up, "/") != 0 && strcmp(up, ".") != 0)
        up = dirname(buf);
    int e = stat(up, &st) != 0 ? errno : !S_ISDIR(st.st_mode) ? ENOTDIR : access(up, W_OK | X_OK) != 0 ? errno : 0;
    if (e) {
        snprintf(err, errlen, "checkpoint.dir %s: cannot create it in %s: %s", d, up, strerror(e));
        return -1;
    }
    return 0;
}

/* What the start would refuse in the outputs and the HTTP endpoint, found
 * without binding or writing anything: the same check for --check-config
 * and before the start. Shards 1..N-1 write checkpoints only. 0, or -1
 * with a message. */
static int check_outputs(const ps_config_t *c, const psd_run_opts_t *run, char *err, size_t errlen)
{
    if (c->ckpt_dir[0] && check_ckpt_dir(c->ckpt_dir, run->shard > 0, err, errlen) != 0) return -1;
    if (run->shard > 0) return 0;
    if (c->save[0] && check_out_file("--save (server.save)", c->save, false, err, errlen) != 0) return -1;
    if (c->metrics[0] && check_out_file("--metrics (server.metrics)", c->metrics, true, err, errlen) != 0) return -1;
    if (!c->http[0]) return 0;
    char token[256];
    bool open;
    return psd_http_settings(c->http, c->http_token_file, c->insecure, token, sizeof token, &open, err, errlen) == 0
               ? 0
               : -1;
}

/* What the command line says, besides config keys (over: KEY=VALUE, in order). */
typedef struct {
    const char *config, *eval_path;
    int print, check, threads;
    psd_run_opts_t run;
    override_t *over;
    int n_over;
} flags_t;

/* psd keygen and psd export: true when argv is one of them (*code its exit code). */
static bool subcommand(int argc, char **argv, int *code)
{
    char err[1024];
    *code = 2;
    if (argc > 1 && strcmp(argv[1], "keygen") == 0) {
        if (argc != 3 || argv[2][0] == '-') {
            fprintf(stderr, "psd keygen: usage: psd keygen NAME (writes NAME.key, mode 0600, and NAME.pub)\n");
            return true;
        }
        if (ps_auth_keygen(argv[2], err, sizeof err) != 0) {
            fprintf(stderr, "psd keygen: %s\n", err);
            return true;
        }
        printf("psd keygen: wrote %s.key (secret, mode 0600) and %s.pub\n", argv[2], argv[2]);
        *code = 0;
        return true;
    }
    if (argc > 1 && strcmp(argv[1], "export") == 0) {
        if (argc != 4 || argv[2][0] == '-' || !ps_weights_is_st(argv[3])) {
            fprintf(stderr, "psd export: usage: psd export WEIGHTS OUT.safetensors\n");
            return true;
        }
        *code = psd_export_run(argv[2], argv[3]);
        return true;
    }
    return false;
}

enum { /* psd's long flags (getopt_long's values) */
    OPT_CONFIG = 256, OPT_LISTEN, OPT_WORKERS, OPT_EPOCHS, OPT_SEED, OPT_METRICS, OPT_SAVE,
    OPT_PRINT, OPT_CHECK, OPT_LOGLEVEL, OPT_HELP, OPT_VERSION, OPT_START_TMO, OPT_WORKER_TMO,
    OPT_SET, OPT_THREADS, OPT_RESUME, OPT_FORCE_RESUME, OPT_STOP_AFTER, OPT_KEY, OPT_ALLOW,
    OPT_INSECURE, OPT_XNOZAP, OPT_XVERIFY, OPT_XFETCH, OPT_XBREAKFETCH, OPT_XSLOWCKPT, OPT_XMAXW, OPT_XDIEMETRICS, OPT_LOGFORMAT, OPT_SHARD, OPT_LEADER, OPT_ADVERTISE, OPT_HTTP
};
static const struct option longopts[] = {
    {"config", required_argument, NULL, OPT_CONFIG},
    {"listen", required_argument, NULL, OPT_LISTEN},
    {"workers", required_argument, NULL, OPT_WORKERS},
    {"epochs", required_argument, NULL, OPT_EPOCHS},
    {"seed", required_argument, NULL, OPT_SEED},
    {"metrics", required_argument, NULL, OPT_METRICS},
    {"save", required_argument, NULL, OPT_SAVE},
    {"print-config", no_argument, NULL, OPT_PRINT},
    {"check-config", no_argument, NULL, OPT_CHECK},
    {"log-level", required_argument, NULL, OPT_LOGLEVEL},
    {"log-format", required_argument, NULL, OPT_LOGFORMAT},
    {"start-timeout", required_argument, NULL, OPT_START_TMO},
    {"worker-timeout", required_argument, NULL, OPT_WORKER_TMO},
    {"set", required_argument, NULL, OPT_SET},
    {"threads", required_argument, NULL, OPT_THREADS},
    {"resume", required_argument, NULL, OPT_RESUME},
    {"force-resume", no_argument, NULL, OPT_FORCE_RESUME},
    {"stop-after-epoch", required_argument, NULL, OPT_STOP_AFTER},
    {"key", required_argument, NULL, OPT_KEY},
    {"allow", required_argument, NULL, OPT_ALLOW},
    {"insecure", no_argument, NULL, OPT_INSECURE},
    {"x-no-zap", no_argument, NULL, OPT_XNOZAP},
    {"x-verify-weights", no_argument, NULL, OPT_XVERIFY},
    {"x-fetch-floats", required_argument, NULL, OPT_XFETCH},
    {"x-break-fetch", no_argument, NULL, OPT_XBREAKFETCH},
    {"x-slow-ckpt-ms", required_argument, NULL, OPT_XSLOWCKPT},
    {"x-max-workers", required_argument, NULL, OPT_XMAXW},
    {"x-die-after-metrics", required_argument, NULL, OPT_XDIEMETRICS},
    {"shard", required_argument, NULL, OPT_SHARD},
    {"leader", required_argument, NULL, OPT_LEADER},
    {"advertise", required_argument, NULL, OPT_ADVERTISE},
    {"http", required_argument, NULL, OPT_HTTP},
    {"help", no_argument, NULL, OPT_HELP},
    {"version", no_argument, NULL, OPT_VERSION},
    {NULL, 0, NULL, 0}};
static const char *keys[] = {
    [OPT_LISTEN - OPT_CONFIG] = "server.listen",   [OPT_WORKERS - OPT_CONFIG] = "server.workers",
    [OPT_EPOCHS - OPT_CONFIG] = "run.epochs",      [OPT_SEED - OPT_CONFIG] = "run.seed",
    [OPT_METRICS - OPT_CONFIG] = "server.metrics", [OPT_SAVE - OPT_CONFIG] = "server.save",
    [OPT_LOGLEVEL - OPT_CONFIG] = "server.log_level",
    [OPT_LOGFORMAT - OPT_CONFIG] = "server.log_format",
    [OPT_START_TMO - OPT_CONFIG] = "server.start_timeout",
    [OPT_WORKER_TMO - OPT_CONFIG] = "server.worker_timeout",
    [OPT_KEY - OPT_CONFIG] = "server.key",
    [OPT_ALLOW - OPT_CONFIG] = "server.allow",
    [OPT_HTTP - OPT_CONFIG] = "server.http",
};

/* The flags from argv[first] on into f: -1 to go on, else the exit code (--help, --version: 0;
 * a bad flag: 2, said on stderr). */
static int parse_flags(int argc, char **argv, int first, flags_t *f)
{
    psd_run_opts_t *run = &f->run;
    override_t *over = f->over;
    optind = first;
    opterr = 0;
    int c;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case OPT_CONFIG: f->config = optarg; break;
        case OPT_PRINT: f->print = 1; break;
        case OPT_CHECK: f->check = 1; break;
        case OPT_HELP: usage(stdout); return 0;
        case OPT_VERSION:
            printf("psd %s (protocol %u, commit %s)\n", PSD_VERSION, PS_PROTOCOL_VERSION, PSD_GIT_COMMIT);
            return 0;
        case OPT_THREADS:
            if (int_opt("threads", optarg, 1, 1024, &f->threads) != 0) return 2;
            break;
        case OPT_RESUME: run->resume_dir = optarg; break;
        case OPT_INSECURE: over[f->n_over++] = (override_t){"server.insecure", "true"}; break;
        case OPT_XNOZAP: run->no_zap = 1; break; /* tests only */
        case OPT_XVERIFY: run->verify_weights = 1; break; /* tests only */
        case OPT_XBREAKFETCH: run->break_fetch = 1; break; /* tests only */
        case OPT_XSLOWCKPT: { /* tests only: a slow disk */
            int ms;
            if (int_opt("x-slow-ckpt-ms", optarg, 0, 600000, &ms) != 0) return 2;
            psd_ckpt_test_delay(ms);
            break;
        }
        case OPT_XDIEMETRICS: /* tests only: killed between an epoch's metrics line and its checkpoint */
            if (int_opt("x-die-after-metrics", optarg, 1, 1000000, &run->die_after_metrics) != 0) return 2;
            break;
        case OPT_XMAXW: /* tests only: few worker slots, to see them reused */
            if (int_opt("x-max-workers", optarg, 1, 1024, &run->max_workers) != 0) return 2;
            break;
        case OPT_XFETCH: { /* tests only */
            char *end;
            unsigned long long v = strtoull(optarg, &end, 10);
            if (*end || end == optarg || optarg[0] == '-' || v < 1 || v > ((uint64_t)1 << 32)) {
                fprintf(stderr, "psd: --x-fetch-floats: expected an integer in [1, 2^32], got '%s'\n", optarg);
                return 2;
            }
            run->fetch_floats = v;
            break;
        }
        case OPT_FORCE_RESUME: run->force_resume = 1; break;
        case OPT_SHARD: {
            int i = -1, n = -1, used = 0;
            if (sscanf(optarg, "%d/%d%n", &i, &n, &used) != 2 || optarg[used] || n < 1 || n > PS_MAX_SHARDS || i < 0 ||
                i >= n) {
                fprintf(stderr, "psd: --shard: expected I/N with 0 <= I < N <= %d, got '%s'\n", PS_MAX_SHARDS, optarg);
                return 2;
            }
            run->shard = i;
            run->shards = n;
            break;
        }
        case OPT_LEADER: run->leader = optarg; break;
        case OPT_ADVERTISE: run->advertise = optarg; break;
        case OPT_STOP_AFTER: {
            char *end;
            long v = strtol(optarg, &end, 10);
            if (*end || end == optarg || v < 1 || v > 1000000) {
                fprintf(stderr, "psd: --stop-after-epoch: expected an epoch number >= 1, got '%s'\n", optarg);
                return 2;
            }
            run->stop_after_epoch = (int)v;
            break;
        }
        case OPT_SET: {
            char *eq = strchr(optarg, '=');
            if (!eq || eq == optarg) {
                fprintf(stderr, "psd: --set: expected KEY=VALUE, got '%s'\n", optarg);
                return 2;
            }
            *eq = '\0';
            over[f->n_over++] = (override_t){optarg, eq + 1};
            break;
        }
        case '?':
        case ':':
            fprintf(stderr, "psd: unknown or incomplete option '%s' (see --help)\n", argv[optind - 1]);
            return 2;
        default:
            over[f->n_over++] = (override_t){keys[c - OPT_CONFIG], optarg};
        }
    }
    if (optind < argc) {
        fprintf(stderr, "psd: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }

    if (optind < argc) {
        fprintf(stderr, "psd: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    return -1;
}

/* The run's config: defaults, the file, the flags' keys, checked with the flags
 * (shards, endpoints): 0, or -1 (said on stderr). */
static int load_config(ps_config_t *cfg, const flags_t *f)
{
    char err[1024];
    const psd_run_opts_t *run = &f->run;
    const char *config = f->config;
    if (run->shard > 0 && !run->leader) {
        fprintf(stderr, "psd: --shard %d/%d: give shard 0's endpoint with --leader ENDPOINT\n", run->shard, run->shards);
        return -1;
    }
    if ((run->leader || run->advertise) && run->shard == 0) {
        fprintf(stderr, "psd: --leader and --advertise are for shards 1..N-1 (--shard I/N)\n");
        return -1;
    }
    const struct { const char *flag, *ep; } eps[] = {{"leader", run->leader}, {"advertise", run->advertise}};
    for (size_t i = 0; i < sizeof eps / sizeof eps[0]; i++)
        if (eps[i].ep && ps_endpoint_check(eps[i].ep, PS_EP_CONNECT, err, sizeof err) != 0) {
            fprintf(stderr, "psd: --%s: %s\n", eps[i].flag, err);
            return -1;
        }
    ps_config_defaults(cfg);
    if (config && ps_config_load_file(cfg, config, err, sizeof err) != 0) {
        fprintf(stderr, "psd: %s\n", err);
        return -1;
    }
    for (int i = 0; i < f->n_over; i++)
        if (ps_config_set(cfg, f->over[i].key, f->over[i].value, err, sizeof err) != 0) {
            fprintf(stderr, "psd: %s\n", err);
            return -1;
        }
    ps_config_user_defaults(cfg); /* a user's model: PyTorch's defaults for what nothing set */
    if (ps_config_validate(cfg, err, sizeof err) != 0) {
        fprintf(stderr, "psd: %s%s%s\n", config ? config : "", config ? ": " : "", err);
        return -1;
    }
    if (ps_tcp_cc_check(cfg->tcp_congestion, err, sizeof err) != 0) { /* the kernel's say: found out now */
        fprintf(stderr, "psd: %s%s%s\n", config ? config : "", config ? ": " : "", err);
        return -1;
    }
    if (run->shards > 1 && cfg->stream) {
        fprintf(stderr, "psd: train.stream: true needs one psd; psd shards (--shard) take whole pushes\n");
        return -1;
    }
    if (run->shards > 1 && cfg->sync != PS_SYNC_BSP) {
        fprintf(stderr, "psd: train.sync: %s needs one psd; psd shards (--shard) train with bsp only\n",
                ps_sync_name(cfg->sync));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    static ps_config_t cfg; /* zero until read; freed at out */
    ps_malloc_keep(); /* before ZeroMQ's threads start */
    flags_t fl = {.threads = 1};
    psd_run_opts_t *run = &fl.run;
    char err[1024];
    int code = 2;
    ps_log_set_role("psd");
    psm_blas_tune(argv);
    if (subcommand(argc, argv, &code)) return code;
    fl.over = calloc((size_t)argc + 1, sizeof *fl.over);
    if (!fl.over) return 1;
    int first = 1;
    if (argc > 1 && strcmp(argv[1], "eval") == 0) {
        if (argc < 3 || argv[2][0] == '-') {
            fprintf(stderr, "psd eval: a weights file is required (psd eval WEIGHTS [--config FILE])\n");
            goto out;
        }
        fl.eval_path = argv[2];
        first = 3;
    }
    if ((code = parse_flags(argc, argv, first, &fl)) >= 0) goto out;
    code = 2;
    if (load_config(&cfg, &fl) != 0) goto out;
    ps_log_set_level(cfg.log_level);
    ps_log_set_json(cfg.log_format == PS_LOG_JSON);
    if (fl.print) {
        code = ps_config_write_yaml(&cfg, stdout) == 0 ? 0 : 1;
        goto out;
    }
    if (!fl.eval_path && run->stop_after_epoch > 0 && !cfg.ckpt_dir[0]) {
        fprintf(stderr, "psd: --stop-after-epoch needs checkpoints to resume from, and checkpoint.dir is empty\n");
        goto out;
    }
    if (!fl.eval_path && check_outputs(&cfg, run, err, sizeof err) != 0) { /* found out now, not after the training */
        fprintf(stderr, "psd: %s\n", err);
        goto out;
    }
    if (fl.check && run->resume_dir && run->shard > 0) { /* its part is found at the step shard 0 resumes */
        fprintf(stderr, "psd: --check-config --resume checks shard 0's checkpoint: run it with --shard 0/%d\n",
                run->shards);
        goto out;
    }
    if (fl.check) { /* the start's own checks (psd_server_run, psd_shard_run), stopped before it writes or trains */
        if (run->resume_dir && (code = psd_resume_check(run->resume_dir, &cfg, run->force_resume, run->shards)) != 0)
            goto out; /* (it says which checkpoint a resume would use) */
        run->check = 1;
        ps_log_set_level(cfg.log_level < PS_LOG_WARN ? cfg.log_level : PS_LOG_WARN); /* its errors, not its INFO */
        code = run->shard > 0 ? psd_shard_run(&cfg, run) : psd_server_run(&cfg, run);
        if (code == 0) printf("psd: config OK\n");
        goto out;
    }
    if (fl.eval_path) {
        code = psd_eval_run(&cfg, fl.eval_path, fl.threads);
        goto out;
    }
    ps_early_stop_signals(); /* a stop while loading is acted on once the loop runs */
    code = run->shard > 0 ? psd_shard_run(&cfg, run) : psd_server_run(&cfg, run);
out:
    free(fl.over);
    ps_config_free(&cfg);
    return code;
}
