/* psd_server.c - the shell of psd's run coordinator (the files below it:
 * psd_core.h).
 *
 * One thread. A libuv loop watches the ROUTER socket's ZMQ_FD (edge
 * triggered: every wake-up drains while ZMQ_EVENTS says readable, and every
 * callback that sent something drains again), a 100 ms timer calls each
 * part's tick (psd_shard0_tick, psd_run_tick: they decide what their
 * deadlines mean) and polls the checkpoint writer, and signal handles stop
 * the run cleanly. This file sets it all up, dispatches each message to the
 * file whose concern it is (psd_run.c decides who does what when), cuts off
 * peers that send bad messages, and answers psctl.
 *
 * Workers come and go: a worker psd waits for that stays silent past
 * worker_timeout (plus, for a large model, the time a message of the whole
 * model takes each way: psd_silence_limit) is declared lost, one that
 * leaves (SIGTERM) says so; either way the samples of the epoch it had not
 * trained are given to the others (or to the next worker to join), and its
 * part of a validation goes to another worker, so every sample is trained
 * once per epoch and validated once. New workers may join at any time: they
 * get samples from the next epoch, or at once if some are waiting for a
 * worker. */
#include "psd_server.h"

#include "psd_core.h"
#include "ps_table.h"
#include "ps_weights_st.h"
#include "psd_status.h"


static void on_control(srv_t *s, ps_msg_t *m);
static void request_stop(srv_t *s, int signum, const char *what);
static void end_asked(srv_t *s, uint32_t rank);

static void drain(srv_t *s);

/* A peer whose connection closed (the ROUTER's monitor): its last words
 * first (a LEAVE, an ERROR: queued before the connection closed), then its
 * part decides (psd_shard0_closed, psd_run_closed). */
static void reap_closed(srv_t *s, double now)
{
    bool any = false;
    for (int i = 0; i < s->n; i++) any |= s->w[i].conn_closed;
    for (int i = 1; i < s->sh.n; i++) any |= s->sh.shard[i].conn_closed;
    if (!any) return;
    drain(s);
    psd_shard0_closed(s, now);
    psd_run_closed(s, now);
}

/* ---- messages of the psd shards ----------------------------------------- */

/* again: the shard said HELLO before and was answered (its answer may have
 * been lost): answer again, without logging a second join */

static void start_shm(srv_t *s);

