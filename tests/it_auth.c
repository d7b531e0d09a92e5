/* it_auth.c - integration tests: authentication (CurveZMQ + allow-list) and the soak under hostile
 * connections (see itest.h). */
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

/* ---- authentication (CurveZMQ + allow-list) ------------------------------ */

static void keygen(const char *name)
{
    cr_assert_eq(run_cmd("cd '%s' && '%s' keygen %s > /dev/null", dir, psd_bin, name), 0, "keygen %s", name);
}

/* pworker with keys against psd at r->endpoint; returns its exit code. */
static int keyed_worker(run_t *r, const char *tag, const char *key, const char *server_pub, double wait_s)
{
    char log[256], k[256], sp[256];
    snprintf(log, sizeof log, "%s/%s.log", dir, tag);
    snprintf(k, sizeof k, "%s/%s", dir, key ? key : "");
    snprintf(sp, sizeof sp, "%s/%s", dir, server_pub ? server_pub : "");
    /* how long the worker waits for psd: 20 s, or a third of wait_s when
     * that is shorter (a test that expects no answer) */
    char wait[16];
    snprintf(wait, sizeof wait, "%.0f", wait_s >= 60 ? 20.0 : wait_s / 3);
    const char *argv[16] = {pworker_bin, "--connect", r->endpoint, "--devices", "cpu", "--wait", wait};
    int n = 7;
    if (key) {
        argv[n++] = "--key";
        argv[n++] = k;
        argv[n++] = "--server-key";
        argv[n++] = sp;
    }
    argv[n] = NULL;
    pid_t w = proc_spawn(argv, log);
    return proc_wait(w, wait_s);
}

Test(short, keygen_writes_a_private_secret_key)
{
    keygen("a");
    cr_assert_eq(run_cmd("cd '%s' && test \"$(stat -c %%a a.key)\" = 600 && test \"$(stat -c %%a a.pub)\" = 644 && "
                         "test $(head -c 40 a.pub | wc -c) = 40", dir), 0);
    cr_assert_eq(run_cmd("cd '%s' && '%s' keygen a > /dev/null 2>&1", dir, psd_bin), 2, "never overwrites a key");
    keygen("srv");
    cr_assert_eq(run_cmd("chmod 644 '%s/a.key'", dir), 0);
    char out[256];
    path(out, sizeof out, "perm.txt");
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices cpu --key '%s/a.key' --server-key '%s/srv.pub' "
                         "> '%s' 2>&1", pworker_bin, dir, dir, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "readable by others") && strstr(t, "chmod 600"), "clear message: %s", t);
    free(t);
    cr_assert_eq(run_cmd("mkdir -p '%s/allow' && chmod 644 '%s/srv.key' && '%s' --key '%s/srv.key' --allow '%s/allow' "
                         "--listen tcp://127.0.0.1:9 > '%s' 2>&1", dir, dir, psd_bin, dir, dir, out), 2,
                 "psd refuses a world-readable secret key too");
}

/* srv.key/.pub, and DIR/allow holding allowed.pub (NULL: empty); fills the
 * --key and --allow arguments. */
static void auth_setup(const char *allowed, char *key, char *allow, size_t n)
{
    keygen("srv");
    cr_assert_eq(run_cmd("mkdir -p '%s/allow'", dir), 0);
    if (allowed) cr_assert_eq(run_cmd("cp '%s/%s.pub' '%s/allow/'", dir, allowed, dir), 0);
    snprintf(key, n, "%s/srv.key", dir);
    snprintf(allow, n, "%s/allow", dir);
}

