/* gen_seeds - writes the seed corpora under tests/fuzz/corpus/ (committed;
 * rerun only when a format changes). Valid inputs are made with the
 * project's own writers where there is one (ps_weights_save, psd_ckpt_*,
 * protobuf-c), edge cases by editing them.
 *
 *   clang-14 -std=c17 -D_GNU_SOURCE -Icommon -Iserver -Iworker -Ibuild/proto -Itests/fuzz \
 *       tests/fuzz/gen_seeds.c common/ps_weights.c common/ps_model.c common/ps_util.c \
 *       common/ps_config.c common/ps_ctr.c common/ps_pool.c common/ps_shm.c common/ps_wire.c common/ps_log.c \
 *       common/ps_tensor.c common/ps_table.c common/ps_safetensors.c \
 *       server/psd_ckpt.c server/psd_store.c server/psd_optim.c server/psd_rows.c \
 *       build/proto/psd.pb-c.c -lprotobuf-c -lyaml -lz -lzmq -lm -lpthread -o build/fuzz/gen_seeds
 *   build/fuzz/gen_seeds tests/fuzz/corpus
 */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "fuzz_util.h"
#include "psd.pb-c.h"
#include "psd_ckpt.h"
#include "psd_store.h"
#include "ps_weights.h"

static const char *g_root;

static void put(const char *harness, const char *name, const void *buf, size_t n)
{
    char dir[512], path[768];
    snprintf(dir, sizeof dir, "%s/%s", g_root, harness);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    fuzz_write_file(path, buf, n);
}

static uint8_t *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) FUZZ_DIE("open %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)len + 1);
    if (fread(b, 1, (size_t)len, f) != (size_t)len) FUZZ_DIE("read %s", path);
    fclose(f);
    *n = (size_t)len;
    return b;
}

/* ---- wire ----------------------------------------------------------------- */

typedef struct {
    uint8_t buf[4096];
    size_t len;
} wbuf_t;

static void w_ctl(wbuf_t *w, int n_frames, int router)
{
    w->len = 0;
    w->buf[w->len++] = (uint8_t)((n_frames - 1) | (router ? 8 : 0));
    w->buf[w->len++] = 0;
}