static void handle(srv_t *s, ps_msg_t *m)
{
    Psd__Header *h = m->hdr;
    if (h->protocol != PS_PROTOCOL_VERSION) {
        const char *host = "?";
        uint32_t pid = 0;
        if (h->type == PSD__MSG_TYPE__MSG_REGISTER) {
            host = h->reg->hostname ? h->reg->hostname : "?";
            pid = h->reg->pid;
        }
        const bool shard = h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO;
        if (shard) {
            host = h->shard_hello->hostname ? h->shard_hello->hostname : "?";
            pid = h->shard_hello->pid;
        }
        PS_WARN("refused a %s from %s pid %u: it speaks protocol %u, psd %u", shard ? "psd shard" : "worker", host, pid,
                h->protocol, PS_PROTOCOL_VERSION);
        char msg[256];
        if (h->protocol < PS_PROTOCOL_VERSION)
            snprintf(msg, sizeof msg, "this %s speaks protocol %u, psd %s speaks %u (models as tables of named "
                     "tensors): upgrade it to psd %s or later", shard ? "psd shard" : "worker", h->protocol,
                     PSD_VERSION, PS_PROTOCOL_VERSION, PSD_VERSION);
        else
            snprintf(msg, sizeof msg, "psd speaks protocol %u, this %s %u: upgrade psd", PS_PROTOCOL_VERSION,
                     shard ? "psd shard" : "worker", h->protocol);
        psd_peers_send_error_as(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_PROTOCOL, msg,
                      h->protocol < PS_PROTOCOL_VERSION && h->protocol >= 3 ? h->protocol : 0);
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_CONTROL) {
        on_control(s, m);
        return;
    }
    int si = sharded(s) ? psd_shard0_find(s, m->ident, m->ident_len) : -1;
    if (si > 0 || h->type == PSD__MSG_TYPE__MSG_SHARD_HELLO) {
        if (si > 0) psd_peers_note_conn(s, &s->sh.shard[si].conn, m);
        if (!psd_shard0_on_shard(s, si, m)) return;
        switch (h->type) { /* the shards' messages about steps, checkpoints and resumes */
        case PSD__MSG_TYPE__MSG_SHARD_HAVE: psd_push_on_shard_have(s, si, m); break;
        case PSD__MSG_TYPE__MSG_SHARD_NORM: psd_push_on_shard_norm(s, si, m); break;
        case PSD__MSG_TYPE__MSG_SHARD_CKPT_DONE: psd_run_on_shard_ckpt_done(s, si, m); break;
        default: psd_run_on_shard_resumed(s, si, m); break;
        }
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_REGISTER) {
        if (h->run_id != 0 && h->run_id != s->run_id) {
            char msg[160];
            snprintf(msg, sizeof msg, "this psd runs run %016" PRIx64 ", the worker belongs to run %016" PRIx64,
                     s->run_id, h->run_id);
            PS_WARN("refused a worker from %s pid %u: %s", h->reg->hostname ? h->reg->hostname : "?",
                    h->reg->pid, msg);
            psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_RUN, msg);
            return;
        }
        if (psd_offer_gate(s, m)) psd_run_on_register(s, m);
        return;
    }
    if (h->type == PSD__MSG_TYPE__MSG_VALUES) { /* the first worker's model (from_worker): not registered yet */
        psd_offer_on_values(s, m);
        return;
    }
    worker_t *w = psd_peers_find_worker(s, m->ident, m->ident_len);
    if (!w) {
        psd_peers_drop(s, NULL, "%s from a peer that never registered", ps_msg_type_name((int)h->type));
        /* a worker of this run whose slot went to another (free_slot), or
         * from before a restart: told to register again (at most 10 a
         * second: a stranger's messages cost no more than one reply) */
        const double now = ps_now();
        if (h->run_id == s->run_id && h->type != PSD__MSG_TYPE__MSG_ERROR && h->type != PSD__MSG_TYPE__MSG_LEAVE &&
            now - s->net.stranger_reply_t >= 0.1) {
            s->net.stranger_reply_t = now;
            psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_LOST,
                             "psd does not know this worker (lost, its slot given to another); register again");
        }
        return;
    }
    if (w->state == W_GONE) {
        /* e.g. a worker that was frozen past the deadline wakes up: its
         * messages are never used; tell it, so that it registers again */
        if (w->end != WEND_REFUSED && w->lost_replies++ < 3 && h->type != PSD__MSG_TYPE__MSG_ERROR &&
            h->type != PSD__MSG_TYPE__MSG_LEAVE) {
            PS_WARN("rank %u (%s pid %u) was declared gone %.1f s ago; ignoring its %s", w->rank, w->hostname,
                    w->pid, ps_now() - w->gone_at, ps_msg_type_name((int)h->type));
            psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_LOST,
                             "psd declared this worker lost; register again to rejoin");
        }
        return;
    }
    if (h->run_id != s->run_id) {
        psd_peers_drop_stale(s, w, "run id %016" PRIx64 ", this run is %016" PRIx64, h->run_id, s->run_id);
        return;
    }
    if (h->rank != w->rank) {
        psd_peers_drop_stale(s, w, "claims rank %u", h->rank);
        return;
    }
    if (h->seq <= w->seq_in) {
        psd_peers_drop_stale(s, w, "sequence number %" PRIu64 " not after %" PRIu64 " (duplicate)", h->seq, w->seq_in);
        return;
    }
    w->seq_in = h->seq;
    w->last_seen = ps_now();
    psd_peers_note_conn(s, &w->conn, m);
    switch (h->type) {
    case PSD__MSG_TYPE__MSG_READY: psd_run_on_ready(s, w, m); break;
    case PSD__MSG_TYPE__MSG_PULL: psd_push_on_pull(s, w, m); break;
    case PSD__MSG_TYPE__MSG_PUSH: psd_push_on_push(s, w, m); break;
    case PSD__MSG_TYPE__MSG_BARRIER: psd_run_on_barrier(s, w, m); break;
    case PSD__MSG_TYPE__MSG_VAL_RESULT: psd_valid_on_result(s, w, m); break;
    case PSD__MSG_TYPE__MSG_ERROR: psd_run_on_worker_error(s, w, m); break;
    case PSD__MSG_TYPE__MSG_LEAVE:
        psd_run_on_leave(s, w, m);
        if (h->leave->end_run) end_asked(s, w->rank);
        break;
    case PSD__MSG_TYPE__MSG_HEARTBEAT: break; /* last_seen is all it is for */
    default: psd_peers_drop(s, w, "%s is not a message workers send", ps_msg_type_name((int)h->type));
    }
}

/* A peer that sends PS_BAD_IN_A_ROW bad messages in a row (malformed, or not
 * valid in its state) is cut off: libzmq 4.3 has no call to disconnect one
 * peer of a ROUTER, so psd shuts down the TCP connection the message came
 * from (ZMQ_SRCFD) after checking that the fd is still that peer's socket;
 * libzmq sees the connection end and forgets the peer. A registered worker cut
 * off is lost like any other (training goes on); an unknown peer may connect
 * again and is cut off again (logged at most every 1000th time). */
#define PS_BAD_IN_A_ROW 16

static bool same_peer(int fd, const char *addr)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (fd < 0 || getpeername(fd, (struct sockaddr *)&ss, &len) != 0) return false;
    char ip[INET6_ADDRSTRLEN] = "";
    if (ss.ss_family == AF_INET)
        inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, ip, sizeof ip);
    else if (ss.ss_family == AF_INET6)
        inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, ip, sizeof ip);
    else
        return ss.ss_family == AF_UNIX; /* ipc://: no address to compare */
    return addr[0] && strcmp(ip, addr) == 0;
}

static int bad_slot(srv_t *s, const ps_msg_t *m)
{
    for (int i = 0; i < s->net.n_bad; i++)
        if (s->net.bad[i].ident_len == m->ident_len && memcmp(s->net.bad[i].ident, m->ident, m->ident_len) == 0)
            return i;
    return -1;
}