Test(short, only_allow_listed_keys_get_in)
{
    keygen("good");
    keygen("bad");
    keygen("other");
    run_t r;
    char key[300], allow[300];
    auth_setup("good", key, allow, sizeof key);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow,
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "auth", 1, args);
    cr_assert_eq(keyed_worker(&r, "w-bad", "bad.key", "srv.pub", 60), 2, "unknown key refused");
    cr_assert_eq(keyed_worker(&r, "w-plain", NULL, NULL, 60), 2, "client without encryption refused");
    cr_assert_eq(keyed_worker(&r, "w-wrongsrv", "good.key", "other.pub", 60), 2, "wrong server key refused");
    char wlog[256];
    path(wlog, sizeof wlog, "w-bad.log");
    char *t = slurp(wlog);
    cr_assert(strstr(t, "authentication failed"), "%s", t);
    free(t);
    cr_assert_eq(keyed_worker(&r, "w-good", "good.key", "srv.pub", 120), 0, "the allowed worker trains");
    cr_assert_eq(proc_wait(p, 60), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "refused a client from 127.0.0.1: key not in the allow-list"), "address logged: %s", log);
    cr_assert(strstr(log, "handshake failed"), "plain and wrong-server-key clients logged: %s", log);
    free(log);
    assert_validated_all(&r);
}

/* With keys, psd shards share shard 0's key pair and allow-list: shard 1
 * joins with it, an allowed worker trains through both, a worker with a
 * key not in the list gets into neither. */
Test(short, psd_shards_with_keys)
{
    keygen("good");
    keygen("bad");
    char key[300], allow[300];
    auth_setup("good", key, allow, sizeof key);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow,
                          "--set", "checkpoint.dir=", "--shard", "0/2", NULL};
    const char *fargs[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow, "--set",
                           "checkpoint.dir=", NULL};
    run_t r;
    pid_t p = start_psd(&r, "kshard", 1, args);
    { /* an allowed worker's key claiming to be shard 1 is refused */
        ps_keypair_t kp;
        char spub[PS_Z85_LEN], err[256], kf[300], sf[300];
        snprintf(kf, sizeof kf, "%s/good.key", dir);
        snprintf(sf, sizeof sf, "%s/srv.pub", dir);
        cr_assert_eq(ps_auth_load_secret(kf, &kp, err, sizeof err), 0, "%s", err);
        cr_assert_eq(ps_auth_load_public(sf, spub, err, sizeof err), 0, "%s", err);
        void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
        int zero = 0, tmo = 20000;
        zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
        zmq_setsockopt(d, ZMQ_CURVE_SERVERKEY, spub, 40);
        zmq_setsockopt(d, ZMQ_CURVE_PUBLICKEY, kp.public_z85, 40);
        zmq_setsockopt(d, ZMQ_CURVE_SECRETKEY, kp.secret_z85, 40);
        cr_assert_eq(zmq_connect(d, r.endpoint), 0);
        Psd__Header h;
        Psd__ShardHello b = PSD__SHARD_HELLO__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
        b.shard = 1;
        b.shards = 2;
        b.endpoint = "tcp://127.0.0.1:1";
        h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
        h.shard_hello = &b;
        cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
        ps_msg_t m;
        cr_assert_eq(ps_msg_recv(d, &m, false, 0, err, sizeof err), 0, "an answer");
        cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ERROR);
        cr_assert(strstr(m.hdr->error->message, "psd's own key"), "%s", m.hdr->error->message);
        ps_msg_deinit(&m);
        zmq_close(d);
        zmq_ctx_term(ctx);
    }
    pid_t f = start_shard(&r, "kshard", 1, 2, fargs);
    cr_assert_eq(keyed_worker(&r, "w-bad", "bad.key", "srv.pub", 60), 2, "unknown key refused");
    cr_assert_eq(keyed_worker(&r, "w-good", "good.key", "srv.pub", 120), 0, "the allowed worker trains");
    cr_assert_eq(proc_wait(p, 60), 0);
    cr_assert_eq(proc_wait(f, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "psd shard 1/2 joined"), "%s", log);
    free(log);
    assert_validated_all(&r);
}

Test(short, no_authentication_handler_means_nobody_gets_in)
{
    keygen("good");
    run_t r;
    char key[300], allow[300];
    auth_setup("good", key, allow, sizeof key);
    const char *args[] = {"--key", key, "--allow", allow, "--x-no-zap", "--start-timeout", "30", NULL};
    pid_t p = start_psd(&r, "nozap", 1, args);
    int code = keyed_worker(&r, "w-good", "good.key", "srv.pub", 15);
    cr_assert(code == 2 || code == 4, "even an allowed key gets no answer (exit 2 refused, or 4 nothing for 5 s): %d",
              code);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert_null(strstr(log, "worker registered"), "nobody got in: %s", log);
    cr_assert(strstr(log, "handshake failed"), "the refusal is logged: %s", log);
    free(log);
}

