/* pworker - psd worker processes. Needs only psd's address; everything else
 * (rank, model, data, hyper-parameters) comes from psd.
 *
 * A small supervisor: --devices picks the devices (all visible GPUs by
 * default, the CPU when there are none); one device runs in this process,
 * several run one worker process each. The parent forwards SIGINT/SIGTERM and
 * exits with the status of the first worker that failed. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda/psw_cuda.h"
#include "ps_log.h"
#include "ps_util.h"
#include "ps_wire.h"
#include "psw_backend.h"
#include "psw_worker.h"

#define MAX_DEVICES 64

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pworker --connect tcp://HOST:PORT [options]\n"
            "\n"
            "psd workers: each registers with psd, gets its rank, model, data shard and\n"
            "hyper-parameters, and trains until psd ends the run.\n"
            "\n"
            "  --connect ENDPOINT  psd's address, e.g. tcp://10.0.0.5:5555 (required)\n"
            "  --devices DEVS      auto (default): every visible GPU, one worker process each,\n"
            "                      or the CPU when there is none; cpu; or a list of CUDA\n"
            "                      ordinals as seen after CUDA_VISIBLE_DEVICES, e.g. 0,2\n"
            "                      (\"cpu\" may appear in the list: 0,cpu = one GPU and one CPU worker)\n"
            "  --threads N         CPU workers: BLAS threads (default: the CPUs this process may\n"
            "                      use / workers psd has on this host; all of them when its\n"
            "                      affinity mask or cgroup quota gives it a share of the host\n"
            "                      and the workers' shares fit in it)\n"
            "  --data-dir DIR      look for the data files in DIR (by base name) instead of psd's paths\n"
            "  --wait SECONDS      how long to wait for psd to answer the registration (default 300)\n"
            "  --retry-for SECONDS after losing psd (killed, restarted), keep registering again with\n"
            "                      back-off for this long, then continue with the restarted psd\n"
            "                      (default 120; 0 = exit 4 at once)\n"
            "  --key FILE          this worker's secret key (psd keygen NAME); with --server-key,\n"
            "                      connect with CurveZMQ (psd must have NAME.pub in its allow-list)\n"
            "  --server-key FILE   psd's public key (psd keygen's .pub)\n"
            "  --no-shm            on psd's host, send tensors over the socket too (default: through\n"
            "                      shared memory, which psd offers to workers on its host)\n"
            "  --verbose           log INFO on every rank (default: only rank 0; others warn/error)\n"
            "  --log-format FMT    text (default) or json: one JSON object a line, for log collectors\n"
            "  --help              this text\n"
            "  --version           version, protocol version and git commit\n"
            "\n"
            "exit codes: 0 run finished, 1 runtime error, 2 usage error / refused by psd /\n"
            "protocol or data mismatch / no such device, 4 psd lost (silent past its deadline)\n");
}

static int parse_int(const char *flag, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "pworker: %s: expected an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

/* Count GPUs in a child process: initialising CUDA here would make it
 * unusable in the workers we fork. Returns the count, or -1 with why. */
static int probe_gpus(char *why, size_t n)
{
    int fds[2];
    if (pipe(fds) != 0) {
        snprintf(why, n, "pipe: %s", strerror(errno));
        return -1;
    }
    pid_t pid = fork();
    if (pid < 0) {
        snprintf(why, n, "fork: %s", strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return -1;
    }
    if (pid == 0) {
        close(fds[0]);
        char msg[600];
        char err[512] = "";
        const psw_cuda_plugin_t *p = psw_cuda_load(err, sizeof err);
        int count = p ? p->device_count(err, sizeof err) : -1;
        int len = snprintf(msg, sizeof msg, "%d %s", count, err);
        if (write(fds[1], msg, (size_t)len) < 0) _exit(1);
        _exit(0);
    }
    close(fds[1]);
    char buf[600];
    size_t got = 0;
    ssize_t r;
    while (got < sizeof buf - 1 && (r = read(fds[0], buf + got, sizeof buf - 1 - got)) != 0) {
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) break;
        got += (size_t)r;
    }
    buf[got] = '\0';
    close(fds[0]);
    waitpid(pid, NULL, 0);
    char *sp = strchr(buf, ' ');
    snprintf(why, n, "%s", sp ? sp + 1 : "GPU probe failed");
    return got ? atoi(buf) : -1;
}

typedef struct {
    int cuda; /* 0: cpu */
    int index;
} device_t;

