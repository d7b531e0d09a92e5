#include "ps_wire.h"

#include "ps_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *ps_msg_type_name(int type)
{
    static const char *names[] = {"NONE",     "REGISTER", "ASSIGN",     "READY",    "EPOCH",
                                  "PULL",     "WEIGHTS",  "PUSH",       "BARRIER",  "VALIDATE",
                                  "VAL_RESULT", "SHUTDOWN", "ERROR",    "HEARTBEAT", "LEAVE",
                                  "SHARD_HELLO", "SHARD_WORKER", "SHARD_HAVE", "SHARD_STEP", "SHARD_NORM",
                                  "SHARD_APPLY", "SHARD_FETCH", "SHARD_CKPT", "CONTROL", "CONTROL_REPLY",
                                  "SHARD_CKPT_DONE", "SHARD_RESUMED", "SHARD_RESUME", "OFFER", "VALUES",
                                  "SHARD_INIT_FETCH", "SHARD_INIT_VALUES", "SHARD_INIT_DONE", "GO"};
    if (type < 0 || type >= (int)(sizeof names / sizeof names[0])) return "UNKNOWN";
    return names[type];
}

/* The body each type must carry. */
static int body_for_type(int type)
{
    switch (type) {
    case PSD__MSG_TYPE__MSG_REGISTER: return PSD__HEADER__BODY_REG;
    case PSD__MSG_TYPE__MSG_ASSIGN: return PSD__HEADER__BODY_ASSIGN;
    case PSD__MSG_TYPE__MSG_READY: return PSD__HEADER__BODY_READY;
    case PSD__MSG_TYPE__MSG_EPOCH: return PSD__HEADER__BODY_EPOCH;
    case PSD__MSG_TYPE__MSG_PULL: return PSD__HEADER__BODY_PULL;
    case PSD__MSG_TYPE__MSG_WEIGHTS: return PSD__HEADER__BODY_WEIGHTS;
    case PSD__MSG_TYPE__MSG_PUSH: return PSD__HEADER__BODY_PUSH;
    case PSD__MSG_TYPE__MSG_BARRIER: return PSD__HEADER__BODY_BARRIER;
    case PSD__MSG_TYPE__MSG_VALIDATE: return PSD__HEADER__BODY_VALIDATE;
    case PSD__MSG_TYPE__MSG_VAL_RESULT: return PSD__HEADER__BODY_VAL_RESULT;
    case PSD__MSG_TYPE__MSG_SHUTDOWN: return PSD__HEADER__BODY_SHUTDOWN;
    case PSD__MSG_TYPE__MSG_ERROR: return PSD__HEADER__BODY_ERROR;
    case PSD__MSG_TYPE__MSG_HEARTBEAT: return PSD__HEADER__BODY_HEARTBEAT;
    case PSD__MSG_TYPE__MSG_LEAVE: return PSD__HEADER__BODY_LEAVE;
    case PSD__MSG_TYPE__MSG_SHARD_HELLO: return PSD__HEADER__BODY_SHARD_HELLO;
    case PSD__MSG_TYPE__MSG_SHARD_WORKER: return PSD__HEADER__BODY_SHARD_WORKER;
    case PSD__MSG_TYPE__MSG_SHARD_HAVE: return PSD__HEADER__BODY_SHARD_HAVE;
    case PSD__MSG_TYPE__MSG_SHARD_STEP: return PSD__HEADER__BODY_SHARD_STEP;
    case PSD__MSG_TYPE__MSG_SHARD_NORM: return PSD__HEADER__BODY_SHARD_NORM;
    case PSD__MSG_TYPE__MSG_SHARD_APPLY: return PSD__HEADER__BODY_SHARD_APPLY;
    case PSD__MSG_TYPE__MSG_SHARD_FETCH: return PSD__HEADER__BODY_SHARD_FETCH;
    case PSD__MSG_TYPE__MSG_SHARD_CKPT: return PSD__HEADER__BODY_SHARD_CKPT;
    case PSD__MSG_TYPE__MSG_CONTROL: return PSD__HEADER__BODY_CONTROL;
    case PSD__MSG_TYPE__MSG_CONTROL_REPLY: return PSD__HEADER__BODY_CONTROL_REPLY;
    case PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE: return PSD__HEADER__BODY_SHARD_CKPT;
    case PSD__MSG_TYPE__MSG_SHARD_RESUMED: return PSD__HEADER__BODY_SHARD_CKPT;
    case PSD__MSG_TYPE__MSG_SHARD_RESUME: return PSD__HEADER__BODY_SHARD_HELLO;
    case PSD__MSG_TYPE__MSG_OFFER: return PSD__HEADER__BODY_OFFER;
    case PSD__MSG_TYPE__MSG_VALUES: return PSD__HEADER__BODY_VALUES;
    case PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH:
    case PSD__MSG_TYPE__MSG_SHARD_INIT_VALUES:
    case PSD__MSG_TYPE__MSG_SHARD_INIT_DONE: return PSD__HEADER__BODY_SHARD_FETCH;
    case PSD__MSG_TYPE__MSG_GO: return PSD__HEADER__BODY_HEARTBEAT;
    default: return -1;
    }
}