Test(short, sighup_reloads_the_allow_list)
{
    keygen("late");
    run_t r;
    char key[300], allow[300];
    auth_setup(NULL, key, allow, sizeof key);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow,
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "hup", 1, args);
    cr_assert_eq(keyed_worker(&r, "w-early", "late.key", "srv.pub", 60), 2, "not allowed yet");
    cr_assert_eq(run_cmd("cp '%s/late.pub' '%s/allow/'", dir, dir), 0);
    kill(p, SIGHUP);
    wait_log(r.psd_log, "reloaded 1 allowed worker key", 10);
    cr_assert_eq(keyed_worker(&r, "w-late", "late.key", "srv.pub", 120), 0, "allowed after SIGHUP");
    cr_assert_eq(proc_wait(p, 60), 0);
}

Test(short, no_keys_no_listening_beyond_loopback)
{
    char out[256];
    path(out, sizeof out, "ins.txt");
    int port = free_port();
    cr_assert_eq(run_cmd("'%s' --listen tcp://0.0.0.0:%d > '%s' 2>&1", psd_bin, port, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "psd keygen") && strstr(t, "--insecure"), "says how to make keys: %s", t);
    free(t);
    run_t r;
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://0.0.0.0:%d", port);
    char log[256];
    path(log, sizeof log, "ins-psd.log");
    const char *argv[] = {psd_bin, "--listen", ep, "--insecure", "--set", "checkpoint.dir=", "--metrics", "",
                          "--start-timeout", "30", NULL};
    pid_t p = proc_spawn(argv, log);
    wait_log(log, "WITHOUT AUTHENTICATION", 20);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0);
    (void)r;
}

/* SIGTERM while psd still builds a large table (before its loop and its
 * own handlers): remembered, acted on once the loop runs (exit 0, the
 * workers told); a second one exits at once with 128+15, but not the first
 * one again at once (twice == 2: as timeout(1) sends it), which is one
 * request. */
Test(short, a_stop_while_psd_loads_is_a_clean_stop)
{
    for (int twice = 0; twice < 3; twice++) {
        char log[256], ep[64];
        snprintf(log, sizeof log, "%s/load-stop%d.log", dir, twice);
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
        char cfg[512];
        snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
        const char *argv[] = {psd_bin, "--config", cfg, "--listen", ep, "--set", "ctr.rows=3000000", "--set",
                              "ctr.dim=32", "--set", "model.layers=[256,64,2]", "--set", "checkpoint.dir=",
                              "--metrics", "", "--start-timeout", "60", NULL};
        pid_t p = proc_spawn(argv, log);
        wait_log(log, "ctr task:", 60); /* logged before the table is built */
        kill(p, SIGTERM);
        if (twice) {
            if (twice == 1) zmq_poll(NULL, 0, 250); /* past PS_SIGNAL_ECHO_S */
            kill(p, SIGTERM);
        }
        int rc = proc_wait(p, 60);
        char *t = slurp(log);
        cr_assert(t, "psd's log");
        if (twice == 1) {
            cr_assert_eq(rc, 128 + SIGTERM, "a second signal exits at once: %d\n%s", rc, t);
            cr_assert_null(strstr(t, "listening on"), "it did not go on loading: %s", t);
        } else {
            cr_assert_eq(rc, 0, "a clean stop: %d\n%s", rc, t);
            cr_assert(strstr(t, "the embedding table") && strstr(t, "received Terminated"),
                      "loaded, then acted on the signal: %s", t);
        }
        free(t);
    }
}

/* timeout(1) sends its signal to psd and to its process group: twice at
 * once. One request: a checkpoint, the workers told, exit 0 (before, the
 * second copy made psd exit at once with 143). */