static void bad_peer(srv_t *s, const ps_msg_t *m)
{
    if (m->ident_len == 0) return;
    int i = bad_slot(s, m);
    if (i < 0) {
        if (s->net.n_bad < (int)(sizeof s->net.bad / sizeof s->net.bad[0])) i = s->net.n_bad++;
        else { /* full: forget the peer with the fewest bad messages */
            i = 0;
            for (int j = 1; j < s->net.n_bad; j++)
                if (s->net.bad[j].bad < s->net.bad[i].bad) i = j;
        }
        memcpy(s->net.bad[i].ident, m->ident, m->ident_len);
        s->net.bad[i].ident_len = m->ident_len;
        s->net.bad[i].bad = 0;
        s->net.bad[i].cut_at = 0;
    }
    if (++s->net.bad[i].bad < PS_BAD_IN_A_ROW) return;
    uint32_t n = s->net.bad[i].bad;
    /* what it sent before its connection was cut is still arriving: libzmq
     * may already have closed that fd and given its number to a new peer */
    double t = ps_now();
    if (s->net.bad[i].cut_at > 0 && t - s->net.bad[i].cut_at < 2.0) return;
    s->net.bad[i].bad = 0;
    s->net.bad[i].cut_at = t;
    if (!same_peer(m->srcfd, m->peer)) return; /* its connection is already gone */
    worker_t *w = psd_peers_find_worker(s, m->ident, m->ident_len);
    s->net.cut++;
    if (s->net.cut <= 20 || s->net.cut % 1000 == 0) {
        if (w)
            PS_WARN("disconnected rank %u (%s pid %u, %s): %u bad messages in a row", w->rank, w->hostname, w->pid,
                    m->peer[0] ? m->peer : "?", n);
        else
            PS_WARN("disconnected a peer at %s: %u bad messages in a row%s", m->peer[0] ? m->peer : "?", n,
                    s->net.cut == 20 ? " (further ones logged every 1000th)" : "");
    }
    shutdown(m->srcfd, SHUT_RDWR);
    if (w && w->state != W_GONE) psd_run_worker_gone(s, w);
}

static void good_peer(srv_t *s, const ps_msg_t *m)
{
    int i = bad_slot(s, m);
    if (i >= 0) s->net.bad[i] = s->net.bad[--s->net.n_bad];
}

/* The message just handled was dropped, and its sender is a worker in the
 * run: its run ends with the reason (a worker left waiting for an answer
 * psd will never give would only be lost and register again, forever). */
static void refuse_dropped(srv_t *s)
{
    int i = s->net.refuse - 1;
    s->net.refuse = 0;
    if (i >= 0 && i < s->n && s->w[i].state != W_GONE && s->phase != PHASE_DONE)
        psd_run_refuse_worker(s, &s->w[i], s->net.refuse_why);
}

static void drain(srv_t *s)
{
    while (s->phase != PHASE_DONE) {
        int events = 0;
        size_t len = sizeof events;
        if (zmq_getsockopt(s->net.sock, ZMQ_EVENTS, &events, &len) != 0) return;
        if (!(events & ZMQ_POLLIN)) return;
        ps_msg_t m;
        char why[256];
        int rc = ps_msg_recv_arena(s->net.sock, &m, true, ZMQ_DONTWAIT, &s->net.rx_arena, why, sizeof why);
        if (rc == -EAGAIN || rc == -EINTR) continue;
        s->net.cur_peer = m.peer;
        s->net.refuse = 0;
        if (rc == -EPROTO) {
            psd_peers_drop(s, psd_peers_find_worker(s, m.ident, m.ident_len), "%s", why);
            refuse_dropped(s);
            bad_peer(s, &m);
            s->net.cur_peer = NULL;
            continue;
        }
        if (rc < 0) {
            PS_ERROR("receive failed: %s", zmq_strerror(-rc));
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd failed");
            return;
        }
        s->net.cur_bad = false;
        handle(s, &m);
        refuse_dropped(s);
        psd_run_events(s); /* what the message set off in the layers below psd_run.c */
        if (s->net.shm_later && s->model_ready) { /* the first worker's model came (from_worker) */
            s->net.shm_later = false;
            if (!s->table_on_psd) start_shm(s);
        }
        if (s->net.cur_bad) bad_peer(s, &m);
        else if (s->net.n_bad) good_peer(s, &m);
        s->net.cur_peer = NULL;
        ps_msg_deinit(&m);
    }
}

static void on_poll(uv_poll_t *p, int status, int events)
{
    (void)status;
    (void)events;
    drain(p->data);
}

/* The loop's tick (every 100 ms): each part decides what time means to it. */
static void on_timer(uv_timer_t *t)
{
    srv_t *s = t->data;
    double now = ps_now();
    double held = ps_hearing_tick(&s->hearing, now, s->silence);
    if (held >= s->silence) /* long enough to have lost everyone it waits for */
        PS_WARN("psd's event loop was held up for %.1f s; nobody is taken for lost for silence before %.1f s "
                "from now", held, s->silence);
    if (s->net.mon) psd_peers_poll_monitor(s);
    reap_closed(s, now);
    psd_run_poll_checkpoint(s, false);
    psd_shm_expire(s->net.shm, now);
    psd_status_progress(s, now);
    if (s->phase != PHASE_DONE) psd_peers_keep_alive(s, now);
    if (!psd_shard0_tick(s, now)) return; /* a psd shard was lost: the run stops */
    psd_run_tick(s, now);
    psd_run_events(s);
    drain(s);
}

