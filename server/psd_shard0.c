/* psd_shard0.c - shard 0's side of the psd shard protocol: shards join
 * (SHARD_HELLO), resume their parts, send their blocks' norms for
 * clipping, confirm checkpoints, and give their parts for the weights file
 * at the end of a run. psd_shard.c is the other side. */
#include "psd_core.h"

int find_shard(const srv_t *s, const uint8_t *ident, size_t len)
{
    for (int i = 1; i < s->n_shards; i++)
        if (s->shards[i].ident_len == len && memcmp(s->shards[i].ident, ident, len) == 0) return i;
    return -1;
}

static void refuse_shard(srv_t *s, ps_msg_t *m, const char *why)
{
    PS_ERROR("refused a psd shard: %s", why);
    send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED, why);
}

static void on_shard_hello(srv_t *s, ps_msg_t *m, bool again)
{
    Psd__ShardHello *h = m->hdr->shard_hello;
    char why[320];
    if (!sharded(s)) {
        refuse_shard(s, m, "this psd was not started as shard 0 of several (--shard 0/N)");
        return;
    }
    if (s->zap && !psd_zap_is_self(s->zap, m->user)) { /* with keys: only psd's own key is a shard */
        refuse_shard(s, m, "a psd shard must connect with psd's own key (--key), not a worker's");
        return;
    }
    int i = (int)h->shard;
    if (h->shards != (uint32_t)s->n_shards || i < 1 || i >= s->n_shards) {
        snprintf(why, sizeof why, "it is shard %u/%u, this run has %d shards", h->shard, h->shards, s->n_shards);
        refuse_shard(s, m, why);
        return;
    }
    if (h->config_hash != s->config_hash || h->n_params != s->layout.n_params) {
        snprintf(why, sizeof why, "shard %d was started with another config (hash %016" PRIx64 ", shard 0's %016" PRIx64
                 "): give every shard the same config", i, h->config_hash, s->config_hash);
        refuse_shard(s, m, why);
        return;
    }
    bool resumed = s->opts.resume_dir != NULL;
    if ((bool)h->resume != resumed) {
        snprintf(why, sizeof why, resumed ? "shard 0 resumed run %016" PRIx64 " at step %" PRIu64
                                            ": start shard %d with --resume DIR too"
                                          : "shard 0 starts run %016" PRIx64 " (step %" PRIu64 "), but shard %d was "
                                            "started with --resume: resume shard 0 too, or start the shard without it",
                 s->run_id, s->store.steps, i);
        refuse_shard(s, m, why);
        return;
    }
    shard_t *sh = &s->shards[i];
    if (sh->joined) {
        snprintf(why, sizeof why, "shard %d has already joined (from %s pid %u)", i, sh->hostname, sh->pid);
        refuse_shard(s, m, why);
        return;
    }
    if (!h->endpoint || !h->endpoint[0] || strlen(h->endpoint) >= sizeof sh->endpoint) {
        refuse_shard(s, m, "no endpoint for the workers");
        return;
    }
    memcpy(sh->ident, m->ident, m->ident_len);
    sh->ident_len = m->ident_len;
    snprintf(sh->endpoint, sizeof sh->endpoint, "%s", h->endpoint);
    snprintf(sh->hostname, sizeof sh->hostname, "%s", h->hostname ? h->hostname : "?");
    sh->pid = h->pid;
    sh->last_seen = ps_now();
    sh->joined = true;
    sh->conn = 0; /* a new connection maybe under an fd number the last one had */
    note_conn(s, &sh->conn, m);
    Psd__Header r;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&r);
    r.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
    rb.shard = (uint32_t)i;
    rb.shards = (uint32_t)s->n_shards;
    rb.config_hash = s->config_hash;
    rb.n_params = s->layout.n_params;
    rb.resume = resumed;
    rb.resume_step = s->store.steps;
    rb.resume_version = s->store.cur->version;
    if (resumed) { /* it resumes at the newest of shard 0's steps it has */
        rb.resume_steps = s->resume_steps;
        rb.n_resume_steps = s->n_resume_steps;
        sh->resumed = false;
    }
    r.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    r.shard_hello = &rb;
    send_shard(s, i, &r, NULL, 0);
    if (again)
        PS_DEBUG("psd shard %d/%d said hello again (pid %u): answered again", i, s->n_shards, sh->pid);
    else
        PS_INFO("psd shard %d/%d joined from %s pid %u; workers reach it at %s", i, s->n_shards, sh->hostname,
                sh->pid, sh->endpoint);
    shards_go(s);
}

/* Every shard is there (and resumed): the workers that waited get their
 * ASSIGN. */