static size_t dtype_size(int dt)
{
    switch (dt) {
    case PSD__DTYPE__DT_F32: return 4;
    case PSD__DTYPE__DT_U32: return 4;
    case PSD__DTYPE__DT_BF16: return 2;
    case PSD__DTYPE__DT_U8: return 1;
    default: return 0;
    }
}

int ps_desc_check(const Psd__TensorDesc *d, size_t frame_bytes, char *why, size_t n)
{
    size_t es = dtype_size(d->dtype);
    if (es == 0) return snprintf(why, n, "unknown dtype %d", (int)d->dtype), -1;
    if (d->nbytes != frame_bytes)
        return snprintf(why, n, "descriptor says %llu bytes, frame has %zu", (unsigned long long)d->nbytes,
                        frame_bytes), -1;
    if (d->nbytes % es)
        return snprintf(why, n, "%llu bytes is not a whole number of elements", (unsigned long long)d->nbytes), -1;
    if (d->n_shape < 1 || d->n_shape > 8) return snprintf(why, n, "%zu dimensions", d->n_shape), -1;
    uint64_t numel = 1;
    for (size_t k = 0; k < d->n_shape; k++) {
        if (d->shape[k] == 0 && d->nbytes) return snprintf(why, n, "zero dimension"), -1; /* empty: no rows asked for */
        if (d->shape[k] && numel > PS_WIRE_MAX_NUMEL / d->shape[k])
            return snprintf(why, n, "shape too large"), -1; /* checked before multiplying: no wrap */
        numel *= d->shape[k];
    }
    if (d->offset > numel || d->nbytes / es > numel - d->offset)
        return snprintf(why, n, "frame [%llu, +%llu) outside shape of %llu elements", (unsigned long long)d->offset,
                        (unsigned long long)(d->nbytes / es), (unsigned long long)numel), -1;
    return 0;
}

static void *arena_alloc(void *data, size_t size);
static void arena_free(void *data, void *p);

void ps_arena_init(ps_arena_t *a, void *buf, size_t cap)
{
    memset(a, 0, sizeof *a);
    a->al = (ProtobufCAllocator){arena_alloc, arena_free, a};
    a->buf = buf;
    a->cap = cap;
}

static void *arena_alloc(void *data, size_t size)
{
    ps_arena_t *a = data;
    size_t at = (a->used + 15) & ~(size_t)15;
    if (at <= a->cap && size <= a->cap - at) {
        a->used = at + size;
        return a->buf + at;
    }
    a->fallbacks++;
    return malloc(size);
}

static void arena_free(void *data, void *p)
{
    ps_arena_t *a = data;
    if (p && ((uint8_t *)p < a->buf || (uint8_t *)p >= a->buf + a->cap)) free(p);
}

void ps_msg_deinit(ps_msg_t *m)
{
    if (m->hdr) psd__header__free_unpacked(m->hdr, m->arena ? &m->arena->al : NULL);
    if (m->arena && --m->arena->live == 0) m->arena->used = 0;
    m->arena = NULL;
    m->hdr = NULL;
    for (int i = 0; i < m->n_frames; i++) zmq_msg_close(&m->frames[i]);
    m->n_frames = 0;
}

