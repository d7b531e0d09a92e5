/* ps_wire.h - framing of psd messages on ZeroMQ sockets.
 *
 * A message is [identity (ROUTER only)] [header: packed Psd__Header]
 * [tensor frame]...; header->tensors[i] describes tensor frame i. Receiving
 * checks the structure (header decodes, body matches type, frame count and
 * byte lengths match the descriptors, dtype known, shapes consistent) and
 * drops what does not fit; field values that depend on the run (ranks,
 * versions, sizes of the model) are checked by the handlers. */
#ifndef PS_WIRE_H
#define PS_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "psd.pb-c.h"

#define PS_PROTOCOL_VERSION 10u /* 5: tensor frames in any order (ps_frames_small_first); 6: EPOCH keep;
                                * 7: the model as a table of named tensors (ASSIGN's table frame), 64-bit shapes;
                                * 8: READY data_id, VALIDATE split and ids, VAL_RESULT named sums;
                                * 9: pad frames (DT_PAD); 10: announced pushes and GO (server.grad_room) */
#define PS_MAX_FRAMES 64         /* tensor frames in one message */
#define PS_MAX_IDENTITY 255      /* ZeroMQ routing ids are at most 255 bytes */
#define PS_MAX_HEADER (1u << 20) /* header frame bytes */

/* Bump allocator for decoded headers: protobuf-c allocates the unpacked
 * header's parts from buf, so receiving a message allocates nothing once
 * training runs (what does not fit falls back to malloc, counted). One
 * message at a time: the arena is reused when its message is released. */
typedef struct {
    ProtobufCAllocator al;           /* protobuf-c's view of this arena */
    uint8_t *buf;
    size_t cap, used;
    int live;                        /* messages decoded into it, not released yet */
    uint64_t fallbacks;              /* allocations that did not fit */
} ps_arena_t;

void ps_arena_init(ps_arena_t *a, void *buf, size_t cap);

typedef struct {
    Psd__Header *hdr;                /* owned; NULL if not received */
    ps_arena_t *arena;               /* where hdr lives (NULL: malloc) */
    int n_frames;
    zmq_msg_t frames[PS_MAX_FRAMES]; /* tensor frames, owned */
    uint8_t ident[PS_MAX_IDENTITY];  /* ROUTER peer id */
    size_t ident_len;
    int srcfd;                       /* libzmq's fd of the peer's connection, -1 unknown */
    char peer[64];                   /* the peer's address (IP), "" unknown */
    char user[24];                   /* ZAP user id: the CURVE key's fingerprint, "" without keys */
} ps_msg_t;

/* Receive one whole multipart message. router: the first frame is the peer
 * identity. flags: 0 or ZMQ_DONTWAIT. Returns
 *   0        a well-formed message in *m (release with ps_msg_deinit)
 *   -EAGAIN  nothing to read (ZMQ_DONTWAIT)
 *   -EPROTO  malformed: the whole message was read and dropped; err says why
 *            (m->ident, srcfd and peer are still filled in when known)
 *   other -errno from ZeroMQ (e.g. -ETERM, -EINTR). */
int ps_msg_recv(void *sock, ps_msg_t *m, bool router, int flags, char *err, size_t errlen);
/* The same, decoding the header into `arena` (if it holds no live message). */
int ps_msg_recv_arena(void *sock, ps_msg_t *m, bool router, int flags, ps_arena_t *arena, char *err,
                      size_t errlen);

/* One tensor frame's descriptor against the frame's size: a known dtype,
 * nbytes equal to the frame's and whole elements, 1 to 8 dimensions whose
 * product is at most PS_WIRE_MAX_NUMEL, the frame's elements [offset,
 * offset + nbytes / element size) inside the shape. 0, or -1 with why. */
#define PS_WIRE_MAX_NUMEL (1ull << 61)
int ps_desc_check(const Psd__TensorDesc *d, size_t frame_bytes, char *why, size_t n);

/* Free header and frames. Safe to call twice. */
void ps_msg_deinit(ps_msg_t *m);

/* Frame data as floats / u32s, or NULL if frame i is not of that dtype or is
 * misaligned. n receives the element count. Borrowed until ps_msg_deinit. */
const float *ps_msg_f32(const ps_msg_t *m, int i, size_t *n);
const uint32_t *ps_msg_u32(const ps_msg_t *m, int i, size_t *n);
/* Frames i (u32 row ids) and i + 1 (f32 values of the same tensor) of a
 * row push: false unless they are such; then *ids, their count *n and the
 * count of values *nv (both may be 0). */
bool ps_msg_rows(const ps_msg_t *m, int i, const uint32_t **ids, size_t *n, size_t *nv);
const uint16_t *ps_msg_bf16(const ps_msg_t *m, int i, size_t *n);

/* bfloat16 <-> float: the high half of the bits, rounded to nearest even
 * (NaN stays NaN). */
static inline uint16_t ps_f32_to_bf16(float f)
{
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float ps_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
void ps_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n);
void ps_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n);

