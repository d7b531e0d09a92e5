/* psd_shard0.c - shard 0's side of the psd shard protocol: shards join
 * (SHARD_HELLO: the run and its tensor table), take their parts of the
 * initial values (SHARD_INIT_FETCH) or resume them, send their blocks'
 * norms for clipping, confirm checkpoints, and give their parts for the
 * weights file at the end of a run. psd_shard.c is the other side. */
#include "psd_core.h"

int psd_shard0_find(const srv_t *s, const uint8_t *ident, size_t len)
{
    for (int i = 1; i < s->sh.n; i++)
        if (s->sh.shard[i].ident_len == len && memcmp(s->sh.shard[i].ident, ident, len) == 0) return i;
    return -1;
}

static void refuse_shard(srv_t *s, ps_msg_t *m, const char *why)
{
    PS_ERROR("refused a psd shard: %s", why);
    psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED, why);
}

/* Once every shard has joined: when each is reached at an address of this
 * host, shards only share its cores and memory bandwidth (on the 2-core VM
 * two shards cost more than one psd at every worker count: README), and
 * psd says so, once. */
static void say_one_host(srv_t *s)
{
    if (s->sh.said_one_host || !all_shards(s)) return;
    for (int i = 1; i < s->sh.n; i++)
        if (!ps_endpoint_is_this_host(s->sh.shard[i].endpoint)) return;
    s->sh.said_one_host = true;
    PS_WARN("all %d psd shards run on this host (the workers reach every shard at an address of it): shards help "
            "only across hosts, where each adds its own cores and network; on one host one psd is faster",
            s->sh.n);
}

/* Shard i said HELLO before shard 0 has a model (model.kind from_worker,
 * before the first worker's values): it is told to wait and says hello
 * again every second; it joins, and fetches its part, once the model is
 * here. Nothing of it is kept meanwhile. */
static void wait_shard(srv_t *s, ps_msg_t *m, int i)
{
    shard_peer_t *sh = &s->sh.shard[i];
    const Psd__ShardHello *h = m->hdr->shard_hello;
    if (!sh->told_wait)
        PS_INFO("psd shard %d/%d is here (%s pid %u); it joins once the model is (model.kind from_worker: the first "
                "worker's)", i, s->sh.n, h->hostname ? h->hostname : "?", h->pid);
    sh->told_wait = true;
    Psd__Header r;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&r);
    r.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
    r.run_id = s->run_id;
    r.rank = (uint32_t)i;
    rb.shard = (uint32_t)i;
    rb.shards = (uint32_t)s->sh.n;
    rb.config_hash = s->config_hash;
    rb.wait = true;
    r.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    r.shard_hello = &rb;
    int rc = ps_msg_send(s->net.sock, m->ident, m->ident_len, &r, NULL, 0);
    if (rc < 0) PS_WARN("cannot tell psd shard %d to wait: %s", i, zmq_strerror(-rc));
}

