/* wire_probe - what the machine and ZeroMQ allow, as the yardsticks of psd's
 * communication figures. Not a test.
 *
 *   build/wire_probe [--cc=SETTING] [MIB] [SECONDS]
 *
 * --cc: the congestion control of the probe's tcp connections, as psd's
 *   server.tcp_congestion (common/ps_tcp.h): off (the kernel's, the
 *   default), auto (what psd does: reno instead of bbr on loopback) or a
 *   name. Compare psd with the probe under the same setting.
 *
 * memcpy:  bytes copied per second, MIB-sized buffers (one thread).
 * zmq tcp / ipc: a raw ZeroMQ round trip as push+pull does it: a DEALER
 *   sends MIB bytes (zero-copy, zmq_msg_init_data), a ROUTER in another
 *   process answers with MIB bytes (zero-copy from a prepared buffer);
 *   GB/s = (bytes sent + bytes received) / round time, like psbench's
 *   push+pull figure. Prints one line per probe, medians of 5 runs.
 *
 *   build/wire_probe MIB SECONDS CLIENTS
 *
 * tcp only: CLIENTS DEALERs (threads, one ZeroMQ context each, as psbench's
 *   workers) round-trip with one ROUTER process (2 I/O threads, as psd) at
 *   once; GB/s = the clients' rates (bytes sent and received / each one's
 *   time) summed, as psbench's aggregate: what the machine's
 *   loopback carries for CLIENTS connections into one server, the yardstick
 *   of psd's aggregate figures.
 *
 *   build/wire_probe MIB SECONDS CLIENTS sync
 *
 * tcp only: the same CLIENTS, in synchronous rounds as psd's bsp steps
 *   take them: the server waits until every client's message is in, then
 *   answers them all; once with no work between (the wire's own cost of the
 *   barrier), once with one pass of plain SGD over the round's messages on
 *   the server's critical path (w -= lr * their mean, one thread: the work
 *   psd's step does there). Prints both. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_util.h"
#include "ps_tcp.h"
#include "ps_util.h"

static double memcpy_gbs(size_t bytes, double seconds)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    uint64_t n = 0;
    double t0 = ps_now(), t;
    do {
        memcpy(n & 1 ? a : b, n & 1 ? b : a, bytes);
        n++;
        t = ps_now();
    } while (t - t0 < seconds);
    volatile char sink = a[bytes / 2] + b[bytes / 3];
    (void)sink;
    free(a);
    free(b);
    return (double)n * (double)bytes / (t - t0) / 1e9;
}

/* --cc=SETTING: server.tcp_congestion for the probe's connections (off: the
 * kernel's congestion control; auto: what psd does by default) */
static const char *cc = "off";

/* the setting on connection fd, once (the connections are few) */
static void tune_once(int fd)
{
    static __thread int done[64], n_done;
    if (fd < 0) return;
    for (int i = 0; i < n_done; i++)
        if (done[i] == fd) return;
    if (n_done < 64) done[n_done++] = fd;
    int last = 0;
    ps_tcp_cc_conn(&last, fd, cc, false);
}

/* The synchronous rounds' work: w -= lr * mean of the n messages g[k],
 * one pass, through a scratch block that stays in L1 (as psd's fused step) */
#define SGD_BLOCK 2048
static void sgd_pass(float *w, size_t nf, zmq_msg_t *g, int n)
{
    const float *gk[16];
    for (int k = 0; k < n; k++) gk[k] = zmq_msg_data(&g[k]);
    const float scale = 0.01f / (float)n;
    float acc[SGD_BLOCK];
    for (size_t o = 0; o < nf; o += SGD_BLOCK) {
        size_t m = nf - o < SGD_BLOCK ? nf - o : SGD_BLOCK;
        for (size_t i = 0; i < m; i++) acc[i] = gk[0][o + i];
        for (int k = 1; k < n; k++)
            for (size_t i = 0; i < m; i++) acc[i] += gk[k][o + i];
        for (size_t i = 0; i < m; i++) w[o + i] -= scale * acc[i];
    }
}

/* child: ROUTER bound to `ep` (tcp://127.0.0.1:* or ipc://), endpoint
 * written to fd; answers every message until `clients` empty ones came.
 * sync > 0: answers a round's messages once every client still running has
 * sent one (sync 2: after an SGD pass over them). */