static void on_control(srv_t *s, ps_msg_t *m)
{
    const char *cmd = m->hdr->control->command ? m->hdr->control->command : "";
    PS_DEBUG("psctl %s from %s", cmd, m->peer[0] ? m->peer : "?");
    if (strcmp(cmd, "status") == 0 || strcmp(cmd, "workers") == 0) {
        char *text = NULL, *json = NULL;
        size_t tl = 0, jl = 0;
        FILE *ft = open_memstream(&text, &tl), *fj = open_memstream(&json, &jl);
        if (ft) psd_status_human(s, ft, cmd[0] == 'w');
        if (fj) psd_status_json(s, fj);
        int bad = (ft ? fclose(ft) != 0 : 1) | (fj ? fclose(fj) != 0 : 1);
        bool ok = !bad;
        psd_peers_control_reply(s, m->ident, m->ident_len, ok, ok ? text : "out of memory", ok ? json : NULL);
        free(text);
        free(json);
        return;
    }
    if (strcmp(cmd, "checkpoint") == 0) {
        if (!s->cfg.ckpt_dir[0] || s->phase == PHASE_DONE) {
            psd_peers_control_reply(s, m->ident, m->ident_len, false,
                          s->phase == PHASE_DONE ? "the run is over" : "checkpoints are off (checkpoint.dir is empty)",
                          NULL);
            return;
        }
        if (s->ck.n_ctl_wait == (int)(sizeof s->ck.ctl_wait / sizeof s->ck.ctl_wait[0])) {
            psd_peers_control_reply(s, m->ident, m->ident_len, false, "too many checkpoint requests waiting", NULL);
            return;
        }
        memcpy(s->ck.ctl_wait[s->ck.n_ctl_wait].ident, m->ident, m->ident_len);
        s->ck.ctl_wait[s->ck.n_ctl_wait++].ident_len = m->ident_len;
        PS_INFO("psctl asks for a checkpoint");
        psd_run_take_checkpoint(s, false); /* answered when written (psd_run_poll_checkpoint) */
        if (!s->ck.writer && !s->ck.open && !s->ck.deferred) { /* could not start (else: started, or queued) */
            s->ck.n_ctl_wait--;
            psd_peers_control_reply(s, m->ident, m->ident_len, false, "the checkpoint could not start (see psd's log)", NULL);
        }
        return;
    }
    if (strcmp(cmd, "stop") == 0) {
        psd_peers_control_reply(s, m->ident, m->ident_len, true,
                      s->cfg.ckpt_dir[0] ? "stopping: a checkpoint, then the workers are told to stop"
                                         : "stopping: the workers are told to stop (checkpoints are off)",
                      NULL);
        request_stop(s, SIGTERM, "psctl stop");
        return;
    }
    char msg[160];
    snprintf(msg, sizeof msg, "unknown command '%.40s' (status, workers, checkpoint, stop)", cmd);
    psd_peers_drop(s, NULL, "CONTROL: %s", msg);
    psd_peers_control_reply(s, m->ident, m->ident_len, false, msg, NULL);
}

/* server.http: start the endpoint (token from server.http_token_file;
 * beyond loopback only with a token, or --insecure). 0 or an exit code. */
static int start_http(srv_t *s)
{
    const ps_config_t *c = &s->cfg;
    char err[PS_PATH_MAX + 256];
    bool open;
    if (psd_http_settings(c->http, c->http_token_file, c->insecure, s->net.http_token, sizeof s->net.http_token, &open, err,
                          sizeof err) != 0) {
        PS_ERROR("%s", err);
        return PSD_EXIT_USAGE;
    }
    if (open) PS_WARN("*** --insecure: HTTP on %s without a token ***", c->http);
    if (psd_http_start(&s->net.http, &s->net.loop, c->http, s->net.http_token, psd_status_http, s, err, sizeof err) != 0) {
        PS_ERROR("%s", err);
        return PSD_EXIT_USAGE;
    }
    PS_INFO("HTTP on %s (port %d): / (live page) /metrics /status /history /healthz%s", c->http, psd_http_port(s->net.http),
            s->net.http_token[0] ? "; a bearer token is needed but for /healthz" : "");
    return 0;
}

/* The run's metrics file and checkpoint directory (checkpoint.dir/run-<id>/,
 * held with its lock), made only once the start's checks passed and its
 * sockets are bound: a psd that refuses to start leaves neither behind.
 * What this call made is removed again when the next one cannot be made.
 * 0, or PSD_EXIT_USAGE after saying why. */
static int make_outputs(srv_t *s)
{
    const ps_config_t *c = &s->cfg;
    char err[PS_PATH_MAX + 400];
    bool made_metrics = false, made_dir = false, made_run = false;
    struct stat st;
    if (c->metrics[0]) {
        made_metrics = stat(c->metrics, &st) != 0 && errno == ENOENT; /* no other psd makes it: we hold its lock */
        if (s->resumed && psd_run_resume_metrics(s, err, sizeof err) != 0) goto fail; /* before it is opened */
        if (psd_metrics_open(&s->metrics, c->metrics, err, sizeof err) != 0) goto fail;
    }
    if (!c->ckpt_dir[0]) return 0;
    const char *dirs[2] = {c->ckpt_dir, s->ck.run_dir};
    bool *made[2] = {&made_dir, &made_run};
    for (int i = 0; i < 2; i++) {
        if (mkdir(dirs[i], 0755) == 0) {
            *made[i] = true;
        } else if (errno != EEXIST) {
            snprintf(err, sizeof err, "checkpoint directory %s: %s", dirs[i], strerror(errno));
            goto fail;
        }
    }
    if (psd_lock_dir(&s->locks, s->ck.run_dir, err, sizeof err) != 0) goto fail; /* it leaves no file when it fails */
    return 0;
fail:
    PS_ERROR("%s", err);
    if (made_run && rmdir(s->ck.run_dir) != 0) PS_WARN("cannot remove %s: %s", s->ck.run_dir, strerror(errno));
    if (made_dir && rmdir(c->ckpt_dir) != 0) PS_WARN("cannot remove %s: %s", c->ckpt_dir, strerror(errno));
    psd_metrics_close(&s->metrics);
    if (made_metrics && unlink(c->metrics) != 0 && errno != ENOENT)
        PS_WARN("cannot remove %s: %s", c->metrics, strerror(errno));
    return PSD_EXIT_USAGE;
}

/* SIGINT/SIGTERM or psctl stop (signum SIGTERM, what "psctl stop"):
 * checkpoint, tell the workers, exit 0; a second one exits at once. */
