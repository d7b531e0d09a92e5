/* it_shards.c - integration tests: a fake shard 0 against a real psd shard; logs and the progress
 * line; shared slots stepped in place; table rows and validation parts (see itest.h). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "itest.h"
#include "proc.h"
#include "ps_auth.h"
#include "ps_ctr.h"
#include "ps_model.h"
#include "ps_safetensors.h"
#include "ps_shm.h"
#include "ps_table.h"
#include "psworker.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_wire.h"

/* ---- a fake shard 0 (and a hand-made worker) against a real psd shard ---- */

/* The next message of `type` on sock within timeout_s (others dropped):
 * 0, or -1. */
static int recv_type(void *sock, bool router, Psd__MsgType type, ps_msg_t *m, double timeout_s)
{
    double end = ps_now() + timeout_s;
    char err[256];
    while (ps_now() < end) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0 || ps_msg_recv(sock, m, router, ZMQ_DONTWAIT, err, sizeof err) != 0) continue;
        if (m->hdr->type == type) return 0;
        ps_msg_deinit(m);
    }
    return -1;
}

/* A worker's DEALER registered with the shard at ep as rank 0 with token
 * (asked again until the shard answers: shard 0's word may come later). */
static void *shard_register(void *ctx, const char *ep, const uint8_t *token, uint64_t *seq)
{
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, ep), 0);
    for (int i = 0; i < 50; i++) {
        Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_REGISTER, ++*seq);
        Psd__Register r = PSD__REGISTER__INIT;
        r.shard_token.data = (uint8_t *)token;
        r.shard_token.len = PS_SHM_TOKEN;
        h.body_case = PSD__HEADER__BODY_REG;
        h.reg = &r;
        cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
        ps_msg_t m;
        if (recv_type(d, false, PSD__MSG_TYPE__MSG_ASSIGN, &m, 0.5) == 0) {
            ps_msg_deinit(&m);
            return d;
        }
    }
    cr_assert_fail("the shard did not answer REGISTER");
    return NULL;
}

/* Rank 0's push of version v: the bias (4 floats of 1, the shard's part of
 * MLP 784-4), with a pull of the next version. */
static void shard_push(void *d, uint64_t v, uint64_t *seq)
{
    float g[4] = {1, 1, 1, 1};
    ps_frame_t fr = {.data = g, .nbytes = sizeof g, .id = 1, .dtype = PSD__DTYPE__DT_F32, .rows = 4};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_PUSH, ++*seq);
    Psd__Push p = PSD__PUSH__INIT;
    p.version = v;
    p.batch = 1;
    p.pull = true;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, &fr, 1), 0);
}

/* Shard 0 tells the shard to step version v (step v) with `ranks`, each
 * weighing 1/n, lr 0.5. */
static void shard_step(void *lead, const uint8_t *ident, size_t ilen, uint64_t v, uint32_t *ranks, size_t n,
                       uint64_t seq)
{
    double wt[4] = {1.0 / (double)n, 1.0 / (double)n, 1.0 / (double)n, 1.0 / (double)n};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_STEP, seq);
    Psd__ShardStep st = PSD__SHARD_STEP__INIT;
    st.version = v;
    st.step = v;
    st.ranks = ranks;
    st.n_ranks = n;
    st.weights = wt;
    st.n_weights = n;
    st.lr = 0.5;
    h.body_case = PSD__HEADER__BODY_SHARD_STEP;
    h.shard_step = &st;
    cr_assert_eq(ps_msg_send(lead, ident, ilen, &h, NULL, 0), 0);
}

/* The test as shard 0 of 2 against a real `psd --shard 1/2` (started with
 * the extra arguments, its log in `log`): it joins (the test answers its
 * HELLO with l's table; the shard draws its part of the initial values as
 * its config says and says so), learns that rank 0 may register with
 * fake_token, and rank 0 is registered with it (w). */
typedef struct {
    void *ctx, *lead, *w; /* shard 0's ROUTER; rank 0's DEALER to the shard */
    char wep[64], log[256];
    uint8_t ident[PS_MAX_IDENTITY]; /* the shard's identity on lead */
    size_t ilen;
    uint64_t lseq, seq; /* shard 0's and rank 0's sequence numbers */
    pid_t sh;
} fake_lead_t;

static const uint8_t fake_token[PS_SHM_TOKEN] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

static void fake_lead_start(fake_lead_t *f, const char *logname, const char *const *extra, const ps_layout_t *l)
{
    memset(f, 0, sizeof *f);
    f->ctx = zmq_ctx_new();
    f->lead = zmq_socket(f->ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(f->lead, ZMQ_LINGER, &zero, sizeof zero);
    char lep[64];
    snprintf(lep, sizeof lep, "tcp://127.0.0.1:%d", free_port());
    snprintf(f->wep, sizeof f->wep, "tcp://127.0.0.1:%d", free_port());
    cr_assert_eq(zmq_bind(f->lead, lep), 0);
    path(f->log, sizeof f->log, logname);
    const char *argv[32] = {psd_bin, "--listen", f->wep, "--shard", "1/2", "--leader", lep, "--set",
                            "checkpoint.dir=", "--worker-timeout", "60"};
    int k = 11;
    for (int j = 0; extra[j]; j++) argv[k++] = extra[j];
    argv[k] = NULL;
    f->sh = proc_spawn(argv, f->log);
    ps_msg_t m;
    cr_assert_eq(recv_type(f->lead, true, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 60), 0, "no HELLO from the shard");
    f->ilen = m.ident_len;
    memcpy(f->ident, m.ident, m.ident_len);
    ps_msg_deinit(&m);
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_HELLO, ++f->lseq);
    Psd__ShardHello hb = PSD__SHARD_HELLO__INIT;
    hb.shard = 1;
    hb.shards = 2;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &hb;
    uint8_t *tb;
    size_t tlen;
    cr_assert_eq(ps_table_pack(l, &tb, &tlen), 0);
    ps_frame_t table = {.data = tb, .nbytes = tlen, .dtype = PSD__DTYPE__DT_U8, .rows = tlen};
    cr_assert_eq(ps_msg_send(f->lead, f->ident, f->ilen, &h, &table, 1), 0);
    free(tb);
    cr_assert_eq(recv_type(f->lead, true, PSD__MSG_TYPE__MSG_SHARD_INIT_DONE, &m, 60), 0, "no INIT_DONE (%s)", f->log);
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(l, 1, 2, p);
    cr_assert_eq(m.hdr->shard_fetch->count, ps_part_size(p, l->n_tensors), "its part, drawn");
    ps_msg_deinit(&m);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_WORKER, ++f->lseq);
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    sw.token.data = (uint8_t *)fake_token;
    sw.token.len = PS_SHM_TOKEN;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    cr_assert_eq(ps_msg_send(f->lead, f->ident, f->ilen, &h, NULL, 0), 0);
    f->w = shard_register(f->ctx, f->wep, fake_token, &f->seq);
}

/* Shard 0 sends h (its sequence number next) to the shard. */
static void fake_lead_send(fake_lead_t *f, Psd__Header *h)
{
    h->seq = ++f->lseq;
    cr_assert_eq(ps_msg_send(f->lead, f->ident, f->ilen, h, NULL, 0), 0);
}

static void fake_lead_end(fake_lead_t *f)
{
    zmq_close(f->w);
    zmq_close(f->lead);
    zmq_ctx_term(f->ctx);
}

/* A psd shard keeps a worker's complete push when the worker registers
 * again from a new connection (shard 0 was told it is here and names it
 * in its STEP: the shard failed the run before), and refuses a STEP that
 * names a rank twice (it reduced that push twice before). Shard 0 is this
 * test: it answers the shard's HELLO, tells it about rank 0, reads its
 * SHARD_HAVE and sends the STEPs. */
