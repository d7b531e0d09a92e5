/* Wire framing: encode/decode round trips and rejection of malformed messages. */
#include <criterion/criterion.h>
#include <math.h>
#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <zmq.h>

#include "ps_wire.h"

static void *ctx, *router, *dealer;

static void setup(void)
{
    ctx = zmq_ctx_new();
    router = zmq_socket(ctx, ZMQ_ROUTER);
    dealer = zmq_socket(ctx, ZMQ_DEALER);
    cr_assert_eq(zmq_bind(router, "inproc://wire"), 0);
    cr_assert_eq(zmq_connect(dealer, "inproc://wire"), 0);
}

/* a context and its two sockets, closed at once */
static void close_pair(void *c, void *r, void *d)
{
    int z = 0;
    zmq_setsockopt(r, ZMQ_LINGER, &z, sizeof z);
    zmq_setsockopt(d, ZMQ_LINGER, &z, sizeof z);
    zmq_close(r);
    zmq_close(d);
    zmq_ctx_term(c);
}

static void teardown(void) { close_pair(ctx, router, dealer); }

TestSuite(wire, .init = setup, .fini = teardown);

static atomic_int freed;
static void count_free(void *data, void *hint)
{
    (void)data;
    (void)hint;
    atomic_fetch_add(&freed, 1);
}

/* h, a PULL with body p */
static void as_pull(Psd__Header *h, Psd__Pull *p)
{
    h->type = PSD__MSG_TYPE__MSG_PULL;
    h->body_case = PSD__HEADER__BODY_PULL;
    h->pull = p;
}

static int recv_router(ps_msg_t *m, char *err)
{
    zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
    zmq_poll(&it, 1, 2000);
    return ps_msg_recv(router, m, true, ZMQ_DONTWAIT, err, 256);
}

static void send_valid_pull(uint64_t v)
{
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull p = PSD__PULL__INIT;
    h.type = PSD__MSG_TYPE__MSG_PULL;
    h.run_id = 7;
    p.min_version = v;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &p;
    cr_assert_eq(ps_msg_send(dealer, NULL, 0, &h, NULL, 0), 0);
}

/* After a rejected message the next valid one must still come through intact. */
static void expect_valid_pull(uint64_t v)
{
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "valid message after a bad one: %s", err);
    cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_PULL);
    cr_assert_eq(m.hdr->pull->min_version, v);
    cr_assert_eq(m.n_frames, 0);
    ps_msg_deinit(&m);
}

Test(wire, push_round_trip_zero_copy)
{
    float a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {-1, -2, -3};
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Push p = PSD__PUSH__INIT;
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.run_id = 0x1234;
    h.rank = 3;
    h.seq = 9;
    p.version = 41;
    p.batch = 64;
    p.loss_sum = 12.5;
    p.correct = 50;
    p.pull = 1;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    ps_frame_t fr[2] = {
        {.data = a, .nbytes = sizeof a, .ffn = count_free, .id = 0, .dtype = PSD__DTYPE__DT_F32, .rows = 2, .cols = 3},
        {.data = b, .nbytes = sizeof b, .ffn = count_free, .id = 1, .dtype = PSD__DTYPE__DT_F32, .rows = 3},
    };
    atomic_store(&freed, 0);
    cr_assert_eq(ps_msg_send(dealer, NULL, 0, &h, fr, 2), 0);
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "%s", err);
    cr_assert_eq(m.hdr->protocol, PS_PROTOCOL_VERSION);
    cr_assert_eq(m.hdr->run_id, 0x1234);
    cr_assert_eq(m.hdr->rank, 3);
    cr_assert_eq(m.hdr->seq, 9);
    cr_assert_eq(m.hdr->push->version, 41);
    cr_assert_eq(m.hdr->push->batch, 64);
    cr_assert_float_eq(m.hdr->push->loss_sum, 12.5, 0);
    cr_assert(m.hdr->push->pull);
    cr_assert_eq(m.n_frames, 2);
    cr_assert_gt(m.ident_len, 0);
    size_t n;
    const float *g0 = ps_msg_f32(&m, 0, &n);
    cr_assert_not_null(g0);
    cr_assert_eq(n, 6);
    cr_assert_arr_eq(g0, a, sizeof a);
    const float *g1 = ps_msg_f32(&m, 1, &n);
    cr_assert_eq(n, 3);
    cr_assert_arr_eq(g1, b, sizeof b);
    cr_assert_null(ps_msg_u32(&m, 0, &n), "dtype is checked");
    cr_assert_eq(m.hdr->tensors[0]->n_shape, 2);
    cr_assert_eq(m.hdr->tensors[1]->n_shape, 1);
    ps_msg_deinit(&m);
    ps_msg_deinit(&m); /* idempotent */
    /* ZeroMQ released both zero-copy frames */
    for (int i = 0; i < 200 && atomic_load(&freed) < 2; i++) zmq_poll(NULL, 0, 5);
    cr_assert_eq(atomic_load(&freed), 2);
}