/* --devices into a list; exit code 2 on a bad spec or a missing device. */
static int resolve_devices(const char *spec, device_t *dev, int *n_dev)
{
    char why[512] = "";
    *n_dev = 0;
    if (strcmp(spec, "cpu") == 0) {
        dev[(*n_dev)++] = (device_t){0, -1};
        return 0;
    }
    if (strcmp(spec, "auto") == 0) {
        int count = probe_gpus(why, sizeof why);
        if (count <= 0) {
            PS_WARN("no GPU found: %s; training on the CPU", count == 0 ? "no CUDA device visible" : why);
            dev[(*n_dev)++] = (device_t){0, -1};
            return 0;
        }
        for (int i = 0; i < count && i < MAX_DEVICES; i++) dev[(*n_dev)++] = (device_t){1, i};
        return 0;
    }
    char buf[512];
    snprintf(buf, sizeof buf, "%s", spec);
    int count = -2; /* probed on the first ordinal */
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n_dev >= MAX_DEVICES) {
            fprintf(stderr, "pworker: --devices: more than %d devices\n", MAX_DEVICES);
            return 2;
        }
        if (strcmp(tok, "cpu") == 0) {
            dev[(*n_dev)++] = (device_t){0, -1};
            continue;
        }
        long v;
        char *end;
        errno = 0;
        v = strtol(tok, &end, 10);
        if (errno || end == tok || *end || v < 0 || v > INT_MAX) {
            fprintf(stderr, "pworker: --devices: '%s' is not auto, cpu or a list of GPU ordinals like 0,2\n",
                    spec);
            return 2;
        }
        if (count == -2) count = probe_gpus(why, sizeof why);
        if (v >= count) {
            if (count <= 0)
                fprintf(stderr, "pworker: --devices: GPU %ld does not exist: no GPU is usable here (%s)\n", v,
                        count == 0 ? "no CUDA device visible" : why);
            else
                fprintf(stderr, "pworker: --devices: GPU %ld does not exist: %d visible (ordinals 0-%d%s)\n", v,
                        count, count - 1, getenv("CUDA_VISIBLE_DEVICES") ? ", after CUDA_VISIBLE_DEVICES" : "");
            return 2;
        }
        dev[(*n_dev)++] = (device_t){1, (int)v};
    }
    if (*n_dev == 0) {
        fprintf(stderr, "pworker: --devices: empty list\n");
        return 2;
    }
    return 0;
}

static volatile sig_atomic_t got_signal;
static void on_signal(int sig) { got_signal = sig; }