Test(short, a_psd_shard_keeps_pushes_across_registrations_and_refuses_repeated_ranks)
{
    const char *extra[] = {"--set", "model.layers=[784,4]", "--set", "optimizer.momentum=0", "--set",
                           "optimizer.weight_decay=0", "--set", "data.train_limit=1000", "--log-level", "debug", NULL};
    fake_lead_t f;
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, (const int[]){784, 4}, 2), 0);
    fake_lead_start(&f, "fakelead-shard.log", extra, &l);
    ps_msg_t m;
    Psd__Header h;
    shard_push(f.w, 0, &f.seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE");
    cr_assert_eq(m.hdr->shard_have->rank, 0);
    ps_msg_deinit(&m);
    void *w2 = shard_register(f.ctx, f.wep, fake_token, &f.seq); /* the same rank from a new connection */
    h = fake_hdr(PSD__MSG_TYPE__MSG_PULL, ++f.seq);
    Psd__Pull pl = PSD__PULL__INIT;
    pl.min_version = 1;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    cr_assert_eq(ps_msg_send(w2, NULL, 0, &h, NULL, 0), 0);
    uint32_t one[1] = {0};
    shard_step(f.lead, f.ident, f.ilen, 0, one, 1, ++f.lseq);
    cr_assert_eq(recv_type(w2, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0,
                 "no version 1 after the STEP: the shard dropped the push (log %s)", f.log);
    size_t n = 0;
    const float *b = m.n_frames == 1 ? ps_msg_f32(&m, 0, &n) : NULL;
    cr_assert(b && n == 4 && m.hdr->weights->version == 1, "weights of the shard's part");
    for (int i = 0; i < 4; i++) cr_expect_float_eq(b[i], -0.5f, 1e-6, "bias %d: 0 - 0.5 x 1", i);
    ps_msg_deinit(&m);

    shard_push(w2, 1, &f.seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for version 1");
    ps_msg_deinit(&m);
    uint32_t twice[2] = {0, 0};
    shard_step(f.lead, f.ident, f.ilen, 1, twice, 2, ++f.lseq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_ERROR, &m, 30), 0, "a STEP naming rank 0 twice was taken");
    cr_expect(m.hdr->error->message && strstr(m.hdr->error->message, "repeated rank"), "%s",
              m.hdr->error->message ? m.hdr->error->message : "");
    ps_msg_deinit(&m);
    cr_expect_eq(proc_wait(f.sh, 30), 1, "the shard exits 1");
    zmq_close(w2);
    fake_lead_end(&f);
}

/* Shard 0 gives the rank of a worker long gone to a new one (every worker
 * slot taken: worker_slots_are_reused_once_every_one_was_taken): a
 * SHARD_WORKER with another token. The shard forgets all of the old
 * worker, also its complete push that shard 0 never stepped (the old one
 * was gone); the new worker's push of that version is taken, not dropped
 * as a second one, and stepped. */
Test(short, a_psd_shard_forgets_a_rank_given_to_a_new_worker)
{
    const char *extra[] = {"--set", "model.layers=[784,4]", "--set", "optimizer.momentum=0", "--set",
                           "optimizer.weight_decay=0", "--set", "data.train_limit=1000", NULL};
    fake_lead_t f;
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, (const int[]){784, 4}, 2), 0);
    fake_lead_start(&f, "fakelead-reuse.log", extra, &l);
    ps_msg_t m;
    shard_push(f.w, 0, &f.seq); /* the old worker's push, complete here */
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE");
    ps_msg_deinit(&m);
    static const uint8_t token2[PS_SHM_TOKEN] = {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 2};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_WORKER, 0);
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    sw.token.data = (uint8_t *)token2;
    sw.token.len = PS_SHM_TOKEN;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    fake_lead_send(&f, &h);
    uint64_t seq2 = 0;
    void *w2 = shard_register(f.ctx, f.wep, token2, &seq2);
    shard_push(w2, 0, &seq2);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0,
                 "no SHARD_HAVE for the new worker's push: dropped as a second one (log %s)", f.log);
    ps_msg_deinit(&m);
    uint32_t one[1] = {0};
    shard_step(f.lead, f.ident, f.ilen, 0, one, 1, ++f.lseq);
    cr_assert_eq(recv_type(w2, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no version 1 for the new worker");
    size_t n = 0;
    const float *b = m.n_frames == 1 ? ps_msg_f32(&m, 0, &n) : NULL;
    cr_assert(b && n == 4 && m.hdr->weights->version == 1, "weights of the shard's part");
    for (int i = 0; i < 4; i++) cr_expect_float_eq(b[i], -0.5f, 1e-6, "bias %d: 0 - 0.5 x 1 (its push, once)", i);
    ps_msg_deinit(&m);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, 0);
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    sd.reason = "test over";
    h.body_case = PSD__HEADER__BODY_SHUTDOWN;
    h.shutdown = &sd;
    fake_lead_send(&f, &h);
    cr_expect_eq(proc_wait(f.sh, 30), 0, "the shard exits 0 at SHUTDOWN");
    zmq_close(w2);
    fake_lead_end(&f);
}

/* A PUSH of table rows to rank 0's shard connection d for version v: the
 * ids frame (n ids) and a values frame of nv rows of 8 floats (val), or
 * none when nv < 0; then, with want, the n_want rows the reply is to bring
 * (pull: whether it asks for the next version). */
static void shard_push_rows_want(void *d, uint64_t v, const uint32_t *ids, size_t n, int nv, float val,
                                 const uint32_t *want, size_t n_want, bool pull, uint64_t *seq)
{
    const uint32_t table = 4; /* ctr.yaml: W0, b0, W1, b1, E */
    float vals[4 * 8];
    for (int i = 0; i < 4 * 8; i++) vals[i] = val + (float)(i / 8);
    ps_frame_t fr[3] = {{.data = ids, .nbytes = n * 4, .id = table, .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)n},
                        {.data = vals, .nbytes = (size_t)(nv > 0 ? nv : 0) * 32, .id = table,
                         .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)(nv > 0 ? nv : 0), .cols = 8}};
    int k = nv < 0 ? 1 : 2;
    if (want)
        fr[k++] = (ps_frame_t){.data = want, .nbytes = n_want * 4, .id = table, .dtype = PSD__DTYPE__DT_U32,
                               .rows = (uint32_t)n_want};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_PUSH, ++*seq);
    Psd__Push p = PSD__PUSH__INIT;
    p.version = v;
    p.batch = 1;
    p.pull = pull;
    p.want_rows = want != NULL;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, fr, k), 0);
}

static void shard_push_rows(void *d, uint64_t v, const uint32_t *ids, size_t n, int nv, float val, uint64_t *seq)
{
    shard_push_rows_want(d, v, ids, n, nv, val, NULL, 0, true, seq);
}

/* The shard's part (its piece of the table) of the version its WEIGHTS
 * answer on d brings, copied into out (n floats). */
static void shard_weights(void *d, uint64_t version, float *out, size_t n)
{
    ps_msg_t m;
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no WEIGHTS of version %" PRIu64,
                 version);
    size_t got = 0;
    const float *f = m.n_frames == 1 ? ps_msg_f32(&m, 0, &got) : NULL;
    cr_assert(f && got == n && m.hdr->weights->version == version, "the piece of version %" PRIu64, version);
    memcpy(out, f, n * sizeof *f);
    ps_msg_deinit(&m);
}

/* n refusals told to shard 0 on lead (SHARD_HAVE with the shard's words,
 * starting `words`), and no SHARD_HAVE that takes a push among them. */