/* A frame marked copy is copied at send although it has a free callback,
 * which is called before ps_msg_send returns: nothing in flight refers to
 * the buffer, which may change at once without changing what arrives. */
Test(wire, frames_marked_copy_are_copied_and_released_at_send)
{
    float a[4] = {1, 2, 3, 4}, b[2] = {7, 8}, sent[4];
    memcpy(sent, a, sizeof a);
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull p = PSD__PULL__INIT;
    as_pull(&h, &p);
    ps_frame_t fr[2] = {
        {.data = a, .nbytes = sizeof a, .ffn = count_free, .id = 0, .dtype = PSD__DTYPE__DT_F32, .rows = 4,
         .copy = true},
        {.data = b, .nbytes = sizeof b, .ffn = count_free, .id = 1, .dtype = PSD__DTYPE__DT_F32, .rows = 2},
    };
    atomic_store(&freed, 0);
    cr_assert_eq(ps_msg_send(dealer, NULL, 0, &h, fr, 2), 0);
    cr_assert_geq(atomic_load(&freed), 1, "the copied frame's reference is given back at send");
    a[0] = a[1] = a[2] = a[3] = -1; /* its buffer is the caller's again */
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "%s", err);
    size_t n;
    const float *g0 = ps_msg_f32(&m, 0, &n);
    cr_assert_eq(n, 4);
    cr_assert_arr_eq(g0, sent, sizeof sent, "the values as they were at send");
    cr_assert_neq((const void *)g0, (const void *)a);
    const float *g1 = ps_msg_f32(&m, 1, &n);
    cr_assert_eq(n, 2);
    cr_assert_arr_eq(g1, b, sizeof b);
    ps_msg_deinit(&m);
    for (int i = 0; i < 200 && atomic_load(&freed) < 2; i++) zmq_poll(NULL, 0, 5);
    cr_assert_eq(atomic_load(&freed), 2, "each reference given back once");
}

Test(wire, router_to_dealer_with_u32_frame)
{
    send_valid_pull(1); /* learn the dealer's identity */
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0);
    uint8_t ident[256];
    size_t ilen = m.ident_len;
    memcpy(ident, m.ident, ilen);
    ps_msg_deinit(&m);

    uint32_t ids[5] = {4, 0, 3, 1, 2};
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Epoch e = PSD__EPOCH__INIT;
    h.type = PSD__MSG_TYPE__MSG_EPOCH;
    e.epoch = 2;
    e.world = 3;
    h.body_case = PSD__HEADER__BODY_EPOCH;
    h.epoch = &e;
    ps_frame_t fr = {.data = ids, .nbytes = sizeof ids, .dtype = PSD__DTYPE__DT_U32, .rows = 5};
    cr_assert_eq(ps_msg_send(router, ident, ilen, &h, &fr, 1), 0);
    zmq_pollitem_t it = {dealer, 0, ZMQ_POLLIN, 0};
    zmq_poll(&it, 1, 2000);
    cr_assert_eq(ps_msg_recv(dealer, &m, false, ZMQ_DONTWAIT, err, sizeof err), 0, "%s", err);
    cr_assert_eq(m.hdr->epoch->epoch, 2);
    size_t n;
    const uint32_t *got = ps_msg_u32(&m, 0, &n);
    cr_assert_eq(n, 5);
    cr_assert_arr_eq(got, ids, sizeof ids);
    ps_msg_deinit(&m);
}