/* One worker process per device; forward signals; first failure's status. */
static int supervise(psw_worker_opts_t *o, const device_t *dev, int n_dev)
{
    pid_t pids[MAX_DEVICES];
    int alive = 0, first_failure = 0;
    struct sigaction sa = {.sa_handler = on_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    for (int i = 0; i < n_dev; i++) {
        pid_t pid = fork();
        if (pid < 0) {
            PS_ERROR("fork: %s", strerror(errno));
            for (int k = 0; k < i; k++) kill(pids[k], SIGTERM);
            first_failure = 1;
            n_dev = i;
            break;
        }
        if (pid == 0) {
            signal(SIGINT, SIG_DFL);
            signal(SIGTERM, SIG_DFL);
            o->device = dev[i].cuda ? "cuda" : "cpu";
            o->device_index = dev[i].index;
            _exit(psw_worker_run(o));
        }
        pids[i] = pid;
        alive++;
    }
    int forwarded = 0;
    while (alive > 0) {
        int st;
        pid_t pid = waitpid(-1, &st, 0);
        if (pid < 0) {
            if (errno != EINTR) break;
            if (got_signal && !forwarded) {
                for (int i = 0; i < n_dev; i++)
                    if (pids[i] > 0) kill(pids[i], got_signal);
                forwarded = 1;
            }
            continue;
        }
        for (int i = 0; i < n_dev; i++)
            if (pids[i] == pid) pids[i] = 0;
        alive--;
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (code != 0 && first_failure == 0) first_failure = code;
    }
    return first_failure;
}

int main(int argc, char **argv)
{
    enum { OPT_DATA_DIR = 256, OPT_WAIT, OPT_XPROTO, OPT_VERSION, OPT_DEVICES, OPT_XSPLIT, OPT_RETRY, OPT_KEY, OPT_SERVER_KEY, OPT_NO_SHM, OPT_LOG_FORMAT, OPT_XSLOW, OPT_XDEVSIM, OPT_XSLOWRANK };
    static const struct option longopts[] = {
        {"connect", required_argument, NULL, 'c'}, {"threads", required_argument, NULL, 't'},
        {"verbose", no_argument, NULL, 'v'},       {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, OPT_VERSION}, {"data-dir", required_argument, NULL, OPT_DATA_DIR},
        {"wait", required_argument, NULL, OPT_WAIT}, {"devices", required_argument, NULL, OPT_DEVICES},
        {"x-protocol", required_argument, NULL, OPT_XPROTO}, {"x-split-push", no_argument, NULL, OPT_XSPLIT},
        {"x-slow-ms", required_argument, NULL, OPT_XSLOW}, {"x-device-sim", no_argument, NULL, OPT_XDEVSIM},
        {"x-slow-rank-ms", required_argument, NULL, OPT_XSLOWRANK},
        {"retry-for", required_argument, NULL, OPT_RETRY},
        {"key", required_argument, NULL, OPT_KEY},
        {"server-key", required_argument, NULL, OPT_SERVER_KEY},
        {"no-shm", no_argument, NULL, OPT_NO_SHM},
        {"log-format", required_argument, NULL, OPT_LOG_FORMAT},
        {NULL, 0, NULL, 0}};
    psw_worker_opts_t o = {.device = "cpu", .device_index = -1, .register_timeout_s = 300, .retry_s = 120};
    const char *devices = "auto";
    ps_log_set_role("pworker");
    psw_blas_tune(argv);
    long v;
    int c;
    ps_malloc_keep(); /* before ZeroMQ's and OpenBLAS's threads start */
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': o.connect = optarg; break;
        case 't':
            if (parse_int("--threads", optarg, 1, 1024, &v)) return 2;
            o.threads = (int)v;
            break;
        case 'v': o.verbose = 1; break;
        case 'h': usage(stdout); return 0;
        case OPT_VERSION:
            printf("pworker %s (protocol %u, commit %s)\n", PSD_VERSION, PS_PROTOCOL_VERSION, PSD_GIT_COMMIT);
            return 0;
        case OPT_DATA_DIR: o.data_dir = optarg; break;
        case OPT_DEVICES: devices = optarg; break;
        case OPT_WAIT:
            if (parse_int("--wait", optarg, 1, 86400, &v)) return 2;
            o.register_timeout_s = (double)v;
            break;
        case OPT_XPROTO: /* testing only: claim another protocol version */
            if (parse_int("--x-protocol", optarg, 1, INT_MAX, &v)) return 2;
            o.protocol = (unsigned)v;
            break;
        case OPT_XSPLIT: o.split_push = 1; break; /* testing only: push tensor by tensor */
        case OPT_XDEVSIM: o.device_sim = 1; break; /* testing only: the CPU backend taken for a device */
        case OPT_XSLOW: /* testing only: a slow worker */
            if (parse_int("--x-slow-ms", optarg, 0, 60000, &v)) return 2;
            o.slow_ms = (int)v;
            break;
        case OPT_XSLOWRANK: /* testing only: rank r slower by (world - 1 - r) x this: pushes in reverse rank order */
            if (parse_int("--x-slow-rank-ms", optarg, 0, 60000, &v)) return 2;
            o.slow_rank_ms = (int)v;
            break;
        case OPT_KEY: o.key_file = optarg; break;
        case OPT_SERVER_KEY: o.server_key = optarg; break;
        case OPT_NO_SHM: o.no_shm = 1; break;
        case OPT_LOG_FORMAT:
            if (strcmp(optarg, "text") != 0 && strcmp(optarg, "json") != 0) {
                fprintf(stderr, "pworker: --log-format: expected text or json, got '%s'\n", optarg);
                return 2;
            }
            ps_log_set_json(strcmp(optarg, "json") == 0);
            break;
        case OPT_RETRY:
            if (parse_int("--retry-for", optarg, 0, 86400, &v)) return 2;
            o.retry_s = (double)v;
            break;
        default:
            fprintf(stderr, "pworker: unknown or incomplete option '%s' (see --help)\n", argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "pworker: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    if (!o.connect) {
        fprintf(stderr, "pworker: --connect tcp://HOST:PORT is required (see --help)\n");
        return 2;
    }
    char why[400];
    if (ps_endpoint_check(o.connect, PS_EP_CONNECT, why, sizeof why) != 0) {
        fprintf(stderr, "pworker: --connect: %s\n", why);
        return 2;
    }
    device_t dev[MAX_DEVICES];
    int n_dev = 0, rc = resolve_devices(devices, dev, &n_dev);
    if (rc != 0) return rc;
    if (n_dev == 1) {
        o.device = dev[0].cuda ? "cuda" : "cpu";
        o.device_index = dev[0].index;
        return psw_worker_run(&o);
    }
    return supervise(&o, dev, n_dev);
}
