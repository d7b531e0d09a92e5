/* frame_probe - does this machine copy a send slowly when it starts in the
 * last bytes of a page? A ZeroMQ round trip over tcp loopback (DEALER ->
 * ROUTER -> back) of one 4 MiB frame, sent in place (zmq_msg_init_data)
 * from a buffer at a chosen offset from a page: libzmq writes the frame's
 * first 8 KiB minus its 9 bytes of framing through its batch and the rest
 * from the buffer itself, from (offset + 8183) mod 4096 into a page. On this
 * project's AMD Zen 5 VMs, in their slow spells, that write's copy into the
 * socket runs at half speed when it starts in the page's last 63 bytes;
 * psd's messages avoid such starts with pad frames (ps_wire.h).
 * bench/lib.sh machine_line prints the default pair with every benchmark.
 * Not a test.
 *
 *   build/frame_probe [SECONDS, default 0.3] [OFFSET ...]
 *
 * Without offsets: 0 (a start at page offset 4087) and 16 (at 7); prints
 * the median round of 3 runs each, alternated. Frames of other sizes:
 * FRAME_BYTES in the environment. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench_util.h"
#include "ps_tcp.h"
#include "ps_util.h"

/* every part of one message; its size, -1 on error. The connection gets
 * psd's congestion control for loopback (server.tcp_congestion auto), as
 * wire_probe --cc=auto's; *last: the connection that has it (0 for none) */
static long recv_msg(void *s, int *last)
{
    long n = 0;
    int more = 1;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s, 0) < 0) {
            zmq_msg_close(&m);
            return -1;
        }
        ps_tcp_cc_conn(last, zmq_msg_get(&m, ZMQ_SRCFD), "auto", false);
        n += (long)zmq_msg_size(&m);
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    return n;
}

static int send_frame(void *s, void *buf, size_t n, int flags)
{
    zmq_msg_t m;
    zmq_msg_init_data(&m, buf, n, bench_no_free, NULL);
    if (zmq_msg_send(&m, s, flags) >= 0) return 0;
    zmq_msg_close(&m);
    return -1;
}

/* child: a ROUTER answering every message with the same frame from its own
 * buffer at the same offset, until an empty one */
static void echo(int fd, char *buf, size_t n)
{
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_ROUTER);
    char ep[256];
    size_t len = sizeof ep;
    if (zmq_bind(s, "tcp://127.0.0.1:*") != 0 || zmq_getsockopt(s, ZMQ_LAST_ENDPOINT, ep, &len) != 0) _exit(1);
    if (write(fd, ep, strlen(ep) + 1) < 0) _exit(1);
    int last = 0;
    for (;;) {
        zmq_msg_t id;
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, s, 0) < 0 || recv_msg(s, &last) <= 0) break;
        if (zmq_msg_send(&id, s, ZMQ_SNDMORE) < 0 || send_frame(s, buf, n, 0) != 0) break;
    }
    _exit(0);
}

/* microseconds a round, frames sent from page + off */
static double round_us(size_t off, size_t n, double seconds)
{
    char *page = aligned_alloc(4096, (n + off + 4095) / 4096 * 4096);
    if (!page) return -1;
    memset(page, 1, (n + off + 4095) / 4096 * 4096);
    int p[2];
    if (pipe(p) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) echo(p[1], page + off, n);
    char ep[256] = "";
    if (pid < 0 || read(p[0], ep, sizeof ep) <= 0) return -1;
    close(p[0]);
    close(p[1]);
    void *ctx = zmq_ctx_new(), *c = zmq_socket(ctx, ZMQ_DEALER);
    double us = -1;
    if (zmq_connect(c, ep) == 0) {
        int k = 0, bad = 0, last = 0;
        for (int i = 0; i < 10 && !bad; i++) bad = send_frame(c, page + off, n, 0) != 0 || recv_msg(c, &last) < 0;
        double t0 = ps_now(), t = t0;
        for (; !bad && t - t0 < seconds; k++, t = ps_now())
            bad = send_frame(c, page + off, n, 0) != 0 || recv_msg(c, &last) < 0;
        if (!bad && k > 0) us = (t - t0) / k * 1e6;
        zmq_send(c, "", 0, 0);
    }
    int linger = 0;
    zmq_setsockopt(c, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(c);
    zmq_ctx_term(ctx);
    waitpid(pid, NULL, 0);
    free(page);
    return us;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 0.3;
    const char *fb = getenv("FRAME_BYTES");
    size_t n = fb ? strtoull(fb, NULL, 10) : (size_t)4 << 20;
    size_t offs[64] = {0, 16};
    int k = 2;
    if (argc > 2) {
        k = 0;
        for (int i = 2; i < argc && k < 64; i++) offs[k++] = strtoull(argv[i], NULL, 10) % 4096;
    }
    if (!(seconds > 0) || n < 2 * 8192) {
        fprintf(stderr, "usage: frame_probe [SECONDS > 0] [OFFSET ...] (FRAME_BYTES >= 16384)\n");
        return 2;
    }
    double r[64][3];
    for (int run = 0; run < 3; run++) /* alternated: the machine has spells */
        for (int i = 0; i < k; i++)
            if ((r[i][run] = round_us(offs[i], n, seconds)) < 0) {
                fprintf(stderr, "frame_probe: a round trip failed\n");
                return 1;
            }
    printf("send copy: %zu-byte frame round trip, median of 3:", n);
    for (int i = 0; i < k; i++) {
        qsort(r[i], 3, sizeof r[i][0], bench_cmp_double);
        size_t start = (offs[i] + 8192 - 9) % 4096;
        printf("%s %.0f us from page offset %zu%s", i ? "," : "", r[i][1], start, start > 4096 - 64 ? " (slow?)" : "");
    }
    printf("\n");
    return 0;
}