/* Send raw frames from the dealer. */
static void send_raw(const void *const *parts, const size_t *lens, int n)
{
    for (int i = 0; i < n; i++)
        cr_assert_geq(zmq_send(dealer, parts[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0), 0);
}

static size_t pack(Psd__Header *h, uint8_t *buf)
{
    h->protocol = PS_PROTOCOL_VERSION;
    return psd__header__pack(h, buf);
}

static void expect_rejected(const char *what)
{
    ps_msg_t m;
    char err[256];
    int rc = recv_router(&m, err);
    cr_assert_eq(rc, -EPROTO, "%s: expected rejection, got %d", what, rc);
    cr_assert_neq(err[0], '\0', "%s: a reason is given", what);
    cr_assert_null(m.hdr);
}

Test(wire, garbage_header_is_dropped)
{
    const char junk[] = "\xff\xff\xff\xff this is not protobuf";
    const void *parts[] = {junk};
    size_t lens[] = {sizeof junk};
    send_raw(parts, lens, 1);
    expect_rejected("garbage");
    send_valid_pull(5);
    expect_valid_pull(5);
}

Test(wire, empty_header_is_dropped)
{
    const void *parts[] = {""};
    size_t lens[] = {0};
    send_raw(parts, lens, 1);
    expect_rejected("empty");
    send_valid_pull(6);
    expect_valid_pull(6);
}

Test(wire, type_without_body_is_dropped)
{
    uint8_t buf[256];
    Psd__Header h = PSD__HEADER__INIT;
    h.type = PSD__MSG_TYPE__MSG_PUSH; /* no push body */
    size_t n = pack(&h, buf);
    const void *parts[] = {buf};
    size_t lens[] = {n};
    send_raw(parts, lens, 1);
    expect_rejected("no body");
    /* body of another type */
    Psd__Pull p = PSD__PULL__INIT;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &p;
    lens[0] = pack(&h, buf);
    send_raw(parts, lens, 1);
    expect_rejected("wrong body");
    send_valid_pull(7);
    expect_valid_pull(7);
}

Test(wire, unknown_type_is_dropped)
{
    uint8_t buf[256];
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull p = PSD__PULL__INIT;
    h.type = 99;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &p;
    size_t n = pack(&h, buf);
    const void *parts[] = {buf};
    size_t lens[] = {n};
    send_raw(parts, lens, 1);
    expect_rejected("unknown type");
    send_valid_pull(8);
    expect_valid_pull(8);
}

/* A PUSH header with one descriptor, followed by the given frames. */
static void send_push_with(Psd__TensorDesc *d, int n_desc, const void *const *frames,
                           const size_t *lens, int n_frames)
{
    uint8_t buf[1024];
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Push p = PSD__PUSH__INIT;
    Psd__TensorDesc *dp[4] = {d, d, d, d};
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    h.tensors = dp;
    h.n_tensors = (size_t)n_desc;
    size_t n = pack(&h, buf);
    const void *parts[8] = {buf};
    size_t plens[8] = {n};
    for (int i = 0; i < n_frames; i++) {
        parts[i + 1] = frames[i];
        plens[i + 1] = lens[i];
    }
    send_raw(parts, plens, n_frames + 1);
}

Test(wire, frame_count_and_sizes_are_checked)
{
    float data[4] = {0};
    uint64_t shape[2] = {2, 2};
    Psd__TensorDesc d = PSD__TENSOR_DESC__INIT;
    d.dtype = PSD__DTYPE__DT_F32;
    d.shape = shape;
    d.n_shape = 2;
    d.nbytes = sizeof data;
    const void *fr[3] = {data, data, data};
    size_t lens[3] = {sizeof data, sizeof data, sizeof data};

    send_push_with(&d, 2, fr, lens, 1); /* fewer frames than descriptors */
    expect_rejected("missing frame");
    send_push_with(&d, 1, fr, lens, 3); /* more frames than descriptors */
    expect_rejected("extra frames");
    size_t short_len[1] = {sizeof data - 4};
    send_push_with(&d, 1, fr, short_len, 1); /* byte length differs */
    expect_rejected("length mismatch");
    d.dtype = 77;
    send_push_with(&d, 1, fr, lens, 1);
    expect_rejected("unknown dtype");
    d.dtype = PSD__DTYPE__DT_F32;
    shape[1] = 0;
    send_push_with(&d, 1, fr, lens, 1);
    expect_rejected("zero dimension");
    shape[1] = 2;
    d.offset = 2; /* 4 floats at offset 2 of a 4-float tensor */
    send_push_with(&d, 1, fr, lens, 1);
    expect_rejected("offset outside shape");
    d.offset = 0;
    send_push_with(&d, 1, fr, lens, 1); /* and now a good one */
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "%s", err);
    cr_assert_eq(m.n_frames, 1);
    ps_msg_deinit(&m);
    send_valid_pull(9);
    expect_valid_pull(9);
}