static void refused_told(void *lead, int n, const char *words)
{
    for (int k = 0; k < n; k++) {
        ps_msg_t m;
        cr_assert_eq(recv_type(lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "refusal %d not told", k + 1);
        const char *r = m.hdr->shard_have->refused;
        cr_assert(r && strncmp(r, words, strlen(words)) == 0 && m.hdr->shard_have->rank == 0,
                  "refusal %d: a push taken or other words (%s)", k + 1, r ? r : "(none)");
        ps_msg_deinit(&m);
    }
}

/* A psd shard takes a push of table rows for its piece of the table only
 * (ids strictly increasing inside the piece, one value row each: anything
 * else is dropped, logged and told to shard 0, which ends that worker's
 * run), steps the rows pushed (no other), forgets
 * a push's rows at the next one,
 * and answers a push or a PULL that lists rows of its piece with those
 * rows. The test is shard 0 (ctr.yaml: the MLP on shard 0, the table's
 * rows 32768..65535 on shard 1) and worker rank 0. */
Test(short, a_psd_shard_takes_table_rows_of_its_piece_only)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, (int[]){64, 64, 2}, 3, 65536, 8), 0);
    ps_piece_t pc[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 1, 2, pc);
    size_t r0 = 0, r1 = 0;
    cr_assert(l.table == 4 && ps_piece_rows(&l, &pc[4], &r0, &r1) && r0 == 32768 && r1 == 65536, "%zu..%zu", r0, r1);
    for (int t = 0; t < 4; t++) cr_assert_eq(pc[t].n, 0, "the MLP on shard 0");
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *extra[] = {"--config", cfg, NULL};
    fake_lead_t f;
    fake_lead_start(&f, "fakelead-rows.log", extra, &l);
    ps_msg_t m;
    Psd__Header h;
    void *w = f.w;
    uint64_t *seq = &f.seq;
    const size_t n = pc[4].n;
    float *v0 = malloc(n * sizeof *v0), *v1 = malloc(n * sizeof *v1), *v2 = malloc(n * sizeof *v2);
    h = fake_hdr(PSD__MSG_TYPE__MSG_PULL, ++*seq);
    Psd__Pull pl = PSD__PULL__INIT;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    cr_assert_eq(ps_msg_send(w, NULL, 0, &h, NULL, 0), 0);
    shard_weights(w, 0, v0, n);

    /* refused: a row of shard 0's piece, ids out of order, values for fewer rows, no values */
    const uint32_t below[2] = {32767, 32768}, unsorted[2] = {40000, 39999}, ok[2] = {32768, 65535};
    shard_push_rows(w, 0, below, 2, 2, 1, seq);
    shard_push_rows(w, 0, unsorted, 2, 2, 1, seq);
    shard_push_rows(w, 0, ok, 2, 1, 1, seq);
    shard_push_rows(w, 0, ok, 2, -1, 1, seq);
    refused_told(f.lead, 4, "PUSH of rank 0 ");
    char *text = slurp(f.log);
    cr_assert_eq(count_in(text, "are not rows of this shard's piece of the table"), 4, "%s", text);
    free(text);
    shard_push_rows(w, 0, ok, 2, 2, 1, seq); /* rows 32768 (all 1) and 65535 (all 2) */
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for the rows");
    ps_msg_deinit(&m);
    uint32_t one[1] = {0};
    shard_step(f.lead, f.ident, f.ilen, 0, one, 1, ++f.lseq);
    shard_weights(w, 1, v1, n);
    const size_t last = n - 8;
    for (size_t i = 0; i < n; i++) {
        if (i < 8 || i >= last) cr_assert(v1[i] < v0[i], "float %zu of a row pushed went down", i);
        else cr_assert(v1[i] == v0[i], "float %zu of a row not pushed changed", i);
    }
    /* the next push's rows only: the last push's are not stepped again */
    const uint32_t mid[1] = {50000};
    shard_push_rows(w, 1, mid, 1, 1, 1, seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for version 1");
    ps_msg_deinit(&m);
    shard_step(f.lead, f.ident, f.ilen, 1, one, 1, ++f.lseq);
    shard_weights(w, 2, v2, n);
    const size_t at = (50000 - 32768) * 8;
    for (size_t i = 0; i < n; i++) {
        if (i >= at && i < at + 8) cr_assert(v2[i] < v1[i], "float %zu of the row pushed went down", i);
        else cr_assert(v2[i] == v1[i], "float %zu of a row not pushed this time changed", i);
    }
    /* with the rows the next batch reads: the reply brings those rows of the new version only;
     * refused: a row of shard 0's piece, a list without a pull */
    const uint32_t other[1] = {50001}, want[2] = {32768, 65535};
    shard_push_rows_want(w, 2, other, 1, 1, 1, below, 2, true, seq);
    shard_push_rows_want(w, 2, other, 1, 1, 1, want, 2, false, seq);
    refused_told(f.lead, 2, "PUSH of rank 0 ");
    text = slurp(f.log);
    cr_assert_eq(count_in(text, "asking for table rows that are not rows of this shard's piece"), 2, "%s", text);
    free(text);
    shard_push_rows_want(w, 2, other, 1, 1, 1, want, 2, true, seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for version 2");
    ps_msg_deinit(&m);
    shard_step(f.lead, f.ident, f.ilen, 2, one, 1, ++f.lseq);
    cr_assert_eq(recv_type(w, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no WEIGHTS of version 3");
    size_t got = 0;
    const float *r = m.n_frames == 1 ? ps_msg_f32(&m, 0, &got) : NULL;
    cr_assert(r && got == 16 && m.hdr->weights->version == 3 && m.hdr->weights->rows,
              "two rows of version 3 (%zu floats)", got);
    for (int i = 0; i < 8; i++) {
        cr_assert(r[i] == v2[i], "row 32768 (not pushed since version 1), float %d", i);
        cr_assert(r[8 + i] == v2[last + i], "row 65535, float %d", i);
    }
    ps_msg_deinit(&m);
    /* a PULL listing rows (a batch that grew, a validation part): those of the piece only; the
     * reply brings them */
    for (int k = 0; k < 2; k++) {
        h = fake_hdr(PSD__MSG_TYPE__MSG_PULL, ++*seq);
        Psd__Pull rp = PSD__PULL__INIT;
        rp.min_version = 3;
        rp.want_rows = true;
        h.body_case = PSD__HEADER__BODY_PULL;
        h.pull = &rp;
        const uint32_t mine[1] = {40000};
        ps_frame_t fr = {.data = k ? mine : below, .nbytes = (k ? 1 : 2) * sizeof(uint32_t), .id = 4,
                         .dtype = PSD__DTYPE__DT_U32, .rows = k ? 1 : 2};
        cr_assert_eq(ps_msg_send(w, NULL, 0, &h, &fr, 1), 0);
    }
    refused_told(f.lead, 1, "PULL of rank 0 ");
    cr_assert_eq(recv_type(w, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no WEIGHTS for the PULL of rows");
    r = m.n_frames == 1 ? ps_msg_f32(&m, 0, &got) : NULL;
    cr_assert(r && got == 8 && m.hdr->weights->rows, "row 40000 only (%zu floats)", got);
    for (int i = 0; i < 8; i++) cr_assert(r[i] == v2[(40000 - 32768) * 8 + i], "row 40000, float %d", i);
    ps_msg_deinit(&m);
    text = slurp(f.log);
    cr_assert_eq(count_in(text, "PULL of rank 0 asking for table rows that are not rows of this shard's piece"), 1,
                 "%s", text);
    free(text);
    free(v0);
    free(v1);
    free(v2);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, ++f.lseq);
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    sd.reason = "test over";
    h.body_case = PSD__HEADER__BODY_SHUTDOWN;
    h.shutdown = &sd;
    fake_lead_send(&f, &h);
    cr_expect_eq(proc_wait(f.sh, 30), 0, "the shard exits 0 at SHUTDOWN");
    text = slurp(f.log);
    cr_expect(text && strstr(text, "3 pushes of table rows (4 rows); sent 3 rows in replies"), "%s", text ? text : "");
    free(text);
    fake_lead_end(&f);
}

/* With clipping, a psd shard sends its blocks' norms (SHARD_NORM) and
 * applies nothing before shard 0's APPLY; an APPLY whose sum of squares is
 * negative (no gradient has one) ends the run on the shard (exit 1, ERROR
 * to shard 0) instead of applying a NaN scale. The test is shard 0. */
Test(short, a_psd_shard_refuses_a_negative_norm)
{
    const char *extra[] = {"--set", "model.layers=[784,4]", "--set", "optimizer.clip_norm=1", "--set",
                           "data.train_limit=1000", NULL};
    fake_lead_t f;
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, (const int[]){784, 4}, 2), 0);
    fake_lead_start(&f, "fakelead-norm.log", extra, &l);
    ps_msg_t m;
    shard_push(f.w, 0, &f.seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE");
    ps_msg_deinit(&m);
    uint32_t one[1] = {0};
    double wt[1] = {1};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_STEP, 0);
    Psd__ShardStep st = PSD__SHARD_STEP__INIT;
    st.ranks = one;
    st.n_ranks = 1;
    st.weights = wt;
    st.n_weights = 1;
    st.lr = 0.5;
    st.clip_norm = 1;
    h.body_case = PSD__HEADER__BODY_SHARD_STEP;
    h.shard_step = &st;
    fake_lead_send(&f, &h);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_NORM, &m, 30), 0, "no SHARD_NORM (log %s)", f.log);
    cr_assert(m.hdr->shard_norm->n_block_sq == 1 && m.hdr->shard_norm->block_sq[0] == 4.0,
              "one block: the bias's 4 ones");
    ps_msg_deinit(&m);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_APPLY, 0);
    Psd__ShardApply ap = PSD__SHARD_APPLY__INIT;
    ap.sumsq = -1;
    h.body_case = PSD__HEADER__BODY_SHARD_APPLY;
    h.shard_apply = &ap;
    fake_lead_send(&f, &h);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_ERROR, &m, 30), 0, "a negative norm was applied");
    cr_expect(m.hdr->error->message && strstr(m.hdr->error->message, "negative sum of squares"), "%s",
              m.hdr->error->message ? m.hdr->error->message : "");
    ps_msg_deinit(&m);
    cr_expect_eq(proc_wait(f.sh, 30), 1, "the shard exits 1");
    fake_lead_end(&f);
}

/* A shard's HELLO to shard 0 (as shard i of n, config hash `hash`, a model
 * of n_params: 0 when it takes shard 0's), from the fake shard's DEALER d. */
static void fake_hello_at(void *d, uint32_t i, uint32_t n, uint64_t hash, uint64_t n_params, const char *ep,
                          uint64_t *seq)
{
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_HELLO, ++*seq);
    h.run_id = 0;
    h.rank = i;
    Psd__ShardHello b = PSD__SHARD_HELLO__INIT;
    b.shard = i;
    b.shards = n;
    b.endpoint = (char *)ep;
    b.config_hash = hash;
    b.n_params = n_params;
    b.hostname = "fake";
    b.pid = 4242;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &b;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
}

/* ... whose workers' endpoint is nobody's */
static void fake_hello_of(void *d, uint32_t i, uint32_t n, uint64_t hash, uint64_t n_params, uint64_t *seq)
{
    fake_hello_at(d, i, n, hash, n_params, "tcp://127.0.0.1:1", seq);
}

/* ... of the MLP 784-10 */
static void fake_hello(void *d, uint32_t i, uint32_t n, uint64_t hash, uint64_t *seq)
{
    fake_hello_of(d, i, n, hash, 784 * 10 + 10, seq);
}

/* Shard 0 keeps watching a joined shard whose connection says HELLO again
 * as another shard: that HELLO is dropped. Before, it un-joined the shard,
 * and a shard that then fell silent went unnoticed: the run waited for its
 * start timeout (exit 3). This test is shard 1: it joins, says HELLO as
 * shard 2 of 3, and falls silent: shard 0 ends the run, shard lost (5). */