static void on_shard_hello(srv_t *s, ps_msg_t *m, bool again)
{
    Psd__ShardHello *h = m->hdr->shard_hello;
    char why[320];
    if (!sharded(s)) {
        refuse_shard(s, m, "this psd was not started as shard 0 of several (--shard 0/N)");
        return;
    }
    if (s->net.zap && !psd_zap_is_self(s->net.zap, m->user)) { /* with keys: only psd's own key is a shard */
        refuse_shard(s, m, "a psd shard must connect with psd's own key (--key), not a worker's");
        return;
    }
    int i = (int)h->shard;
    if (h->shards != (uint32_t)s->sh.n || i < 1 || i >= s->sh.n) {
        snprintf(why, sizeof why, "it is shard %u/%u, this run has %d shards", h->shard, h->shards, s->sh.n);
        refuse_shard(s, m, why);
        return;
    }
    if (h->config_hash != s->config_hash || (h->n_params && s->model_ready && h->n_params != s->layout.n_params)) {
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
    shard_peer_t *sh = &s->sh.shard[i];
    if (sh->joined) {
        snprintf(why, sizeof why, "shard %d has already joined (from %s pid %u)", i, sh->hostname, sh->pid);
        refuse_shard(s, m, why);
        return;
    }
    if (!h->endpoint || !h->endpoint[0] || strlen(h->endpoint) >= sizeof sh->endpoint) {
        refuse_shard(s, m, "no endpoint for the workers");
        return;
    }
    if (!s->model_ready) { /* model.kind from_worker: the shard says hello again until the first worker's model came */
        wait_shard(s, m, i);
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
    psd_peers_note_conn(s, &sh->conn, m);
    Psd__Header r;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&r);
    r.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
    rb.shard = (uint32_t)i;
    rb.shards = (uint32_t)s->sh.n;
    rb.config_hash = s->config_hash;
    rb.n_params = s->layout.n_params;
    rb.resume = resumed;
    rb.resume_step = s->store.steps;
    rb.resume_version = s->store.cur->version;
    if (resumed) { /* it resumes at the newest of shard 0's steps it has */
        rb.resume_steps = s->sh.resume_steps;
        rb.n_resume_steps = s->sh.n_resume_steps;
        sh->resumed = false;
    }
    /* its model: the run's table; its part of the initial values: fetched from here when the config does not
     * draw them (kept in s->sh.init), unless it resumes (from its checkpoints). A HELLO said again (the answer
     * crossed it) keeps what was fetched so far: the shard takes the first answer only. */
    if (!again) {
        sh->valued = false;
        sh->init_from = sh->init_chunks = 0;
    }
    rb.fetch_values = !resumed && s->sh.init != NULL;
    ps_frame_t table = {.data = s->table_pb, .nbytes = s->table_pb_len, .dtype = PSD__DTYPE__DT_U8,
                        .rows = s->table_pb_len, .copy = true};
    r.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    r.shard_hello = &rb;
    psd_peers_send_shard(s, i, &r, &table, 1);
    if (again)
        PS_DEBUG("psd shard %d/%d said hello again (pid %u): answered again", i, s->sh.n, sh->pid);
    else
        PS_INFO("psd shard %d/%d joined from %s pid %u; workers reach it at %s", i, s->sh.n, sh->hostname,
                sh->pid, sh->endpoint);
    say_one_host(s);
    raise_event(s, PSD_EV_SHARDS_JOINED);
}

/* ---- the shards' initial values (a run not resumed) ---------------------- */

int psd_shard0_check_parts(const srv_t *s)
{
    ps_piece_t p[PS_MAX_TENSORS];
    for (int k = 1; k < s->sh.n; k++) {
        ps_shard_pieces(&s->layout, k, s->sh.n, p);
        if (ps_part_size(p, s->layout.n_tensors) > 0) continue;
        PS_ERROR("psd shard %d of %d would hold no parameters: the model (%zu parameters) has fewer blocks of %d "
                 "floats than there are shards; use fewer shards", k, s->sh.n, s->layout.n_params, PS_NORM_BLOCK);
        return PSD_EXIT_USAGE;
    }
    return 0;
}

int psd_shard0_init_new(srv_t *s)
{
    const size_t bytes = (s->layout.n_params ? s->layout.n_params : 1) * sizeof(float);
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return -errno;
    s->sh.init = p;
    s->sh.init_bytes = bytes;
    return 0;
}

void psd_shard0_init_keep(srv_t *s, const float *const *values)
{
    ps_piece_t p[PS_MAX_TENSORS];
    for (int k = 1; k < s->sh.n; k++) {
        ps_shard_pieces(&s->layout, k, s->sh.n, p);
        for (int t = 0; t < s->layout.n_tensors; t++)
            if (p[t].n)
                memcpy(s->sh.init + s->layout.t[t].offset + p[t].off, values[t] + p[t].off, p[t].n * sizeof(float));
    }
}

void psd_shard0_init_free(srv_t *s)
{
    if (s->sh.init) munmap(s->sh.init, s->sh.init_bytes);
    s->sh.init = NULL;
    s->sh.init_bytes = 0;
}

/* SHARD_INIT_FETCH: floats [from, from + count) of shard i's part of the
 * initial values kept for it, asked for in order, 16 MiB at most: sent as
 * one F32 frame a piece of a tensor (copied into the message: the values
 * kept go once every shard has its part, whatever ZeroMQ still sends). */
static void on_init_fetch(srv_t *s, int i, ps_msg_t *m)
{
    shard_peer_t *sh = &s->sh.shard[i];
    const Psd__ShardFetch *f = m->hdr->shard_fetch;
    ps_piece_t part[PS_MAX_TENSORS], r[PS_MAX_TENSORS];
    const char *why = !s->sh.init || sh->valued ? "no values are kept for it"
                      : f->from != sh->init_from ? "not where the chunk before ended"
                      : f->count == 0 || f->count > PSD_FETCH_FLOATS ? "none, or more than 16 MiB"
                                                                      : NULL;
    int nr = 0;
    if (!why) {
        ps_shard_pieces(&s->layout, i, s->sh.n, part);
        nr = ps_part_range(part, s->layout.n_tensors, f->from, f->count, r);
        why = nr == 0 ? "not in its part" : NULL;
    }
    if (why) {
        psd_peers_drop_shard(s, i, "INIT_FETCH of floats [%" PRIu64 ", +%" PRIu64 ") of its part: %s", f->from, f->count, why);
        return;
    }
    ps_frame_t fr[PS_MAX_TENSORS];
    for (int k = 0; k < nr; k++) {
        const ps_tensor_info_t *ti = &s->layout.t[r[k].t];
        fr[k] = (ps_frame_t){.data = s->sh.init + ti->offset + r[k].off, .nbytes = r[k].n * sizeof(float),
                             .id = (uint32_t)r[k].t, .dtype = PSD__DTYPE__DT_F32, .rows = ti->rows,
                             .cols = ti->ndim >= 2 ? ti->cols : 0, .offset = r[k].off, .copy = true};
    }
    Psd__Header h;
    Psd__ShardFetch a = PSD__SHARD_FETCH__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_INIT_VALUES;
    a.from = f->from;
    a.count = f->count;
    h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
    h.shard_fetch = &a;
    if (psd_peers_send_shard(s, i, &h, fr, nr) != 0) return; /* logged; the shard gives up after the silence limit */
    sh->init_from += f->count;
    sh->init_chunks++;
}

/* SHARD_INIT_DONE: shard i holds its part of the initial values (fetched
 * whole, or drawn as the config says): it has joined. Once every shard
 * has, the values kept for them go, and the workers that wait are
 * assigned. */
static void on_init_done(srv_t *s, int i, ps_msg_t *m)
{
    shard_peer_t *sh = &s->sh.shard[i];
    const Psd__ShardFetch *f = m->hdr->shard_fetch;
    ps_piece_t part[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, i, s->sh.n, part);
    const uint64_t size = ps_part_size(part, s->layout.n_tensors);
    if (s->opts.resume_dir || sh->valued || f->from != 0 || f->count != size || (s->sh.init && sh->init_from != size)) {
        psd_peers_drop_shard(s, i, "INIT_DONE of %" PRIu64 " floats (its part: %" PRIu64 ", %" PRIu64 " sent)", f->count, size,
                   sh->init_from);
        return;
    }
    sh->valued = true;
    if (s->sh.init)
        PS_INFO("psd shard %d/%d has its part of the initial values: %" PRIu64 " floats, sent in %" PRIu64 " chunks", i,
                s->sh.n, size, sh->init_chunks);
    else
        PS_INFO("psd shard %d/%d has its part of the initial values: %" PRIu64 " floats, drawn as the config says", i,
                s->sh.n, size);
    if (shards_valued(s)) psd_shard0_init_free(s);
    raise_event(s, PSD_EV_SHARDS_JOINED);
}

/* Every shard is there with its part (its initial values, or resumed): the
 * workers that waited get their ASSIGN. */
void psd_shard0_go(srv_t *s)
{
    if (!shards_ready(s)) return;
    for (int j = 0; j < s->n; j++) { /* the workers that waited for it */
        worker_t *w = &s->w[j];
        if (w->state == W_GONE) continue;
        psd_peers_shards_worker(s, w);
        if (w->assign_wait) {
            w->assign_wait = false;
            w->last_seen = ps_now();
            psd_peers_send_assign(s, w);
        }
    }
}

/* Ask shard j to resume again, at the newest of shard 0's steps up to the
 * one it is at now. */
void psd_shard0_send_resume(srv_t *s, int j)
{
    Psd__Header h;
    Psd__ShardHello rb = PSD__SHARD_HELLO__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_RESUME;
    rb.shard = (uint32_t)j;
    rb.shards = (uint32_t)s->sh.n;
    rb.resume = true;
    rb.resume_step = s->store.steps;
    rb.resume_version = s->store.cur->version;
    rb.resume_steps = s->sh.resume_steps;
    rb.n_resume_steps = s->sh.n_resume_steps;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &rb;
    s->sh.shard[j].resumed = false;
    psd_peers_send_shard(s, j, &h, NULL, 0);
}

/* The sharded weights file cannot be finished: why, and no file. */
static void save_failed(srv_t *s, const char *why)
{
    PS_ERROR("%s", why);
    s->exit_code = PSD_EXIT_ERROR;
    ps_weights_abort(s->sh.wr);
    s->sh.wr = NULL;
}

/* The end of a sharded run with --save: the weights file is begun with this
 * shard's part; false (the error logged, the exit code set) when it cannot
 * be. */
bool psd_shard0_begin_save(srv_t *s)
{
    char err[512];
    ps_weights_meta_t meta = {.run_id = s->run_id, .step = s->step, .epoch = s->epoch};
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, 0, s->sh.n, p);
    s->sh.wr = ps_weights_begin(s->cfg.save, &s->layout, &meta, err, sizeof err);
    bool ok = s->sh.wr != NULL;
    for (int t = 0; ok && t < s->layout.n_tensors; t++)
        ok = ps_weights_put(s->sh.wr, t, p[t].off, s->store.cur->w + s->layout.t[t].offset + p[t].off, p[t].n, err,
                            sizeof err) == 0;
    if (!ok) {
        save_failed(s, err);
        return false;
    }
    s->sh.fetch_k = 0; /* psd_shard0_fetch_next goes on to shard 1 */
    s->sh.fetch_size = s->sh.fetch_from = s->sh.fetch_chunks = 0;
    return true;
}