/* The element count of a shape is checked before each multiplication:
 * 2^32 x 2^32 x (2^31 + 1) wraps in 64 bits, which a check after the
 * multiplication would let through. */
Test(wire, a_shape_whose_element_count_wraps_is_refused)
{
    float data[4] = {0};
    uint64_t shape[3] = {1ull << 32, 1ull << 32, (1ull << 31) + 1};
    Psd__TensorDesc d = PSD__TENSOR_DESC__INIT;
    d.dtype = PSD__DTYPE__DT_F32;
    d.shape = shape;
    d.n_shape = 3;
    d.nbytes = sizeof data;
    const void *fr[1] = {data};
    size_t lens[1] = {sizeof data};
    send_push_with(&d, 1, fr, lens, 1);
    expect_rejected("a shape whose element count wraps");
    shape[0] = 1ull << 30, shape[1] = 1ull << 31, shape[2] = 1; /* 2^61 elements: the most a shape may hold */
    send_push_with(&d, 1, fr, lens, 1);
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "%s", err);
    ps_msg_deinit(&m);
    send_valid_pull(11);
    expect_valid_pull(11);
}

Test(wire, too_many_descriptors_are_refused)
{
    uint8_t *buf = malloc(1 << 16);
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Push p = PSD__PUSH__INIT;
    Psd__TensorDesc d = PSD__TENSOR_DESC__INIT;
    Psd__TensorDesc *dp[PS_MAX_FRAMES + 1];
    for (int i = 0; i <= PS_MAX_FRAMES; i++) dp[i] = &d;
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    h.tensors = dp;
    h.n_tensors = PS_MAX_FRAMES + 1;
    size_t n = pack(&h, buf);
    const void *parts[] = {buf, "x"};
    size_t lens[] = {n, 1};
    send_raw(parts, lens, 2);
    expect_rejected("too many descriptors");
    free(buf);
    send_valid_pull(10);
    expect_valid_pull(10);
}

/* protocol 5: a message's tensor frames go out smallest first, frames of one
 * size in their order */
Test(wire, frames_go_out_smallest_first_stably)
{
    const size_t sizes[6] = {4194304, 5352, 131072, 512, 5352, 40};
    const int want[6] = {5, 3, 1, 4, 2, 0}; /* the frames' first places */
    ps_frame_t fr[6];
    for (int i = 0; i < 6; i++) fr[i] = (ps_frame_t){.nbytes = sizes[i], .id = (uint32_t)i};
    ps_frames_small_first(fr, 6);
    for (int i = 0; i < 6; i++) cr_assert_eq(fr[i].id, (uint32_t)want[i], "place %d: frame %u", i, fr[i].id);
    ps_frames_small_first(fr, 0);
    ps_frames_small_first(fr, 1);
    cr_assert_eq(fr[0].id, 5u);
}

Test(wire, type_names)
{
    cr_assert_str_eq(ps_msg_type_name(PSD__MSG_TYPE__MSG_PUSH), "PUSH");
    cr_assert_str_eq(ps_msg_type_name(1000), "UNKNOWN");
    cr_assert_str_eq(ps_msg_type_name(-1), "UNKNOWN");
}

/* Found by fuzz_wire: extra frames after a header without tensor
 * descriptors must be read away with the rejected message, or the ROUTER
 * takes the next leftover frame for a peer identity (spoofing). */
Test(wire, extra_frames_after_a_bare_header_are_drained)
{
    uint8_t buf[256], forged[256];
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull p = PSD__PULL__INIT;
    as_pull(&h, &p);
    size_t n = pack(&h, buf);
    p.min_version = 666;
    size_t fn = pack(&h, forged);
    const void *parts[] = {buf, "victim", forged};
    size_t lens[] = {n, 6, fn};
    send_raw(parts, lens, 3);
    expect_rejected("frames beyond the descriptors");
    send_valid_pull(11);
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "%s", err);
    cr_assert_eq(m.hdr->pull->min_version, 11, "the forged message was not taken for another peer's");
    cr_assert_neq(m.ident_len, 6);
    ps_msg_deinit(&m);
}