/* Receive the next frame of a message whose first frame was read. The rest
 * of a multipart message is already queued, so a signal (EINTR) is retried:
 * returning mid-message would leave the next receive starting mid-message. */
static int recv_next(zmq_msg_t *f, void *sock)
{
    for (;;) {
        if (zmq_msg_recv(f, sock, 0) >= 0) return 0;
        if (zmq_errno() != EINTR) return -zmq_errno();
    }
}

/* Discard the rest of a multipart message. */
static void drain_more(void *sock)
{
    int more = 0;
    size_t len = sizeof more;
    while (zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &len) == 0 && more) {
        zmq_msg_t f;
        zmq_msg_init(&f);
        if (recv_next(&f, sock) < 0) {
            zmq_msg_close(&f);
            return;
        }
        zmq_msg_close(&f);
        len = sizeof more;
    }
}

#define FAIL(...)                               \
    do {                                        \
        snprintf(err, errlen, __VA_ARGS__);     \
        rc = -EPROTO;                           \
        goto fail;                              \
    } while (0)

/* Where a frame came from: the connection's fd (ZMQ_SRCFD) and address, as
 * libzmq records them on the frames its engine decoded (not on the routing-id
 * frame a ROUTER makes up). */
static void note_source(ps_msg_t *m, zmq_msg_t *f)
{
    int fd = zmq_msg_get(f, ZMQ_SRCFD);
    if (fd >= 0) m->srcfd = fd;
    const char *a = zmq_msg_gets(f, "Peer-Address");
    if (a && a[0]) snprintf(m->peer, sizeof m->peer, "%s", a);
    const char *u = zmq_msg_gets(f, "User-Id");
    if (u && u[0]) snprintf(m->user, sizeof m->user, "%s", u);
}

int ps_msg_recv(void *sock, ps_msg_t *m, bool router, int flags, char *err, size_t errlen)
{
    return ps_msg_recv_arena(sock, m, router, flags, NULL, err, errlen);
}

/* The message without its pad frames (ps_msg_send's; their descriptors go
 * with them), the other frames in their order */
static void drop_pads(ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    size_t k = 0;
    for (size_t i = 0; i < h->n_tensors; i++) {
        if (h->tensors[i]->dtype == PSD__DTYPE__DT_PAD) {
            zmq_msg_close(&m->frames[i]);
            psd__tensor_desc__free_unpacked(h->tensors[i], m->arena ? &m->arena->al : NULL);
            continue;
        }
        h->tensors[k] = h->tensors[i];
        if (k != i) {
            zmq_msg_init(&m->frames[k]);
            zmq_msg_move(&m->frames[k], &m->frames[i]);
            zmq_msg_close(&m->frames[i]);
        }
        k++;
    }
    h->n_tensors = k;
    m->n_frames = (int)k;
}