static void request_stop(srv_t *s, int signum, const char *what)
{
    if (s->stopping > 0 || !s->cfg.ckpt_dir[0]) {
        if (s->stopping > 0) PS_WARN("received %s again: exiting now", what);
        else PS_WARN("received %s: telling the workers to stop", what);
        psd_peers_finish(s, s->stopping > 0 ? 128 + signum : 0, "psd was stopped");
        return;
    }
    if (sharded(s) && !shards_ready(s)) { /* workers train only once every shard is there */
        PS_WARN("received %s before every psd shard joined: nothing trained since psd started, nothing to "
                "checkpoint", what);
        psd_peers_finish(s, 0, "psd was stopped before training began");
        return;
    }
    PS_WARN("received %s: writing a checkpoint, then telling the workers to stop (again to exit now)", what);
    s->stopping = signum;
    s->ck.stop_when_written = true;
    if (s->ck.writer || s->ck.open) s->ck.again = true; /* one of the state now, once that one is written */
    if (sharded(s)) { /* a shard stopped too waits for this checkpoint, however long it takes */
        Psd__Header h;
        Psd__ShardCkpt ck = PSD__SHARD_CKPT__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_CKPT;
        ck.stop = true; /* step 0: no checkpoint of its own (psd_run_take_checkpoint asks for that) */
        h.body_case = PSD__HEADER__BODY_SHARD_CKPT;
        h.shard_ckpt = &ck;
        psd_peers_shards_send_all(s, &h);
    }
    if (s->ck.writer || s->ck.open) return; /* its turn comes when that one is written (ckpt_complete) */
    psd_run_take_checkpoint(s, false);
    if (!s->ck.writer && !s->ck.deferred) psd_peers_finish(s, PSD_EXIT_ERROR, "psd was stopped; the checkpoint failed");
}

/* A worker's LEAVE with end_run (its framework stopped: Lightning's
 * EarlyStopping, max_epochs): the run stops as on psctl stop. Once a stop
 * is under way (another worker's end_run: every rank of a Lightning run
 * decides the same) there is nothing more to do, not a second stop. */
static void end_asked(srv_t *s, uint32_t rank)
{
    if (s->phase == PHASE_DONE) return;
    if (s->stopping != 0 || s->ck.stop_when_written) {
        PS_INFO("the run is stopping already (rank %u asks for it too)", rank);
        return;
    }
    char what[64];
    snprintf(what, sizeof what, "rank %u's end of the run", rank);
    request_stop(s, SIGTERM, what);
}

static void on_signal(uv_signal_t *h, int signum)
{
    srv_t *s = h->data;
    if (signum == SIGHUP) {
        char err[512];
        if (!s->net.zap) PS_WARN("received SIGHUP: no allow-list to reload (no authentication)");
        else if (psd_zap_reload(s->net.zap, err, sizeof err) != 0) PS_ERROR("allow-list not reloaded: %s", err);
        return;
    }
    if (signum == SIGUSR1) {
        PS_INFO("received SIGUSR1: writing a checkpoint");
        psd_run_take_checkpoint(s, false);
        psd_run_events(s);
        drain(s);
        return;
    }
    if (ps_stop_signal_note(signum) == 0) { /* the first one again at once: one request */
        PS_INFO("received %s again at once: the same request (timeout(1) signals a command and its process group)",
                strsignal(signum));
        return;
    }
    request_stop(s, signum, strsignal(signum));
    psd_run_events(s);
    drain(s);
}

/* ---- set-up ------------------------------------------------------------- */

/* model.kind ctr: examples from the generator, no files. Logs the best
 * log-loss reachable on the test examples (the planted model's) and a
 * constant's (the test click rate's), the yardsticks of the validation loss. */
static uint64_t make_run_id(void)
{
    uint64_t id = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &id, sizeof id) != sizeof id) id = 0;
        close(fd);
    }
    uint64_t x = id ^ (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    id = ps_splitmix64(&x);
    return id ? id : 1;
}

static void close_cb(uv_handle_t *h) { (void)h; }

/* A worker's shared-memory hello (psd_shm.c): the worker it names must be
 * one psd offered shared memory to, still checking its data, with the
 * token of its ASSIGN; its region must be a size-sealed memfd of the
 * gradient's size. */
static int shm_hello(void *ud, const ps_shm_hello_t *h, int fd, char *why, size_t n)
{
    srv_t *s = ud;
    worker_t *w = h->rank < (uint32_t)s->n ? &s->w[h->rank] : NULL;
    uint8_t diff = 0;
    static const uint8_t zero[PS_SHM_TOKEN];
    if (w)
        for (int i = 0; i < PS_SHM_TOKEN; i++) diff |= (uint8_t)(h->token[i] ^ w->shm_token[i]);
    if (h->run_id != s->run_id || !w || diff || memcmp(w->shm_token, zero, sizeof zero) == 0 ||
        strcmp(w->host_id, s->net.host_id) != 0) {
        snprintf(why, n, "rank %u, run %016" PRIx64 ": no such worker was offered shared memory with that token",
                 h->rank, h->run_id);
        return -EACCES;
    }
    if (w->state != W_ASSIGNED || w->shm_grad) {
        snprintf(why, n, "rank %u is %s%s", w->rank, psd_wstate_name[w->state], w->shm_grad ? " and has a region" : "");
        return -EALREADY;
    }
    size_t bytes = s->layout.n_params * sizeof(float);
    char bad[96];
    if (h->grad_bytes != bytes || ps_shm_check_sealed(fd, bytes, bad, sizeof bad) != 0) {
        snprintf(why, n, "rank %u's gradient region: %s", w->rank,
                 h->grad_bytes != bytes ? "wrong size" : bad);
        return -EINVAL;
    }
    void *p = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        snprintf(why, n, "rank %u's gradient region: mmap: %s", w->rank, strerror(e));
        return -e;
    }
    w->shm_grad = p;
    return 0;
}