/* Ask for the next chunk of the shards' parts, or, all in, write the file's
 * end and end the run. */
void psd_shard0_fetch_next(srv_t *s)
{
    while (s->sh.fetch_from >= s->sh.fetch_size && ++s->sh.fetch_k < s->sh.n) { /* the next shard's part */
        ps_shard_pieces(&s->layout, s->sh.fetch_k, s->sh.n, s->sh.fetch_part);
        s->sh.fetch_size = ps_part_size(s->sh.fetch_part, s->layout.n_tensors);
        s->sh.fetch_from = 0;
    }
    if (s->sh.fetch_k < s->sh.n) {
        Psd__Header h;
        Psd__ShardFetch f = PSD__SHARD_FETCH__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_FETCH;
        f.version = s->store.cur->version;
        f.from = s->sh.fetch_from;
        const uint64_t chunk = s->opts.fetch_floats ? s->opts.fetch_floats : PSD_FETCH_FLOATS;
        f.count = s->sh.fetch_count = s->sh.fetch_size - s->sh.fetch_from < chunk ? s->sh.fetch_size - s->sh.fetch_from : chunk;
        h.body_case = PSD__HEADER__BODY_SHARD_FETCH;
        h.shard_fetch = &f;
        s->sh.fetching_since = ps_now();
        s->sh.fetch_chunks++;
        psd_peers_send_shard(s, s->sh.fetch_k, &h, NULL, 0);
        return;
    }
    char err[512];
    int rc = ps_weights_commit(s->sh.wr, err, sizeof err); /* frees it either way */
    s->sh.wr = NULL;
    if (rc != 0)
        save_failed(s, err);
    else
        PS_INFO("saved weights (version %" PRIu64 ") to %s; the other shards' parts came in %" PRIu64 " chunks",
                s->store.cur->version, s->cfg.save, s->sh.fetch_chunks);
    raise_event(s, PSD_EV_SAVED);
}

