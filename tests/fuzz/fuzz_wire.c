/* fuzz_wire - the message decoder and validator (common/ps_wire.c).
 *
 * Input format (so that the fuzzer controls the frame boundaries):
 *   u16 LE control: bits 0-2  number of frames - 1 (1..8)
 *                   bit 3     send DEALER -> ROUTER (ps_msg_recv router=true)
 *                             instead of PAIR -> PAIR
 *                   bit 4     over TCP on 127.0.0.1 instead of inproc: frames
 *                             then come out of ZeroMQ's receive buffer at any
 *                             offset (ps_msg_recv's realignment copy), as on
 *                             psd's real sockets; slower
 *                   bits 5-6  decode the header into a bump arena of 0: none
 *                             (malloc), 1: 256 bytes, 2: 4 KiB, 3: 64 KiB (as
 *                             psd does; small ones fall back to malloc midway)
 *   then per frame: u16 LE length (clamped to the bytes left), the bytes.
 *   Frames for which the input has run out are empty.
 * The first frame is the header frame (in ROUTER mode ZeroMQ prepends the
 * peer identity). The sockets are created once; every iteration receives
 * until EAGAIN so nothing carries over to the next input.
 *
 * Also: psd__header__unpack on the first frame alone, and on a successful
 * ps_msg_recv the accessors on every frame, reading every element.
 *
 * Oracles besides the sanitizers: exactly one message comes out per input,
 * and a rejected message is read to its end (ZMQ_RCVMORE clear afterwards),
 * so the next receive starts at a message boundary.
 * (This found ps_msg_recv leaving the frames after a header without tensor
 * descriptors unread, fixed in 493280d: corpus/fuzz_wire/router-spoof.) */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "fuzz_util.h"
#include "ps_wire.h"

#define MAX_FUZZ_FRAMES 8

static void *g_ctx;
/* [transport: 0 inproc, 1 tcp] */
static void *g_pair_tx[2], *g_pair_rx[2], *g_dealer[2], *g_router[2];

static void *sock_or_die(int type)
{
    void *s = zmq_socket(g_ctx, type);
    if (!s) FUZZ_DIE("zmq_socket: %s", zmq_strerror(zmq_errno()));
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    return s;
}

/* Blocking round trip on a fresh socket pair, so that the connection is
 * established before the first input (inproc attaches lazily on the
 * receiving side). */
static void warm_up(void *tx, void *rx)
{
    while (zmq_send(tx, "x", 1, 0) != 1)
        if (zmq_errno() != EINTR) FUZZ_DIE("warm-up send: %s", zmq_strerror(zmq_errno()));
    char buf[300];
    int more = 0;
    size_t len = sizeof more;
    do {
        while (zmq_recv(rx, buf, sizeof buf, 0) < 0)
            if (zmq_errno() != EINTR) FUZZ_DIE("warm-up recv: %s", zmq_strerror(zmq_errno()));
        len = sizeof more;
        zmq_getsockopt(rx, ZMQ_RCVMORE, &more, &len);
    } while (more);
}

/* Bind rx to an endpoint of the transport, connect tx to it. */
static void link_pair(void *tx, void *rx, const char *endpoint)
{
    char ep[256];
    size_t len = sizeof ep;
    if (zmq_bind(rx, endpoint) != 0) FUZZ_DIE("bind %s: %s", endpoint, zmq_strerror(zmq_errno()));
    if (zmq_getsockopt(rx, ZMQ_LAST_ENDPOINT, ep, &len) != 0) FUZZ_DIE("ZMQ_LAST_ENDPOINT");
    if (zmq_connect(tx, ep) != 0) FUZZ_DIE("connect %s: %s", ep, zmq_strerror(zmq_errno()));
}

static void setup(void)
{
    g_ctx = zmq_ctx_new();
    if (!g_ctx) FUZZ_DIE("zmq_ctx_new");
    for (int t = 0; t < 2; t++) {
        g_pair_rx[t] = sock_or_die(ZMQ_PAIR);
        g_pair_tx[t] = sock_or_die(ZMQ_PAIR);
        g_router[t] = sock_or_die(ZMQ_ROUTER);
        g_dealer[t] = sock_or_die(ZMQ_DEALER);
        if (zmq_setsockopt(g_dealer[t], ZMQ_ROUTING_ID, "fuzz-worker", 11) != 0)
            FUZZ_DIE("routing id: %s", zmq_strerror(zmq_errno()));
        link_pair(g_pair_tx[t], g_pair_rx[t], t ? "tcp://127.0.0.1:*" : "inproc://fuzz-pair");
        link_pair(g_dealer[t], g_router[t], t ? "tcp://127.0.0.1:*" : "inproc://fuzz-router");
        warm_up(g_pair_tx[t], g_pair_rx[t]);
        warm_up(g_dealer[t], g_router[t]);
    }
}