static void server(const char *ep, size_t bytes, int fd, int clients, int sync)
{
    void *ctx = zmq_ctx_new();
    int io = clients > 1 ? 2 : 1;
    zmq_ctx_set(ctx, ZMQ_IO_THREADS, io);
    void *s = zmq_socket(ctx, ZMQ_ROUTER);
    if (zmq_bind(s, ep) != 0) _exit(1);
    char last[256];
    size_t len = sizeof last;
    zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, last, &len);
    if (write(fd, last, strlen(last) + 1) < 0) _exit(1);
    close(fd);
    char *reply = malloc(bytes);
    memset(reply, 0, bytes);
    zmq_msg_t ids[16], held[16];
    int got = 0;
    for (;;) {
        zmq_msg_t id, body, r;
        zmq_msg_init(&id);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&id, s, 0) < 0) break;
        if (zmq_msg_recv(&body, s, 0) < 0) break;
        tune_once(zmq_msg_get(&body, ZMQ_SRCFD));
        int stop = zmq_msg_size(&body) == 0;
        if (!sync || stop) zmq_msg_close(&body);
        if (stop) {
            zmq_msg_close(&id);
            if (--clients == 0) break;
        }
        if (sync) { /* the round is complete once every client still running is in it */
            if (!stop) {
                zmq_msg_init(&ids[got]);
                zmq_msg_move(&ids[got], &id);
                zmq_msg_init(&held[got]);
                zmq_msg_move(&held[got], &body);
                zmq_msg_close(&id);
                got++;
            }
            if (got == 0 || got < clients) continue;
            if (sync == 2) sgd_pass((float *)reply, bytes / sizeof(float), held, got);
            for (int k = 0; k < got; k++) {
                zmq_msg_send(&ids[k], s, ZMQ_SNDMORE);
                zmq_msg_init_data(&r, reply, bytes, bench_no_free, NULL);
                zmq_msg_send(&r, s, 0);
                zmq_msg_close(&held[k]);
            }
            got = 0;
            continue;
        }
        if (stop) continue;
        zmq_msg_send(&id, s, ZMQ_SNDMORE);
        zmq_msg_init_data(&r, reply, bytes, bench_no_free, NULL);
        zmq_msg_send(&r, s, 0);
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
    free(reply);
    _exit(0);
}

/* one client: round trips with the server at `ep` for `seconds` after two
 * warm-up rounds; its rounds and their time */
typedef struct {
    const char *ep;
    size_t bytes;
    double seconds;
    uint64_t rounds;
    double t0, t;
} client_t;