/* A chunk of a shard's part of the final version (SHARD_FETCH): into the
 * weights file. */
static void on_shard_weights(srv_t *s, int i, ps_msg_t *m)
{
    if (!s->sh.wr || i != s->sh.fetch_k || m->hdr->weights->version != s->store.cur->version) {
        psd_peers_drop_shard(s, i, "WEIGHTS that psd did not ask for");
        return;
    }
    ps_piece_t r[PS_MAX_TENSORS];
    int nr = ps_part_range(s->sh.fetch_part, s->layout.n_tensors, s->sh.fetch_from, s->sh.fetch_count, r);
    bool ok = nr == m->n_frames;
    for (int f = 0; ok && f < nr; f++) {
        size_t n = 0;
        const float *src = ps_msg_f32(m, f, &n);
        ok = src && m->hdr->tensors[f]->id == (uint32_t)r[f].t && m->hdr->tensors[f]->offset == r[f].off &&
             n == r[f].n;
        char err[512];
        if (ok && ps_weights_put(s->sh.wr, r[f].t, r[f].off, src, n, err, sizeof err) != 0) {
            save_failed(s, err);
            raise_event(s, PSD_EV_SAVED);
            return;
        }
    }
    if (!ok) { /* it answers a FETCH once: without its part there are no final weights */
        PS_ERROR("psd shard %d sent final weights that do not match its part of the parameters; the run stops", i);
        psd_peers_finish(s, PSD_EXIT_SHARD_LOST, "a psd shard sent a broken part of the weights");
        return;
    }
    s->sh.fetch_from += s->sh.fetch_count;
    psd_shard0_fetch_next(s);
}

