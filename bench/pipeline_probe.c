/* pipeline_probe - would streaming a step in chunks pay on this machine?
 * Not a test. psd receives a push as one message, applies the optimizer,
 * and answers with one message. Streaming would split both into K parts:
 * psd applies part k as it arrives and answers it at once, so the optimizer
 * overlaps the transfers; the worker then has to put the parts of its
 * weights together (a copy: its model computes from whole tensors).
 *
 *   build/pipeline_probe [ROUNDS]
 *
 * A DEALER (the worker) and a ROUTER in another process (psd) exchange a
 * 4 MiB f32 tensor over tcp loopback, zero-copy sends, the ROUTER doing
 * psd's plain-SGD pass (w' = w - lr * g, out of place, one thread) per part.
 * Prints push+pull GB/s ((bytes pushed + pulled) / round time), medians of 3
 * runs, for: one message each way (psd's shape); K = 4 and 8 parts with the
 * worker's copy (what streaming would cost); K parts without the copy (the
 * bound if the model could compute from the parts); and no optimizer at all
 * (the raw round trip). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_util.h"
#include "ps_util.h"

#define N ((size_t)1 << 20) /* floats: 4 MiB */

/* psd's side: rounds of K parts in, the SGD pass per part, K parts out */
static void server(const char *ep, int rounds, int k, int apply)
{
    void *ctx = zmq_ctx_new(), *r = zmq_socket(ctx, ZMQ_ROUTER);
    if (zmq_bind(r, ep) != 0) exit(1);
    float *w[2] = {aligned_alloc(64, N * 4), aligned_alloc(64, N * 4)};
    memset(w[0], 0, N * 4);
    memset(w[1], 0, N * 4);
    size_t n = N / (size_t)k;
    for (int it = 0; it < rounds; it++) {
        const float *src = w[it % 2];
        float *dst = w[(it + 1) % 2];
        for (int p = 0; p < k; p++) {
            zmq_msg_t id, g, out;
            zmq_msg_init(&id);
            zmq_msg_init(&g);
            if (zmq_msg_recv(&id, r, 0) < 0 || zmq_msg_recv(&g, r, 0) < 0) exit(1);
            const float *gp = zmq_msg_data(&g);
            if (apply)
                for (size_t i = 0; i < n; i++) dst[p * n + i] = src[p * n + i] - 0.01f * gp[i];
            zmq_msg_send(&id, r, ZMQ_SNDMORE);
            zmq_msg_init_data(&out, dst + p * n, n * 4, bench_no_free, NULL);
            zmq_msg_send(&out, r, 0);
            zmq_msg_close(&g);
        }
    }
    zmq_close(r);
    zmq_ctx_term(ctx);
    free(w[0]);
    free(w[1]);
}

static double one_run(int rounds, int k, int apply, int copy)
{
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", 20000 + (int)(getpid() % 20000));
    pid_t pid = fork();
    if (pid == 0) {
        server(ep, rounds, k, apply);
        _exit(0);
    }
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    zmq_connect(d, ep);
    float *g = aligned_alloc(64, N * 4), *wb = aligned_alloc(64, N * 4);
    memset(g, 0, N * 4);
    memset(wb, 0, N * 4);
    size_t n = N / (size_t)k;
    int warm = rounds / 10;
    double t0 = 0;
    for (int it = 0; it < rounds; it++) {
        if (it == warm) t0 = ps_now();
        for (int p = 0; p < k; p++) {
            zmq_msg_t m;
            zmq_msg_init_data(&m, g + p * n, n * 4, bench_no_free, NULL);
            zmq_msg_send(&m, d, 0);
        }
        for (int p = 0; p < k; p++) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            zmq_msg_recv(&m, d, 0);
            if (copy) memcpy(wb + p * n, zmq_msg_data(&m), n * 4);
            zmq_msg_close(&m);
        }
    }
    double t = ps_now() - t0;
    waitpid(pid, NULL, 0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    free(g);
    free(wb);
    return (double)(rounds - warm) * 2.0 * (double)N * 4.0 / t / 1e9;
}

static double median3(int rounds, int k, int apply, int copy)
{
    double v[3];
    for (int i = 0; i < 3; i++) v[i] = one_run(rounds, k, apply, copy);
    qsort(v, 3, sizeof v[0], bench_cmp_double);
    return v[1];
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 400;
    if (rounds < 20) rounds = 20;
    printf("push+pull of a 4 MiB tensor over tcp loopback, %d rounds, medians of 3\n", rounds);
    printf("no optimizer, 1 message each way (raw)   %.3f GB/s\n", median3(rounds, 1, 0, 0));
    printf("SGD, 1 message each way (psd's shape)    %.3f GB/s\n", median3(rounds, 1, 1, 0));
    for (int k = 4; k <= 8; k *= 2) {
        printf("SGD, %d parts, worker copies the parts    %.3f GB/s\n", k, median3(rounds, k, 1, 1));
        printf("SGD, %d parts, no copy (bound)            %.3f GB/s\n", k, median3(rounds, k, 1, 0));
    }
    return 0;
}