/* Parameters in shared slots and the socket where workers on this host ask
 * for them. Without either, everyone uses the wire. */
static void start_shm(srv_t *s)
{
    ps_host_id(s->net.host_id, sizeof s->net.host_id);
    int rc = psd_store_share(&s->store);
    if (rc == 0) {
        snprintf(s->net.shm_name, sizeof s->net.shm_name, "psd-%016" PRIx64 "-%d", s->run_id, (int)getpid());
        rc = psd_shm_listen(&s->net.shm, &s->net.loop, s->net.shm_name, s->store.shm_ro_fd, PSD_MAX_ARENAS,
                            s->store.shm_slot_floats * sizeof(float), shm_hello, s);
    }
    if (rc != 0)
        PS_WARN("no shared memory for workers on this host (%s): they use the wire", strerror(-rc));
    else
        PS_INFO("shared memory for workers on this host: socket @%s", s->net.shm_name);
}

/* Close psd's sockets and end its ZeroMQ context, which returns once what
 * was queued (the workers' SHUTDOWN) is sent, or after the router's
 * linger: linger_ms, or -1 for the one set when it was opened (1 s). */
static void zmq_end(srv_t *s, int linger_ms)
{
    if (s->net.sock && linger_ms >= 0) zmq_setsockopt(s->net.sock, ZMQ_LINGER, &linger_ms, sizeof linger_ms);
    ps_zmq_close_monitored(s->net.sock, s->net.mon);
    s->net.sock = s->net.mon = NULL;
    psd_zap_stop(&s->net.zap);
    if (s->net.zctx) zmq_ctx_term(s->net.zctx);
    s->net.zctx = NULL;
}

/* The run's set-up before any socket: config policy (keep_best with shards), the model
 * (unless from the first worker), outputs held, a resume; a checkpoint at the run's end
 * writes its weights and ends here. true to go on; false with *code the exit code. */
static bool run_setup(srv_t *s, const ps_config_t *c, const psd_run_opts_t *opts, int *code)
{
    *code = PSD_EXIT_ERROR;
    s->cfg = *c;
    s->opts = *opts;
    psd_metrics_init(&s->metrics);
    s->config_hash = ps_config_hash(c);
    s->run_id = make_run_id();
    if (psd_run_workers_init(s, opts->max_workers) != 0) return false;
    char lerr[512];
    if (c->kind != PS_MODEL_FROM_WORKER && ps_run_layout(c, &s->layout, lerr, sizeof lerr) != 0) {
        PS_ERROR("%s", lerr);
        *code = PSD_EXIT_USAGE;
        return false;
    }
    if (psd_valid_data_init(s) != 0) {
        *code = PSD_EXIT_USAGE;
        return false;
    }
    psd_best_init(&s->vl.keep, c->best_metric, c->best_mode, 0, 0);
    psd_best_init(&s->vl.stop, c->stop_metric, c->stop_mode, c->stop_min_delta, c->stop_patience);
    if (c->best_metric[0] && opts->shards > 1) {
        PS_ERROR("train.keep_best: not with psd shards yet (each holds a part of the weights); use one psd");
        *code = PSD_EXIT_USAGE;
        return false;
    }
    if ((c->best_metric[0] || c->stop_metric[0]) && c->val_fraction <= 0 && c->val_size <= 0)
        PS_WARN("train.%s: no held-out validation set (data.val_fraction): the best epoch is chosen on the test "
                "set, whose figures then flatter it", c->best_metric[0] ? "keep_best" : "early_stop");
    ps_arena_init(&s->net.rx_arena, s->net.rx_buf, sizeof s->net.rx_buf);
    if (psd_step_init(s) != 0) {
        PS_ERROR("psd out of memory");
        return false;
    }
    s->sh.n = opts->shards > 1 ? opts->shards : 1; /* the store owns shard 0's part (psd_store_init_part) */
    if (c->kind == PS_MODEL_FROM_WORKER && opts->resume_dir) { /* the model is the checkpoint's */
        char rdir[PS_PATH_MAX];
        uint64_t run_id;
        int rr = psd_run_resolve_resume_dir(opts->resume_dir, rdir, sizeof rdir, &run_id);
        if (rr != 0) snprintf(lerr, sizeof lerr, "%s", strerror(-rr));
        if (rr != 0 || psd_ckpt_newest_layout(rdir, run_id, &s->layout, s->offer.config, lerr, sizeof lerr) != 0 ||
            (s->offer.config[0] && psd_adopt(s, s->offer.config, lerr, sizeof lerr) != 0)) { /* and its optimizer */
            PS_ERROR("cannot resume from %s: %s", opts->resume_dir, lerr);
            *code = PSD_EXIT_USAGE;
            return false;
        }
    }
    if (c->kind == PS_MODEL_TENSORS || (c->kind == PS_MODEL_FROM_WORKER && s->layout.n_tensors > 0))
        psd_say_optimizer(&s->cfg); /* a user's model: what it took from where (from_worker: psd_offer.c) */
    if ((c->kind != PS_MODEL_FROM_WORKER || s->layout.n_tensors > 0) && (*code = psd_model_setup(s, NULL)) != 0)
        return false;
    *code = PSD_EXIT_ERROR;
    if ((*code = psd_run_hold_outputs(s)) != 0 || (opts->resume_dir && (*code = psd_run_resume(s)) != 0)) return false;
    *code = PSD_EXIT_ERROR;
    if (s->epoch >= (uint32_t)c->epochs && sharded(s)) /* the shards may hold older steps only: they decide */
        PS_INFO("shard 0's checkpoint is at the end of the run (%d epochs): waiting for the other shards' parts",
                c->epochs);
    else if (s->epoch >= (uint32_t)c->epochs ||
             (!sharded(s) && psd_best_on(&s->vl.stop) && psd_best_stop(&s->vl.stop))) {
        if (s->epoch < (uint32_t)c->epochs) { /* its early stopping had ended it (train.early_stop's state) */
            s->vl.stopped_early = true;
            PS_INFO("the checkpoint is of a run that stopped early after epoch %u (train.early_stop): nothing to "
                    "train", s->epoch);
        } else {
            PS_INFO("the checkpoint is at the end of the run (%d epochs): nothing to train", c->epochs);
        }
        if (opts->check) { /* the start would write the weights and end: nothing to refuse */
            *code = 0;
            return false;
        }
        char err[PS_PATH_MAX + 400];
        if (psd_run_resume_metrics(s, err, sizeof err) != 0) { /* psd ends as a run that starts: its lines past it go */
            PS_ERROR("%s", err);
            *code = PSD_EXIT_USAGE;
            return false;
        }
        s->epoch--; /* the last epoch trained, as the end of the run writes it */
        psd_run_save_weights(s);
        *code = s->exit_code;
        return false;
    }
    return true;
}