/* A message of psd shard i (-1: not joined, a HELLO): joining, heartbeats,
 * the parts of the weights file, failures. True when it is another file's
 * to handle (SHARD_HAVE and SHARD_NORM: psd_push.c; SHARD_CKPT_DONE and
 * SHARD_RESUMED: psd_run.c), its run and rank checked. */
bool psd_shard0_on_shard(srv_t *s, int i, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO) {
        bool again = false, was = i > 0 && s->sh.shard[i].joined;
        if (i > 0) { /* its HELLO again: the answer was lost? answer again */
            const Psd__ShardHello *hh = m->hdr->shard_hello;
            again = was && s->sh.shard[i].pid == hh->pid && hh->shard == (uint32_t)i;
            if (was && !again) {
                psd_peers_drop_shard(s, i, "HELLO on its connection as shard %u pid %u", hh->shard, hh->pid);
                return false;
            }
            s->sh.shard[i].joined = false;
        }
        on_shard_hello(s, m, again);
        if (was && !s->sh.shard[i].joined) { /* refused now: it is no longer watched */
            PS_ERROR("psd shard %d said hello again and was refused; its part of the parameters is gone, so the "
                     "run stops", i);
            psd_peers_finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was refused");
        }
        return false;
    }
    if (i < 0) return false;
    shard_peer_t *sh = &s->sh.shard[i];
    if (h->run_id != s->run_id || h->rank != (uint32_t)i) {
        psd_peers_drop_shard(s, i, "run %016" PRIx64 " rank %u", h->run_id, h->rank);
        return false;
    }
    sh->last_seen = ps_now();
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_HEARTBEAT: break;
    case PSD__MSG_TYPE__MSG_SHARD_HAVE:
    case PSD__MSG_TYPE__MSG_SHARD_NORM:
    case PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE:
    case PSD__MSG_TYPE__MSG_SHARD_RESUMED: return true;
    case PSD__MSG_TYPE__MSG_WEIGHTS: on_shard_weights(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_INIT_FETCH: on_init_fetch(s, i, m); break;
    case PSD__MSG_TYPE__MSG_SHARD_INIT_DONE: on_init_done(s, i, m); break;
    case PSD__MSG_TYPE__MSG_ERROR:
        PS_ERROR("psd shard %d (%s pid %u) failed: %s", i, sh->hostname, sh->pid,
                 h->error->message ? h->error->message : "(no message)");
        sh->joined = false;
        psd_peers_finish(s, PSD_EXIT_SHARD_LOST, "a psd shard failed");
        break;
    default: psd_peers_drop_shard(s, i, "%s is not a message shards send", ps_msg_type_name((int)h->type));
    }
    return false;
}