Test(short, a_joined_shard_saying_hello_as_another_is_still_watched)
{
    run_t r;
    const char *args[] = {"--set", "model.layers=[784,10]", "--set", "checkpoint.dir=", "--shard", "0/2",
                          "--worker-timeout", "2", "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "oddhello", 1, args);
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, r.endpoint), 0);
    uint64_t seq = 0, hash = 0;
    ps_msg_t m;
    fake_hello(d, 1, 2, 0, &seq); /* a wrong hash: the refusal names shard 0's */
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_ERROR, &m, 60), 0, "no refusal");
    const char *at = m.hdr->error->message ? strstr(m.hdr->error->message, "shard 0's ") : NULL;
    cr_assert(at && sscanf(at, "shard 0's %" SCNx64, &hash) == 1, "%s", m.hdr->error->message);
    ps_msg_deinit(&m);
    fake_hello(d, 1, 2, hash, &seq);
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 30), 0, "not joined");
    ps_msg_deinit(&m);
    fake_hello(d, 2, 3, hash, &seq);
    cr_assert_eq(proc_wait(p, 45), 5, "shard 0 did not notice its silent shard (log %s)", r.psd_log);
    char *l = slurp(r.psd_log);
    cr_expect(strstr(l, "dropped a message from psd shard 1 (fake pid 4242): HELLO on its connection as shard 2"), "%s",
              l); /* named as the shard it is, not "an unknown peer" */
    cr_expect(strstr(l, "psd shard 1 (fake pid 4242) lost"), "%s", l);
    free(l);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

/* A message of a worker that a psd shard cannot take ends that worker's
 * run from shard 0 (before, the shard only dropped it: the worker waited,
 * was declared lost and registered again, forever). This test is shard 1
 * of 2: it joins, draws its part, and tells shard 0 it refused rank 0's
 * push; the real pworker ends with exit 2 and psd's reason naming the
 * shard's words, and psd counts it refused. */
Test(short, a_message_a_psd_shard_refuses_ends_that_workers_run)
{
    run_t r;
    const char *args[] = {"--set", "model.layers=[784,10]", "--set", "checkpoint.dir=", "--shard", "0/2",
                          "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "shardrefuse", 1, args);
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, r.endpoint), 0);
    uint64_t seq = 0, hash = 0;
    ps_msg_t m;
    fake_hello(d, 1, 2, 0, &seq); /* a wrong hash: the refusal names shard 0's */
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_ERROR, &m, 60), 0, "no refusal");
    const char *at = m.hdr->error->message ? strstr(m.hdr->error->message, "shard 0's ") : NULL;
    cr_assert(at && sscanf(at, "shard 0's %" SCNx64, &hash) == 1, "%s", m.hdr->error->message);
    ps_msg_deinit(&m);
    char wep[64]; /* where the worker finds this shard: it answers the worker's REGISTER */
    snprintf(wep, sizeof wep, "tcp://127.0.0.1:%d", free_port());
    void *ws = zmq_socket(ctx, ZMQ_ROUTER);
    zmq_setsockopt(ws, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_bind(ws, wep), 0);
    fake_hello_at(d, 1, 2, hash, 784 * 10 + 10, wep, &seq);
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 30), 0, "not joined");
    const uint64_t run = m.hdr->run_id;
    ps_msg_deinit(&m);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init(&l, (const int[]){784, 10}, 2), 0);
    ps_piece_t pc[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 1, 2, pc);
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_INIT_DONE, ++seq);
    h.run_id = run;
    h.rank = 1;
    Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
    f.count = ps_part_size(pc, l.n_tensors);
    h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
    h.shard_fetch = &f;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
    pid_t w = start_worker(&r, "shardrefuse", 0, NULL);
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_SHARD_WORKER, &m, 60), 0, "no SHARD_WORKER for the worker");
    const uint32_t rank = m.hdr->shard_worker->rank;
    ps_msg_deinit(&m);
    cr_assert_eq(recv_type(ws, true, PSD__MSG_TYPE__MSG_REGISTER, &m, 30), 0, "the worker did not register here");
    Psd__Header a = fake_hdr(PSD__MSG_TYPE__MSG_ASSIGN, 1);
    a.run_id = run;
    a.rank = rank;
    Psd__Assign as = PSD__ASSIGN__INIT;
    as.rank = rank;
    a.body_case = PSD__HEADER__BODY_ASSIGN;
    a.assign = &as;
    cr_assert_eq(ps_msg_send(ws, m.ident, m.ident_len, &a, NULL, 0), 0);
    ps_msg_deinit(&m);
    cr_assert_eq(recv_type(ws, true, PSD__MSG_TYPE__MSG_PULL, &m, 30), 0, "the worker did not pull here");
    ps_msg_deinit(&m);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_HAVE, ++seq);
    h.run_id = run;
    h.rank = 1;
    Psd__ShardHave hv = PSD__SHARD_HAVE__INIT;
    hv.rank = rank;
    hv.refused = "PUSH of rank 0 made up by the test";
    h.body_case = PSD__HEADER__BODY_SHARD_HAVE;
    h.shard_have = &hv;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
    cr_assert_eq(proc_wait(w, 30), 2, "the worker's run did not end with exit 2 (log %s)", r.psd_log);
    char *wl = rank0_log("shardrefuse", 1);
    cr_expect(wl && strstr(wl, "psd refused this worker: psd shard 1: PUSH of rank 0 made up by the test"), "%s",
              wl ? wl : "");
    free(wl);
    char *l0 = slurp(r.psd_log);
    cr_expect(strstr(l0, "refused: psd shard 1: PUSH of rank 0 made up by the test; its run ends (exit 2)"), "%s",
              l0);
    free(l0);
    kill(p, SIGTERM);
    proc_wait(p, 30);
    zmq_close(ws);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

/* ---- a shard's part of the initial values, each side against a fake ---- */

/* A table of two tensors, w [410, 160] and b [160] (6 blocks of 16384
 * floats), and (name not NULL) their initial values as model.init's file
 * dir/name: value j of the two one after the other is 0.001 j. */
static void fake_model(ps_layout_t *l, const char *name)
{
    ps_tensor_spec_t sp[2];
    memset(sp, 0, sizeof sp);
    snprintf(sp[0].name, sizeof sp[0].name, "w");
    sp[0].ndim = 2, sp[0].shape[0] = 410, sp[0].shape[1] = 160; /* over PS_PACK_SMALL floats: w and b are two units */
    snprintf(sp[1].name, sizeof sp[1].name, "b");
    sp[1].ndim = 1, sp[1].shape[0] = 160;
    char err[512], file[256];
    cr_assert_eq(ps_layout_init_specs(l, sp, 2, err, sizeof err), 0, "%s", err);
    if (!name) return;
    float *v = malloc((410 * 160 + 160) * sizeof *v);
    cr_assert(v);
    for (int j = 0; j < 410 * 160 + 160; j++) v[j] = 0.001f * (float)j;
    ps_st_out_t t[2] = {{"w", 2, sp[0].shape, v}, {"b", 1, sp[1].shape, v + 410 * 160}};
    path(file, sizeof file, name);
    cr_assert_eq(ps_st_save(file, t, 2, NULL, NULL, 0, err, sizeof err), 0, "%s", err);
    free(v);
}

/* A psd shard of a model.init run never opens the file (here there is
 * none): shard 0 (this test) first says it has no model yet, and the
 * shard says hello again; then it sends the table and has the shard fetch
 * its part (1000 floats a chunk: --x-fetch-floats). A chunk the shard did
 * not ask for is dropped; the chunk it asked for with a piece at another
 * offset fails the run (ERROR to shard 0, exit 1): nothing unchecked goes
 * into its part. */
Test(short, a_psd_shard_takes_only_the_chunk_of_initial_values_it_asked_for)
{
    ps_layout_t l;
    fake_model(&l, NULL);
    void *ctx = zmq_ctx_new(), *lead = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(lead, ZMQ_LINGER, &zero, sizeof zero);
    char lep[64], wep[64], log[256];
    snprintf(lep, sizeof lep, "tcp://127.0.0.1:%d", free_port());
    snprintf(wep, sizeof wep, "tcp://127.0.0.1:%d", free_port());
    cr_assert_eq(zmq_bind(lead, lep), 0);
    path(log, sizeof log, "fakeinit-shard.log");
    const char *argv[] = {psd_bin, "--listen", wep, "--shard", "1/2", "--leader", lep, "--set", "checkpoint.dir=",
                          "--set", "model.kind=tensors", "--set", "model.init=missing.safetensors", "--set",
                          "data.train_size=512", "--set", "data.test_size=64", "--x-fetch-floats", "1000", NULL};
    pid_t sh = proc_spawn(argv, log);
    ps_msg_t m;
    cr_assert_eq(recv_type(lead, true, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 60), 0, "no HELLO (%s)", log);
    cr_assert_eq(m.hdr->shard_hello->n_params, 0, "the model is shard 0's to say");
    uint8_t ident[PS_MAX_IDENTITY];
    size_t ilen = m.ident_len;
    memcpy(ident, m.ident, ilen);
    ps_msg_deinit(&m);
    uint64_t seq = 0;
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_HELLO, ++seq);
    Psd__ShardHello hb = PSD__SHARD_HELLO__INIT;
    hb.shard = 1, hb.shards = 2, hb.wait = true;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &hb;
    cr_assert_eq(ps_msg_send(lead, ident, ilen, &h, NULL, 0), 0);
    cr_assert_eq(recv_type(lead, true, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 5), 0, "no HELLO again after a wait");
    ps_msg_deinit(&m);
    wait_log(log, "shard 0 has no model yet", 10);
    hb.wait = false, hb.fetch_values = true;
    h.seq = ++seq;
    uint8_t *tb;
    size_t tlen;
    cr_assert_eq(ps_table_pack(&l, &tb, &tlen), 0);
    ps_frame_t table = {.data = tb, .nbytes = tlen, .dtype = PSD__DTYPE__DT_U8, .rows = tlen};
    cr_assert_eq(ps_msg_send(lead, ident, ilen, &h, &table, 1), 0);
    free(tb);
    cr_assert_eq(recv_type(lead, true, PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH, &m, 30), 0, "no INIT_FETCH (%s)", log);
    cr_assert(m.hdr->shard_fetch->from == 0 && m.hdr->shard_fetch->count == 1000, "the first 1000 floats");
    ps_msg_deinit(&m);
    ps_piece_t part[PS_MAX_TENSORS], r[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 1, 2, part);
    int nr = ps_part_range(part, l.n_tensors, 0, 1000, r);
    cr_assert_eq(nr, 1);
    float v[1000] = {0};
    ps_frame_t fr = {.data = v, .nbytes = sizeof v, .id = (uint32_t)r[0].t, .dtype = PSD__DTYPE__DT_F32,
                     .rows = l.t[r[0].t].rows, .cols = l.t[r[0].t].cols, .offset = r[0].off};
    Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_INIT_VALUES, ++seq);
    h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
    h.shard_fetch = &f;
    f.from = 1000, f.count = 1000; /* not asked for */
    cr_assert_eq(ps_msg_send(lead, ident, ilen, &h, &fr, 1), 0);
    wait_log(log, "which it did not ask for", 10);
    f.from = 0;
    fr.offset = r[0].off + 1; /* asked for, but not those floats of the tensor */
    h.seq = ++seq;
    cr_assert_eq(ps_msg_send(lead, ident, ilen, &h, &fr, 1), 0);
    cr_assert_eq(recv_type(lead, true, PSD__MSG_TYPE__MSG_ERROR, &m, 30), 0, "a chunk of other floats was taken");
    cr_expect(m.hdr->error->message && strstr(m.hdr->error->message, "not the chunk of this shard's part asked for"),
              "%s", m.hdr->error->message ? m.hdr->error->message : "");
    ps_msg_deinit(&m);
    cr_expect_eq(proc_wait(sh, 30), 1, "the shard exits 1");
    zmq_close(lead);
    zmq_ctx_term(ctx);
}