/* The router socket, the start's log lines, the loop's handles (poll, timer, signals),
 * shared memory and HTTP: 0, or the exit code (*loop_ok once the loop is made: the
 * teardown closes it). */
static int run_open(srv_t *s, const ps_config_t *c, const psd_run_opts_t *opts, bool *loop_ok)
{
    int code;
    snprintf(s->ck.run_dir, sizeof s->ck.run_dir, "%s/run-%016" PRIx64, c->ckpt_dir, s->run_id);
    s->net.zctx = psd_zmq_context(c);
    /* from_worker: sized for the largest model psd takes, before any worker exists */
    const size_t n_params = s->model_ready ? s->layout.n_params : (size_t)c->max_params;
    if ((code = psd_router_open(s->net.zctx, c, c->listen, opts->no_zap, n_params, sharded(s), true, &s->locks,
                                &s->net.sock, &s->net.zap, &s->net.mon)) != 0)
        return code;
    s->silence = psd_silence_limit(c, n_params);
    code = PSD_EXIT_ERROR;
    char ep[256] = "";
    size_t eplen = sizeof ep;
    zmq_getsockopt(s->net.sock, ZMQ_LAST_ENDPOINT, ep, &eplen);
    PS_INFO("psd %s (protocol %u): run %016" PRIx64 ", listening on %s, waiting for %d workers", PSD_VERSION,
            PS_PROTOCOL_VERSION, s->run_id, ep, c->workers);
    if (s->model_ready)
        PS_INFO("model %zu parameters in %d tensors (%d units on the wire), %zu training / %zu test samples, "
                "optimizer %s, schedule %s", ps_layout_numel(&s->layout), ps_layout_ntab(&s->layout),
                s->layout.n_tensors, s->train_count, s->test_count, ps_opt_name(s->cfg.opt),
                ps_sched_name(s->cfg.sched));
    else
        PS_INFO("model from the first worker (model.kind from_worker, at most %lld parameters), %zu training / %zu "
                "test samples; the optimizer: the config's keys, then what the first worker offers",
                (long long)c->max_params, s->train_count, s->test_count);
    bool bound = false;
    int usable = ps_cpus_usable(&bound, NULL), threads = psd_step_threads(c);
    PS_INFO("threads: %d for the step, %d ZeroMQ I/O; %d usable CPU%s%s", threads, psd_io_threads(c), usable,
            usable == 1 ? "" : "s", bound ? " (this process's affinity or cgroup quota, not the host's)" : "");
    PS_DEBUG("steps: %d chunks on %d threads", s->store.n_chunks, threads);
    if (s->stream)
        PS_INFO("streamed steps: %d chunks of up to %zu KiB, each stepped as soon as every worker has sent it",
                s->st.nc, s->st.cf * sizeof(float) / 1024);
    if (sharded(s)) PS_INFO("psd shard 0 of %d: waiting for shards 1..%d to join", s->sh.n, s->sh.n - 1);
    if (s->silence > c->worker_timeout + 0.5)
        PS_INFO("a silent worker is lost after %.1f s: server.worker_timeout %.1f s plus %.1f s each way for a "
                "message of the whole model (%.0f MB at 40 MB/s%s)",
                s->silence, c->worker_timeout, psd_transfer_s(n_params), 4.0 * (double)n_params / 1e6,
                s->model_ready ? "" : "; model.max_params: the model is not known yet");

    int fd;
    size_t fdlen = sizeof fd;
    zmq_getsockopt(s->net.sock, ZMQ_FD, &fd, &fdlen);
    uv_loop_init(&s->net.loop);
    *loop_ok = true;
    uv_poll_init(&s->net.loop, &s->net.poll, fd);
    uv_timer_init(&s->net.loop, &s->net.timer);
    uv_signal_init(&s->net.loop, &s->net.sigint);
    uv_signal_init(&s->net.loop, &s->net.sigterm);
    uv_signal_init(&s->net.loop, &s->net.sigusr1);
    uv_signal_init(&s->net.loop, &s->net.sighup);
    s->net.poll.data = s->net.timer.data = s->net.sigint.data = s->net.sigterm.data = s->net.sigusr1.data = s->net.sighup.data = s;
    uv_poll_start(&s->net.poll, UV_READABLE, on_poll);
    uv_timer_start(&s->net.timer, on_timer, 100, 100);
    uv_signal_start(&s->net.sigint, on_signal, SIGINT);
    uv_signal_start(&s->net.sigterm, on_signal, SIGTERM);
    uv_signal_start(&s->net.sigusr1, on_signal, SIGUSR1);
    uv_signal_start(&s->net.sighup, on_signal, SIGHUP);
    /* with shards: every tensor on the wire; the table on psd: rows go over the wire */
    if (c->shared_memory && !sharded(s) && !s->table_on_psd) {
        if (s->model_ready) start_shm(s);
        else s->net.shm_later = true;
    }
    return 0;
}