/* After a resume: every shard resumed its part at shard 0's step. */
bool psd_shard0_all_resumed(const srv_t *s)
{
    for (int i = 1; i < s->sh.n; i++)
        if (!s->sh.shard[i].joined || !s->sh.shard[i].resumed || s->sh.shard[i].resumed_step != s->store.steps)
            return false;
    return true;
}

/* Psd shards whose connection closed (the shell drained their last words):
 * a joined one's part of the parameters is gone, so the run stops. */
void psd_shard0_closed(srv_t *s, double now)
{
    for (int i = 1; i < s->sh.n && s->phase != PHASE_DONE; i++) {
        shard_peer_t *sh = &s->sh.shard[i];
        if (!sh->conn_closed) continue;
        sh->conn_closed = false;
        if (!sh->joined) continue;
        PS_ERROR("psd shard %d (%s pid %u) lost: its connection closed, %.1f s after its last message; its part of "
                 "the parameters is gone, so the run stops", i, sh->hostname, sh->pid, now - sh->last_seen);
        sh->joined = false;
        psd_peers_finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was lost");
        return;
    }
}

/* The tick: a heartbeat to the shards every second (they stop when shard 0
 * falls silent), and a shard silent past server.worker_timeout, or one
 * that owes shard 0 an answer (its part of a clipped step's norm, of the
 * final weights) that long, stops the run. false: it did. */
bool psd_shard0_tick(srv_t *s, double now)
{
    if (sharded(s) && s->phase != PHASE_DONE) {
        if (now - s->sh.hb >= 1.0) { /* they stop when shard 0 falls silent */
            Psd__Header h;
            Psd__Heartbeat hb;
            psd_peers_heartbeat_hdr(s, NULL, &h, &hb);
            psd_peers_shards_send_all(s, &h);
            s->sh.hb = now;
        }
        for (int i = 1; i < s->sh.n; i++) {
            shard_peer_t *sh = &s->sh.shard[i];
            /* an answer shard 0 waits for: its norms (clipping), its part of the final weights */
            const char *owed = NULL;
            double since = 0;
            if (s->stepping && !sh->norm_in)
                owed = "its part of the gradient's norm", since = s->stepping_since;
            else if (s->sh.wr && i == s->sh.fetch_k)
                owed = "its part of the final weights", since = s->sh.fetching_since;
            if (owed && now - ps_heard_at(&s->hearing, since) >= s->silence) {
                PS_ERROR("psd shard %d (%s pid %u) did not send %s in %.1f s; the run stops", i, sh->hostname, sh->pid,
                         owed, now - since);
                psd_peers_finish(s, PSD_EXIT_SHARD_LOST, "a psd shard stopped answering");
                return false;
            }
            if (!sh->joined || now - ps_heard_at(&s->hearing, sh->last_seen) < s->silence) continue;
            PS_ERROR("psd shard %d (%s pid %u) lost: nothing from it for %.1f s; its part of the parameters is "
                     "gone, so the run stops", i, sh->hostname, sh->pid, now - sh->last_seen);
            sh->joined = false;
            psd_peers_finish(s, PSD_EXIT_SHARD_LOST, "a psd shard was lost");
            return false;
        }
    }
    return true;
}