Test(wire, bf16_rounds_to_nearest_even)
{
    cr_assert_eq(ps_f32_to_bf16(1.0f), 0x3f80);
    cr_assert_eq(ps_bf16_to_f32(0x3f80), 1.0f);
    cr_assert_eq(ps_f32_to_bf16(-2.0f), 0xc000);
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0) */
    cr_assert_eq(ps_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);
    /* 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up to even */
    cr_assert_eq(ps_f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);
    cr_assert_eq(ps_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81, "above half: up");
    cr_assert(isnan(ps_bf16_to_f32(ps_f32_to_bf16(NAN))), "NaN stays NaN");
    cr_assert(isinf(ps_bf16_to_f32(ps_f32_to_bf16(INFINITY))));
    cr_assert(isinf(ps_bf16_to_f32(ps_f32_to_bf16(3.4e38f))), "beyond bf16's largest: infinity");
    float x[5] = {0.1f, -3.5f, 1e-30f, 65504.0f, 0.0f}, y[5];
    uint16_t h[5];
    ps_f32_to_bf16_n(h, x, 5);
    ps_bf16_to_f32_n(y, h, 5);
    for (int i = 0; i < 5; i++) cr_assert(fabsf(y[i] - x[i]) <= fabsf(x[i]) * 0x1p-8f, "%g -> %g", x[i], y[i]);
}

/* Where ZeroMQ starts writing a large frame from its own memory: after a
 * full 8 KiB batch of what came before it since the last such frame (bytes
 * with their framing, the frame's own 9) */
static uintptr_t own_start(uintptr_t data, size_t before) { return data + PS_WIRE_BATCH - (before + 9); }

Test(wire, pads_move_large_frame_starts_off_the_last_bytes_of_a_page)
{
    const size_t big = 4u << 20;
    const uintptr_t page = 0x7f0000200000u; /* page-aligned tensors, as psd's arenas */
    cr_assert(ps_wire_slow_start(page + 4095) && ps_wire_slow_start(page + 4033));
    cr_assert(!ps_wire_slow_start(page + 4032) && !ps_wire_slow_start(page) && !ps_wire_slow_start(page + 64));
    const void *one[1] = {(const void *)page};
    size_t sizes[2] = {big, big};
    uint8_t pad[2];
    int padded = 0;
    for (size_t h = 1; h < 240; h++) {
        pad[0] = 0;
        int k = ps_wire_pads(h, one, sizes, 1, pad);
        if (!ps_wire_slow_start(own_start(page, 2 + h))) {
            cr_assert(k == 0 && pad[0] == 0, "header of %zu bytes: no pad where the start is fine", h);
            continue;
        }
        padded++;
        cr_assert(k == 1 && pad[0] > 0, "header of %zu bytes starts the frame at page offset %lu", h,
                  (unsigned long)(own_start(page, 2 + h) & 4095));
        cr_assert(!ps_wire_slow_start(own_start(page, 2 + h + 2 + pad[0])), "header of %zu, pad of %u", h, pad[0]);
        cr_assert_leq(pad[0], PS_WIRE_PAD_MAX);
    }
    cr_assert_gt(padded, 40, "short headers put a page-aligned frame's start in the page's last bytes");
    /* a pad planned before stays (its descriptor is in the header), resized:
     * with it the header is long enough that none would be needed */
    pad[0] = 9;
    cr_assert_eq(ps_wire_pads(100, one, sizes, 1, pad), 1);
    cr_assert(pad[0] >= 1 && !ps_wire_slow_start(own_start(page, 2 + 100 + 2 + pad[0])));
    /* a large frame after another starts after 9 bytes of framing: a
     * page-aligned one in the page's last bytes */
    const void *two[2] = {(const void *)page, (const void *)(page + big)};
    memset(pad, 0, sizeof pad);
    cr_assert_eq(ps_wire_pads(100, two, sizes, 2, pad), 1);
    cr_assert_eq(pad[0], 0);
    cr_assert(pad[1] > 0 && !ps_wire_slow_start(own_start(page + big, 2 + pad[1])));
    /* frames ZeroMQ copies whole (under 8 KiB past the batch) need none */
    size_t small[2] = {5352, 9000};
    for (size_t h = 1; h < 240; h++) {
        memset(pad, 0, sizeof pad);
        cr_assert_eq(ps_wire_pads(h, two, small, 2, pad), 0);
    }
}

