/* itest.c - see itest.h. */
#include "itest.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "itest.h"
#include "proc.h"
#include "ps_auth.h"
#include "ps_ctr.h"
#include "ps_model.h"
#include "ps_shm.h"
#include "psworker.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"

char dir[128];
const char *psd_bin, *pworker_bin;
const char *slice[] = {"--epochs", "1", "--set", "data.train_limit=4000", NULL};

TestSuite(short, .init = it_setup, .fini = it_teardown, .timeout = 600);
TestSuite(long, .init = it_setup, .fini = it_teardown, .timeout = 900);

void it_setup(void)
{
    psd_bin = getenv("PSD_BIN");
    pworker_bin = getenv("PWORKER_BIN");
    cr_assert_not_null(psd_bin, "PSD_BIN is set by meson");
    cr_assert_not_null(pworker_bin, "PWORKER_BIN is set by meson");
    snprintf(dir, sizeof dir, "/tmp/psd-it-XXXXXX");
    cr_assert_not_null(mkdtemp(dir));
    proc_set_cwd(dir); /* default checkpoint dirs and the like go there */
    /* and for run_cmd's shells too: a `psd --check-config` with the default
     * --save in the build directory took the lock of a parallel test's psd */
    cr_assert_eq(chdir(dir), 0, "chdir %s", dir);
}