int ps_msg_recv_arena(void *sock, ps_msg_t *m, bool router, int flags, ps_arena_t *arena, char *err,
                      size_t errlen)
{
    int rc = 0;
    bool more = false; /* frames of this message not read yet */
    zmq_msg_t f;
    char why[160];
    memset(m, 0, sizeof *m);
    m->srcfd = -1;
    if (errlen) err[0] = '\0';
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, sock, flags) < 0) {
        rc = -zmq_errno();
        zmq_msg_close(&f);
        return rc;
    }
    note_source(m, &f);
    if (router) {
        size_t n = zmq_msg_size(&f);
        if (n > PS_MAX_IDENTITY) n = PS_MAX_IDENTITY;
        memcpy(m->ident, zmq_msg_data(&f), n);
        m->ident_len = n;
        more = zmq_msg_more(&f);
        if (!more) FAIL("empty message");
        zmq_msg_close(&f);
        zmq_msg_init(&f);
        if ((rc = recv_next(&f, sock)) < 0) {
            zmq_msg_close(&f);
            return rc;
        }
        note_source(m, &f);
    }
    more = zmq_msg_more(&f);
    size_t hlen = zmq_msg_size(&f);
    if (hlen == 0 || hlen > PS_MAX_HEADER) FAIL("header frame of %zu bytes", hlen);
    if (arena && arena->live == 0) { /* else: malloc, as without an arena */
        m->arena = arena;
        arena->live = 1;
        arena->used = 0;
    }
    m->hdr = psd__header__unpack(m->arena ? &m->arena->al : NULL, hlen, zmq_msg_data(&f));
    if (!m->hdr) FAIL("header does not decode (%zu bytes)", hlen);
    Psd__Header *h = m->hdr;
    int want = body_for_type((int)h->type);
    if (want < 0) FAIL("unknown message type %d", (int)h->type);
    if ((int)h->body_case != want || !h->reg /* any member of the union */)
        FAIL("%s message without its body", ps_msg_type_name((int)h->type));
    if (h->n_tensors > PS_MAX_FRAMES) FAIL("%zu tensor descriptors (max %d)", h->n_tensors, PS_MAX_FRAMES);

    more = zmq_msg_more(&f);
    zmq_msg_close(&f);
    zmq_msg_init(&f);
    while (more) {
        if (m->n_frames >= (int)h->n_tensors) FAIL("more frames than tensor descriptors (%zu)", h->n_tensors);
        zmq_msg_t *t = &m->frames[m->n_frames];
        zmq_msg_init(t);
        if ((rc = recv_next(t, sock)) < 0) {
            zmq_msg_close(t);
            goto fail_nodrain;
        }
        m->n_frames++;
        more = zmq_msg_more(t);
    }
    if ((size_t)m->n_frames != h->n_tensors)
        FAIL("%d frames for %zu tensor descriptors", m->n_frames, h->n_tensors);
    int pads = 0;
    for (size_t i = 0; i < h->n_tensors; i++) {
        Psd__TensorDesc *d = h->tensors[i];
        if (d->dtype == PSD__DTYPE__DT_PAD) {
            if (d->nbytes != zmq_msg_size(&m->frames[i]) || d->nbytes < 1 || d->nbytes > PS_WIRE_PAD_MAX)
                FAIL("pad frame %zu: %llu bytes, frame has %zu (1 to %d)", i, (unsigned long long)d->nbytes,
                     zmq_msg_size(&m->frames[i]), PS_WIRE_PAD_MAX);
            if (d->id || d->n_shape || d->offset || d->chunk || d->shard) FAIL("pad frame %zu describes a tensor", i);
            pads++;
            continue;
        }
        if (ps_desc_check(d, zmq_msg_size(&m->frames[i]), why, sizeof why) != 0) FAIL("tensor %zu: %s", i, why);
        size_t es = dtype_size(d->dtype);
        if (((uintptr_t)zmq_msg_data(&m->frames[i]) & (es - 1)) != 0) {
            /* small frames can arrive at any offset of ZeroMQ's receive
             * buffer: give them an aligned copy (large ones are aligned) */
            zmq_msg_t c;
            if (zmq_msg_init_size(&c, d->nbytes) != 0) FAIL("out of memory");
            memcpy(zmq_msg_data(&c), zmq_msg_data(&m->frames[i]), d->nbytes);
            zmq_msg_close(&m->frames[i]);
            m->frames[i] = c;
        }
    }
    if (pads) drop_pads(m);
    zmq_msg_close(&f);
    return 0;

fail:
    /* read the rest of the message, so that the next receive starts at a
     * message boundary (on a ROUTER, a leftover frame would otherwise be
     * taken for the next message's peer identity) */
    zmq_msg_close(&f);
    if (more) drain_more(sock);
    ps_msg_deinit(m);
    return rc;
fail_nodrain:
    zmq_msg_close(&f);
    ps_msg_deinit(m);
    return rc;
}

static const void *frame_as(const ps_msg_t *m, int i, int dtype, size_t *n)
{
    if (!m->hdr || i < 0 || i >= m->n_frames) return NULL;
    if ((int)m->hdr->tensors[i]->dtype != dtype) return NULL;
    const void *p = zmq_msg_data((zmq_msg_t *)&m->frames[i]);
    size_t bytes = zmq_msg_size((zmq_msg_t *)&m->frames[i]), es = dtype_size(dtype);
    if (((uintptr_t)p & (es - 1)) != 0 && bytes) return NULL;
    *n = bytes / es;
    return p;
}