/* Everything the run holds, given back once the loop has ended (a checkpoint being
 * written finished first): the final exit code (the metrics file's loss makes it 6). */
static int run_teardown(srv_t *s, bool loop_ok, int code)
{
    if (s->ck.writer || s->ck.open) { /* a last checkpoint still being written: let it finish */
        if (s->stopping > 0 && code >= 128 && s->ck.writer) { /* a second signal: exit at once */
            /* the workers' SHUTDOWN (a few bytes each) is queued: end
             * ZeroMQ as at any exit, with a short linger, so that it goes
             * out (or they would wait for a psd that is not coming back),
             * then leave the checkpoint's writer behind */
            zmq_end(s, 250);
            _exit(code);
        }
        /* the one under way, then the one asked for while it was written
         * (the run's last, maybe): each waited for */
        for (int i = 0; i < 3 && (s->ck.writer || s->ck.open); i++) psd_run_poll_checkpoint(s, true);
    }
    psd_run_said_last(s);
    if (loop_ok) {
        psd_http_stop(&s->net.http);
        psd_shm_close(s->net.shm);
        uv_close((uv_handle_t *)&s->net.poll, close_cb);
        uv_close((uv_handle_t *)&s->net.timer, close_cb);
        uv_close((uv_handle_t *)&s->net.sigint, close_cb);
        uv_close((uv_handle_t *)&s->net.sigterm, close_cb);
        uv_close((uv_handle_t *)&s->net.sigusr1, close_cb);
        uv_close((uv_handle_t *)&s->net.sighup, close_cb);
        /* a uv_stop before the loop ever ran (a stop while loading) makes
         * the first uv_run return at once: run it until the closes are done */
        for (int i = 0; i < 3 && uv_run(&s->net.loop, UV_RUN_DEFAULT) != 0; i++)
            ;
        if (uv_loop_close(&s->net.loop) != 0) PS_WARN("psd's event loop did not close cleanly");
    }
    psd_run_workers_release(s);
    if (s->net.sock) ps_msg_drain(s->net.sock, 0.1, 1.0); /* what workers sent before they saw SHUTDOWN */
    zmq_end(s, -1);
    psd_metrics_close(&s->metrics);
    if (psd_metrics_incomplete(&s->metrics) && code == PSD_EXIT_OK) {
        PS_ERROR("exit %d: the run's metrics file %s is incomplete: %u epoch line%s not written (%s)",
                 PSD_EXIT_METRICS, s->cfg.metrics, s->metrics.lost, s->metrics.lost == 1 ? "" : "s",
                 strerror(s->metrics.err));
        code = PSD_EXIT_METRICS;
    }
    psd_locks_release(&s->locks);
    psd_shard0_init_free(s);
    psd_model_free(s);
    ps_layout_free(&s->layout);
    ps_layout_free(&s->offer.layout);
    psd_samples_free(&s->smp);
    psd_valid_free(s);
    psd_step_free(s);
    psd_stream_free(s);
    if (s->net.rx_arena.fallbacks)
        PS_DEBUG("%" PRIu64 " decoded headers did not fit the receive arena", s->net.rx_arena.fallbacks);
    psd_run_workers_free(s);
    free(s);
    return code;
}

int psd_server_run(const ps_config_t *c, const psd_run_opts_t *opts)
{
    srv_t *s = calloc(1, sizeof *s);
    if (!s) return PSD_EXIT_ERROR;
    int code = PSD_EXIT_ERROR;
    bool loop_ok = false;
    if (!run_setup(s, c, opts, &code) || (code = run_open(s, c, opts, &loop_ok)) != 0) goto out;
    s->t_boot = ps_now();
    if (c->http[0] && (code = start_http(s)) != 0) goto out;
    if (opts->check) { /* --check-config: every check of the start passed, its sockets bound; nothing written */
        code = 0;
        goto out;
    }
    if ((code = make_outputs(s)) != 0) goto out;
    code = PSD_EXIT_ERROR;
    /* the live progress line: on a terminal, unless the log is for a machine (json) */
    s->tty = isatty(STDERR_FILENO) && c->log_format == PS_LOG_TEXT && getenv("TERM") &&
             strcmp(getenv("TERM"), "dumb") != 0;
    s->phase = PHASE_WAIT;
    s->phase_deadline = ps_now() + c->start_timeout;
    /* one that came while psd loaded (counted then): acted on now, as
     * on_signal would have */
    int early = ps_early_stop_signal();
    if (early) request_stop(s, early, strsignal(early));
    drain(s);
    ps_malloc_settle(); /* the data's decoding */
    if (s->phase != PHASE_DONE) uv_run(&s->net.loop, UV_RUN_DEFAULT);
    if (s->tty) ps_log_status(NULL);
    code = s->exit_code;
out:
    return run_teardown(s, loop_ok, code);
}