/* Sent by ps_msg_send with headers of every length from short to long
 * (run id, sequence number, rank and version of 1 to 10 bytes): as the parts arrive over
 * inproc (ZeroMQ passes them as they are, the frame's memory included), the
 * page-aligned frame's in-place write over tcp would start off the page's
 * last bytes, pad frames counted. */
Test(wire, every_header_length_gets_a_good_start)
{
    const size_t n = 1u << 20;
    float *w = aligned_alloc(4096, n * sizeof *w);
    cr_assert_not_null(w);
    memset(w, 0, n * sizeof *w);
    bool seen[256] = {false};
    for (int a = 0; a < 10; a++)
        for (int b = 0; b < 30; b++) {
            Psd__Header h = PSD__HEADER__INIT;
            Psd__Pull p = PSD__PULL__INIT;
            as_pull(&h, &p);
            h.run_id = a ? 1ull << (7 * a - 1) : 0;
            h.seq = b % 10 ? 1ull << (7 * (b % 10) - 1) : 0;
            p.min_version = b >= 10 ? 1ull << 63 : 0;
            h.rank = b >= 20 ? UINT32_MAX : 0;
            ps_frame_t fr = {.data = w, .nbytes = n * sizeof *w, .ffn = count_free, .dtype = PSD__DTYPE__DT_F32,
                             .rows = n};
            cr_assert_eq(ps_msg_send(dealer, NULL, 0, &h, &fr, 1), 0);
            zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
            cr_assert_eq(zmq_poll(&it, 1, 2000), 1);
            size_t sz[4], pos = 0, pads = 0;
            int parts = 0, more = 1;
            const void *data = NULL;
            while (more) {
                zmq_msg_t f;
                zmq_msg_init(&f);
                cr_assert_geq(zmq_msg_recv(&f, router, 0), 0);
                cr_assert_lt(parts, 4);
                sz[parts] = zmq_msg_size(&f);
                if (sz[parts] == n * sizeof *w) data = zmq_msg_data(&f);
                more = zmq_msg_more(&f);
                zmq_msg_close(&f);
                parts++;
            }
            cr_assert_eq(data, (const void *)w, "inproc passes the frame's own memory");
            for (int i = 1; i + 1 < parts; i++) pos += (sz[i] > 255 ? 9 : 2) + sz[i]; /* header, pad */
            pads = (size_t)parts - 3;
            size_t h0 = sz[1] - 6 * pads; /* the header without the pad's descriptor (6 bytes) */
            if (h0 < 256) seen[h0] = true;
            cr_assert(!ps_wire_slow_start(own_start((uintptr_t)w, pos)), "header of %zu bytes, %zu pad(s): starts at %lu",
                      sz[1], pads, (unsigned long)(own_start((uintptr_t)w, pos) & 4095));
        }
    int window = 0; /* where a pad's own descriptor alone would have been enough */
    for (int k = 47; k <= 52; k++) window += seen[k];
    cr_assert_geq(window, 3, "the headers cover the lengths where plans went back and forth");
    free(w);
}

/* A message of page-aligned 4 MiB frames (sent from their memory) over tcp:
 * on the wire with pad frames, from ps_msg_recv without them. */