const uint16_t *ps_msg_bf16(const ps_msg_t *m, int i, size_t *n)
{
    return frame_as(m, i, PSD__DTYPE__DT_BF16, n);
}

const float *ps_msg_f32(const ps_msg_t *m, int i, size_t *n)
{
    return frame_as(m, i, PSD__DTYPE__DT_F32, n);
}

const uint32_t *ps_msg_u32(const ps_msg_t *m, int i, size_t *n)
{
    return frame_as(m, i, PSD__DTYPE__DT_U32, n);
}

bool ps_msg_rows(const ps_msg_t *m, int i, const uint32_t **ids, size_t *n, size_t *nv)
{
    *ids = ps_msg_u32(m, i, n);
    return *ids && i + 1 < m->n_frames && m->hdr->tensors[i + 1]->id == m->hdr->tensors[i]->id &&
           ps_msg_f32(m, i + 1, nv) != NULL;
}

/* zmq_msg_send, retried on EINTR: a signal between the frames of a
 * multipart message must not leave it half sent. */
static int send_frame(zmq_msg_t *m, void *sock, int flags)
{
    for (;;) {
        if (zmq_msg_send(m, sock, flags) >= 0) return 0;
        if (zmq_errno() != EINTR) return -zmq_errno();
    }
}

void ps_frames_small_first(ps_frame_t *fr, int n)
{
    for (int i = 1; i < n; i++) { /* a handful of frames: insertion sort */
        ps_frame_t f = fr[i];
        int j = i;
        for (; j > 0 && fr[j - 1].nbytes > f.nbytes; j--) fr[j] = fr[j - 1];
        fr[j] = f;
    }
}

/* ZMTP 3 frame header: flags and a one-byte size up to 255, else 8 bytes */
static size_t zmtp_head(size_t n) { return n > 255 ? 9 : 2; }

bool ps_wire_slow_start(uintptr_t addr) { return (addr & 4095) > 4096 - 64; }

/* Where frame i's data begins in the batch stream (pos bytes before its
 * framing): *from is the offset within the frame from which ZeroMQ writes
 * it from its own memory; false if it copies the whole frame. */
static bool own_write(size_t pos, size_t size, size_t *from)
{
    size_t into = (pos + zmtp_head(size)) % PS_WIRE_BATCH;
    *from = into ? PS_WIRE_BATCH - into : 0;
    return size >= *from + PS_WIRE_BATCH;
}

int ps_wire_pads(size_t hlen, const void *const *data, const size_t *sizes, int n, uint8_t *pad)
{
    int k = 0, planned = 0;
    for (int i = 0; i < n; i++) planned += pad[i] != 0;
    size_t from, pos = own_write(0, hlen, &from) ? 0 : zmtp_head(hlen) + hlen; /* since the last in-place write */
    for (int i = 0; i < n; i++) {
        bool kept = pad[i] != 0; /* its descriptor is in hlen: it stays (so the plans converge), resized */
        bool room = kept || n + planned < PS_MAX_FRAMES;
        size_t s = kept ? 1 : 0;
        for (; room && s <= PS_WIRE_PAD_MAX; s++) {
            size_t p = pos + (s ? zmtp_head(s) + s : 0);
            if (!own_write(p, sizes[i], &from) || !ps_wire_slow_start((uintptr_t)data[i] + from)) break;
        }
        if (!room) s = 0;
        if (s > PS_WIRE_PAD_MAX) s = kept ? 1 : 0; /* unreachable: the slow bytes are 63 wide */
        if (s && !kept) planned++;
        pad[i] = (uint8_t)s;
        if (s) {
            pos += zmtp_head(s) + s;
            k++;
        }
        pos = own_write(pos, sizes[i], &from) ? 0 : pos + zmtp_head(sizes[i]) + sizes[i];
    }
    return k;
}

/* The descriptors of frames fr[0, n) and of the pad frames planned before
 * them (pad), in the order they go */