/* Shard 0 of a model.init run answers a shard's HELLO with the table and
 * has it fetch its part (this test is shard 1): a chunk asked for out of
 * order, a chunk larger than 16 MiB and an INIT_DONE of a part not sent
 * are dropped with a line saying so; the chunk asked for in order comes as
 * the pieces of shard 1's part it covers, with the file's values. */
Test(short, shard_0_sends_a_shard_its_initial_values_in_order_only)
{
    ps_layout_t l;
    fake_model(&l, "init.safetensors");
    run_t r;
    const char *args[] = {"--set", "model.kind=tensors", "--set", "model.init=init.safetensors", "--set",
                          "data.train_size=512", "--set", "data.test_size=64", "--set", "checkpoint.dir=", "--shard",
                          "0/2", "--worker-timeout", "2", "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "initorder", 1, args);
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, r.endpoint), 0);
    uint64_t seq = 0, hash = 0;
    ps_msg_t m;
    fake_hello_of(d, 1, 2, 0, 0, &seq); /* a wrong hash: the refusal names shard 0's */
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_ERROR, &m, 60), 0, "no refusal");
    const char *at = m.hdr->error->message ? strstr(m.hdr->error->message, "shard 0's ") : NULL;
    cr_assert(at && sscanf(at, "shard 0's %" SCNx64, &hash) == 1, "%s", m.hdr->error->message);
    ps_msg_deinit(&m);
    fake_hello_of(d, 1, 2, hash, 0, &seq);
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 30), 0, "not joined");
    ps_layout_t got;
    char err[400];
    cr_assert(m.hdr->shard_hello->fetch_values && m.n_frames == 1, "the table, and values to fetch");
    cr_assert_eq(ps_table_unpack(zmq_msg_data(&m.frames[0]), zmq_msg_size(&m.frames[0]), &got, err, sizeof err), 0,
                 "%s", err);
    cr_assert(ps_layout_same_table(&got, &l, err, sizeof err), "%s", err);
    const uint64_t run_id = m.hdr->run_id;
    ps_msg_deinit(&m);
    Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
    const struct { int type; uint64_t from, count; const char *log; } bad[] = {
        {PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH, 5, 10, "[5, +10) of its part: not where the chunk before ended"},
        {PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH, 0, (uint64_t)1 << 40, "of its part: none, or more than 16 MiB"},
        {PSD__MSG_TYPE__MSG_SHARD_INIT_DONE, 0, 100, "INIT_DONE of 100 floats"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        Psd__Header h = fake_hdr(bad[k].type, ++seq);
        h.run_id = run_id;
        h.rank = 1;
        f.from = bad[k].from, f.count = bad[k].count;
        h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
        h.shard_fetch = &f;
        cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
        wait_log(r.psd_log, bad[k].log, 10);
    }
    ps_piece_t part[PS_MAX_TENSORS], want[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 1, 2, part);
    const uint64_t count = part[0].n + 100; /* over the end of w's piece: two pieces */
    cr_assert(part[0].n > 0 && part[1].n >= 100);
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH, ++seq);
    h.run_id = run_id;
    h.rank = 1;
    f.from = 0, f.count = count;
    h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
    h.shard_fetch = &f;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_SHARD_INIT_VALUES, &m, 30), 0, "no chunk (%s)", r.psd_log);
    int nw = ps_part_range(part, l.n_tensors, 0, count, want);
    cr_assert(nw == 2 && m.n_frames == 2 && m.hdr->shard_fetch->from == 0 && m.hdr->shard_fetch->count == count);
    for (int k = 0; k < nw; k++) {
        size_t n = 0;
        const float *v = ps_msg_f32(&m, k, &n);
        cr_assert(v && n == want[k].n && m.hdr->tensors[k]->id == (uint32_t)want[k].t &&
                      m.hdr->tensors[k]->offset == want[k].off, "frame %d: piece %d of tensor %d", k, k, want[k].t);
        const size_t first = (want[k].t ? 410 * 160 : 0) + want[k].off; /* in the file's values */
        for (size_t j = 0; j < n; j++)
            cr_assert_eq(v[j], 0.001f * (float)(first + j), "tensor %d float %zu", want[k].t, want[k].off + j);
    }
    ps_msg_deinit(&m);
    zmq_close(d); /* the shard is gone: shard 0 ends the run (its part is gone) */
    cr_assert_eq(proc_wait(p, 30), 5, "(log %s)", r.psd_log);
    zmq_ctx_term(ctx);
}

/* --log-format json: every line psd and the workers write is one JSON
 * object with ts, role, level and msg (checked with Python's json module);
 * the rank-0 rule holds (rank 1 logs no INFO without --verbose). */
Test(short, json_logs_are_one_object_a_line)
{
    if (run_cmd("command -v python3 >/dev/null") != 0) cr_skip_test("no python3 to parse JSON with");
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--log-format", "json", NULL};
    const char *wargs[] = {"--log-format", "json", NULL};
    pid_t p = start_psd(&r, "json", 2, args);
    pid_t w0 = start_worker(&r, "json", 0, wargs);
    wait_log(r.psd_log, "rank 0", 60);
    pid_t w1 = start_worker(&r, "json", 1, wargs);
    cr_assert_eq(proc_wait(p, 300), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char script[] = "import json, sys\n"
                    "for f, want_info in zip(sys.argv[1:], (1, 1, 0)):\n"
                    "    n = info = 0\n"
                    "    for line in open(f, encoding='utf-8'):\n"
                    "        d = json.loads(line)\n"
                    "        assert set(d) == {'ts', 'role', 'level', 'msg'}, d\n"
                    "        assert d['level'] in ('error', 'warn', 'info', 'debug'), d\n"
                    "        n += 1; info += d['level'] == 'info'\n"
                    "    assert n > 0 and (info > 0) == bool(want_info), (f, n, info)\n";
    char py[512];
    path(py, sizeof py, "check.py");
    FILE *f = fopen(py, "w");
    cr_assert_not_null(f);
    fputs(script, f);
    fclose(f);
    cr_assert_eq(run_cmd("python3 '%s' '%s' '%s/json-w0.log' '%s/json-w1.log'", py, r.psd_log, dir, dir), 0,
                 "every log line is a JSON object (see the test's output)");
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "\"msg\":\"run finished: 1 epochs"), "%s", log);
    free(log);
}

/* Progress: on a terminal (a pseudo-terminal from script(1)) psd keeps a
 * live line (carriage return, erase to end of line) with the step, speed,
 * ETA, loss and slowest worker, and the log lines stay whole; without one it
 * writes plain progress lines every server.progress_every seconds and no
 * control character at all. */