void shards_go(srv_t *s)
{
    if (!shards_ready(s)) return;
    for (int j = 0; j < s->n; j++) { /* the workers that waited for it */
        worker_t *w = &s->w[j];
        if (w->state == W_GONE) continue;
        shards_worker(s, w);
        if (w->assign_wait) {
            w->assign_wait = false;
            w->last_seen = ps_now();
            send_assign(s, w);
        }
    }
}

/* Ask shard j to resume again, at the newest of shard 0's steps up to the
 * one it is at now. */
static void send_resume(srv_t *s, int j)
{
    Psd__Header h;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_RESUME;
    rb.shard = (uint32_t)j;
    rb.shards = (uint32_t)s->n_shards;
    rb.resume = true;
    rb.resume_step = s->store.steps;
    rb.resume_version = s->store.cur->version;
    rb.resume_steps = s->resume_steps;
    rb.n_resume_steps = s->n_resume_steps;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &rb;
    s->shards[j].resumed = false;
    send_shard(s, j, &h, NULL, 0);
}

/* Shard i resumed its part at a step (the newest of shard 0's it has), or
 * cannot. All go back to the oldest step any shard resumed at. */
static void on_shard_resumed(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardCkpt *ck = m->hdr->shard_ckpt;
    shard_t *sh = &s->shards[i];
    if (!s->opts.resume_dir || sh->resumed || shards_ready(s) || s->phase != PHASE_WAIT) {
        drop_shard(s, i, "RESUMED, which psd does not wait for");
        return;
    }
    if (ck->error && ck->error[0]) {
        PS_ERROR("psd shard %d (%s pid %u) cannot resume: %s", i, sh->hostname, sh->pid, ck->error);
        finish(s, PSD_EXIT_USAGE, "a psd shard cannot resume");
        return;
    }
    if (ck->step > s->store.steps) { /* it chose from a list shard 0 has gone back from since */
        PS_DEBUG("psd shard %d resumed at step %" PRIu64 "; shard 0 has gone back to %" PRIu64 ": again", i, ck->step,
                 s->store.steps);
        send_resume(s, i);
        return;
    }
    sh->resumed = true;
    sh->resumed_step = ck->step;
    sh->resumed_version = ck->version;
    if (ck->step < s->store.steps) { /* it has none as new: shard 0 and the others go back */
        PS_WARN("psd shard %d has no checkpoint of step %" PRIu64 " (its newest usable one is of step %" PRIu64
                "): every shard goes back to a step all of them have", i, s->store.steps, ck->step);
        if (resume_at(s, ck->step) != 0) {
            finish(s, PSD_EXIT_USAGE, "the psd shards have no checkpoint of one step");
            return;
        }
        for (int j = 1; j < s->n_shards; j++) {
            shard_t *o = &s->shards[j];
            if (o->joined && o->resumed && o->resumed_step != s->store.steps) send_resume(s, j);
        }
    }
    if (!shards_resumed(s)) return;
    for (int j = 1; j < s->n_shards; j++)
        if (s->shards[j].resumed_version != s->store.cur->version) {
            PS_ERROR("psd shard %d resumed step %" PRIu64 " at version %" PRIu64 ", shard 0 at %" PRIu64
                     ": their checkpoints are not of one run", j, s->store.steps, s->shards[j].resumed_version,
                     s->store.cur->version);
            finish(s, PSD_EXIT_USAGE, "the psd shards' checkpoints are not of one run");
            return;
        }
    PS_INFO("all %d psd shards resumed at step %" PRIu64, s->n_shards, s->store.steps);
    s->resume_agreed = true;
    s->ck_safe = s->store.steps; /* every shard has it */
    if (s->epoch >= (uint32_t)s->cfg.epochs) { /* the end of the run: only the weights file is left to write */
        PS_INFO("the shards' checkpoints are at the end of the run (%d epochs): nothing to train", s->cfg.epochs);
        s->epoch--; /* the last epoch trained, as the end of the run writes it */
        s->t_start = ps_now();
        run_end(s);
        return;
    }
    shards_go(s);
}