Test(short, psd_under_timeout_stops_cleanly)
{
    char log[256], ck[256];
    path(log, sizeof log, "timeout-psd.log");
    path(ck, sizeof ck, "timeout-ck");
    int rc = run_cmd("timeout -k 30 --preserve-status 2 '%s' --listen tcp://127.0.0.1:%d --workers 1 --set "
                     "checkpoint.dir='%s' --metrics '' --start-timeout 60 > '%s' 2>&1",
                     psd_bin, free_port(), ck, log);
    char *t = slurp(log);
    cr_assert_eq(rc, 0, "psd's exit status: %d\n%s", rc, t);
    cr_assert(strstr(t, "received Terminated: writing a checkpoint"), "%s", t);
    cr_assert_null(strstr(t, "exiting now"), "%s", t);
    free(t);
}

/* ---- soak: training while hostile connections pound psd ----------------- */

static long rss_kib(pid_t pid)
{
    char f[64], line[256];
    snprintf(f, sizeof f, "/proc/%d/status", (int)pid);
    FILE *fp = fopen(f, "r");
    long kib = -1;
    while (fp && fgets(line, sizeof line, fp))
        if (strncmp(line, "VmRSS:", 6) == 0) kib = strtol(line + 6, NULL, 10);
    if (fp) fclose(fp);
    return kib;
}

typedef struct {
    const char *endpoint;
    int port;
    volatile int stop;
    unsigned seed;
} soak_t;

/* 20 hostile peers: raw TCP garbage, idle connections, and ZeroMQ peers
 * sending frames larger than psd's ZMQ_MAXMSGSIZE or malformed headers. */