void it_teardown(void)
{
    proc_reap_all();
    if (getenv("PSD_TEST_KEEP")) { /* keep the logs for a look */
        fprintf(stderr, "kept %s\n", dir);
        return;
    }
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

void path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", dir, name); }

/* The log of the worker that got rank 0 (the one that logs its INFO lines)
 * among the `workers` of run `tag`; NULL if none. Caller frees. */
char *rank0_log(const char *tag, int workers)
{
    for (int i = 0; i < workers; i++) {
        char name[256], wl[512];
        snprintf(name, sizeof name, "%s-w%d.log", tag, i);
        path(wl, sizeof wl, name);
        char *log = slurp(wl);
        if (log && strstr(log, ": rank 0, run ")) return log;
        free(log);
    }
    return NULL;
}

/* Start psd with the given extra args (NULL-terminated). */
pid_t start_psd(run_t *r, const char *tag, int workers, const char **extra)
{
    char wn[16];
    snprintf(wn, sizeof wn, "%d", workers);
    snprintf(r->endpoint, sizeof r->endpoint, "tcp://127.0.0.1:%d", free_port());
    char name[64];
    snprintf(name, sizeof name, "%s-metrics.jsonl", tag);
    path(r->metrics, sizeof r->metrics, name);
    snprintf(name, sizeof name, "%s-weights.bin", tag);
    path(r->weights, sizeof r->weights, name);
    snprintf(name, sizeof name, "%s-psd.log", tag);
    path(r->psd_log, sizeof r->psd_log, name);
    const char *argv[64] = {psd_bin, "--listen", r->endpoint, "--workers", wn, "--metrics", r->metrics,
                            "--save", r->weights, "--start-timeout", "120", "--worker-timeout", "60"};
    int n = 13;
    for (int i = 0; extra && extra[i]; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    return proc_spawn(argv, r->psd_log);
}

pid_t start_worker(run_t *r, const char *tag, int i, const char **extra)
{
    char name[64], log[256];
    snprintf(name, sizeof name, "%s-w%d.log", tag, i);
    path(log, sizeof log, name);
    const char *argv[32] = {pworker_bin, "--connect", r->endpoint, "--wait", "120"};
    int n = 5;
    for (int k = 0; extra && extra[k]; k++) argv[n++] = extra[k];
    argv[n] = NULL;
    return proc_spawn(argv, log);
}

/* psd + N workers (each with worker_extra) to the end. */
void train_wx(run_t *r, const char *tag, int workers, const char **extra,
                     const char **worker_extra, double timeout)
{
    pid_t p = start_psd(r, tag, workers, extra);
    pid_t w[MAXW];
    for (int i = 0; i < workers; i++) w[i] = start_worker(r, tag, i, worker_extra);
    r->psd_code = proc_wait(p, timeout);
    for (int i = 0; i < workers; i++) r->worker_code[i] = proc_wait(w[i], 30);
}

void train(run_t *r, const char *tag, int workers, const char **extra, double timeout)
{
    train_wx(r, tag, workers, extra, NULL, timeout);
}

char *metrics_last(const run_t *r)
{
    char *m = slurp(r->metrics);
    cr_assert_not_null(m, "metrics file %s exists", r->metrics);
    return m;
}

/* Built with sanitizers (meson sets PSD_TEST_SANITIZED). */
bool sanitized(void)
{
    const char *v = getenv("PSD_TEST_SANITIZED");
    return v && strcmp(v, "1") == 0;
}

/* The last epoch validated every test sample once. */
void assert_validated_all(const run_t *r)
{
    char *m = metrics_last(r);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
    free(m);
}

void check_run(const run_t *r, int workers, int epochs)
{
    char *log = slurp(r->psd_log);
    size_t len = log ? strlen(log) : 0; /* Criterion drops long messages: the tail */
    cr_assert_eq(r->psd_code, 0, "psd exit %d; end of its log:\n%s", r->psd_code,
                 log ? log + (len > 1500 ? len - 1500 : 0) : "");
    cr_assert(!strstr(log, "psd's bookkeeping"), "every training sample trained once an epoch: %s",
              strstr(log, "trained twice"));
    for (int i = 0; i < workers; i++) cr_assert_eq(r->worker_code[i], 0, "worker %d exit %d", i, r->worker_code[i]);
    char *m = metrics_last(r);
    cr_assert_eq(count_lines(m), epochs, "one metrics line per epoch");
    const char *last = last_line(m);
    cr_assert_eq(json_num(last, "schema"), IT_METRICS_SCHEMA);
    cr_assert_eq(json_num(last, "val_samples"), 10000, "every test sample counted once: %s", last);
    cr_assert_eq(json_num(last, "workers"), workers);
    cr_assert_eq(json_num(last, "epoch"), epochs);
    cr_assert_gt(json_num(last, "samples_per_s"), 0);
    /* the workers' step time and the part of it spent waiting for weights */
    double step_ms = json_num(last, "worker_step_ms"), frac = json_num(last, "worker_wait_frac");
    cr_assert(step_ms > 0 && step_ms < 60000, "worker_step_ms %g", step_ms);
    cr_assert(frac > 0 && frac < 1, "worker_wait_frac %g", frac);
    /* psd's own step (reduce + optimizer) is reported. (Not compared with the workers' step: that
     * is a timing, and one slow step of a short run under load tips it: 26.7 ms against 8.4 in
     * a 16-step run of CI; speed is the benchmarks' business.) */
    double psd_ms = json_num(last, "psd_step_ms");
    cr_assert(psd_ms > 0 && psd_ms < 60000, "psd_step_ms %g, worker_step_ms %g", psd_ms, step_ms);
    free(m);
    free(log);
}

/* The same model, run id aside (ps_weights_same, as bench/same_weights.sh). */
int weights_equal(const char *a, const char *b)
{
    char why[512];
    int same = ps_weights_same(a, b, why, sizeof why);
    if (same != 1) cr_log_info("weights %s and %s: %s", a, b, why);
    return same == 1;
}

int count_in(const char *text, const char *what)
{
    int n = 0;
    for (const char *p = text; (p = strstr(p, what)); p += strlen(what)) n++;
    return n;
}

/* Wait until psd's metrics file has at least n lines, allowing 60 s for
 * each new line. */
void wait_metrics(const run_t *r, int n)
{
    int seen = -1;
    double since = ps_now();
    while (ps_now() - since < 60) {
        char *m = slurp(r->metrics);
        int lines = m ? count_lines(m) : 0;
        free(m);
        if (lines >= n) return;
        if (lines != seen) {
            seen = lines;
            since = ps_now();
        }
        zmq_poll(NULL, 0, 50);
    }
    cr_assert_fail("psd wrote no new metrics line in 60 s (%d of %d)", seen, n);
}

void wait_log(const char *file, const char *text, double timeout_s)
{
    for (double t = 0; t < timeout_s; t += 0.05) {
        char *log = slurp(file);
        int found = log && strstr(log, text);
        free(log);
        if (found) return;
        zmq_poll(NULL, 0, 50);
    }
    cr_assert_fail("'%s' did not appear in %s within %.0f s", text, file, timeout_s);
}

int run_cmd(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* Workers <tag>-w0.. ran with --verbose under psd --x-verify-weights: each
 * says it checked the weights it received against psd's CRC-32. */
void assert_workers_verified(const char *tag, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        char wlog[512];
        snprintf(wlog, sizeof wlog, "%s/%s-w%d.log", dir, tag, i);
        char *log = slurp(wlog);
        cr_assert(log && strstr(log, "weights messages matched psd's checksums"), "worker %d checked %s", i, what);
        free(log);
    }
}

/* Every epoch trained each sample once and validated every test sample. */
void check_every_epoch(const run_t *r, int epochs, uint64_t train)
{
    char *m = metrics_last(r);
    cr_assert_eq(count_lines(m), epochs, "%s", m);
    int e = 0;
    for (char *line = m; line && *line; e++) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        cr_assert_eq(json_num(line, "train_samples"), (double)train, "epoch %d: %s", e + 1, line);
        cr_assert_eq(json_num(line, "val_samples"), 10000, "epoch %d: %s", e + 1, line);
        cr_assert_eq(json_num(line, "epoch"), e + 1, "%s", line);
        line = nl ? nl + 1 : NULL;
    }
    cr_assert_gt(json_num(last_line(m), "val_acc"), 0.7, "trained: %s", last_line(m));
    free(m);
}

/* How many of pid's mappings and open descriptors are files in /dev/shm
 * (*memfd: how many of its mappings are memfds). */
int dev_shm_files_of(pid_t pid, int *memfd)
{
    char path[64], line[512], link[512];
    int n = 0;
    *memfd = 0;
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "/dev/shm/")) n++;
        if (strstr(line, "/memfd:")) (*memfd)++;
    }
    fclose(f);
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s", path);
    for (struct dirent *e; (e = readdir(d));) {
        char fd[320];
        snprintf(fd, sizeof fd, "%s/%s", path, e->d_name);
        ssize_t k = readlink(fd, link, sizeof link - 1);
        if (k > 0 && (link[k] = '\0', strncmp(link, "/dev/shm/", 9) == 0)) n++;
    }
    closedir(d);
    return n;
}

