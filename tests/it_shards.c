/* it_shards.c - integration tests: a fake shard 0 (and hand-made workers) against a real psd
 * shard (see itest.h); the rest of what was here is in it_paths.c. */
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