Test(wire, pad_frames_go_on_the_wire_and_are_dropped_at_receive)
{
    void *c2 = zmq_ctx_new(), *r = zmq_socket(c2, ZMQ_ROUTER), *d = zmq_socket(c2, ZMQ_DEALER);
    cr_assert_eq(zmq_bind(r, "tcp://127.0.0.1:*"), 0);
    char ep[64];
    size_t epl = sizeof ep;
    zmq_getsockopt(r, ZMQ_LAST_ENDPOINT, ep, &epl);
    cr_assert_eq(zmq_connect(d, ep), 0);
    const size_t n = 1u << 20;
    float *w = aligned_alloc(4096, 2 * n * sizeof *w);
    cr_assert_not_null(w);
    for (size_t i = 0; i < 2 * n; i++) w[i] = (float)i;
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull p = PSD__PULL__INIT;
    as_pull(&h, &p);
    ps_frame_t fr[2] = {
        {.data = w, .nbytes = n * sizeof *w, .ffn = count_free, .id = 0, .dtype = PSD__DTYPE__DT_F32, .rows = n},
        {.data = w + n, .nbytes = n * sizeof *w, .ffn = count_free, .id = 1, .dtype = PSD__DTYPE__DT_F32, .rows = n},
    };
    atomic_store(&freed, 0);
    for (int round = 0; round < 2; round++) {
        cr_assert_eq(ps_msg_send(d, NULL, 0, &h, fr, 2), 0);
        cr_assert_null(h.tensors, "the caller's header is left as it was");
        zmq_pollitem_t it = {r, 0, ZMQ_POLLIN, 0};
        cr_assert_eq(zmq_poll(&it, 1, 5000), 1);
        if (round == 0) { /* as it went: identity, header, the frames and a pad before each */
            int parts = 0, more = 1;
            size_t sz[8];
            while (more && parts < 8) {
                zmq_msg_t f;
                zmq_msg_init(&f);
                cr_assert_geq(zmq_msg_recv(&f, r, 0), 0);
                sz[parts++] = zmq_msg_size(&f);
                more = zmq_msg_more(&f);
                zmq_msg_close(&f);
            }
            cr_assert_eq(parts, 6, "identity, header, pad, frame, pad, frame: %d parts", parts);
            cr_assert(sz[2] >= 1 && sz[2] <= PS_WIRE_PAD_MAX && sz[3] == n * sizeof *w);
            cr_assert(sz[4] >= 1 && sz[4] <= PS_WIRE_PAD_MAX && sz[5] == n * sizeof *w);
            continue;
        }
        ps_msg_t m;
        char err[256];
        cr_assert_eq(ps_msg_recv(r, &m, true, ZMQ_DONTWAIT, err, sizeof err), 0, "%s", err);
        cr_assert_eq(m.n_frames, 2);
        cr_assert_eq(m.hdr->n_tensors, 2);
        for (int t = 0; t < 2; t++) {
            size_t got;
            const float *g = ps_msg_f32(&m, t, &got);
            cr_assert_eq(m.hdr->tensors[t]->id, (uint32_t)t);
            cr_assert_eq(got, n);
            cr_assert_arr_eq(g, w + (size_t)t * n, n * sizeof *w);
        }
        ps_msg_deinit(&m);
    }
    for (int i = 0; i < 400 && atomic_load(&freed) < 4; i++) zmq_poll(NULL, 0, 5);
    cr_assert_eq(atomic_load(&freed), 4);
    close_pair(c2, r, d);
    free(w);
}

/* A pad frame whose descriptor says other than the frame, or more than
 * PS_WIRE_PAD_MAX bytes, or describes a tensor: the message is dropped. */
static void send_bad_pad(uint64_t nbytes, size_t frame, uint32_t id)
{
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull p = PSD__PULL__INIT;
    Psd__TensorDesc pd = PSD__TENSOR_DESC__INIT, *dp[1] = {&pd};
    h.protocol = PS_PROTOCOL_VERSION;
    as_pull(&h, &p);
    pd.dtype = PSD__DTYPE__DT_PAD;
    pd.nbytes = nbytes;
    pd.id = id;
    h.n_tensors = 1;
    h.tensors = dp;
    uint8_t buf[256], zeros[256] = {0};
    size_t len = psd__header__pack(&h, buf);
    cr_assert_eq(zmq_send(dealer, buf, len, ZMQ_SNDMORE), (int)len);
    cr_assert_eq(zmq_send(dealer, zeros, frame, 0), (int)frame);
}

Test(wire, bad_pad_frames_are_dropped)
{
    const struct {
        uint64_t nbytes;
        size_t frame;
        uint32_t id;
        const char *why;
    } bad[] = {{16, 17, 0, "frame has 17"}, {200, 200, 0, "1 to 127"}, {8, 8, 3, "describes a tensor"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        send_bad_pad(bad[i].nbytes, bad[i].frame, bad[i].id);
        ps_msg_t m;
        char err[256];
        cr_assert_eq(recv_router(&m, err), -EPROTO);
        cr_assert(strstr(err, bad[i].why), "%s", err);
        send_valid_pull(3);
        expect_valid_pull(3);
    }
    send_bad_pad(16, 16, 0); /* a good one alone: a message without frames */
    ps_msg_t m;
    char err[256];
    cr_assert_eq(recv_router(&m, err), 0, "%s", err);
    cr_assert_eq(m.n_frames, 0);
    cr_assert_eq(m.hdr->n_tensors, 0);
    ps_msg_deinit(&m);
}
