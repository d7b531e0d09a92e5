/* curve_bench - what CurveZMQ encryption costs on psd's traffic pattern:
 * push + pull of a 4 MiB tensor (DEALER -> ROUTER -> DEALER round trips over
 * tcp loopback), plain and CURVE in the same run. Not a test.
 *   build/curve_bench [ROUNDS] [MIB] */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "ps_util.h"

typedef struct {
    void *ctx;
    const char *ep;
    int rounds;
    size_t bytes;
    const char *secret; /* server secret key, NULL = plain */
} srv_arg_t;

static void *server(void *p)
{
    srv_arg_t *a = p;
    void *s = zmq_socket(a->ctx, ZMQ_ROUTER);
    if (a->secret) {
        int on = 1;
        zmq_setsockopt(s, ZMQ_CURVE_SERVER, &on, sizeof on);
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, a->secret, 40);
    }
    zmq_bind(s, a->ep);
    void *reply = malloc(a->bytes);
    memset(reply, 1, a->bytes);
    for (int i = 0; i < a->rounds + 2; i++) {
        zmq_msg_t id, body;
        zmq_msg_init(&id);
        zmq_msg_init(&body);
        zmq_msg_recv(&id, s, 0);
        zmq_msg_recv(&body, s, 0);
        zmq_msg_send(&id, s, ZMQ_SNDMORE);
        zmq_send(s, reply, a->bytes, 0);
        zmq_msg_close(&body);
    }
    free(reply);
    zmq_close(s);
    return NULL;
}

static double run(int rounds, size_t bytes, int curve)
{
    char pub[41], sec[41], cpub[41], csec[41], ep[64];
    zmq_curve_keypair(pub, sec);
    zmq_curve_keypair(cpub, csec);
    void *ctx = zmq_ctx_new();
    static int port = 47211;
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", port++);
    srv_arg_t a = {ctx, ep, rounds, bytes, curve ? sec : NULL};
    pthread_t th;
    pthread_create(&th, NULL, server, &a);
    void *c = zmq_socket(ctx, ZMQ_DEALER);
    if (curve) {
        zmq_setsockopt(c, ZMQ_CURVE_SERVERKEY, pub, 40);
        zmq_setsockopt(c, ZMQ_CURVE_PUBLICKEY, cpub, 40);
        zmq_setsockopt(c, ZMQ_CURVE_SECRETKEY, csec, 40);
    }
    zmq_connect(c, ep);
    void *buf = malloc(bytes);
    memset(buf, 2, bytes);
    double t0 = 0;
    for (int i = 0; i < rounds + 2; i++) {
        if (i == 2) t0 = ps_now(); /* two warm-up rounds */
        zmq_send(c, buf, bytes, 0);
        zmq_msg_t m;
        zmq_msg_init(&m);
        zmq_msg_recv(&m, c, 0);
        zmq_msg_close(&m);
    }
    double dt = ps_now() - t0;
    pthread_join(th, NULL);
    free(buf);
    int zero = 0;
    zmq_setsockopt(c, ZMQ_LINGER, &zero, sizeof zero);
    zmq_close(c);
    zmq_ctx_term(ctx);
    return 2.0 * (double)bytes * rounds / dt / 1e9; /* GB/s, both directions */
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 200;
    size_t mib = argc > 2 ? (size_t)atoi(argv[2]) : 4;
    size_t bytes = mib << 20;
    double plain = run(rounds, bytes, 0), curve = run(rounds, bytes, 1);
    double plain2 = run(rounds, bytes, 0);
    printf("push+pull of %zu MiB over tcp loopback, %d rounds: plain %.2f GB/s (again: %.2f), CURVE %.2f GB/s; "
           "CURVE/plain = %.2f\n",
           mib, rounds, plain, plain2, curve, curve / ((plain + plain2) / 2));
    return 0;
}