Test(short, progress_on_a_terminal_and_off_it)
{
    if (run_cmd("command -v script >/dev/null") != 0) cr_skip_test("no script(1) for a pseudo-terminal");
    const char *wx[] = {"--no-shm", NULL}; /* slower: the epoch lasts a few timer ticks */
    /* on a terminal */
    run_t r;
    snprintf(r.endpoint, sizeof r.endpoint, "tcp://127.0.0.1:%d", free_port());
    char out[512];
    path(out, sizeof out, "tty.out");
    pid_t w0 = start_worker(&r, "tty", 0, wx), w1 = start_worker(&r, "tty", 1, wx);
    int rc = run_cmd("cd '%s' && TERM=xterm timeout 300 script -qfec \"'%s' --listen %s --workers 2 --epochs 1 "
                     "--set data.train_limit=20000 --set checkpoint.dir= --metrics '' --save ''\" /dev/null > '%s'",
                     dir, psd_bin, r.endpoint, out);
    cr_assert_eq(rc, 0, "psd under a pseudo-terminal");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char *t = slurp(out);
    cr_assert_not_null(t);
    cr_assert(strstr(t, "\r") && strstr(t, "\x1b[K"), "a live line on the terminal:\n%s", t);
    cr_assert(strstr(t, "\repoch 1/1 step ") && strstr(t, "samples/s ETA "), "%s", t);
    cr_assert(strstr(t, "psd INFO  epoch 1/1 step "), "the epoch's log line:\n%s", t);
    cr_assert(strstr(t, "\r\x1b[K20"), "a log line erases the live line first:\n%s", t);
    free(t);
    /* not a terminal */
    run_t q;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=20000", "--set", "server.progress_every=0.2",
                          NULL};
    train_wx(&q, "plain", 2, args, wx, 300);
    check_run(&q, 2, 1);
    char *log = slurp(q.psd_log);
    cr_assert_not_null(log);
    cr_assert(strstr(log, "psd INFO  epoch 1/1 step ") && strstr(log, " samples/s ETA "), "progress lines:\n%s", log);
    for (const char *c = log; *c; c++)
        cr_assert((unsigned char)*c >= 0x20 || *c == '\n', "control character %#x in a log file", *c);
    free(log);
}

/* A worker on shared memory reads its weights in psd's parameter slot.
 * Until it promises to read no more of them once it pushes
 * (psw_client_release_on_push), psd's step leaves that slot alone: the next
 * version goes into another slot and the old one keeps its values. Once it
 * has promised, each step updates the slot in place (the same slot, new
 * values, the CRC-32 psd sends for it checked by the client), and the
 * metrics count those steps; the last push of the epoch asks for nothing,
 * so it releases nothing. The weights are the same as a wire worker's. */
/* psd's arguments for the in-place tests (one epoch of 384 samples, model
 * 784-32-10, CRC-32 of every version), the model's layout, a gradient that
 * moves every weight, and room for a copy of the first tensor */
static const char *const inplace_args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set",
                                           "model.layers=[784,32,10]", "--set", "checkpoint.dir=",
                                           "--x-verify-weights", NULL};

static float *inplace_model(ps_layout_t *l, float **copy)
{
    float *grad = lib_model(l, 32);
    for (size_t i = 0; i < l->n_params; i++) grad[i] = 0.01f * (float)(i % 7) - 0.02f;
    *copy = malloc(l->t[0].numel * sizeof **copy);
    cr_assert(*copy);
    return grad;
}

Test(short, a_shared_slot_is_stepped_in_place_only_once_released)
{
    const char **args = (const char **)inplace_args;
    ps_layout_t l;
    float *copy;
    float *grad = inplace_model(&l, &copy);
    const size_t n0 = l.t[0].numel;
    char weights[2][sizeof ((run_t *)0)->weights];
    for (int mode = 0; mode < 2; mode++) { /* shared memory, then the wire */
        run_t r;
        pid_t p = start_psd(&r, mode ? "inplace-wire" : "inplace", 1, args);
        char err[512];
        psw_client_t *c = lib_worker_shm(r.endpoint, mode == 0, err, sizeof err);
        cr_assert_eq(psw_client_push_region(c) != NULL, mode == 0, "shared memory only without no_shm");
        psw_event_t ev;
        lib_next(c, &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, 384);
        psw_client_pull(c, ev.version);
        lib_next(c, &ev, PSW_EV_WEIGHTS);
        const float *prev = ev.tensors[0];
        for (int step = 0; step < 6; step++) {
            int last = step == 5;
            memcpy(copy, ev.tensors[0], n0 * sizeof *copy);
            if (step == 1) psw_client_release_on_push(c, 1);
            lib_push(c, ev.version, 64, !last, grad, &l);
            if (last) break;
            lib_next(c, &ev, PSW_EV_WEIGHTS);
            if (mode == 1) continue;
            cr_assert_neq(memcmp(ev.tensors[0], copy, n0 * sizeof *copy), 0, "step %d changed the weights", step);
            if (step == 0) {
                cr_assert_neq(ev.tensors[0], prev, "not released: the next version in another slot");
                cr_assert_eq(memcmp(prev, copy, n0 * sizeof *copy), 0, "not released: the slot read is untouched");
            } else {
                cr_assert_eq(ev.tensors[0], prev, "released (step %d): the same slot, updated in place", step);
            }
            prev = ev.tensors[0];
        }
        psw_client_barrier(c, 0, 384);
        lib_next(c, &ev, PSW_EV_VALIDATE);
        cr_assert_eq(psw_client_val_result(c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                .loss_sum = 0, .correct = 0, .count = ev.val_end - ev.val_begin, .scores = NULL}),
                     0);
        lib_next(c, &ev, PSW_EV_SHUTDOWN);
        r.psd_code = proc_wait(p, 30);
        psw_client_destroy(&c);
        cr_assert_eq(r.psd_code, 0);
        char *m = metrics_last(&r);
        if (mode == 0) /* the 4 between: the first released nothing, the last asked for nothing */
            cr_assert_eq(json_num(m, "psd_steps_in_place"), 4, "%s", m);
        free(m);
        snprintf(weights[mode], sizeof weights[mode], "%s", r.weights);
    }
    cr_assert(weights_equal(weights[0], weights[1]), "in place or not, shared memory or wire: the same weights");
    free(copy);
    free(grad);
}

/* Two workers on shared memory read the same slot: one that releases it
 * with its push does not make psd step it in place while the other still
 * holds it (another slot, the read one untouched); once both release, the
 * step is in place. */
Test(short, a_slot_another_worker_still_reads_is_not_stepped_in_place)
{
    const char **args = (const char **)inplace_args;
    ps_layout_t l;
    float *copy;
    float *grad = inplace_model(&l, &copy);
    const size_t n0 = l.t[0].numel;
    run_t r;
    pid_t p = start_psd(&r, "inplace2", 2, args);
    char err[512];
    psw_client_t *c[2];
    psw_event_t ev[2];
    for (int i = 0; i < 2; i++) {
        c[i] = lib_worker_shm(r.endpoint, 1, err, sizeof err);
        cr_assert_not_null(psw_client_push_region(c[i]), "worker %d on shared memory", i);
    }
    psw_client_release_on_push(c[0], 1); /* worker 1 does not promise, at first */
    for (int i = 0; i < 2; i++) {
        lib_next(c[i], &ev[i], PSW_EV_EPOCH);
        cr_assert_eq(ev[i].n_samples, 192);
        psw_client_pull(c[i], ev[i].version);
        lib_next(c[i], &ev[i], PSW_EV_WEIGHTS);
    }
    /* each client maps psd's slots at its own addresses: each is compared with itself */
    for (int step = 0; step < 3; step++) {
        int last = step == 2;
        const float *prev[2] = {ev[0].tensors[0], ev[1].tensors[0]};
        memcpy(copy, prev[1], n0 * sizeof *copy);
        if (step == 1) psw_client_release_on_push(c[1], 1);
        for (int i = 0; i < 2; i++) lib_push(c[i], ev[i].version, 64, !last, grad, &l);
        if (last) break;
        for (int i = 0; i < 2; i++) lib_next(c[i], &ev[i], PSW_EV_WEIGHTS);
        for (int i = 0; i < 2; i++) {
            cr_assert_neq(memcmp(ev[i].tensors[0], copy, n0 * sizeof *copy), 0, "step %d changed the weights", step);
            if (step == 0)
                cr_assert_neq(ev[i].tensors[0], prev[i], "worker 1 still held the slot: the next version in another");
            else
                cr_assert_eq(ev[i].tensors[0], prev[i], "both released: the same slot, updated in place");
        }
        if (step == 0) cr_assert_eq(memcmp(prev[1], copy, n0 * sizeof *copy), 0, "the slot worker 1 held is untouched");
    }
    for (int i = 0; i < 2; i++) psw_client_barrier(c[i], 0, 192);
    for (int i = 0; i < 2; i++) {
        lib_next(c[i], &ev[i], PSW_EV_VALIDATE);
        cr_assert_eq(psw_client_val_result(c[i], &(psw_val_t){.epoch = ev[i].epoch, .version = ev[i].version, .begin = ev[i].val_begin,
                .loss_sum = 0, .correct = 0, .count = ev[i].val_end - ev[i].val_begin, .scores = NULL}),
                     0);
    }
    for (int i = 0; i < 2; i++) lib_next(c[i], &ev[i], PSW_EV_SHUTDOWN);
    r.psd_code = proc_wait(p, 30);
    for (int i = 0; i < 2; i++) psw_client_destroy(&c[i]);
    cr_assert_eq(r.psd_code, 0);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(m, "psd_steps_in_place"), 1, "only the step both released: %s", m);
    free(m);
    free(copy);
    free(grad);
}

/* A library worker of the ctr run below that joins while its one test part
 * waits for a worker: registered, ready, given the part (VALIDATE in *ev). */