static int fill_descs(Psd__TensorDesc *descs, Psd__TensorDesc **dptr, uint64_t (*shapes)[2], const ps_frame_t *frames,
                      int n, const uint8_t *pad)
{
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (pad[i]) {
            psd__tensor_desc__init(&descs[k]);
            descs[k].dtype = PSD__DTYPE__DT_PAD;
            descs[k].nbytes = pad[i];
            dptr[k] = &descs[k];
            k++;
        }
        const ps_frame_t *fr = &frames[i];
        psd__tensor_desc__init(&descs[k]);
        descs[k].id = fr->id;
        descs[k].dtype = fr->dtype;
        shapes[k][0] = fr->rows;
        shapes[k][1] = fr->cols;
        descs[k].shape = shapes[k];
        descs[k].n_shape = fr->cols ? 2 : 1;
        descs[k].nbytes = fr->nbytes;
        descs[k].offset = fr->offset;
        dptr[k] = &descs[k];
        k++;
    }
    return k;
}

int ps_msg_send(void *sock, const uint8_t *ident, size_t ident_len, Psd__Header *hdr,
                const ps_frame_t *frames, int n_frames)
{
    Psd__TensorDesc descs[PS_MAX_FRAMES], *dptr[PS_MAX_FRAMES];
    uint64_t shapes[PS_MAX_FRAMES][2];
    zmq_msg_t fm[PS_MAX_FRAMES], pm[PS_MAX_FRAMES]; /* the frames, the pad frames before them */
    const void *fdata[PS_MAX_FRAMES];
    size_t fsize[PS_MAX_FRAMES];
    uint8_t pad[PS_MAX_FRAMES] = {0}, plan[PS_MAX_FRAMES];
    int rc = 0, made = 0, padded = 0, sent = 0; /* frames made into messages (ownership passed to ZeroMQ),
                                                 * their pad frames made, frames sent */
    if (n_frames > PS_MAX_FRAMES) {
        rc = -E2BIG;
        goto out;
    }
    /* the frames first: where their bytes lie decides the pad frames */
    for (; made < n_frames; made++) {
        const ps_frame_t *fr = &frames[made];
        if (fr->ffn && !fr->copy) {
            if (zmq_msg_init_data(&fm[made], (void *)fr->data, fr->nbytes, fr->ffn, fr->hint) != 0) {
                rc = -ENOMEM;
                goto out;
            }
        } else {
            if (zmq_msg_init_size(&fm[made], fr->nbytes) != 0) {
                rc = -ENOMEM;
                goto out;
            }
            if (fr->nbytes) memcpy(zmq_msg_data(&fm[made]), fr->data, fr->nbytes);
            if (fr->ffn) fr->ffn((void *)fr->data, fr->hint); /* copied: its reference is given back now */
        }
        fdata[made] = zmq_msg_data(&fm[made]);
        fsize[made] = fr->nbytes;
    }
    if (!hdr->protocol) hdr->protocol = PS_PROTOCOL_VERSION; /* an answer in an older peer's protocol may set it */
    /* the pads' own descriptors lengthen the header, which moves the
     * frames: plan again until the plan holds. A pad once planned stays
     * (ps_wire_pads), so the plans only grow and this ends. Under CURVE
     * libzmq sends encrypted copies of the frames: nothing to plan. */
    int mech = ZMQ_NULL;
    size_t ml = sizeof mech, hlen;
    zmq_getsockopt(sock, ZMQ_MECHANISM, &mech, &ml);
    for (int round = 0;; round++) {
        int n_desc = fill_descs(descs, dptr, shapes, frames, n_frames, pad);
        hdr->n_tensors = (size_t)n_desc;
        hdr->tensors = n_desc ? dptr : NULL;
        hlen = psd__header__get_packed_size(hdr);
        if (mech == ZMQ_CURVE || round > n_frames) break;
        memcpy(plan, pad, (size_t)n_frames);
        ps_wire_pads(hlen, fdata, fsize, n_frames, plan);
        if (memcmp(plan, pad, (size_t)n_frames) == 0) break;
        memcpy(pad, plan, (size_t)n_frames);
    }
    for (; padded < n_frames; padded++) { /* their bytes are zeros */
        if (!pad[padded]) continue;
        if (zmq_msg_init_size(&pm[padded], pad[padded]) != 0) {
            rc = -ENOMEM;
            goto out;
        }
        memset(zmq_msg_data(&pm[padded]), 0, pad[padded]);
    }

    if (ident) {
        zmq_msg_t im;
        if (zmq_msg_init_size(&im, ident_len) != 0) {
            rc = -ENOMEM;
            goto out;
        }
        memcpy(zmq_msg_data(&im), ident, ident_len);
        if ((rc = send_frame(&im, sock, ZMQ_SNDMORE)) < 0) {
            zmq_msg_close(&im);
            goto out;
        }
    }
    zmq_msg_t hm; /* hlen: the header as planned */
    if (zmq_msg_init_size(&hm, hlen) != 0) {
        rc = -ENOMEM;
        goto out;
    }
    psd__header__pack(hdr, zmq_msg_data(&hm));
    if ((rc = send_frame(&hm, sock, n_frames ? ZMQ_SNDMORE : 0)) < 0) {
        zmq_msg_close(&hm);
        goto out;
    }
    for (; sent < n_frames; sent++) {
        if (pad[sent]) {
            if ((rc = send_frame(&pm[sent], sock, ZMQ_SNDMORE)) < 0) goto out;
            pad[sent] = 0; /* sent */
        }
        if ((rc = send_frame(&fm[sent], sock, sent + 1 < n_frames ? ZMQ_SNDMORE : 0)) < 0) goto out;
    }
out:
    /* frames not sent: closing their messages gives their references back
     * (ffn); those never made into one get their ffn here */
    for (int i = sent; i < made; i++) zmq_msg_close(&fm[i]);
    for (int i = made; i < n_frames; i++)
        if (frames[i].ffn) frames[i].ffn((void *)frames[i].data, frames[i].hint);
    for (int i = 0; i < padded; i++)
        if (pad[i]) zmq_msg_close(&pm[i]);
    hdr->n_tensors = 0;
    hdr->tensors = NULL;
    return rc;
}