static void w_frame(wbuf_t *w, const void *p, size_t n)
{
    w->buf[w->len++] = (uint8_t)n;
    w->buf[w->len++] = (uint8_t)(n >> 8);
    memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static void w_header(wbuf_t *w, const Psd__Header *h)
{
    uint8_t tmp[2048];
    size_t n = psd__header__pack(h, tmp);
    w_frame(w, tmp, n);
}

static void wire_seeds(void)
{
    wbuf_t w;
    Psd__Header h;
    Psd__Register reg;
    Psd__Pull pull;
    Psd__Push push;
    Psd__Epoch ep;
    Psd__Range r0, r1, *rr[2] = {&r0, &r1};
    Psd__Weights wt;
    Psd__Error er;
    Psd__ValResult vr;
    Psd__TensorDesc t0, t1, *tt[2] = {&t0, &t1};
    uint64_t shape0[2] = {2, 3}, shape1[1] = {2}, ids_shape[1] = {5}, wshape[1] = {4};
    float wdata[6] = {1, -2, 3.5f, 0, 1e-3f, -1e9f}, bdata[2] = {0.25f, -0.5f};
    uint32_t ids[5] = {4, 0, 3, 1, 2};

    /* REGISTER, PAIR and ROUTER */
    psd__header__init(&h);
    psd__register__init(&reg);
    reg.hostname = "node1";
    reg.host_id = "0123456789abcdef";
    reg.pid = 4242;
    reg.device = "cpu";
    reg.device_index = -1;
    reg.version = "0.1.0";
    reg.prev_rank = -1;
    h.protocol = 1;
    h.type = PSD__MSG_TYPE__MSG_REGISTER;
    h.seq = 1;
    h.body_case = PSD__HEADER__BODY_REG;
    h.reg = &reg;
    w_ctl(&w, 1, 0);
    w_header(&w, &h);
    put("fuzz_wire", "register", w.buf, w.len);
    w_ctl(&w, 1, 1);
    w_header(&w, &h);
    put("fuzz_wire", "register-router", w.buf, w.len);

    /* PULL */
    psd__header__init(&h);
    psd__pull__init(&pull);
    pull.min_version = 7;
    h.protocol = 1;
    h.run_id = 0x1122334455667788ULL;
    h.type = PSD__MSG_TYPE__MSG_PULL;
    h.rank = 1;
    h.seq = 9;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pull;
    w_ctl(&w, 1, 1);
    w_header(&w, &h);
    put("fuzz_wire", "pull-router", w.buf, w.len);

    /* PUSH with two f32 frames (W0 2x3, b0 2) */
    psd__header__init(&h);
    psd__push__init(&push);
    push.version = 7;
    push.batch = 64;
    push.loss_sum = 12.5;
    push.correct = 50;
    push.pull = 1;
    psd__tensor_desc__init(&t0);
    t0.id = 0;
    t0.dtype = PSD__DTYPE__DT_F32;
    t0.shape = shape0;
    t0.n_shape = 2;
    t0.nbytes = sizeof wdata;
    psd__tensor_desc__init(&t1);
    t1.id = 1;
    t1.dtype = PSD__DTYPE__DT_F32;
    t1.shape = shape1;
    t1.n_shape = 1;
    t1.nbytes = sizeof bdata;
    h.protocol = 1;
    h.run_id = 0x1122334455667788ULL;
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.rank = 0;
    h.seq = 10;
    h.n_tensors = 2;
    h.tensors = tt;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &push;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push", w.buf, w.len);
    w_ctl(&w, 3, 1);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push-router", w.buf, w.len);

    /* the same with a pad frame before W0 (protocol 9: dropped at receive) */
    {
        Psd__TensorDesc tp, *tpt[3] = {&tp, &t0, &t1};
        const uint8_t zeros[5] = {0};
        psd__tensor_desc__init(&tp);
        tp.dtype = PSD__DTYPE__DT_PAD;
        tp.nbytes = sizeof zeros;
        h.n_tensors = 3;
        h.tensors = tpt;
        w_ctl(&w, 4, 1);
        w_header(&w, &h);
        w_frame(&w, zeros, sizeof zeros);
        w_frame(&w, wdata, sizeof wdata);
        w_frame(&w, bdata, sizeof bdata);
        put("fuzz_wire", "push-pad-router", w.buf, w.len);
        h.n_tensors = 2;
        h.tensors = tt;
    }

    /* over TCP, frames larger than ZeroMQ's in-message buffer (33 bytes)
     * come out of the receive buffer at any offset: W0 4x3, b0 4 */
    {
        uint64_t big_w[2] = {4, 3}, big_b[1] = {4};
        float wbig[12], bbig[4] = {1, 2, 3, 4};
        for (int i = 0; i < 12; i++) wbig[i] = (float)i - 5.5f;
        t0.shape = big_w;
        t0.nbytes = sizeof wbig;
        t1.shape = big_b;
        t1.nbytes = sizeof bbig;
        for (int router = 0; router < 2; router++) {
            w_ctl(&w, 3, router);
            w.buf[0] |= 16;
            w_header(&w, &h);
            w_frame(&w, wbig, sizeof wbig);
            w_frame(&w, bbig, sizeof bbig);
            put("fuzz_wire", router ? "push-router-tcp" : "push-tcp", w.buf, w.len);
        }
        t0.shape = shape0;
        t0.nbytes = sizeof wdata;
        t1.shape = shape1;
        t1.nbytes = sizeof bdata;
    }

    /* edge: nbytes does not match the frame */
    t1.nbytes = 12;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push-bad-nbytes", w.buf, w.len);
    t1.nbytes = sizeof bdata;

    /* edge: two descriptors, one frame */
    w_ctl(&w, 2, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    put("fuzz_wire", "push-missing-frame", w.buf, w.len);

    /* edge: dtype none, zero dimension, 5 dimensions */
    t0.dtype = PSD__DTYPE__DT_NONE;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push-dtype-none", w.buf, w.len);
    t0.dtype = PSD__DTYPE__DT_F32;
    uint64_t zshape[2] = {2, 0}, bigshape[5] = {2, 1, 1, 1, 1};
    t0.shape = zshape;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push-zero-dim", w.buf, w.len);
    t0.shape = bigshape;
    t0.n_shape = 5;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push-5-dims", w.buf, w.len);
    t0.shape = shape0;
    t0.n_shape = 2;

    /* edge: PUSH without its body; unknown type */
    h.body_case = PSD__HEADER__BODY__NOT_SET;
    h.push = NULL;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "push-no-body", w.buf, w.len);
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &push;
    h.type = (Psd__MsgType)99;
    w_ctl(&w, 3, 0);
    w_header(&w, &h);
    w_frame(&w, wdata, sizeof wdata);
    w_frame(&w, bdata, sizeof bdata);
    put("fuzz_wire", "unknown-type", w.buf, w.len);

    /* EPOCH with a u32 frame of sample ids */
    psd__header__init(&h);
    psd__epoch__init(&ep);
    psd__range__init(&r0);
    psd__range__init(&r1);
    r0.begin = 0;
    r0.end = 3;
    r1.begin = 10;
    r1.end = 12;
    ep.epoch = 2;
    ep.world = 3;
    ep.workers_on_host = 2;
    ep.n_ranges = 2;
    ep.ranges = rr;
    ep.version = 100;
    psd__tensor_desc__init(&t0);
    t0.dtype = PSD__DTYPE__DT_U32;
    t0.shape = ids_shape;
    t0.n_shape = 1;
    t0.nbytes = sizeof ids;
    h.protocol = 1;
    h.run_id = 5;
    h.type = PSD__MSG_TYPE__MSG_EPOCH;
    h.n_tensors = 1;
    h.tensors = tt;
    h.body_case = PSD__HEADER__BODY_EPOCH;
    h.epoch = &ep;
    w_ctl(&w, 2, 0);
    w_header(&w, &h);
    w_frame(&w, ids, sizeof ids);
    put("fuzz_wire", "epoch-u32", w.buf, w.len);
    {
        uint32_t many[12] = {11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0};
        uint64_t many_shape[1] = {12};
        t0.shape = many_shape;
        t0.nbytes = sizeof many;
        w_ctl(&w, 2, 1);
        w.buf[0] |= 16;
        w_header(&w, &h);
        w_frame(&w, many, sizeof many);
        put("fuzz_wire", "epoch-u32-router-tcp", w.buf, w.len);
        t0.shape = ids_shape;
        t0.nbytes = sizeof ids;
    }

    /* WEIGHTS: a chunk [2, 4) of a 4-element tensor; then outside it */
    psd__header__init(&h);
    psd__weights__init(&wt);
    wt.version = 3;
    wt.step = 3;
    psd__tensor_desc__init(&t0);
    t0.id = 1;
    t0.dtype = PSD__DTYPE__DT_F32;
    t0.shape = wshape;
    t0.n_shape = 1;
    t0.offset = 2;
    t0.nbytes = 8;
    t0.chunk = 1;
    h.protocol = 1;
    h.run_id = 5;
    h.type = PSD__MSG_TYPE__MSG_WEIGHTS;
    h.n_tensors = 1;
    h.tensors = tt;
    h.body_case = PSD__HEADER__BODY_WEIGHTS;
    h.weights = &wt;
    w_ctl(&w, 2, 0);
    w_header(&w, &h);
    w_frame(&w, bdata, 8);
    put("fuzz_wire", "weights-chunk", w.buf, w.len);
    t0.offset = 3;
    w_ctl(&w, 2, 0);
    w_header(&w, &h);
    w_frame(&w, bdata, 8);
    put("fuzz_wire", "weights-chunk-outside", w.buf, w.len);

    /* ERROR and VAL_RESULT (no tensors) */
    psd__header__init(&h);
    psd__error__init(&er);
    er.code = PSD__ERR_CODE__ERR_DATA;
    er.message = "data files differ";
    h.protocol = 1;
    h.type = PSD__MSG_TYPE__MSG_ERROR;
    h.body_case = PSD__HEADER__BODY_ERROR;
    h.error = &er;
    w_ctl(&w, 1, 0);
    w_header(&w, &h);
    put("fuzz_wire", "error", w.buf, w.len);
    psd__header__init(&h);
    psd__val_result__init(&vr);
    vr.begin = 500;
    vr.epoch = 1;
    vr.version = 9;
    vr.loss_sum = 1.25;
    vr.correct = 400;
    vr.count = 500;
    h.protocol = 1;
    h.type = PSD__MSG_TYPE__MSG_VAL_RESULT;
    h.body_case = PSD__HEADER__BODY_VAL_RESULT;
    h.val_result = &vr;
    w_ctl(&w, 1, 0);
    w_header(&w, &h);
    put("fuzz_wire", "val-result", w.buf, w.len);

    /* edge: a frame more than the descriptors (REGISTER + a data frame) */
    psd__header__init(&h);
    h.protocol = 1;
    h.type = PSD__MSG_TYPE__MSG_REGISTER;
    h.body_case = PSD__HEADER__BODY_REG;
    h.reg = &reg;
    w_ctl(&w, 4, 0);
    w_header(&w, &h);
    w_frame(&w, ids, 4);
    w_frame(&w, ids, 4);
    w_frame(&w, ids, 4);
    put("fuzz_wire", "extra-frames", w.buf, w.len);
    w.buf[0] |= 8 | 16;
    put("fuzz_wire", "extra-frames-router-tcp", w.buf, w.len);

    /* edge: empty header frame; garbage header; nothing after the control */
    w_ctl(&w, 2, 0);
    w_frame(&w, "", 0);
    w_frame(&w, ids, 8);
    put("fuzz_wire", "empty-header", w.buf, w.len);
    static const uint8_t junk[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x08, 0x01, 0x12};
    w_ctl(&w, 1, 0);
    w_frame(&w, junk, sizeof junk);
    put("fuzz_wire", "garbage-header", w.buf, w.len);
    w_ctl(&w, 8, 1);
    put("fuzz_wire", "eight-empty-frames", w.buf, w.len);

    /* regression (fixed in 493280d): [heartbeat, 0 tensors][identity][forged
     * LEAVE] on the ROUTER; the leftover frames used to be read as a new
     * message from identity "victim" */
    static const uint8_t hb[] = {0x08, 0x01, 0x18, 0x0d, 0xb2, 0x01, 0x00};
    static const uint8_t forged[] = {0x08, 0x01, 0x10, 0x2a, 0x18, 0x0e, 0xba, 0x01, 0x08,
                                     0x0a, 0x06, 'f',  'o',  'r',  'g',  'e',  'd'};
    w_ctl(&w, 3, 1);
    w_frame(&w, hb, sizeof hb);
    w_frame(&w, "victim", 6);
    w_frame(&w, forged, sizeof forged);
    put("fuzz_wire", "router-spoof", w.buf, w.len);
}

/* ---- config --------------------------------------------------------------- */

static void cfg(const char *name, const char *text) { put("fuzz_config", name, text, strlen(text)); }

static void config_seeds(void)
{
    size_t n;
    uint8_t *full = slurp("deploy/configs/fashion-mnist.yaml", &n);
    put("fuzz_config", "fashion-mnist.yaml", full, n);
    free(full);
    cfg("minimal.yaml", "model:\n  layers: [4, 3, 2]\noptimizer:\n  name: adamw\n  lr: 1e-3\n");
    cfg("flow.yaml", "{run: {seed: 7, epochs: 2}, schedule: {name: cosine, min_lr: 0.0001},"
                     " server: {workers: 4, log_level: debug}}\n");
    cfg("strings.yaml", "data:\n  train_images: 'it''s \"quoted\"'\n  test_images: \"a\\tb\\u00e9\"\n"
                        "server:\n  metrics: ~\n  save: \"\"\ncheckpoint:\n  dir: null\n"
                        "  every_steps: 100\n  keep: 5\n");
    cfg("empty-sections.yaml", "run:\ntrain:\n  batch_size: 32\n# only a comment\n");
    cfg("empty.yaml", "");
    cfg("comment.yaml", "# nothing here\n");
    cfg("onecycle.yaml", "schedule:\n  name: onecycle\n  pct_start: 0.3\n  div_factor: 25\n"
                         "  final_div_factor: 1e4\n  warmup_epochs: 1.5\noptimizer:\n"
                         "  name: sgd\n  momentum: 0.0\n  nesterov: off\n  clip_norm: 5\n");
    /* regression (fixed in 493280d): NEL written raw read back as a space */
    cfg("nel-roundtrip.yaml", "data:\n  train_images: \"a\\Nb\"\n");
    /* regression (fixed in 71bb5f5): C1 controls and U+FFFE/U+FFFF written raw,
     * which YAML's reader refuses */
    cfg("c1-control-roundtrip.yaml", "data:\n  test_images: \"\\u009e\"\n");
    cfg("fffe-roundtrip.yaml", "server:\n  save: \"x\\uFFFEy\\uFFFF\\u0080\"\n");
    cfg("bad-duplicate.yaml", "run:\n  seed: 1\n  seed: 2\n");
    cfg("bad-unknown.yaml", "optimizer:\n  lrr: 0.1\n");
    cfg("bad-anchor.yaml", "run: &a {seed: 1}\ntrain: *a\n");
    cfg("bad-two-docs.yaml", "run: {seed: 1}\n---\nrun: {seed: 2}\n");
    cfg("bad-nul.yaml", "data:\n  train_images: \"a\\0b\"\n");
    cfg("bad-range.yaml", "run:\n  epochs: 0\nschedule:\n  warmup_epochs: 1e309\n");
    cfg("bad-layers.yaml", "model:\n  layers: [784, [1], 10]\n");
    cfg("set-lr", "optimizer.lr=0.05");
    cfg("set-layers", "model.layers=[784, 256, 10]");
    cfg("set-layers-csv", "model.layers= 784 ,128,64,10 ");
    cfg("set-bool", "optimizer.nesterov=NO");
    cfg("set-seed", "run.seed=18446744073709551615");
    cfg("set-unknown", "foo.bar=1");
}

/* ---- idx ------------------------------------------------------------------ */

static size_t idx_make(uint8_t *b, uint8_t type, int ndim, const uint32_t *dims, size_t data_len)
{
    size_t n = 0;
    b[n++] = 0;
    b[n++] = 0;
    b[n++] = type;
    b[n++] = (uint8_t)ndim;
    for (int i = 0; i < ndim; i++) {
        b[n++] = (uint8_t)(dims[i] >> 24);
        b[n++] = (uint8_t)(dims[i] >> 16);
        b[n++] = (uint8_t)(dims[i] >> 8);
        b[n++] = (uint8_t)dims[i];
    }
    for (size_t i = 0; i < data_len; i++) b[n++] = (uint8_t)(i * 37 + 11);
    return n;
}

static void put_gz(const char *name, const uint8_t *buf, size_t n)
{
    char tmp[] = "/tmp/psd-gen-XXXXXX";
    int fd = mkstemp(tmp);
    if (fd < 0) FUZZ_DIE("mkstemp");
    close(fd);
    gzFile gz = gzopen(tmp, "wb9");
    if (!gz || gzwrite(gz, buf, (unsigned)n) != (int)n || gzclose(gz) != Z_OK) FUZZ_DIE("gzip");
    size_t len;
    uint8_t *z = slurp(tmp, &len);
    unlink(tmp);
    put("fuzz_idx", name, z, len);
    if (!strcmp(name, "images3-gz")) {
        put("fuzz_idx", "images3-gz-truncated", z, len - 6);
        z[len / 2] ^= 0x40;
        put("fuzz_idx", "images3-gz-corrupt", z, len);
    }
    free(z);
}

static void idx_seeds(void)
{
    uint8_t b[512];
    size_t n;
    uint32_t d1[1] = {8}, d3[3] = {2, 4, 4}, d2[2] = {3, 5}, d4[4] = {2, 2, 2, 3};
    n = idx_make(b, 0x08, 1, d1, 8);
    put("fuzz_idx", "labels1", b, n);
    put_gz("labels1-gz", b, n);
    n = idx_make(b, 0x08, 3, d3, 32);
    put("fuzz_idx", "images3", b, n);
    put_gz("images3-gz", b, n);
    put("fuzz_idx", "images3-truncated", b, n - 3);
    b[n] = 0xee;
    put("fuzz_idx", "images3-trailing", b, n + 1);
    n = idx_make(b, 0x08, 2, d2, 15);
    put("fuzz_idx", "matrix2", b, n);
    n = idx_make(b, 0x08, 4, d4, 24);
    put("fuzz_idx", "tensor4", b, n);
    n = idx_make(b, 0x0d, 1, d1, 32);
    put("fuzz_idx", "type-float", b, n);
    n = idx_make(b, 0x08, 1, d1, 8);
    b[1] = 1;
    put("fuzz_idx", "bad-magic", b, n);
    uint32_t z3[3] = {2, 0, 4};
    n = idx_make(b, 0x08, 3, z3, 0);
    put("fuzz_idx", "zero-dim", b, n);
    uint32_t big[3] = {0x10000, 0x100, 0x101};
    n = idx_make(b, 0x08, 3, big, 4);
    put("fuzz_idx", "too-large", b, n);
    uint32_t gib[2] = {0x4000, 0x10000};
    n = idx_make(b, 0x08, 2, gib, 4);
    put("fuzz_idx", "one-gib-truncated", b, n);
    n = idx_make(b, 0x08, 0, NULL, 0);
    put("fuzz_idx", "ndim0", b, n);
    b[3] = 5;
    put("fuzz_idx", "ndim5", b, 4 + 20);
    put("fuzz_idx", "header-only-2", b, 2);
    put("fuzz_idx", "empty", b, 0);
}

/* ---- weights and checkpoints ---------------------------------------------- */

static char g_tmp[64];

/* table_rows > 0: with an embedding table of table_rows x 4 (format 2) */
static void weights_one(const char *name, const int *sizes, int n_sizes, uint64_t seed, uint64_t table_rows)
{
    ps_layout_t l;
    if (ps_layout_init_table(&l, sizes, n_sizes, table_rows, 4) != 0) FUZZ_DIE("layout");
    float *w = calloc(l.n_params, sizeof *w);
    ps_model_init_params(&l, w, seed);
    ps_weights_meta_t meta = {.run_id = 0xabcdef, .step = 120, .epoch = 2};
    char path[128], err[256];
    snprintf(path, sizeof path, "%s/w.bin", g_tmp);
    if (ps_weights_save(path, &l, w, &meta, err, sizeof err) != 0) FUZZ_DIE("%s", err);
    free(w);
    size_t len;
    uint8_t *b = slurp(path, &len);
    unlink(path);
    put("fuzz_weights", name, b, len);
    if (n_sizes == 2) {
        /* edge cases of the small one */
        put("fuzz_weights", "truncated", b, len - 5);
        put("fuzz_weights", "short-15", b, 15);
        uint8_t *c = malloc(len);
        memcpy(c, b, len);
        c[len / 2] ^= 1;
        put("fuzz_weights", "bad-crc", c, len);
        memcpy(c, b, len);
        c[0] = 'X';
        put("fuzz_weights", "bad-magic", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 4, 2); /* format 2 without the table's shape */
        fuzz_put_u32le(c + len - 4, (uint32_t)crc32(0, c, (uInt)(len - 4)));
        put("fuzz_weights", "format2", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 8, 1000);
        fuzz_put_u32le(c + len - 4, (uint32_t)crc32(0, c, (uInt)(len - 4)));
        put("fuzz_weights", "many-layers", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 12, 0);
        fuzz_put_u32le(c + len - 4, (uint32_t)crc32(0, c, (uInt)(len - 4)));
        put("fuzz_weights", "layer-size-0", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 12 + 4 * (uint32_t)n_sizes, 1);
        fuzz_put_u32le(c + len - 4, (uint32_t)crc32(0, c, (uInt)(len - 4)));
        put("fuzz_weights", "activation-1", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 12, 4); /* sizes no longer match the data length */
        fuzz_put_u32le(c + len - 4, (uint32_t)crc32(0, c, (uInt)(len - 4)));
        put("fuzz_weights", "size-mismatch", c, len);
        free(c);
    }
    free(b);
}

static void ckpt_one(const char *name, const int *sizes, int n_sizes, ps_opt_kind_t kind,
                     float momentum, uint64_t train_count, int edges, uint64_t table_rows, uint32_t shards)
{
    ps_layout_t l;
    if (ps_layout_init_table(&l, sizes, n_sizes, table_rows, 4) != 0) FUZZ_DIE("layout");
    psd_optim_t o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.momentum = momentum;
    o.beta1 = 0.9f;
    o.beta2 = 0.999f;
    o.eps = 1e-8f;
    psd_store_t s;
    if (psd_store_init(&s, &l, &o, 99) != 0) FUZZ_DIE("store");
    for (size_t i = 0; s.s0 && i < l.n_params; i++) s.s0[i] = (float)i * 0.5f;
    for (size_t i = 0; s.s1 && i < l.n_params; i++) s.s1[i] = (float)i * 0.25f;
    psd_ckpt_meta_t m;
    memset(&m, 0, sizeof m);
    m.run_id = 77;
    m.config_hash = 0x1234;
    m.seed = 99;
    m.step = 1;
    m.version = 1;
    m.epoch = 1;
    m.epoch_step = 3;
    m.steps_per_epoch = 10;
    m.ep_loss = 2.5;
    m.ep_correct = 3;
    m.ep_samples = 12;
    m.train_s_total = 1.5;
    m.samples_total = 44;
    m.lr = 0.01;
    m.train_count = train_count;
    m.n_sizes = n_sizes;
    memcpy(m.sizes, sizes, (size_t)n_sizes * sizeof *sizes);
    m.opt_kind = kind;
    m.n_slots = (uint32_t)psd_optim_slots(&o);
    m.n_params = l.n_params;
    m.table_rows = table_rows;
    m.table_dim = table_rows ? 4 : 0;
    m.shards = shards; /* > 1: the last shard's part only (format 4) */
    m.shard = shards > 1 ? shards - 1 : 0;
    uint8_t seen[64];
    for (size_t i = 0; i < sizeof seen; i++) seen[i] = (uint8_t)(0x55 ^ i);
    psd_ckpt_writer_t *wr;
    if (psd_ckpt_begin(&wr, g_tmp, 0, &m, seen, &s) != 0) FUZZ_DIE("ckpt begin");
    char path[4096];
    if (psd_ckpt_end(&wr, path, sizeof path, NULL, NULL, NULL) != 0) FUZZ_DIE("ckpt end");
    psd_store_deinit(&s);
    size_t len;
    uint8_t *b = slurp(path, &len);
    unlink(path);
    put("fuzz_ckpt", name, b, len);
    if (edges) {
        uint8_t *c = malloc(len);
        put("fuzz_ckpt", "truncated", b, len - 1);
        put("fuzz_ckpt", "header-only", b, 232);
        put("fuzz_ckpt", "short", b, 100);
        memcpy(c, b, len);
        c[300] ^= 0x80;
        put("fuzz_ckpt", "bad-crc", c, len);
        memcpy(c, b, len);
        fuzz_put_u64le(c + len - 12, 5);
        put("fuzz_ckpt", "bad-length-field", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 128, 1); /* n_sizes */
        put("fuzz_ckpt", "bad-layer-count", c, len);
        memcpy(c, b, len);
        fuzz_put_u32le(c + 200, 3); /* n_slots */
        put("fuzz_ckpt", "three-slots", c, len);
        memcpy(c, b, len);
        fuzz_put_u64le(c + 120, (uint64_t)1 << 40); /* train_count */
        put("fuzz_ckpt", "huge-train-count", c, len);
        memcpy(c, b, len);
        c[4] = 3; /* format */
        put("fuzz_ckpt", "format3", c, len);
        free(c);
    }
    free(b);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: gen_seeds CORPUS_ROOT (tests/fuzz/corpus)\n");
        return 2;
    }
    g_root = argv[1];
    mkdir(g_root, 0755);
    snprintf(g_tmp, sizeof g_tmp, "/tmp/psd-gen-seeds-XXXXXX");
    if (!mkdtemp(g_tmp)) FUZZ_DIE("mkdtemp");

    wire_seeds();
    config_seeds();
    idx_seeds();

    static const int s2[] = {3, 2}, s3[] = {4, 3, 2}, s4[] = {5, 4, 3, 2};
    weights_one("w-3-2", s2, 2, 1, 0);
    weights_one("w-4-3-2", s3, 3, 2, 0);
    weights_one("w-5-4-3-2", s4, 4, 3, 0);
    weights_one("w-table-8-4-2", (const int[]){8, 4, 2}, 3, 4, 10);

    ckpt_one("adam-2-slots", s2, 2, PS_OPT_ADAM, 0, 10, 1, 0, 1);
    ckpt_one("sgd-momentum-1-slot", s3, 3, PS_OPT_SGD, 0.9f, 17, 0, 0, 1);
    ckpt_one("sgd-0-slots-no-seen", s2, 2, PS_OPT_SGD, 0, 0, 0, 0, 1);
    ckpt_one("adagrad-table", (const int[]){8, 4, 2}, 3, PS_OPT_ADAGRAD, 0, 20, 0, 12, 1);
    ckpt_one("adam-shard-2-of-2", (const int[]){100, 200, 10}, 3, PS_OPT_ADAM, 0, 10, 0, 0, 2);
    rmdir(g_tmp);
    return 0;
}