static psw_client_t *ctr_validator(const run_t *r, psw_event_t *ev)
{
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(r->endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(psw_client_ready(c, 256, 100, NULL), 0);
    lib_next(c, ev, PSW_EV_VALIDATE);
    cr_assert_eq(ev->val_end - ev->val_begin, 100);
    return c;
}

/* c's answer was refused: its run ends, exit 2, psd's reason naming why. */
static void ctr_refused(psw_client_t *c, const psw_val_t *v, const char *why)
{
    psw_event_t ev;
    psw_client_val_result(c, v);
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(ev.exit_code, 2);
    cr_assert(strstr(ev.message, "psd refused this worker: ") && strstr(ev.message, why), "%s", ev.message);
    psw_client_destroy(&c);
}

/* ctr validation results must carry the range's click probabilities (psd
 * reduces them to the AUC): without them, or with one that is no
 * probability, the worker's run ends with the reason, and the run goes on
 * with the next worker, given the part. A library worker that answers with
 * the planted probabilities gets psd's planted AUC back as val_auc: the
 * scores land where their examples are. */
Test(short, ctr_results_without_scores_end_the_workers_run)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "ctrbad", 1, args);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(r.endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(a.ctr.fields, 8);
    cr_assert_eq(a.n_files, 0);
    cr_assert_eq(psw_client_ready(c, 256, 100, NULL), 0);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    cr_assert_eq(l.n_tensors, 5);
    float *zero = calloc(l.n_params, sizeof *zero);
    cr_assert(zero);
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    cr_assert_eq(ev.n_samples, 256);
    psw_client_pull(c, ev.version);
    lib_next(c, &ev, PSW_EV_WEIGHTS);
    lib_push(c, ev.version, 256, 0, zero, &l);
    psw_client_barrier(c, 0, 256);
    lib_next(c, &ev, PSW_EV_VALIDATE);
    cr_assert_eq(ev.val_end - ev.val_begin, 100);
    ps_ctr_t g = {.fields = a.ctr.fields, .per_field = a.ctr.per_field, .vocab = a.ctr.vocab, .zipf = a.ctr.zipf,
                  .rows = a.ctr.rows, .weight_std = a.ctr.weight_std, .bias = a.ctr.bias, .seed = a.ctr.seed};
    float sc[100];
    uint32_t rows[PS_CTR_MAX_IDS];
    for (int i = 0; i < 100; i++) {
        uint8_t y;
        sc[i] = (float)ps_ctr_example(&g, a.ctr.train + (uint64_t)i, rows, NULL, &y);
    }
    psw_val_t v = {.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin, .loss_sum = 50, .correct = 60,
                   .count = 100, .scores = NULL};
    ctr_refused(c, &v, "without the range's 100 scores");
    float keep = sc[37];
    v.scores = sc;
    sc[37] = NAN;
    ctr_refused(ctr_validator(&r, &ev), &v, "without the range's 100 scores");
    sc[37] = 1.5f;
    ctr_refused(ctr_validator(&r, &ev), &v, "without the range's 100 scores");
    sc[37] = keep;
    c = ctr_validator(&r, &ev);
    psw_client_val_result(c, &v);
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(ev.exit_code, 0);
    r.psd_code = proc_wait(p, 30);
    psw_client_destroy(&c);
    free(zero);
    cr_assert_eq(r.psd_code, 0);
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "without the range's 100 scores"), 3, "%s", log);
    cr_assert_eq(count_in(log, "its run ends (exit 2)"), 3, "%s", log);
    free(log);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(m, "val_auc"), json_num(m, "optimum_auc"), "%s", m);
    cr_assert_eq(json_num(m, "val_loss"), 0.5, "%s", m);
    cr_assert_eq(json_num(m, "workers_refused"), 3, "%s", m);
    free(m);
}

/* The rows of the ctr task's table test examples [begin, end) read,
 * sorted, into out (room for (end - begin) x 8); their count. */
static size_t ctr_range_rows(const psw_assign_t *a, uint64_t begin, uint64_t end, uint32_t *out)
{
    ps_ctr_t gen = {.fields = a->ctr.fields, .per_field = a->ctr.per_field, .vocab = a->ctr.vocab,
                    .zipf = a->ctr.zipf, .rows = a->ctr.rows, .weight_std = a->ctr.weight_std, .bias = a->ctr.bias,
                    .seed = a->ctr.seed};
    const size_t per = (size_t)(a->ctr.fields * a->ctr.per_field);
    for (uint64_t i = begin; i < end; i++) {
        uint8_t y;
        ps_ctr_example(&gen, a->ctr.train + i, out + (i - begin) * per, NULL, &y);
    }
    return ps_sort_unique_u32(out, (size_t)(end - begin) * per);
}

/* The table on psd, as a library worker sees it: a plain pull brings no
 * row of the table, a pull listing rows brings exactly those (psd's
 * values, asked again: again), a push of rows steps them, and the
 * validation part brings the rows of its range's examples, the pushed
 * rows stepped and the others as they were. */
Test(short, a_worker_gets_the_table_rows_it_asks_for)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    pid_t p = start_psd(&r, "askrows", 1, args);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1};
    psw_client_t *c = psw_client_new(r.endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert(a.ctr.table_on_psd, "psd keeps the table");
    cr_assert(!a.shm, "and sends rows over the wire");
    cr_assert_eq(psw_client_ready(c, 256, 100, NULL), 0);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    float *w0 = calloc(l.n_params, sizeof *w0);
    cr_assert(w0);
    ps_model_init_params(&l, w0, 7); /* run.seed 7 in ctr.yaml */
    const float *E0 = w0 + l.t[4].offset;
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    psw_client_pull(c, ev.version);
    lib_next(c, &ev, PSW_EV_WEIGHTS);
    cr_assert(ev.n_row_ids == 0 && ev.tensor_numel[4] == 0, "no row asked for, none sent (never the table)");
    cr_assert(memcmp(ev.tensors[0], w0, l.t[0].numel * sizeof *w0) == 0, "the MLP whole");
    const uint32_t asks[2][3] = {{1, 5, 900}, {2, 3, 65535}};
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(psw_client_pull_rows(c, ev.version, asks[k], 3), 0);
        lib_next(c, &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.n_row_ids, 3);
        cr_assert(memcmp(ev.row_ids, asks[k], sizeof asks[k]) == 0, "the rows asked for");
        cr_assert_eq(ev.tensor_numel[4], 3 * 8);
        for (int j = 0; j < 3; j++)
            cr_assert(memcmp(ev.tensors[4] + j * 8, E0 + asks[k][j] * 8, 8 * sizeof(float)) == 0, "row %u's values",
                      asks[k][j]);
    }
    const uint32_t bad[2] = {5, 1};
    cr_assert_eq(psw_client_pull_rows(c, ev.version, bad, 2), -EINVAL, "refused before it leaves");
    /* push rows 1 and 5, then validate */
    float *zero = calloc(l.n_params, sizeof *zero), vals[16];
    cr_assert(zero);
    lib_grads_t ga;
    lib_grads(&ga, &l, zero);
    for (int i = 0; i < 16; i++) vals[i] = 0.25f;
    const uint32_t pushed[2] = {1, 5};
    ga.gr[4] = (psw_grad_t){.tensor = 4, .row_ids = pushed, .n_rows = 2, .row_vals = vals}; /* the table as rows */
    psw_push_t pp = {.version = ev.version, .batch = 256, .loss_sum = 100, .n_grads = 5, .grads = ga.gr};
    cr_assert_eq(psw_client_push_v(c, &pp), 0);
    psw_client_barrier(c, 0, 256);
    lib_next(c, &ev, PSW_EV_VALIDATE);
    uint32_t want[800];
    size_t nw = ctr_range_rows(&a, 0, 100, want);
    cr_assert_eq(ev.n_row_ids, nw, "the rows the range's examples read");
    cr_assert(memcmp(ev.row_ids, want, nw * sizeof *want) == 0, "those rows, increasing");
    for (size_t j = 0; j < ev.n_row_ids; j++) {
        uint32_t id = ev.row_ids[j];
        bool stepped = memcmp(ev.tensors[4] + j * 8, E0 + (size_t)id * 8, 8 * sizeof(float)) != 0;
        cr_assert_eq(stepped, id == 1 || id == 5, "row %u %s", id, stepped ? "changed" : "did not change");
    }
    float sc[100];
    for (int i = 0; i < 100; i++) sc[i] = 0.5f;
    psw_client_val_result(c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
            .loss_sum = 50, .correct = 60, .count = 100, .scores = sc});
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(proc_wait(p, 30), 0);
    psw_client_destroy(&c);
    free(zero);
    free(w0);
}

/* The table on psd with 2 psd shards, as a library worker sees it, given
 * two validation parts at once (the second one is a worker's that left
 * while it validated): each part's event brings the rows its range's
 * examples read, all of them, put together from both shards (psd's
 * values: the pushes were zero), the second after the first; the run ends
 * with both results in. */