static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static void exercise(const ps_msg_t *m)
{
    const Psd__Header *h = m->hdr;
    if (!h) FUZZ_DIE("ps_msg_recv returned 0 without a header");
    (void)ps_msg_type_name((int)h->type);
    if ((size_t)m->n_frames != h->n_tensors) FUZZ_DIE("frame count != descriptors after recv");
    for (int i = -1; i <= m->n_frames; i++) {
        size_t n = 0;
        const float *f = ps_msg_f32(m, i, &n);
        if (f) {
            if (i < 0 || i >= m->n_frames) FUZZ_DIE("ps_msg_f32 accepted frame %d", i);
            volatile float acc = 0;
            for (size_t k = 0; k < n; k++) acc += f[k];
            (void)acc;
        }
        n = 0;
        const uint32_t *u = ps_msg_u32(m, i, &n);
        if (u) {
            if (i < 0 || i >= m->n_frames) FUZZ_DIE("ps_msg_u32 accepted frame %d", i);
            volatile uint32_t acc = 0;
            for (size_t k = 0; k < n; k++) acc ^= u[k];
            (void)acc;
        }
        if (f && u) FUZZ_DIE("frame %d is both f32 and u32", i);
    }
    for (size_t i = 0; i < h->n_tensors; i++) {
        const Psd__TensorDesc *d = h->tensors[i];
        fuzz_touch(d->shape, d->n_shape * sizeof *d->shape);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool ready;
    if (!ready) {
        setup();
        ready = true;
    }
    if (size < 2) return 0;
    const uint16_t ctl = get_u16(data);
    const int n_frames = (ctl & 7) + 1;
    const bool router = ctl & 8;
    const int tcp = (ctl & 16) ? 1 : 0;
    const uint8_t *fp[MAX_FUZZ_FRAMES];
    size_t fl[MAX_FUZZ_FRAMES];
    size_t off = 2;
    for (int i = 0; i < n_frames; i++) {
        size_t len = 0;
        if (size - off >= 2) {
            len = get_u16(data + off);
            off += 2;
            if (len > size - off) len = size - off;
        }
        fp[i] = data + off;
        fl[i] = len;
        off += len;
    }

    /* The header frame alone, straight into protobuf-c. */
    Psd__Header *h = psd__header__unpack(NULL, fl[0], fp[0]);
    if (h) psd__header__free_unpacked(h, NULL);

    void *tx = router ? g_dealer[tcp] : g_pair_tx[tcp], *rx = router ? g_router[tcp] : g_pair_rx[tcp];
    for (int i = 0; i < n_frames; i++) {
        int flags = ZMQ_DONTWAIT | (i + 1 < n_frames ? ZMQ_SNDMORE : 0), rc;
        do rc = zmq_send(tx, fp[i], fl[i], flags); /* libFuzzer's SIGALRM can interrupt it too */
        while (rc < 0 && zmq_errno() == EINTR);
        if (rc != (int)fl[i]) FUZZ_DIE("zmq_send frame %d: %s", i, zmq_strerror(zmq_errno()));
    }

    if (tcp) {
        /* over TCP the message takes a moment to arrive: wait for it (ZeroMQ
         * delivers a multipart message whole). Poll rather than a blocking
         * receive: libFuzzer's SIGALRM would interrupt that with EINTR. */
        zmq_pollitem_t it = {.socket = rx, .events = ZMQ_POLLIN};
        int n;
        do n = zmq_poll(&it, 1, 5000);
        while (n < 0 && zmq_errno() == EINTR);
        if (n < 0) FUZZ_DIE("zmq_poll: %s", zmq_strerror(zmq_errno()));
    }

    char err[256];
    int got = 0;
    static uint8_t arena_buf[64 << 10];
    static const size_t arena_cap[4] = {0, 256, 4096, sizeof arena_buf};
    ps_arena_t arena;
    int ak = (ctl >> 5) & 3;
    ps_arena_init(&arena, arena_buf, arena_cap[ak]);
    for (;;) {
        ps_msg_t m;
        int rc = ps_msg_recv_arena(rx, &m, router, ZMQ_DONTWAIT, ak ? &arena : NULL, err, sizeof err);
        if (arena.live != (rc == 0 && ak ? 1 : 0)) FUZZ_DIE("arena: %d live messages after rc %d", arena.live, rc);
        if (rc == -EAGAIN) break;
        if (rc == -EINTR) {
            /* a signal (libFuzzer's SIGALRM) during ZeroMQ's command poll:
             * fine before the first frame (nothing read, try again), not in
             * the middle of a message */
            int more = 0;
            size_t len = sizeof more;
            if (zmq_getsockopt(rx, ZMQ_RCVMORE, &more, &len) != 0) FUZZ_DIE("ZMQ_RCVMORE");
            if (more)
                FUZZ_DIE("ps_msg_recv returned -EINTR in the middle of a message and left the "
                         "rest of it unread: the next receive starts mid-message");
            continue;
        }
        got++;
        if (rc == 0) {
            exercise(&m);
            ps_msg_deinit(&m);
            ps_msg_deinit(&m); /* documented as safe to call twice */
            if (arena.live != 0 || arena.used != 0) FUZZ_DIE("arena not released by ps_msg_deinit");
        } else if (rc == -EPROTO) {
            if (!memchr(err, '\0', sizeof err) || err[0] == '\0')
                FUZZ_DIE("-EPROTO without a message");
            int more = 0;
            size_t len = sizeof more;
            if (zmq_getsockopt(rx, ZMQ_RCVMORE, &more, &len) != 0) FUZZ_DIE("ZMQ_RCVMORE");
            if (more)
                FUZZ_DIE("ps_msg_recv rejected a message (%s) but left the rest of it unread: "
                         "the next receive starts mid-message",
                         err);
        } else {
            FUZZ_DIE("ps_msg_recv: unexpected %d (%s)", rc, zmq_strerror(-rc));
        }
        if (got > 1) FUZZ_DIE("one message sent, %d received", got);
    }
    if (got != 1) FUZZ_DIE("one message sent, none received (%s)", tcp ? "tcp" : "inproc");
    return 0;
}