static void *soak_main(void *arg)
{
    soak_t *k = arg;
    int raw[14];
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)k->port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 14; i++) {
        raw[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (raw[i] >= 0 && connect(raw[i], (struct sockaddr *)&a, sizeof a) != 0) {
            close(raw[i]);
            raw[i] = -1;
        }
    }
    void *ctx = zmq_ctx_new(), *z[6];
    int linger = 0;
    for (int i = 0; i < 6; i++) {
        z[i] = zmq_socket(ctx, ZMQ_DEALER);
        zmq_setsockopt(z[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_connect(z[i], k->endpoint);
    }
    size_t big_n = 64u << 20; /* larger than psd accepts for this model */
    char *big = calloc(1, big_n), junk[4096];
    unsigned seed = k->seed;
    while (!k->stop) {
        for (int i = 0; i < 8; i++) { /* 8 raw garbage senders; 6 stay idle */
            if (raw[i] < 0) continue;
            for (size_t j = 0; j < sizeof junk; j++) junk[j] = (char)rand_r(&seed);
            if (send(raw[i], junk, 1 + (size_t)rand_r(&seed) % sizeof junk, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 &&
                errno != EAGAIN) {
                close(raw[i]); /* psd dropped it: come back */
                raw[i] = socket(AF_INET, SOCK_STREAM, 0);
                if (raw[i] >= 0 && connect(raw[i], (struct sockaddr *)&a, sizeof a) != 0) {
                    close(raw[i]);
                    raw[i] = -1;
                }
            }
        }
        for (int i = 0; i < 3; i++) zmq_send(z[i], big, big_n, ZMQ_DONTWAIT); /* oversized */
        for (int i = 3; i < 6; i++) zmq_send(z[i], junk, 1 + (size_t)rand_r(&seed) % 512, ZMQ_DONTWAIT);
        zmq_poll(NULL, 0, 20);
    }
    for (int i = 0; i < 14; i++)
        if (raw[i] >= 0) close(raw[i]);
    for (int i = 0; i < 6; i++) zmq_close(z[i]);
    zmq_ctx_term(ctx);
    free(big);
    return NULL;
}

Test(short, soak_hostile_connections_while_training)
{
    /* PSD_SOAK_EPOCHS / PSD_SOAK_LIMIT make it longer (a 5-minute soak) */
    unsigned seed = fault_seed();
    run_t r;
    const char *ep_env = getenv("PSD_SOAK_EPOCHS"), *lim_env = getenv("PSD_SOAK_LIMIT");
    int epochs = ep_env ? atoi(ep_env) : 6;
    long limit = lim_env ? atol(lim_env) : 12000;
    char ep_s[16], lim_s[48];
    snprintf(ep_s, sizeof ep_s, "%d", epochs < 6 ? 6 : epochs);
    epochs = atoi(ep_s);
    snprintf(lim_s, sizeof lim_s, "data.train_limit=%ld", limit);
    const char *args[] = {"--epochs", ep_s, "--set", lim_s, "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "soak", 4, args);
    int port = atoi(strrchr(r.endpoint, ':') + 1);
    soak_t k = {.endpoint = r.endpoint, .port = port, .seed = seed};
    pthread_t th;
    pthread_create(&th, NULL, soak_main, &k);
    pid_t w[4];
    for (int i = 0; i < 4; i++) w[i] = start_worker(&r, "soak", i, NULL);
    wait_metrics(&r, 2); /* warm-up */
    long rss0 = rss_kib(p);
    wait_metrics(&r, epochs - 1);
    long rss1 = rss_kib(p);
    int code = proc_wait(p, 300);
    k.stop = 1;
    pthread_join(th, NULL);
    cr_assert_eq(code, 0, "psd trained to the end under attack");
    for (int i = 0; i < 4; i++) cr_assert_eq(proc_wait(w[i], 30), 0);
    check_every_epoch(&r, epochs, (uint64_t)(limit ? limit : 60000));
    char *m = metrics_last(&r);
    fprintf(stderr, "soak: %d epochs, final val_acc %.4f\n", epochs, json_num(last_line(m), "val_acc"));
    free(m);
    fprintf(stderr, "soak: psd RSS %ld KiB after warm-up, %ld KiB near the end (%+.1f%%)\n", rss0, rss1,
            100.0 * (double)(rss1 - rss0) / (double)rss0);
    /* Under ASan, RSS follows its allocator (quarantine, size-class regions
     * that are never returned), which connection churn from peers cut off
     * and reconnecting makes grow; leaks are LeakSanitizer's job there. */
    if (!sanitized())
        cr_assert(rss0 > 0 && rss1 <= rss0 * 105 / 100, "RSS grew by at most 5%%: %ld -> %ld KiB", rss0, rss1);
}

/* A psd shard's socket is as exposed as psd's: the same hostile peers
 * (raw garbage, frames over its ZMQ_MAXMSGSIZE, malformed headers) against
 * shard 1 while 2 shards train. Nothing reaches the parameters: the
 * weights are the bits of the same run left alone, and the shard logs what
 * it dropped. */
Test(short, a_psd_shard_under_attack_trains_on_with_the_same_weights)
{
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=4000", "--seed", "7", "--set",
                          "checkpoint.dir=", NULL};
    run_t a, b;
    train_sharded(&a, "calm", 2, args, NULL);
    check_run(&a, 2, 3);
    const char *args0[] = {"--epochs", "3", "--set", "data.train_limit=4000", "--seed", "7", "--set",
                           "checkpoint.dir=", "--shard", "0/2", NULL};
    pid_t p = start_psd(&b, "attacked", 2, args0);
    char ep[64];
    pid_t f = start_shard_at(&b, "attacked", 1, 2, args, ep);
    soak_t k = {.endpoint = ep, .port = atoi(strrchr(ep, ':') + 1), .seed = fault_seed()};
    pthread_t th;
    pthread_create(&th, NULL, soak_main, &k);
    pid_t w0 = start_worker(&b, "attacked", 0, NULL), w1 = start_worker(&b, "attacked", 1, NULL);
    b.psd_code = proc_wait(p, 300);
    k.stop = 1;
    pthread_join(th, NULL);
    b.worker_code[0] = proc_wait(w0, 30);
    b.worker_code[1] = proc_wait(w1, 30);
    cr_assert_eq(proc_wait(f, 30), 0, "shard 1 trained to the end under attack");
    check_run(&b, 2, 3);
    cr_assert(weights_equal(a.weights, b.weights), "the same bits as the run left alone");
    char log[256];
    path(log, sizeof log, "attacked-shard1.log");
    char *l = slurp(log);
    cr_assert(l && strstr(l, "dropped"), "shard 1 logs what it dropped: %s", l ? l : "(no log)");
    free(l);
}
