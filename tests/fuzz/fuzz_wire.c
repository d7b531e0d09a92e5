/* fuzz_wire - the message decoder and validator (common/ps_wire.c).
 *
 * Input format (so that the fuzzer controls the frame boundaries):
 *   u16 LE control: bits 0-2  number of frames - 1 (1..8)
 *                   bit 3     send DEALER -> ROUTER (ps_msg_recv router=true)
 *                             instead of PAIR -> PAIR
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
 *
 * FUZZ_TOLERATE_KNOWN=1 in the environment: frames of a rejected message
 * that ps_msg_recv leaves unread (tests/fuzz/crashes/README.md, found by this
 * harness) are drained here instead of failing, so that fuzzing can go on. */
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

static void *g_ctx, *g_pair_tx, *g_pair_rx, *g_dealer, *g_router;

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
static void warm_up(void *tx, void *rx, bool router)
{
    if (zmq_send(tx, "x", 1, 0) != 1) FUZZ_DIE("warm-up send: %s", zmq_strerror(zmq_errno()));
    char buf[300];
    int more = 0;
    size_t len = sizeof more;
    do {
        if (zmq_recv(rx, buf, sizeof buf, 0) < 0)
            FUZZ_DIE("warm-up recv: %s", zmq_strerror(zmq_errno()));
        len = sizeof more;
        zmq_getsockopt(rx, ZMQ_RCVMORE, &more, &len);
    } while (more);
    (void)router;
}

static void setup(void)
{
    g_ctx = zmq_ctx_new();
    if (!g_ctx) FUZZ_DIE("zmq_ctx_new");
    g_pair_rx = sock_or_die(ZMQ_PAIR);
    g_pair_tx = sock_or_die(ZMQ_PAIR);
    if (zmq_bind(g_pair_rx, "inproc://fuzz-pair") != 0 ||
        zmq_connect(g_pair_tx, "inproc://fuzz-pair") != 0)
        FUZZ_DIE("pair: %s", zmq_strerror(zmq_errno()));
    g_router = sock_or_die(ZMQ_ROUTER);
    g_dealer = sock_or_die(ZMQ_DEALER);
    if (zmq_setsockopt(g_dealer, ZMQ_ROUTING_ID, "fuzz-worker", 11) != 0)
        FUZZ_DIE("routing id: %s", zmq_strerror(zmq_errno()));
    if (zmq_bind(g_router, "inproc://fuzz-router") != 0 ||
        zmq_connect(g_dealer, "inproc://fuzz-router") != 0)
        FUZZ_DIE("router: %s", zmq_strerror(zmq_errno()));
    warm_up(g_pair_tx, g_pair_rx, false);
    warm_up(g_dealer, g_router, true);
}

static bool g_tolerate;

/* Discard what is left of the current multipart message; returns the number
 * of frames discarded. */
static int drain_rest(void *sock)
{
    int n = 0, more = 0;
    size_t len = sizeof more;
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) == 0 && more) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (zmq_msg_recv(&f, sock, ZMQ_DONTWAIT) < 0) FUZZ_DIE("drain: %s", zmq_strerror(zmq_errno()));
        zmq_msg_close(&f);
        n++;
        len = sizeof more;
    }
    return n;
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
        const char *t = getenv("FUZZ_TOLERATE_KNOWN");
        g_tolerate = t && *t && strcmp(t, "0") != 0;
        ready = true;
    }
    if (size < 2) return 0;
    const uint16_t ctl = get_u16(data);
    const int n_frames = (ctl & 7) + 1;
    const bool router = ctl & 8;
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

    void *tx = router ? g_dealer : g_pair_tx, *rx = router ? g_router : g_pair_rx;
    for (int i = 0; i < n_frames; i++) {
        int flags = ZMQ_DONTWAIT | (i + 1 < n_frames ? ZMQ_SNDMORE : 0);
        if (zmq_send(tx, fp[i], fl[i], flags) != (int)fl[i])
            FUZZ_DIE("zmq_send frame %d: %s", i, zmq_strerror(zmq_errno()));
    }

    char err[256];
    int got = 0;
    for (;;) {
        ps_msg_t m;
        int rc = ps_msg_recv(rx, &m, router, ZMQ_DONTWAIT, err, sizeof err);
        if (rc == -EAGAIN) break;
        got++;
        if (rc == 0) {
            exercise(&m);
            ps_msg_deinit(&m);
            ps_msg_deinit(&m); /* documented as safe to call twice */
        } else if (rc == -EPROTO) {
            if (!memchr(err, '\0', sizeof err) || err[0] == '\0')
                FUZZ_DIE("-EPROTO without a message");
            int more = 0;
            size_t len = sizeof more;
            if (zmq_getsockopt(rx, ZMQ_RCVMORE, &more, &len) != 0) FUZZ_DIE("ZMQ_RCVMORE");
            if (more) {
                if (!g_tolerate)
                    FUZZ_DIE("ps_msg_recv rejected a message (%s) but left the rest of it unread: "
                             "the next receive starts mid-message",
                             err);
                drain_rest(rx);
            }
        } else {
            FUZZ_DIE("ps_msg_recv: unexpected %d (%s)", rc, zmq_strerror(-rc));
        }
        if (got > 1) FUZZ_DIE("one message sent, %d received", got);
    }
    if (got != 1) FUZZ_DIE("one message sent, none received");
    return 0;
}