static void on_shard_norm(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardNorm *n = m->hdr->shard_norm;
    if (!s->stepping || n->version != s->store.cur->version || s->shards[i].norm_in) {
        drop_shard(s, i, "NORM for version %" PRIu64 " (current %" PRIu64 ")", n->version,
             s->store.cur->version);
        return;
    }
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, i, s->n_shards, p);
    size_t want = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) want += (p[t].n + PSD_NORM_BLOCK - 1) / PSD_NORM_BLOCK;
    if (n->n_block_sq != want) {
        drop_shard(s, i, "NORM with %zu blocks, it has %zu", n->n_block_sq, want);
        return;
    }
    for (size_t j = 0; j < want; j++)
        if (n->block_sq[j] < 0) { /* sums of squares (NaN or inf: a diverging gradient, as with one psd) */
            drop_shard(s, i, "NORM with a negative sum of squares");
            return;
        }
    size_t j = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) {
        size_t b = ps_layout_first_block(&s->layout, t) + p[t].off / PSD_NORM_BLOCK;
        for (size_t o = 0; o < p[t].n; o += PSD_NORM_BLOCK) s->store.blk_sq[b++] = n->block_sq[j++];
    }
    s->shards[i].norm_in = true;
    for (int k = 1; k < s->n_shards; k++)
        if (!s->shards[k].norm_in) return;
    /* every block's norm is in: the same sum, in the same order, as one psd */
    double sumsq = psd_store_sumsq(&s->store);
    Psd__Header h;
    Psd__ShardApply ap = PSD__SHARD_APPLY__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_APPLY;
    ap.version = s->store.cur->version;
    ap.sumsq = sumsq;
    h.body_case = PSD__HEADER__BODY_SHARD_APPLY;
    h.shard_apply = &ap;
    shards_send_all(s, &h);
    s->stepping = false;
    if (psd_store_apply(&s->store, sumsq, s->cfg.clip_norm, s->lr) != 0) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    step_done(s, true);
    deferred_checkpoint(s);
    maybe_step(s);
}

/* The sharded weights file cannot be finished: why, and no file. */
static void save_failed(srv_t *s, const char *why)
{
    PS_ERROR("%s", why);
    s->exit_code = PSD_EXIT_ERROR;
    ps_weights_abort(s->wr);
    s->wr = NULL;
}

/* The end of a sharded run with --save: the weights file is begun with this
 * shard's part; false (the error logged, the exit code set) when it cannot
 * be. */
bool begin_save(srv_t *s)
{
    char err[512];
    ps_weights_meta_t meta = {.run_id = s->run_id, .step = s->step, .epoch = s->epoch};
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, 0, s->n_shards, p);
    s->wr = ps_weights_begin(s->cfg.save, &s->layout, &meta, err, sizeof err);
    bool ok = s->wr != NULL;
    for (int t = 0; ok && t < s->layout.n_tensors; t++)
        ok = ps_weights_put(s->wr, t, p[t].off, s->store.cur->w + s->layout.t[t].offset + p[t].off, p[t].n, err,
                            sizeof err) == 0;
    if (!ok) {
        save_failed(s, err);
        return false;
    }
    s->fetch_k = 0; /* fetch_next goes on to shard 1 */
    s->fetch_size = s->fetch_from = s->fetch_chunks = 0;
    return true;
}

/* Ask for the next chunk of the shards' parts, or, all in, write the file's
 * end and end the run. */
void fetch_next(srv_t *s)
{
    while (s->fetch_from >= s->fetch_size && ++s->fetch_k < s->n_shards) { /* the next shard's part */
        ps_shard_pieces(&s->layout, s->fetch_k, s->n_shards, s->fetch_part);
        s->fetch_size = ps_part_size(s->fetch_part, s->layout.n_tensors);
        s->fetch_from = 0;
    }
    if (s->fetch_k < s->n_shards) {
        Psd__Header h;
        Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_FETCH;
        f.version = s->store.cur->version;
        f.from = s->fetch_from;
        const uint64_t chunk = s->opts.fetch_floats ? s->opts.fetch_floats : PSD_FETCH_FLOATS;
        f.count = s->fetch_count = s->fetch_size - s->fetch_from < chunk ? s->fetch_size - s->fetch_from : chunk;
        h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
        h.shard_fetch = &f;
        s->fetching_since = ps_now();
        s->fetch_chunks++;
        send_shard(s, s->fetch_k, &h, NULL, 0);
        return;
    }
    char err[512];
    int rc = ps_weights_commit(s->wr, err, sizeof err); /* frees it either way */
    s->wr = NULL;
    if (rc != 0)
        save_failed(s, err);
    else
        PS_INFO("saved weights (version %" PRIu64 ") to %s; the other shards' parts came in %" PRIu64 " chunks",
                s->store.cur->version, s->cfg.save, s->fetch_chunks);
    end_run(s);
}

/* A chunk of a shard's part of the final version (SHARD_FETCH): into the
 * weights file. */
static void on_shard_weights(srv_t *s, int i, ps_msg_t *m)
{
    if (!s->wr || i != s->fetch_k || m->hdr->weights->version != s->store.cur->version) {
        drop_shard(s, i, "WEIGHTS that psd did not ask for");
        return;
    }
    ps_piece_t r[PS_MAX_TENSORS];
    int nr = ps_part_range(s->fetch_part, s->layout.n_tensors, s->fetch_from, s->fetch_count, r);
    bool ok = nr == m->n_frames;
    for (int f = 0; ok && f < nr; f++) {
        size_t n = 0;
        const float *src = ps_msg_f32(m, f, &n);
        ok = src && m->hdr->tensors[f]->id == (uint32_t)r[f].t && m->hdr->tensors[f]->offset == r[f].off &&
             n == r[f].n;
        char err[512];
        if (ok && ps_weights_put(s->wr, r[f].t, r[f].off, src, n, err, sizeof err) != 0) {
            save_failed(s, err);
            end_run(s);
            return;
        }
    }
    if (!ok) { /* it answers a FETCH once: without its part there are no final weights */
        PS_ERROR("psd shard %d sent final weights that do not match its part of the parameters; the run stops", i);
        finish(s, PSD_EXIT_SHARD_LOST, "a psd shard sent a broken part of the weights");
        return;
    }
    s->fetch_from += s->fetch_count;
    fetch_next(s);
}