/* A header of `type` for run 0x77 from rank 0 (the body is the caller's):
 * the fake peers' (shard 0, a shard, a worker, psd) */
Psd__Header fake_hdr(Psd__MsgType type, uint64_t seq)
{
    Psd__Header h;
    psd__header__init(&h);
    h.type = type;
    h.run_id = 0x77;
    h.seq = seq;
    return h;
}

unsigned fault_seed(void)
{
    const char *e = getenv("PSD_FAULT_SEED");
    unsigned seed = e ? (unsigned)strtoul(e, NULL, 10) : (unsigned)time(NULL);
    fprintf(stderr, "fault injection seed %u (PSD_FAULT_SEED=%u replays it)\n", seed, seed);
    srand(seed);
    return seed;
}

/* The library workers' model, 784-hidden-10, and a zero gradient for it. */
float *lib_model(ps_layout_t *l, int hidden)
{
    cr_assert_eq(ps_layout_init(l, (const int[]){784, hidden, 10}, 3), 0);
    float *zero = calloc(l->n_params, sizeof *zero);
    cr_assert(zero);
    return zero;
}

void lib_next(psw_client_t *c, psw_event_t *ev, psw_event_kind_t kind)
{
    char err[512];
    int rc = psw_client_next(c, ev, 30, err, sizeof err);
    cr_assert_eq(rc, 0, "%s", err);
    cr_assert_eq(ev->kind, kind, "event %d, want %d", (int)ev->kind, (int)kind);
}

void lib_grads(lib_grads_t *a, const ps_layout_t *l, const float *grad)
{
    a->n = ps_layout_ntab(l);
    cr_assert_leq(a->n, LIB_GRADS_MAX);
    for (int t = 0; t < a->n; t++)
        a->gr[t] = (psw_grad_t){.tensor = (uint32_t)t, .data = grad + ps_layout_tensor(l, t)->offset};
}

void lib_push(psw_client_t *c, uint64_t version, uint32_t batch, int pull, const float *zero,
                     const ps_layout_t *l)
{
    lib_grads_t a;
    lib_grads(&a, l, zero);
    psw_push_t p = {.version = version, .batch = batch, .loss_sum = 0.5 * batch, .pull = pull, .n_grads = a.n,
                    .grads = a.gr};
    cr_assert_eq(psw_client_push_v(c, &p), 0);
}

/* n library workers in registration order, each given `samples` of the
 * epoch and asking for the weights. */
void lib_start(const char *ep, psw_client_t **w, int n, size_t samples)
{
    char err[512];
    psw_event_t ev;
    for (int i = 0; i < n; i++) w[i] = lib_worker(ep, err, sizeof err);
    for (int i = 0; i < n; i++) {
        lib_next(w[i], &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, samples, "worker %d was given %" PRIu64 " samples, not %zu", i,
                     (uint64_t)ev.n_samples, samples);
        psw_client_pull(w[i], ev.version);
    }
}

/* train.stream: PUSH messages whose frames are not chunks of the model, or
 * repeat a chunk (in one message or a later one), are dropped with a log
 * line; the push then completes with the right chunks, psd steps, and sends
 * the new version back in parts, every tensor once. A raw worker (the only
 * one) over the wire. */
/* A raw worker's DEALER connected to endpoint (no linger). */
void *raw_dealer(void *ctx, const char *endpoint)
{
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(d, endpoint), 0);
    return d;
}