static void *client(void *arg)
{
    client_t *cl = arg;
    void *ctx = zmq_ctx_new(), *c = zmq_socket(ctx, ZMQ_DEALER);
    zmq_connect(c, cl->ep);
    char *buf = malloc(cl->bytes);
    memset(buf, 4, cl->bytes);
    for (int i = 0;; i++) {
        zmq_msg_t m, r;
        zmq_msg_init_data(&m, buf, cl->bytes, bench_no_free, NULL);
        zmq_msg_send(&m, c, 0);
        zmq_msg_init(&r);
        zmq_msg_recv(&r, c, 0);
        tune_once(zmq_msg_get(&r, ZMQ_SRCFD));
        zmq_msg_close(&r);
        cl->t = ps_now();
        if (i == 2) cl->t0 = cl->t; /* the first rounds set up buffers */
        if (i > 2) cl->rounds++;
        if (i > 2 && cl->t - cl->t0 > cl->seconds) break;
    }
    zmq_send(c, "", 0, 0);
    int linger = 1000;
    zmq_setsockopt(c, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(c);
    zmq_ctx_term(ctx);
    free(buf);
    return NULL;
}

/* GB/s of `clients` connections round-tripping `bytes` each way at once */
static double zmq_gbs(const char *bind_ep, size_t bytes, double seconds, int clients, int sync)
{
    int pfd[2];
    if (pipe(pfd) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(pfd[0]);
        server(bind_ep, bytes, pfd[1], clients, sync);
    }
    close(pfd[1]);
    char ep[256] = "";
    ssize_t n = read(pfd[0], ep, sizeof ep - 1);
    close(pfd[0]);
    if (n <= 0) return -1;
    client_t cl[16];
    pthread_t th[16];
    for (int k = 0; k < clients; k++) {
        cl[k] = (client_t){.ep = ep, .bytes = bytes, .seconds = seconds};
        if (pthread_create(&th[k], NULL, client, &cl[k]) != 0) {
            perror("wire_probe: pthread_create");
            kill(pid, SIGKILL); /* the server waits for every client's stop */
            exit(1);
        }
    }
    double gbs = 0; /* the clients' rates summed, as psbench's aggregate */
    for (int k = 0; k < clients; k++) {
        pthread_join(th[k], NULL);
        gbs += 2.0 * (double)cl[k].rounds * (double)bytes / (cl[k].t - cl[k].t0) / 1e9;
    }
    waitpid(pid, NULL, 0);
    return gbs;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strncmp(argv[1], "--cc=", 5) == 0) {
        cc = argv[1] + 5;
        char err[512];
        if (ps_tcp_cc_check(cc, err, sizeof err) != 0) {
            fprintf(stderr, "wire_probe: %s\n", err);
            return 2;
        }
        argv++;
        argc--;
    }
    double mib = argc > 1 ? atof(argv[1]) : 4;
    double seconds = argc > 2 ? atof(argv[2]) : 1;
    int clients = argc > 3 ? atoi(argv[3]) : 0;
    int sync = argc > 4 && strcmp(argv[4], "sync") == 0;
    if (mib <= 0 || seconds <= 0 || argc > 5 || (argc > 3 && (clients < 1 || clients > 16)) || (argc > 4 && !sync)) {
        fprintf(stderr, "usage: wire_probe [--cc=auto|off|NAME] [MIB] [SECONDS] [CLIENTS (1-16) [sync]]\n");
        return 2;
    }
    size_t bytes = (size_t)(mib * 1048576) / sizeof(float) * sizeof(float);
    if (sync) { /* alternating, so that both see the same spells of the machine */
        double r[2][5];
        for (int k = 0; k < 5; k++) {
            r[0][k] = zmq_gbs("tcp://127.0.0.1:*", bytes, seconds, clients, 1);
            r[1][k] = zmq_gbs("tcp://127.0.0.1:*", bytes, seconds, clients, 2);
        }
        const char *name[2] = {"zmq_tcp_sync_aggregate", "zmq_tcp_sync_sgd_aggregate"};
        for (int i = 0; i < 2; i++) {
            qsort(r[i], 5, sizeof(double), bench_cmp_double);
            printf("%s %.2f MiB %d clients: %.3f GB/s (median of 5; min %.3f max %.3f)\n", name[i], mib, clients,
                   r[i][2], r[i][0], r[i][4]);
        }
        return 0;
    }
    if (clients > 0) {
        double r[5];
        for (int k = 0; k < 5; k++) r[k] = zmq_gbs("tcp://127.0.0.1:*", bytes, seconds, clients, 0);
        qsort(r, 5, sizeof(double), bench_cmp_double);
        printf("zmq_tcp_roundtrip_aggregate %.2f MiB %d clients: %.3f GB/s (median of 5; min %.3f max %.3f)\n", mib,
               clients, r[2], r[0], r[4]);
        return 0;
    }
    char ipc[128];
    snprintf(ipc, sizeof ipc, "ipc:///tmp/wire-probe-%d.sock", (int)getpid());
    double r[3][5];
    for (int k = 0; k < 5; k++) {
        r[0][k] = memcpy_gbs(bytes, seconds);
        r[1][k] = zmq_gbs("tcp://127.0.0.1:*", bytes, seconds, 1, 0);
        r[2][k] = zmq_gbs(ipc, bytes, seconds, 1, 0);
    }
    unlink(ipc + 6);
    const char *name[3] = {"memcpy", "zmq_tcp_roundtrip", "zmq_ipc_roundtrip"};
    for (int i = 0; i < 3; i++) {
        qsort(r[i], 5, sizeof(double), bench_cmp_double);
        printf("%s %.2f MiB: %.3f GB/s (median of 5; min %.3f max %.3f)\n", name[i], mib, r[i][2], r[i][0], r[i][4]);
    }
    return 0;
}