static void on_shard_have(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardHave *hv = m->hdr->shard_have;
    worker_t *w = hv->rank < (uint32_t)s->n ? &s->w[hv->rank] : NULL;
    if (!w || (w->state != W_TRAIN && w->state != W_BARRIER) || s->stepping || hv->version != s->store.cur->version) {
        /* a worker lost meanwhile, or declared gone: nothing to wait for */
        PS_DEBUG("shard %d has rank %u's push for version %" PRIu64 "; not needed", i, hv->rank, hv->version);
        return;
    }
    w->shard_have |= 1u << i;
    if (push_check(s, w)) maybe_step(s);
}

void on_shard(srv_t *s, int i, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO) {
        bool again = false, was = i > 0 && s->shards[i].joined;
        if (i > 0) { /* its HELLO again: the answer was lost? answer again */
            const Psd__ShardHello *hh = m->hdr->shard_hello;
            again = was && s->shards[i].pid == hh->pid && hh->shard == (uint32_t)i;
            if (was && !again) {
                drop_shard(s, i, "HELLO on its connection as shard %u pid %u", hh->shard, hh->pid);
                return;
            }
            s->shards[i].joined = false;
        }
        on_shard_hello(s, m, again);
        if (was && !s->shards[i].joined) { /* refused now: it is no longer watched */
            PS_ERROR("psd shard %d said hello again and was refused; its part of the parameters is gone, so the "
                     "run stops", i);
            finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was refused");
        }
        return;
    }
    if (i < 0) return;
    shard_t *sh = &s->shards[i];
    if (h->run_id != s->run_id || h->rank != (uint32_t)i) {
        drop_shard(s, i, "run %016" PRIx64 " rank %u", h->run_id, h->rank);
        return;
    }
    sh->last_seen = ps_now();
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_HEARTBEAT: break;
    case PSD__MSG_TYPE__MSG_SHARD_HAVE: on_shard_have(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_NORM: on_shard_norm(s, i, m); break;
    case PSD__MSG_TYPE__MSG_WEIGHTS: on_shard_weights(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE: on_shard_ckpt_done(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_RESUMED: on_shard_resumed(s, i, m); break;
    case PSD__MSG_TYPE__MSG_ERROR:
        PS_ERROR("psd shard %d (%s pid %u) failed: %s", i, sh->hostname, sh->pid,
                 h->error->message ? h->error->message : "(no message)");
        sh->joined = false;
        finish(s, PSD_EXIT_SHARD_LOST, "a psd shard failed");
        break;
    default: drop_shard(s, i, "%s is not a message shards send", ps_msg_type_name((int)h->type));
    }
}

/* After a resume: every shard resumed its part at shard 0's step. */
bool shards_resumed(const srv_t *s)
{
    for (int i = 1; i < s->n_shards; i++)
        if (!s->shards[i].joined || !s->shards[i].resumed || s->shards[i].resumed_step != s->store.steps)
            return false;
    return true;
}

int send_shard(srv_t *s, int i, Psd__Header *h, const ps_frame_t *fr, int n)
{
    shard_t *sh = &s->shards[i];
    h->run_id = s->run_id;
    h->rank = (uint32_t)i;
    h->seq = ++sh->seq_out;
    int rc = ps_msg_send(s->sock, sh->ident, sh->ident_len, h, fr, n);
    if (rc < 0)
        PS_WARN("cannot send %s to shard %d (%s pid %u): %s", ps_msg_type_name((int)h->type), i, sh->hostname,
                sh->pid, zmq_strerror(-rc));
    return rc;
}

void shards_send_all(srv_t *s, Psd__Header *h)
{
    for (int i = 1; i < s->n_shards; i++)
        if (s->shards[i].joined) send_shard(s, i, h, NULL, 0);
}

/* Tell every shard about a worker: its rank and token. */
void shards_worker(srv_t *s, const worker_t *w)
{
    Psd__Header h;
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_WORKER;
    sw.rank = w->rank;
    sw.token.data = (uint8_t *)w->shard_token;
    sw.token.len = sizeof w->shard_token;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    shards_send_all(s, &h);
}