/* A raw worker: REGISTER on a DEALER and return psd's ASSIGN (in m). */
int raw_register(void *sock, ps_msg_t *m)
{
    char host[256], hid[256];
    ps_hostname(host, sizeof host);
    ps_host_id(hid, sizeof hid);
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Register reg = PSD__REGISTER__INIT;
    h.type = PSD__MSG_TYPE__MSG_REGISTER;
    h.seq = 1;
    reg.hostname = host;
    reg.host_id = hid;
    reg.pid = (uint32_t)getpid();
    reg.device = "cpu";
    reg.device_index = -1;
    reg.prev_rank = -1;
    h.body_case = PSD__HEADER__BODY_REG;
    h.reg = &reg;
    if (ps_msg_send(sock, NULL, 0, &h, NULL, 0) != 0) return -1;
    char err[256];
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 30000) != 1) return -1;
    return ps_msg_recv(sock, m, false, 0, err, sizeof err);
}

/* A command's first line of output (or all of it, up to n - 1 bytes). */
void run_cmd_out(const char *cmd, char *out, size_t n)
{
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    size_t k = fread(out, 1, n - 1, f);
    out[k] = '\0';
    pclose(f);
}

pid_t start_shard(const run_t *r, const char *tag, int i, int n, const char **extra)
{
    return start_shard_at(r, tag, i, n, extra, NULL);
}

/* psd shard i of n (i > 0) of the run r's psd (shard 0), listening on a
 * free port, logging to TAG-shardI.log. */
/* shard i of n for the run r; its endpoint into ep_out (64 bytes) if not NULL */
pid_t start_shard_at(const run_t *r, const char *tag, int i, int n, const char **extra, char *ep_out)
{
    char ep[64], sh[16], name[64], log[256];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
    if (ep_out) memcpy(ep_out, ep, sizeof ep);
    snprintf(sh, sizeof sh, "%d/%d", i, n);
    snprintf(name, sizeof name, "%s-shard%d.log", tag, i);
    path(log, sizeof log, name);
    const char *argv[48] = {psd_bin, "--listen", ep, "--shard", sh, "--leader", r->endpoint, "--start-timeout", "120",
                            "--worker-timeout", "60"};
    int k = 11;
    for (int j = 0; extra && extra[j]; j++) argv[k++] = extra[j];
    argv[k] = NULL;
    return proc_spawn(argv, log);
}

/* train_sharded, and psd (every shard) and both workers exited 0 */
void train_ok(run_t *r, const char *tag, int shards, const char **args, const char **wex)
{
    train_sharded(r, tag, shards, args, wex);
    cr_assert(a_run_ok(r), "%s: %s", tag, r->psd_log);
}

/* psd as n shards (n > 1: shard 0 with --shard 0/n, and shards 1..n-1) and
 * two workers, to the end; every shard must exit 0. */
void train_sharded(run_t *r, const char *tag, int n, const char **extra, const char **worker_extra)
{
    const char *args[48];
    int k = 0;
    char sh[16];
    snprintf(sh, sizeof sh, "0/%d", n);
    for (int j = 0; extra && extra[j]; j++) args[k++] = extra[j];
    if (n > 1) {
        args[k++] = "--shard";
        args[k++] = sh;
    }
    args[k] = NULL;
    pid_t p = start_psd(r, tag, 2, args), f[PS_MAX_SHARDS];
    for (int i = 1; i < n; i++) f[i] = start_shard(r, tag, i, n, extra);
    pid_t w0 = start_worker(r, tag, 0, worker_extra), w1 = start_worker(r, tag, 1, worker_extra);
    r->psd_code = proc_wait(p, 300);
    r->worker_code[0] = proc_wait(w0, 30);
    r->worker_code[1] = proc_wait(w1, 30);
    for (int i = 1; i < n; i++) cr_assert_eq(proc_wait(f[i], 30), 0, "shard %d/%d exits 0", i, n);
}

/* A unix socket bound to abstract name `name` exists on this host. */
bool unix_socket_listed(const char *name)
{
    FILE *f = fopen("/proc/net/unix", "r"); /* size 0 to stat: read it line by line */
    char line[512], want[128];
    snprintf(want, sizeof want, " @%s\n", name);
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f)) found = strstr(line, want) != NULL;
    if (f) fclose(f);
    return found;
}

/* psd (every shard: train_sharded) and both workers exited 0 */
bool a_run_ok(const run_t *r)
{
    return r->psd_code == 0 && r->worker_code[0] == 0 && r->worker_code[1] == 0;
}

/* the same over the wire */
psw_client_t *lib_worker(const char *ep, char *err, size_t n) { return lib_worker_shm(ep, 0, err, n); }

/* A library worker, registered and ready (384 training samples, 10000
 * test), through psd's shared memory (shm) or over the wire. */
psw_client_t *lib_worker_shm(const char *ep, int shm, char *err, size_t n)
{
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = !shm};
    psw_client_t *c = psw_client_new(ep, &info, err, n);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, n) == 0, "%s", err);
    cr_assert_eq(psw_client_ready(c, 384, 10000, NULL), 0);
    return c;
}