/* One tensor frame to send. If ffn is NULL the bytes are copied at send
 * time; otherwise they are sent in place and ffn(data, hint) is called by
 * ZeroMQ (on its I/O thread) once they are no longer needed. With copy set
 * they are copied even with an ffn, which is then called once they are
 * (before ps_msg_send returns: nothing in flight holds the reference). */
typedef struct {
    const void *data;
    size_t nbytes;
    zmq_free_fn *ffn;
    void *hint;
    uint32_t id;
    Psd__DType dtype;
    uint64_t rows, cols; /* shape; cols 0 for 1-D */
    uint64_t offset;     /* first element of the frame within the tensor (a piece of it) */
    bool copy;
} ps_frame_t;

/* Order a weights or gradient message's tensor frames smallest first
 * (stable; protocol 5: receivers take tensor frames by their descriptor's
 * id, in any order). ZeroMQ copies small frames into its 8 KiB send batch
 * together with the start of the next one; a small frame after a large one
 * costs each message one more send and one more wake-up of the receiver
 * (psd with one 4 MiB tensor and its 5 KiB bias, 1 worker over tcp: +8%
 * push+pull). Models with an embedding table keep tensor order: their
 * table (rows) frames are found by position. */
void ps_frames_small_first(ps_frame_t *fr, int n);

/* Pad frames. libzmq 4.3 copies a message's frames, their ZMTP framing
 * included, into an 8 KiB batch and writes each full batch; a frame with
 * 8 KiB or more still to go at a batch boundary is written from its own
 * memory from there on. On this project's AMD Zen 5 VMs the kernel's copy
 * of such a write runs at half speed when it starts in the last 63 bytes
 * of a page (the source then sits just below the socket buffer's
 * page-aligned destination: 4 KiB aliasing, by all appearances), which a
 * page-aligned tensor after a short header or after another large frame
 * does; measured in docs/design.md ("The send copy's 4 KiB aliasing"). So
 * ps_msg_send puts a pad frame (DT_PAD, 1 to PS_WIRE_PAD_MAX bytes) before
 * a frame that would start there, sized to move the start, and
 * ps_msg_recv drops pad frames: no caller sees them.
 *
 * ps_wire_pads plans them for a header of hlen bytes and frames sizes[i]
 * at data[i]: pad[i] is the pad frame's size before frame i, 0 for none;
 * on entry the pads whose descriptors hlen counts (they stay, at 1 byte or
 * more; zeros for none); returns how many. Not modelled: a message queued
 * behind another's unsent bytes, heartbeats between frames, the later
 * writes of a frame larger than the socket's buffer. ps_wire_slow_start:
 * whether a write from addr starts in those bytes. */
#define PS_WIRE_BATCH 8192
#define PS_WIRE_PAD_MAX 127
bool ps_wire_slow_start(uintptr_t addr);
int ps_wire_pads(size_t hlen, const void *const *data, const size_t *sizes, int n, uint8_t *pad);

/* Send header (+frames). hdr->protocol (unless set: a refusal worded for an
 * older peer goes in its protocol, so that it shows the words) and the
 * tensors list are filled in here. ident: ROUTER peer id or NULL for DEALER. Returns 0 or -errno. On
 * error, frames whose ownership had not passed to ZeroMQ get their ffn called,
 * so the caller's references are released either way. */
int ps_msg_send(void *sock, const uint8_t *ident, size_t ident_len, Psd__Header *hdr,
                const ps_frame_t *frames, int n_frames);

/* Read and drop whatever arrives on sock until it has been quiet for
 * quiet_s (at most max_s): called before closing a socket, because libzmq
 * 4.3 does not always free unread messages at close. */
void ps_msg_drain(void *sock, double quiet_s, double max_s);
/* What a socket needs before it binds or connects to ep: ZMQ_IPV6 for an
 * IPv6 address or a host name with IPv6 addresses only
 * (ps_endpoint_wants_ipv6). */
void ps_zmq_endpoint_opts(void *sock, const char *ep);
/* A PAIR socket of ctx receiving sock's monitor events (the mask `events`)
 * through the inproc endpoint `ep` (unique in ctx): set before sock binds or
 * connects, so that no event is missed. NULL if libzmq refused (the caller
 * goes without its events). */
void *ps_zmq_monitor(void *ctx, void *sock, const char *ep, int events);
/* The next event waiting on mon (ps_zmq_monitor's PAIR), without waiting:
 * 0 with its number (ZMQ_EVENT_*) and value (an fd, an error code), or -1
 * if none is waiting. */
int ps_zmq_monitor_event(void *mon, uint16_t *event, uint32_t *value);
/* Close sock (stopping its monitor, if mon) and mon, the PAIR its monitor
 * reports to (linger 0: its events are of no use any more); either may be
 * NULL. */
void ps_zmq_close_monitored(void *sock, void *mon);

/* Short name of a message type for logs ("PUSH"). */
const char *ps_msg_type_name(int type);

#endif