void ps_msg_drain(void *sock, double quiet_s, double max_s)
{
    double quiet_since = ps_now(), until = quiet_since + max_s;
    while (ps_now() < until && ps_now() - quiet_since < quiet_s) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 10) <= 0) continue;
        zmq_msg_t f;
        zmq_msg_init(&f);
        while (zmq_msg_recv(&f, sock, ZMQ_DONTWAIT) >= 0) {
            zmq_msg_close(&f);
            zmq_msg_init(&f);
        }
        zmq_msg_close(&f);
        quiet_since = ps_now();
    }
}

void ps_f32_to_bf16_n(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = ps_f32_to_bf16(src[i]);
}

void ps_bf16_to_f32_n(float *dst, const uint16_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = ps_bf16_to_f32(src[i]);
}

void ps_zmq_endpoint_opts(void *sock, const char *ep)
{
    int on = ps_endpoint_wants_ipv6(ep);
    zmq_setsockopt(sock, ZMQ_IPV6, &on, sizeof on);
}

void *ps_zmq_monitor(void *ctx, void *sock, const char *ep, int events)
{
    if (zmq_socket_monitor(sock, ep, events) != 0) return NULL;
    void *mon = zmq_socket(ctx, ZMQ_PAIR);
    if (!mon || zmq_connect(mon, ep) != 0) {
        if (mon) zmq_close(mon);
        zmq_socket_monitor(sock, NULL, 0);
        return NULL;
    }
    return mon;
}

int ps_zmq_monitor_event(void *mon, uint16_t *event, uint32_t *value)
{
    zmq_msg_t ev, ep;
    zmq_msg_init(&ev);
    if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0) {
        zmq_msg_close(&ev);
        return -1;
    }
    *event = 0;
    *value = 0;
    if (zmq_msg_size(&ev) >= 6) {
        memcpy(event, zmq_msg_data(&ev), 2);
        memcpy(value, (char *)zmq_msg_data(&ev) + 2, 4);
    }
    zmq_msg_close(&ev);
    zmq_msg_init(&ep);
    zmq_msg_recv(&ep, mon, 0); /* second frame: the endpoint */
    zmq_msg_close(&ep);
    return 0;
}

void ps_zmq_close_monitored(void *sock, void *mon)
{
    if (sock) {
        if (mon) zmq_socket_monitor(sock, NULL, 0);
        zmq_close(sock);
    }
    if (mon) {
        int zero = 0;
        zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(mon);
    }
}