Test(short, two_validation_parts_at_once_with_the_table_on_psd_shards)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *base[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=512", "--set", "ctr.test=200",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    const char *a0[16] = {NULL};
    int n0 = 0;
    while (base[n0]) a0[n0] = base[n0], n0++;
    a0[n0++] = "--shard", a0[n0] = "0/2"; /* shard 0, and shard 1 */
    pid_t p = start_psd(&r, "twoparts", 2, a0), p1 = start_shard(&r, "twoparts", 1, 2, base);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c[2];
    psw_assign_t a;
    for (int i = 0; i < 2; i++) {
        c[i] = psw_client_new(r.endpoint, &info, err, sizeof err);
        cr_assert(c[i] && psw_client_register(c[i], &a, 60, err, sizeof err) == 0, "%s", err);
        cr_assert(a.ctr.table_on_psd, "psd keeps the table");
        cr_assert_eq(psw_client_ready(c[i], 512, 200, NULL), 0);
    }
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    float *w0 = calloc(l.n_params, sizeof *w0), *zero = calloc(l.n_params, sizeof *zero);
    cr_assert(w0 && zero);
    ps_model_init_params(&l, w0, 7); /* run.seed 7 in ctr.yaml */
    const float *E0 = w0 + l.t[4].offset;
    psw_event_t ev;
    lib_grads_t ga;
    lib_grads(&ga, &l, zero);
    const uint32_t one_row[1] = {1};
    const float vals[8] = {0};
    for (int i = 0; i < 2; i++) { /* one batch each, a zero gradient */
        lib_next(c[i], &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, 256);
        psw_client_pull(c[i], ev.version);
        lib_next(c[i], &ev, PSW_EV_WEIGHTS);
        ga.gr[4] = (psw_grad_t){.tensor = 4, .row_ids = one_row, .n_rows = 1, .row_vals = vals}; /* the table as rows */
        psw_push_t pp = {.version = ev.version, .batch = 256, .loss_sum = 100, .n_grads = 5, .grads = ga.gr};
        cr_assert_eq(psw_client_push_v(c[i], &pp), 0);
        psw_client_barrier(c[i], 0, 256);
    }
    psw_event_t gone;
    lib_next(c[1], &gone, PSW_EV_VALIDATE); /* validation began; worker 1 leaves with its part */
    cr_assert_eq(psw_client_leave(c[1], "test: leaves while validating"), 0);
    psw_client_destroy(&c[1]);
    wait_log(r.psd_log, "left the run", 30);
    zmq_poll(NULL, 0, 300); /* the second part is on its way to worker 0 */
    uint32_t *want = malloc(200 * 8 * sizeof *want);
    cr_assert(want);
    uint64_t covered = 0;
    float sc[200];
    for (int i = 0; i < 200; i++) sc[i] = 0.5f;
    for (int k = 0; k < 2; k++) {
        lib_next(c[0], &ev, PSW_EV_VALIDATE);
        if (k == 1) cr_assert_eq(ev.val_begin, gone.val_begin, "the part of the worker that left, second");
        size_t nw = ctr_range_rows(&a, ev.val_begin, ev.val_end, want);
        cr_assert_eq(ev.n_row_ids, nw, "part %d [%" PRIu64 ", %" PRIu64 "): the rows its examples read", k,
                     ev.val_begin, ev.val_end);
        cr_assert(memcmp(ev.row_ids, want, nw * sizeof *want) == 0, "part %d: those rows", k);
        cr_assert_eq(ev.tensor_numel[4], nw * 8);
        for (size_t j = 0; j < nw; j++)
            cr_assert(memcmp(ev.tensors[4] + j * 8, E0 + (size_t)want[j] * 8, 8 * sizeof(float)) == 0,
                      "part %d, row %u: psd's values (from shard %d)", k, want[j], want[j] < 32768 ? 0 : 1);
        covered += ev.val_end - ev.val_begin;
        psw_client_val_result(c[0], &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                .loss_sum = 50, .correct = 60, .count = ev.val_end - ev.val_begin, .scores = sc});
    }
    cr_assert_eq(covered, 200, "both parts");
    lib_next(c[0], &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(proc_wait(p, 30), 0);
    cr_assert_eq(proc_wait(p1, 30), 0);
    psw_client_destroy(&c[0]);
    free(want);
    free(zero);
    free(w0);
}

/* psd gives a worker at most two validation parts at once (its own and one
 * more): the parts of three workers that left during validation wait on
 * psd and come one at a time as the worker answers, instead of piling up on
 * it (a worker's queue of parts is bounded). Every test example is still
 * validated exactly once. Four library workers; three leave. */
Test(short, validation_parts_of_workers_that_left_come_one_at_a_time)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "vparts", 4, args);
    ps_layout_t l;
    float *zero = lib_model(&l, 16);
    psw_client_t *w[4];
    lib_start(r.endpoint, w, 4, 96);
    psw_event_t ev, held[8];
    for (int i = 0; i < 4; i++) { /* two batches each (64 and 32), then the barrier */
        lib_next(w[i], &ev, PSW_EV_WEIGHTS);
        lib_push(w[i], ev.version, 64, 1, zero, &l);
    }
    for (int i = 0; i < 4; i++) {
        lib_next(w[i], &ev, PSW_EV_WEIGHTS);
        lib_push(w[i], ev.version, 32, 0, zero, &l);
        psw_client_barrier(w[i], 0, 96);
    }
    int n = 0;
    lib_next(w[0], &held[n++], PSW_EV_VALIDATE);
    for (int i = 1; i < 4; i++) {
        lib_next(w[i], &ev, PSW_EV_VALIDATE); /* validation began: they leave with their parts */
        cr_assert_eq(psw_client_leave(w[i], "test: leaves while validating"), 0);
        psw_client_destroy(&w[i]);
    }
    for (int t = 0; t < 600; t++) {
        char *log = slurp(r.psd_log);
        int left = log ? count_in(log, "left the run") : 0;
        free(log);
        if (left == 3) break;
        zmq_poll(NULL, 0, 50);
    }
    char err[512];
    uint64_t covered = 0;
    int most = 0, answered = 0;
    for (;;) {
        /* take what psd sends without answering for a while: what it holds at once */
        while (psw_client_next(w[0], &ev, 0.5, err, sizeof err) == 0) {
            if (ev.kind == PSW_EV_SHUTDOWN) goto done;
            cr_assert_eq(ev.kind, PSW_EV_VALIDATE, "event %d", (int)ev.kind);
            cr_assert_lt(n, 8);
            held[n++] = ev;
        }
        if (n > most) most = n;
        cr_assert_gt(n, 0, "psd sent nothing more and did not end the run: %s", err);
        ev = held[0]; /* answer the oldest */
        memmove(held, held + 1, (size_t)(n - 1) * sizeof *held);
        n--;
        covered += ev.val_end - ev.val_begin;
        answered++;
        psw_client_val_result(w[0], &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                .loss_sum = 0.5 * (double)(ev.val_end - ev.val_begin), .correct = 0,
                .count = ev.val_end - ev.val_begin, .scores = NULL});
    }
done:
    cr_assert_eq(n, 0);
    cr_assert_eq(answered, 4, "its part and the three of the workers that left");
    cr_assert_eq(most, 2, "two parts held at once, never more (held %d)", most);
    cr_assert_eq(covered, 10000, "every test example once");
    psw_client_destroy(&w[0]);
    free(zero);
    cr_assert_eq(proc_wait(p, 30), 0);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
    free(m);
}

/* This process's TCP connections to 127.0.0.1 at one of the ports (its fds
 * whose peer is there). */
static int conns_to(const int ports[2])
{
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    for (struct dirent *e; (e = readdir(d));) {
        struct sockaddr_in a;
        socklen_t len = sizeof a;
        int fd = atoi(e->d_name);
        if (e->d_name[0] == '.' || fd == dirfd(d) || getpeername(fd, (struct sockaddr *)&a, &len) != 0 ||
            a.sin_family != AF_INET || a.sin_addr.s_addr != htonl(INADDR_LOOPBACK))
            continue;
        n += ntohs(a.sin_port) == ports[0] || ntohs(a.sin_port) == ports[1];
    }
    closedir(d);
    return n;
}

/* A worker's child forked without exec (a torch DataLoader's reader
 * processes) does not hold the worker's connections to psd and to psd's
 * shard: the library closes them in the child, so that psd notices at once
 * when the worker dies (issue 56). The worker keeps its own: it goes on
 * with both. */
Test(short, a_forked_child_of_a_worker_holds_none_of_its_connections)
{
    run_t r;
    char ep1[64];
    const char *base[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--set", "checkpoint.dir=", NULL};
    const char *a0[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                        "--set", "checkpoint.dir=", "--shard", "0/2", NULL};
    start_psd(&r, "fork", 1, a0);
    start_shard_at(&r, "fork", 1, 2, base, ep1);
    const int ports[2] = {atoi(strrchr(r.endpoint, ':') + 1), atoi(strrchr(ep1, ':') + 1)};
    char err[512];
    psw_client_t *c = lib_worker(r.endpoint, err, sizeof err);
    cr_assert_eq(conns_to(ports), 2, "the worker's connections to psd and to its shard");
    pid_t ch = fork();
    cr_assert_geq(ch, 0);
    if (ch == 0) _exit(conns_to(ports) & 0x7f);
    int st;
    cr_assert_eq(waitpid(ch, &st, 0), ch);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child holds %d of them", WEXITSTATUS(st));
    cr_assert_eq(conns_to(ports), 2, "the worker's own stay");
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    cr_assert_eq(psw_client_pull(c, ev.version), 0);
    lib_next(c, &ev, PSW_EV_WEIGHTS); /* both parts: over both connections */
    psw_client_destroy(&c);
}
