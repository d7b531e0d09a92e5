/* psd_run.c - the run's phases: workers ready, at the barrier, leaving
 * or lost; epochs, validation and its exact reduction, the end of the run
 * (weights, metrics line), checkpoint scheduling, and --resume. */
#include "psd_core.h"

#include <ctype.h>

#include "ps_weights_st.h"
#include "psd_run.h"
#include "psd_status.h"

/* One psd's weights file, from the current version (psd shards write theirs
 * as the parts come: psd_shard0_begin_save, psd_shard0_fetch_next). */
void psd_run_save_weights(srv_t *s)
{
    if (!s->cfg.save[0]) return;
    char err[512];
    ps_weights_meta_t meta = {.run_id = s->run_id, .step = s->step, .epoch = s->epoch};
    if (ps_weights_save(s->cfg.save, &s->layout, s->store.cur->w, &meta, err, sizeof err) != 0) {
        PS_ERROR("%s", err);
        s->exit_code = PSD_EXIT_ERROR;
        return;
    }
    PS_INFO("saved weights (version %" PRIu64 ") to %s", s->store.cur->version, s->cfg.save);
}

static void start_epoch(srv_t *s)
{
    uint64_t T = s->n_pos;
    ps_rng_permutation(s->smp.perm, T, s->cfg.seed, 1000 + s->epoch);
    if (s->vl.train_ids) /* a held-out split: positions are the samples not held out */
        for (uint64_t i = 0; i < T; i++) s->smp.perm[i] = s->vl.train_ids[s->smp.perm[i]];
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED) to[k++] = &s->w[i];
    /* positions not trained yet: all of them, or what a resumed epoch has left */
    uint64_t *pos = malloc((T ? T : 1) * sizeof *pos);
    if (!pos) {
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    size_t n = psd_samples_begin(&s->smp, s->resumed_mid_epoch, pos);
    if (!s->resumed_mid_epoch) {
        s->epoch_step = 0;
        s->ep.loss = 0;
        s->ep.correct = s->ep.samples = 0;
    }
    s->ep.compute_s = s->ep.wait_s = 0;
    s->ep.timed = 0;
    s->ep.step_s0 = s->store.step_s;
    s->ep.in_place0 = s->store.in_place;
    s->ep.step_n = 0;
    s->bytes_in_done += s->ep.bytes_in;
    s->bytes_out_done += s->ep.bytes_out;
    s->ep.bytes_in = s->ep.bytes_out = 0;
    s->ep.rows_in = s->ep.rows_pushes = 0;
    s->ep.rows_out = s->ep.rows_replies = 0;
    s->resumed_mid_epoch = false;
    uint64_t longest = k ? (T + (uint64_t)k - 1) / (uint64_t)k : T;
    s->spe = (double)((longest + (uint64_t)s->cfg.batch_size - 1) / (uint64_t)s->cfg.batch_size);
    if (s->cfg.sync != PS_SYNC_BSP) s->spe *= k ? k : 1; /* a step per push, not per round of pushes */
    if (s->spe < 1) s->spe = 1;
    s->ep.stale_sum = s->ep.stale_n = s->ep.stale_max = s->ep.lead_max = 0;
    s->ep.moved = s->ep.ahead = 0;
    s->phase = PHASE_TRAIN;
    s->t_epoch = ps_now();
    for (int i = 0; i < s->n; i++) psd_share_reset(&s->w[i].share);
    if (k == 0) { /* everyone left: the next worker to come takes them all */
        psd_samples_pool_add(&s->smp, pos, n);
        s->orphan_deadline = ps_now() + s->cfg.start_timeout;
        PS_WARN("no workers for epoch %u; waiting up to %.0f s for one to join", s->epoch + 1,
                s->cfg.start_timeout);
    } else {
        psd_give_spread(s, pos, n, to, k, false);
    }
    free(pos);
    if (n == 0) { /* nothing left to train (resumed at the end of an epoch) */
        psd_push_maybe_step(s);
        psd_run_events(s);
    }
}

/* The checkpoint asked for while a step was half taken: now. */
static void deferred_checkpoint(srv_t *s)
{
    if (!s->ck.deferred) return;
    s->ck.deferred = false;
    psd_run_take_checkpoint(s, false);
    if (!s->ck.writer && !s->ck.open && s->ck.stop_when_written)
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd was stopped; the checkpoint failed");
}

/* A worker is gone (lost, left, failed): its samples and validation parts go
 * to the others, or to a worker waiting for the next epoch, or wait for the
 * next worker to join. */
_Static_assert(WEND_N - WEND_LEFT == 4, "psd_ckpt_run_t.ended holds the four endings");

void psd_run_worker_gone(srv_t *s, worker_t *w)
{
    wstate_t was = w->state;
    if (was != W_GONE) {
        if (w->end == WEND_NONE) w->end = WEND_LOST;
        s->ended[w->end]++;
    }
    if (s->stream) psd_stream_forget(s, w);
    if (w->contrib.folded) /* its gradient is in the step's sum (psd_fold.c): its batch is trained */
        psd_step_account_batch(s, w);
    psd_step_release_push(s, w); /* a gradient from a worker declared gone is never applied (streamed: see psd_stream_forget) */
    psd_peers_shm_forget(s, w);
    psd_peers_rows_free(w); /* the rows sent were copied at send */
    w->state = W_GONE;
    w->gone_at = ps_now();
    int live = live_workers(s);
    if (was >= W_READY && was <= W_VALIDATED && (s->phase == PHASE_TRAIN || s->phase == PHASE_VALIDATE) &&
        live > 0 && !s->batch_told) {
        s->batch_told = true; /* train.batch_size is each worker's: a step averages fewer samples now */
        PS_WARN("a step now averages the batches of %d worker%s (%d x train.batch_size %d = %d samples), %d before; "
                "workers that join make it grow again (logged once a run)", live, live == 1 ? "" : "s", live,
                s->cfg.batch_size, live * s->cfg.batch_size, live + 1);
    }
    if (s->phase == PHASE_TRAIN && (was == W_TRAIN || was == W_BARRIER) && w->share.consumed < w->share.assigned) {
        size_t n = (size_t)(w->share.assigned - w->share.consumed);
        uint64_t *pos = psd_share_positions(&w->share, w->share.consumed, n);
        if (!pos) {
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        psd_give_hand_out(s, pos, n, "its remaining");
        free(pos);
        w->share.assigned = w->share.consumed;
        psd_push_maybe_step(s);
        psd_run_events(s);
    } else if (s->phase == PHASE_VALIDATE && w->val_pending > 0) {
        w->val_pending = 0;
        for (int i = 0; i < s->n_parts; i++)
            if (!s->parts[i].done && s->parts[i].worker == (int)(w - s->w)) s->parts[i].worker = -1;
        psd_valid_give_orphans(s);
        if (!psd_valid_least_busy(s)) s->orphan_deadline = ps_now() + s->cfg.start_timeout;
    } else if (s->phase == PHASE_TRAIN) {
        psd_push_maybe_step(s);
        psd_run_events(s);
    }
}

/* The last epoch is validated (and every part of the weights is here). */
static void end_run(srv_t *s)
{
    if (sharded(s) && (s->ck.writer || s->ck.open)) { /* the shards write their parts of the last checkpoint: they
                                                   * are told the run is over once each confirmed it */
        s->ck.end_when_written = true;
        s->phase = PHASE_WAIT;
        s->phase_deadline = INFINITY;
        return;
    }
    s->ck.end_when_written = false;
    double sps = s->train_s_total > 0 ? (double)s->samples_total / s->train_s_total : 0;
    double wall = ps_now() - s->t_start;
    if (!sharded(s)) psd_run_save_weights(s); /* shards: written already (psd_shard0_fetch_next) */
    const char *partial = psd_metrics_incomplete(&s->metrics) ? " (its metrics file is INCOMPLETE)" : "";
    /* the epochs trained: the last one validated (early stopping ends the run before cfg.epochs) */
    char trained[64];
    if (s->vl.stopped_early)
        snprintf(trained, sizeof trained, "%u of %d epochs (early stop)", s->epoch + 1, s->cfg.epochs);
    else
        snprintf(trained, sizeof trained, "%u epochs", s->epoch + 1);
    if (s->val_epoch_last)
        PS_INFO("run finished: %s, %" PRIu64 " steps, val_acc %.4f, %.0f samples/s, %.1f s%s", trained, s->step,
                s->val_acc_last, sps, wall, partial);
    else /* resumed at its end: nothing was trained or validated by this psd */
        PS_INFO("run finished: %s, %" PRIu64 " steps (all before this resume), %.1f s", trained, s->step, wall);
    if (s->int_n[1] > 0)
        PS_INFO("step interval %.2f ms over %" PRIu64 " steps without a checkpoint being written, "
                "%.2f ms over %" PRIu64 " steps while one was",
                1e3 * s->int_sum[0] / (double)(s->int_n[0] ? s->int_n[0] : 1), s->int_n[0],
                1e3 * s->int_sum[1] / (double)s->int_n[1], s->int_n[1]);
    s->finished = true; /* psd_run_said_last: after the last checkpoint is written */
    int code = s->exit_code;
    psd_peers_finish(s, 0, "training finished");
    s->exit_code = code;
}

/* The last epoch is done: with psd shards and --save the other shards'
 * parts come for the weights file first (psd_shard0_fetch_next then ends the run). */
static void run_end(srv_t *s)
{
    if (sharded(s) && s->cfg.save[0] && psd_shard0_begin_save(s)) {
        s->phase = PHASE_WAIT; /* nothing to do but wait for them */
        s->phase_deadline = INFINITY;
        psd_shard0_fetch_next(s);
        psd_run_events(s);
        return;
    }
    end_run(s);
}

/* An epoch is validated (end_validation): the run's end, a stop asked
 * for, or the next epoch; the epoch's checkpoint after its metrics line. */
static void after_validation(srv_t *s)
{
    if (s->phase != PHASE_VALIDATE) return; /* ended meanwhile */
    if (s->vl.closing) {
        psd_valid_write_held(s);
        if (s->cfg.ckpt_dir[0]) psd_run_take_checkpoint(s, true);
        run_end(s);
        return;
    }
    bool stop = s->vl.stop_asked;
    if (s->cfg.ckpt_dir[0] && (stop || (s->cfg.ckpt_every_epochs > 0 &&
                                         (s->epoch + 1) % (uint32_t)s->cfg.ckpt_every_epochs == 0)))
        psd_run_take_checkpoint(s, true);
    if (stop) {
        PS_INFO("stopping after epoch %u as asked (--stop-after-epoch); resume with --resume %s",
                s->epoch + 1, s->cfg.ckpt_dir[0] ? s->ck.run_dir : "DIR");
        if (s->ck.writer || s->ck.open) {
            s->ck.stop_when_written = true;
            s->phase = PHASE_WAIT; /* nothing more to do but write */
            s->phase_deadline = INFINITY;
        } else {
            psd_peers_finish(s, 0, "psd stopped after the epoch it was asked to");
        }
        return;
    }
    s->epoch++;
    start_epoch(s);
}

void psd_run_take_checkpoint(srv_t *s, bool epoch_done)
{
    if (!s->cfg.ckpt_dir[0]) return;
    if (s->stepping || s->st.open) { /* between a sharded step's halves (every shard checkpoints the same
                                      * step after it), or in a streamed step: once the step is taken */
        s->ck.deferred = true;
        return;
    }
    if (s->ck.writer || s->ck.open) { /* one at a time: with shards, until each confirmed its part */
        s->ck.again = true;
        if (epoch_done) {
            s->ck.again_epoch_done = true;
            s->ck.again_epoch = s->epoch;
            s->ck.again_steps = s->store.steps;
        }
        return;
    }
    if (sharded(s) && !shards_ready(s)) { /* a part alone is no checkpoint, and nothing has trained yet */
        PS_WARN("no checkpoint taken: not every psd shard has joined (and resumed) yet");
        return;
    }
    psd_ckpt_meta_t m = {
        .run_id = s->run_id, .config_hash = s->config_hash, .seed = s->cfg.seed,
        .step = s->store.steps, .version = s->store.cur->version, .epoch = s->epoch,
        .epoch_done = epoch_done, .epoch_step = s->epoch_step, .steps_per_epoch = s->spe,
        .ep_loss = s->ep.loss, .ep_correct = s->ep.correct, .ep_samples = s->ep.samples,
        .train_s_total = s->train_s_total + (s->phase == PHASE_TRAIN ? ps_now() - s->t_epoch : 0),
        .samples_total = s->samples_total, .lr = s->lr, .train_count = s->n_pos,
        .n_sizes = s->layout.n_sizes, .opt_kind = (uint32_t)s->cfg.opt,
        .n_slots = (uint32_t)psd_optim_slots(&s->store.opt), .n_params = s->layout.n_params,
        .shard = 0, .shards = (uint32_t)s->sh.n, .keep_step = sharded(s) ? s->ck.safe : 0};
    memcpy(m.sizes, s->layout.sizes, sizeof m.sizes);
    m.run = (psd_ckpt_run_t){.train_size = s->train_count, .test_size = s->test_count, .n_val = s->vl.n_val,
                             .keep = s->vl.keep, .stop = s->vl.stop, .best_version = s->vl.best_version};
    if (s->vl.id_known) snprintf(m.run.data_id, sizeof m.run.data_id, "%s", s->vl.data_id);
    for (int k = WEND_LEFT; k < WEND_N; k++) m.run.ended[k - WEND_LEFT] = s->ended[k];
    snprintf(m.run.offer, sizeof m.run.offer, "%s", s->adopted);
    if (s->layout.table >= 0) {
        m.table_rows = (uint64_t)s->layout.t[s->layout.table].rows;
        m.table_dim = (uint32_t)s->layout.t[s->layout.table].cols;
    }
    int rc = psd_ckpt_begin(&s->ck.writer, s->ck.run_dir, psd_ckpt_keep(&s->cfg, s->sh.n), &m, s->smp.seen, &s->store);
    if (rc != 0) {
        PS_ERROR("cannot start a checkpoint in %s: %s", s->ck.run_dir, strerror(-rc));
        s->ck.writer = NULL;
        return;
    }
    s->ck.step = m.step;
    s->ck.version = m.version;
    s->ck.fail[0] = '\0';
    for (int i = 1; i < s->sh.n; i++) s->sh.shard[i].ck_acked = false;
    if (sharded(s)) { /* every shard writes its part of the same step */
        Psd__Header h;
        Psd__ShardCkpt ck = PSD__SHARD_CKPT__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_CKPT;
        ck.step = s->store.steps;
        ck.version = s->store.cur->version;
        ck.keep_step = s->ck.safe;
        h.body_case = PSD__HEADER__BODY_SHARD_CKPT;
        h.shard_ckpt = &ck;
        psd_peers_shards_send_all(s, &h);
    }
}

/* The checkpoint asked for while another was written: now (an epoch's end
 * if it was one and nothing trained since). */
static void take_again(srv_t *s)
{
    bool epoch_done = s->ck.again_epoch_done && s->ck.again_epoch == s->epoch && s->ck.again_steps == s->store.steps;
    s->ck.again = false;
    s->ck.again_epoch_done = false;
    psd_run_take_checkpoint(s, epoch_done);
}

/* psctl checkpoint: answer whoever waits (why "": written). */
static void ctl_answer(srv_t *s, const char *why)
{
    char msg[PS_PATH_MAX + 480];
    snprintf(msg, sizeof msg, !why[0] ? "checkpoint written: %s" : "checkpoint failed: %s", !why[0] ? s->ck.path : why);
    for (int i = 0; i < s->ck.n_ctl_wait; i++)
        psd_peers_control_reply(s, s->ck.ctl_wait[i].ident, s->ck.ctl_wait[i].ident_len, !why[0], msg, NULL);
    s->ck.n_ctl_wait = 0;
}

/* The checkpoint is written, or failed: every part of it (shard 0's, then
 * each shard's confirmation). Stop if asked, start the next one if asked,
 * answer psctl once none is coming. `unconfirmed`: psd exits without
 * every shard's confirmation (a failure: the parts may be missing). */
static void ckpt_complete(srv_t *s, bool unconfirmed)
{
    s->ck.open = false;
    char why[sizeof s->ck.fail];
    if (s->ck.rc != 0) snprintf(why, sizeof why, "%s", strerror(-s->ck.rc));
    else if (s->ck.fail[0]) snprintf(why, sizeof why, "%s", s->ck.fail);
    else if (unconfirmed) snprintf(why, sizeof why, "psd exited before every psd shard confirmed its part");
    else why[0] = '\0';
    if (unconfirmed && !s->ck.rc && !s->ck.fail[0])
        PS_WARN("psd exits before every psd shard confirmed its part of checkpoint %" PRIu64, s->ck.step);
    if (!why[0]) {
        if (sharded(s)) PS_INFO("checkpoint of step %" PRIu64 " written by all %d psd shards", s->ck.step, s->sh.n);
        s->ck.written++;
        s->ck.last_t = ps_now();
        s->ck.safe = s->ck.step;
    }
    if (s->ck.stop_when_written && s->ck.again && !why[0]) {
        /* asked for while another was written (the stop itself, or the
         * epoch's end before --stop-after-epoch): the stop's checkpoint is
         * of the state now, not of the one written */
        take_again(s);
        if (s->ck.writer || s->ck.deferred) return;
        snprintf(why, sizeof why, "the checkpoint of the state at the stop could not be started");
    }
    if (s->ck.stop_when_written) {
        ctl_answer(s, why);
        if (why[0]) /* nothing to resume from: say so, and fail */
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd stopped; its checkpoint failed");
        else
            psd_peers_finish(s, 0,
                   s->stopping > 0 ? "psd was stopped; checkpoint saved" : "psd stopped as asked; checkpoint saved");
        return;
    }
    if (s->ck.again) {
        if (sharded(s) && s->phase == PHASE_DONE) { /* the shards have stopped: a part alone is no checkpoint */
            s->ck.again = false;
            PS_WARN("the checkpoint asked for while another was written is not taken: the psd shards have stopped");
        } else {
            take_again(s);
        }
    }
    if (!s->ck.writer && !s->ck.deferred) ctl_answer(s, why); /* none coming for them: this was theirs */
    if (s->ck.end_when_written && !s->ck.writer && s->phase != PHASE_DONE) end_run(s);
}

/* The writer finished: log; once every shard confirmed its part (wait:
 * psd exits, it does not wait for them), the checkpoint is complete. */
void psd_run_poll_checkpoint(srv_t *s, bool wait)
{
    if (s->ck.writer) {
        if (!wait && !psd_ckpt_done(s->ck.writer)) return;
        double secs = 0;
        uint64_t bytes = 0, peak = 0;
        s->ck.rc = psd_ckpt_end(&s->ck.writer, s->ck.path, sizeof s->ck.path, &secs, &bytes, &peak);
        s->ck.open = true;
        if (s->ck.rc != 0) PS_ERROR("checkpoint failed: %s", strerror(-s->ck.rc));
        else
            PS_INFO("checkpoint %s: %.1f MB in %.2f s, peak extra memory %.1f MB%s", s->ck.path, (double)bytes / 1e6,
                    secs, (double)peak / 1e6, sharded(s) ? " (shard 0's part)" : "");
    }
    if (!s->ck.open) return;
    bool confirmed = true;
    for (int i = 1; i < s->sh.n; i++) confirmed &= s->sh.shard[i].ck_acked;
    if (confirmed || wait) ckpt_complete(s, !confirmed && s->ck.rc == 0);
}

/* A shard's part of the checkpoint being taken is written, or failed. */
void psd_run_on_shard_ckpt_done(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardCkpt *ck = m->hdr->shard_ckpt;
    shard_peer_t *sh = &s->sh.shard[i];
    if ((!s->ck.writer && !s->ck.open) || ck->step != s->ck.step || sh->ck_acked) {
        psd_peers_drop_shard(s, i, "CKPT_DONE for step %" PRIu64 " (taking %s%" PRIu64 ")", ck->step,
             s->ck.writer || s->ck.open ? "" : "none after ", s->ck.step);
        return;
    }
    sh->ck_acked = true;
    if (ck->error && ck->error[0]) {
        PS_ERROR("psd shard %d (%s pid %u) could not write its part of checkpoint %" PRIu64 ": %s", i, sh->hostname,
                 sh->pid, ck->step, ck->error);
        if (!s->ck.fail[0])
            snprintf(s->ck.fail, sizeof s->ck.fail, "psd shard %d could not write its part: %.300s", i, ck->error);
    }
    psd_run_poll_checkpoint(s, false);
}

void psd_run_on_ready(srv_t *s, worker_t *w, ps_msg_t *m)
{
    if (w->state != W_ASSIGNED) {
        psd_peers_drop(s, w, "READY while %s", psd_wstate_name[w->state]);
        return;
    }
    Psd__Ready *r = m->hdr->ready;
    int ok = psd_valid_data_ready_ok(s, w, r);
    if (ok < 0) return; /* dropped */
    if (ok == 0) { /* refused (psd_valid_data_ready_ok said why, to it and in the log) */
        s->ended[WEND_REFUSED]++;
        w->end = WEND_REFUSED;
        psd_peers_shm_forget(s, w); /* its region, if it sent its hello: unmapped, and the slot free for reuse */
        psd_peers_rows_free(w);
        w->state = W_GONE;
        w->gone_at = ps_now();
        return;
    }
    if (r->shm && !w->shm_grad) {
        psd_peers_drop(s, w, "READY with shared memory psd did not set up");
        return;
    }
    if (r->shm) {
        w->shm = true;
        PS_INFO("rank %u exchanges tensors with psd through shared memory", w->rank);
    } else if (w->shm_grad) {
        psd_peers_shm_forget(s, w); /* it gave up on its side */
    }
    w->state = W_READY;
    if (s->ck.stop_when_written || s->ck.end_when_written || s->sh.wr)
        return; /* stopping, writing the weights or the last checkpoint: nothing more to train */
    if (s->phase == PHASE_WAIT) {
        if (live_workers(s) >= s->cfg.workers) {
            if (s->epoch)
                PS_INFO("%d workers ready; training epochs %u to %d", live_workers(s), s->epoch + 1, s->cfg.epochs);
            else
                PS_INFO("%d workers ready; training %d epochs", live_workers(s), s->cfg.epochs);
            s->t_start = ps_now();
            s->workers_at_start = live_workers(s);
            start_epoch(s);
        }
        return;
    }
    /* joining a run under way: take samples waiting for a worker at once,
     * else wait for the next epoch */
    if (psd_give_take_pool(s, w)) return;
    if (s->phase == PHASE_VALIDATE) {
        psd_valid_give_orphans(s); /* it is the least busy */
        if (w->state == W_VALIDATING) return;
    }
    PS_INFO("rank %u joins from epoch %u", w->rank, s->epoch + 2);
}

void psd_run_on_barrier(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Barrier *b = m->hdr->barrier;
    if (b->epoch != s->epoch || (w->state != W_TRAIN && w->state != W_BARRIER)) {
        psd_peers_drop(s, w, "BARRIER for epoch %u while %s in epoch %u", b->epoch, psd_wstate_name[w->state], s->epoch + 1);
        return;
    }
    if (b->samples < w->share.assigned) return; /* sent before it got more samples: it will come again */
    uint64_t done = w->share.consumed + (psd_contrib_own_done(&w->contrib) ? w->contrib.head.batch : 0);
    if (b->samples != w->share.assigned || done != w->share.assigned) {
        psd_peers_drop(s, w, "BARRIER after %" PRIu64 " samples, psd counted %" PRIu64 " of %" PRIu64, b->samples, done,
             w->share.assigned);
        return;
    }
    if (w->state == W_TRAIN) {
        w->state = W_BARRIER;
        w->barrier_at = ps_now();
        psd_push_maybe_step(s);
        psd_run_events(s);
    }
}

void psd_run_on_worker_error(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Error *e = m->hdr->error;
    PS_ERROR("rank %u (%s pid %u) failed: %s", w->rank, w->hostname, w->pid,
             e->message && e->message[0] ? e->message : "(no message)");
    w->end = WEND_FAILED;
    psd_run_worker_gone(s, w);
}

/* The run finished (end_run) and everything is written: a run that lost
 * workers says so on its last log line. */
void psd_run_said_last(const srv_t *s)
{
    uint64_t ended = 0;
    for (int k = WEND_LEFT; k < WEND_N; k++) ended += s->ended[k];
    const int live = live_workers(s); /* as end_run left them: the loop has stopped */
    if (s->finished && (ended > 0 || live < s->workers_at_start))
        PS_WARN("the run finished with %d of the %d workers it started with: %" PRIu64 " failed, %" PRIu64
                " lost, %" PRIu64 " left, %" PRIu64 " refused (the lines above name them)", live,
                s->workers_at_start, s->ended[WEND_FAILED], s->ended[WEND_LOST], s->ended[WEND_LEFT],
                s->ended[WEND_REFUSED]);
}

/* A message of w psd cannot take (psd_peers_drop's words in why): its run ends with
 * the reason, exit 2 (PSD_EXIT_USAGE: what it sends does not fit this
 * run), and the run goes on without it. */
void psd_run_refuse_worker(srv_t *s, worker_t *w, const char *why)
{
    PS_ERROR("rank %u (%s pid %u) refused: %s; its run ends (exit %d)", w->rank, w->hostname, w->pid, why,
             PSD_EXIT_USAGE);
    char reason[sizeof s->net.refuse_why + 32];
    snprintf(reason, sizeof reason, "psd refused this worker: %s", why);
    psd_peers_send_shutdown(s, w, PSD_EXIT_USAGE, reason);
    w->end = WEND_REFUSED;
    psd_run_worker_gone(s, w);
}

void psd_run_on_leave(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Leave *l = m->hdr->leave;
    const char *why = l->reason && l->reason[0] ? l->reason : l->end_run ? "no reason given" : "planned departure";
    if (l->end_run) /* the shell stops the run after this (request_stop) */
        PS_INFO("rank %u ends the run: %s (%s pid %u leaves with it)", w->rank, why, w->hostname, w->pid);
    else
        PS_INFO("rank %u (%s pid %u) left the run: %s", w->rank, w->hostname, w->pid, why);
    w->end = WEND_LEFT;
    psd_run_worker_gone(s, w);
}

static void log_line(const char *line) { PS_WARN("%s", line); }

/* The run a checkpoint directory is named for (its last component
 * run-<16 hex digits>, as the run writes it), or 0. */
static uint64_t dir_run_id(const char *dir)
{
    size_t end = strlen(dir);
    while (end > 1 && dir[end - 1] == '/') end--;
    const char *b = memrchr(dir, '/', end), *stop = dir + end;
    b = b ? b + 1 : dir;
    if (stop - b != 4 + 16 || strncmp(b, "run-", 4) != 0 || !isxdigit((unsigned char)b[4])) return 0;
    char *x;
    uint64_t id = strtoull(b + 4, &x, 16);
    return x == stop ? id : 0;
}

/* Checkpoints live in DIR/run-<run id>/, so that a new run in the same DIR
 * never mixes with (or prunes) another run's. --resume takes a run
 * directory, or DIR itself: then the run whose newest checkpoint is newest.
 * A run's directory holds that run's checkpoints only: a file of another
 * run found there is skipped (psd_ckpt_load_newest), never adopted. */
int psd_run_resolve_resume_dir(const char *dir, char *out, size_t n, uint64_t *run_id)
{
    DIR *d = opendir(dir);
    if (!d) return -errno;
    struct dirent *e;
    double best_t = -1;
    bool has_ckpt = false;
    char best[PS_PATH_MAX] = "";
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, "ckpt-", 5) == 0) has_ckpt = true;
        if (strncmp(e->d_name, "run-", 4) != 0) continue;
        char sub[PS_PATH_MAX];
        snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
        DIR *sd = opendir(sub);
        if (!sd) continue;
        struct dirent *f;
        while ((f = readdir(sd)) != NULL) {
            if (strncmp(f->d_name, "ckpt-", 5) != 0) continue;
            char fp[PS_PATH_MAX + 300];
            struct stat st;
            snprintf(fp, sizeof fp, "%s/%s", sub, f->d_name);
            if (stat(fp, &st) != 0) continue;
            double t = (double)st.st_mtim.tv_sec + 1e-9 * (double)st.st_mtim.tv_nsec;
            if (t > best_t) {
                best_t = t;
                snprintf(best, sizeof best, "%s", sub);
            }
        }
        closedir(sd);
    }
    closedir(d);
    snprintf(out, n, "%s", has_ckpt || !best[0] ? dir : best);
    *run_id = dir_run_id(out);
    return 0;
}

/* Why checkpoint m cannot be resumed as shard 0 of `shards` with model l and
 * optimizer o (psd_run_resume and --check-config --resume alike), in why;
 * NULL if it can. The data's size is checked by psd_run_resume only (it
 * needs the data). */
static const char *ckpt_misfit(const psd_ckpt_meta_t *m, const ps_layout_t *l, const psd_optim_t *o, int shards,
                               char *why, size_t n)
{
    if (m->shards && (m->shard != 0 || m->shards != (uint32_t)shards)) { /* its other parts are elsewhere */
        snprintf(why, n, "it holds the part of psd shard %u of %u, and this psd is shard 0 of %d: resume with the "
                 "layout it was written with (--shard I/%u)", m->shard, m->shards, shards, m->shards);
        return why;
    }
    uint64_t rows = l->table >= 0 ? (uint64_t)l->t[l->table].rows : 0;
    if (m->n_params != l->n_params || m->n_sizes != l->n_sizes || memcmp(m->sizes, l->sizes, sizeof m->sizes) != 0 ||
        m->table_rows != rows || (rows && (uint64_t)m->table_dim != l->t[l->table].cols) ||
        m->table_crc != psd_ckpt_table_crc(l))
        return "its model (tensor table) does not match this config";
    if (m->n_slots != (uint32_t)psd_optim_slots(o) || m->opt_kind != (uint32_t)o->kind)
        return "its optimizer does not match this config";
    return NULL;
}

/* The run's data and best epoch from checkpoint m: its sizes, split and
 * fingerprint where psd does not know them yet (the workers state them),
 * else they must match; keep_best and early_stop go on where they were
 * (for the same metric). 0, or -1 after saying why not. */
static int resume_data(srv_t *s, const psd_ckpt_meta_t *m, const char *path)
{
    const psd_ckpt_run_t *r = &m->run;
    if (!r->train_size) { /* format 5 or older: its positions are the whole training set */
        if (!s->vl.known) {
            PS_ERROR("cannot resume from %s: it does not say how many samples the data has (an older psd wrote it): "
                     "set data.train_size and data.test_size", path);
            return -1;
        }
        if (m->train_count != s->n_pos || s->vl.n_val) {
            PS_ERROR("cannot resume from %s: its data (%" PRIu64 " training samples) does not match this run's", path,
                     m->train_count);
            return -1;
        }
        return 0;
    }
    if (!s->vl.known) {
        if (r->train_size > UINT32_MAX || r->test_size > UINT32_MAX ||
            psd_valid_data_setup(s, (size_t)r->train_size, (size_t)r->test_size, r->data_id[0] ? r->data_id : NULL) != 0)
            return -1;
    } else if (!s->vl.id_known && r->data_id[0]) {
        snprintf(s->vl.data_id, sizeof s->vl.data_id, "%s", r->data_id);
        s->vl.id_known = true;
    }
    if (r->train_size != s->train_count || r->test_size != s->test_count || r->n_val != s->vl.n_val ||
        m->train_count != s->n_pos) {
        PS_ERROR("cannot resume from %s: its data (%" PRIu64 " training samples, %" PRIu64 " held out, %" PRIu64
                 " test) does not match this run's (%zu, %zu, %zu)", path, r->train_size, r->n_val, r->test_size,
                 s->train_count, s->vl.n_val, s->test_count);
        return -1;
    }
    psd_best_t *b[2] = {&s->vl.keep, &s->vl.stop};
    const psd_best_t *was[2] = {&r->keep, &r->stop};
    for (int i = 0; i < 2; i++) {
        if (!psd_best_on(b[i]) || !was[i]->has) continue;
        if (strcmp(b[i]->metric, was[i]->metric) != 0 || b[i]->max != was[i]->max) {
            PS_WARN("train.%s: the checkpoint's best epoch was by %s; this run's is by %s: it starts over",
                    i ? "early_stop" : "keep_best", was[i]->metric, b[i]->metric);
            continue;
        }
        b[i]->has = true;
        b[i]->best = was[i]->best;
        b[i]->epoch = was[i]->epoch;
        b[i]->bad = was[i]->bad;
        if (i == 0) s->vl.best_version = r->best_version;
        PS_INFO("train.%s: the best epoch so far is %u (%s %.6g)%s", i ? "early_stop" : "keep_best", b[i]->epoch,
                b[i]->metric, b[i]->best, i ? "" : ", its weights in train.keep_best.path");
    }
    return 0;
}

/* Epochs logged after the checkpoint resumed (s->epoch epochs done) are
 * trained and logged again: their lines are dropped, so that the metrics
 * file keeps each epoch once. 0, or -1 with err. */
int psd_run_resume_metrics(srv_t *s, char *err, size_t n)
{
    char why[PS_PATH_MAX + 200];
    if (!s->cfg.metrics[0] || psd_metrics_trim(&s->metrics, s->cfg.metrics, s->run_id, s->epoch, why, sizeof why) >= 0)
        return 0;
    snprintf(err, n, "cannot resume: %s", why);
    return -1;
}

/* Why a checkpoint of config hash `was` does not fit config c, into buf:
 * a run of a user's model made before psd took PyTorch's defaults is told
 * the flags that give it its former values. */
static void hash_misfit(const ps_config_t *c, uint64_t was, const char *path, char *buf, size_t n)
{
    ps_config_t old;
    char flags[700];
    if (ps_config_before_user_defaults(c, &old, flags, sizeof flags) > 0 && ps_config_hash(&old) == was) {
        snprintf(buf, n, "cannot resume from %s: it was written before psd gave a user's model PyTorch's optimizer "
                 "defaults, with psd's former ones; resume it with them: %s", path, flags);
        return;
    }
    snprintf(buf, n, "cannot resume from %s: it was written with another config (hash %016" PRIx64 ", this one %016"
             PRIx64 "); use --force-resume to resume anyway", path, was, ps_config_hash(c));
}

/* A checkpoint read (path) into the store and the run, if it fits: 0, or
 * PSD_EXIT_USAGE after saying why not. */
static int resume_apply(srv_t *s, const psd_ckpt_meta_t *m, const uint8_t *seen, const float *weights,
                        float *const slots[2], const char *path)
{
    char why[256];
    const char *misfit = ckpt_misfit(m, &s->layout, &s->store.opt, s->sh.n, why, sizeof why);
    if (m->config_hash != s->config_hash && !s->opts.force_resume) {
        char hwhy[PS_PATH_MAX + 900];
        hash_misfit(&s->cfg, m->config_hash, path, hwhy, sizeof hwhy);
        PS_ERROR("%s", hwhy);
        return PSD_EXIT_USAGE;
    }
    if (misfit) {
        PS_ERROR("cannot resume from %s: %s", path, misfit);
        return PSD_EXIT_USAGE;
    }
    if (resume_data(s, m, path) != 0) return PSD_EXIT_USAGE;
    if (m->config_hash != s->config_hash) PS_WARN("resuming with another config, as forced");
    psd_store_load_part(&s->store, weights, (const float *const *)slots, m->n_slots); /* a shard: its part only */
    s->store.steps = m->step;
    s->store.cur->version = m->version;
    s->run_id = m->run_id;
    s->step = m->step;
    s->lr = m->lr;
    s->train_s_total = m->train_s_total;
    s->samples_total = m->samples_total;
    for (int k = WEND_LEFT; k < WEND_N; k++) s->ended[k] = m->run.ended[k - WEND_LEFT]; /* the run's, so far */
    if (m->epoch_done) {
        s->epoch = m->epoch + 1;
        s->resumed_mid_epoch = false;
    } else {
        s->epoch = m->epoch;
        s->epoch_step = m->epoch_step;
        s->spe = m->steps_per_epoch;
        s->ep.loss = m->ep_loss;
        s->ep.correct = m->ep_correct;
        s->ep.samples = m->ep_samples;
        memcpy(s->smp.seen, seen, (s->n_pos + 7) / 8);
        s->resumed_mid_epoch = true;
    }
    PS_INFO("resuming run %016" PRIx64 " from %s: step %" PRIu64 ", epoch %u%s", s->run_id, path, s->step,
            s->epoch + 1, s->resumed_mid_epoch ? " (part done)" : "");
    /* at the start the metrics file is trimmed once psd is sure to start
     * (make_outputs); later (psd shards going back) here */
    char err[PS_PATH_MAX + 400];
    if (s->metrics.fd >= 0 && psd_run_resume_metrics(s, err, sizeof err) != 0) {
        PS_ERROR("%s", err);
        return PSD_EXIT_USAGE;
    }
    s->resumed = true;
    s->resumed_step = m->step;
    /* the steps the psd shards may resume at: this one and older */
    s->sh.n_resume_steps = psd_ckpt_steps(s->sh.resume_dir, m->step, s->sh.resume_steps, PSD_RESUME_STEPS_MAX);
    return 0;
}

/* This run's weights and metrics files are its own (psd_lock.h): 0, or
 * PSD_EXIT_USAGE after saying which file another psd holds. */
int psd_run_hold_outputs(srv_t *s)
{
    char err[PS_PATH_MAX + 400];
    const char *files[] = {s->cfg.save, s->cfg.metrics};
    for (int i = 0; i < 2; i++)
        if (files[i][0] && psd_lock_beside(&s->locks, files[i], err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            return PSD_EXIT_USAGE;
        }
    return 0;
}

/* --resume DIR: the newest valid checkpoint into the store and the run. */
int psd_run_resume(srv_t *s)
{
    psd_ckpt_meta_t m;
    uint8_t *seen = NULL;
    float *weights = NULL, *slots[2] = {NULL, NULL};
    char path[PS_PATH_MAX], err[512];
    uint64_t run_id;
    int r = psd_run_resolve_resume_dir(s->opts.resume_dir, s->sh.resume_dir, sizeof s->sh.resume_dir, &run_id);
    if (r != 0) {
        PS_ERROR("cannot resume from %s: %s", s->opts.resume_dir, strerror(-r));
        return PSD_EXIT_USAGE;
    }
    /* a run still going writes there: refused. One only read (a copy on a
     * read-only disk) cannot be locked, and needs not be */
    if ((r = psd_lock_dir(&s->locks, s->sh.resume_dir, err, sizeof err)) == -EWOULDBLOCK) {
        PS_ERROR("cannot resume from %s: %s", s->sh.resume_dir, err);
        return PSD_EXIT_USAGE;
    }
    if (psd_ckpt_load_newest(s->sh.resume_dir, run_id, &m, &seen, &weights, slots, path, sizeof path, log_line, err,
                             sizeof err) != 0) {
        PS_ERROR("cannot resume: %s", err);
        return PSD_EXIT_USAGE;
    }
    int rc = resume_apply(s, &m, seen, weights, slots, path);
    free(seen);
    free(weights);
    free(slots[0]);
    free(slots[1]);
    return rc;
}

/* psd shards: a shard has no checkpoint as new as the one shard 0 resumed
 * at. Back to the newest of shard 0's at or before step at_most: 0, or -1
 * after saying why none. Nothing has trained yet (workers wait for every
 * shard to resume). */
static int resume_at(srv_t *s, uint64_t at_most)
{
    uint64_t steps[PSD_RESUME_STEPS_MAX];
    size_t n = psd_ckpt_steps(s->sh.resume_dir, at_most, steps, PSD_RESUME_STEPS_MAX);
    for (size_t k = 0; k < n; k++) {
        psd_ckpt_meta_t m;
        uint8_t *seen = NULL;
        float *weights = NULL, *slots[2] = {NULL, NULL};
        char path[PS_PATH_MAX], err[PS_PATH_MAX + 300];
        if (psd_ckpt_load_step(s->sh.resume_dir, s->run_id, steps[k], &m, &seen, &weights, slots, path, sizeof path,
                               err, sizeof err) != 0) { /* damaged, or another run's: skipped as at the start */
            PS_WARN("%s; trying an older one", err);
            continue;
        }
        int rc = resume_apply(s, &m, seen, weights, slots, path);
        free(seen);
        free(weights);
        free(slots[0]);
        free(slots[1]);
        return rc == 0 ? 0 : -1;
    }
    PS_ERROR("cannot resume: shard 0 has no valid checkpoint in %s of step %" PRIu64 " or older, which every psd shard "
             "would need", s->sh.resume_dir, at_most);
    return -1;
}

int psd_resume_check(const char *dir, const ps_config_t *c, int force, int shards)
{
    psd_ckpt_meta_t m;
    uint8_t *seen = NULL;
    float *weights = NULL, *slots[2] = {NULL, NULL};
    char path[PS_PATH_MAX], err[512], rdir[PS_PATH_MAX];
    uint64_t run_id;
    int r = psd_run_resolve_resume_dir(dir, rdir, sizeof rdir, &run_id);
    if (r != 0) {
        fprintf(stderr, "psd: cannot resume from %s: %s\n", dir, strerror(-r));
        return PSD_EXIT_USAGE;
    }
    if (psd_ckpt_load_newest(rdir, run_id, &m, &seen, &weights, slots, path, sizeof path, log_line, err,
                             sizeof err) != 0) {
        fprintf(stderr, "psd: cannot resume: %s\n", err);
        return PSD_EXIT_USAGE;
    }
    free(seen);
    free(weights);
    free(slots[0]);
    free(slots[1]);
    ps_config_t cc = *c; /* a view: with the optimizer the run's first worker offered (from_worker) */
    ps_layout_t l = {0};
    char why[PS_PATH_MAX + 900];
    int lrc = c->kind == PS_MODEL_FROM_WORKER ? psd_ckpt_newest_layout(rdir, run_id, &l, m.run.offer, why, sizeof why)
                                              : ps_run_layout(c, &l, why, sizeof why);
    if (lrc == 0 && m.run.offer[0] && ps_config_adopt(&cc, m.run.offer, why, sizeof why) != 0) lrc = -1;
    uint64_t h = ps_config_hash(&cc);
    if (lrc == 0 && m.config_hash != h && !force) {
        hash_misfit(&cc, m.config_hash, path, why, sizeof why);
        fprintf(stderr, "psd: %s\n", why);
        ps_layout_free(&l);
        return PSD_EXIT_USAGE;
    }
    psd_optim_t o;
    psd_optim_from_config(&o, &cc);
    const char *misfit = lrc != 0 ? why : ckpt_misfit(&m, &l, &o, shards > 1 ? shards : 1, why, sizeof why);
    ps_layout_free(&l);
    if (misfit) {
        fprintf(stderr, "psd: cannot resume from %s: %s\n", path, misfit);
        return PSD_EXIT_USAGE;
    }
    printf("psd: would resume run %016" PRIx64 " from %s: step %" PRIu64 ", epoch %u%s\n", m.run_id, path, m.step,
           m.epoch + 1, m.epoch_done ? " done" : " in progress");
    return 0;
}

/* Shard i resumed its part at a step (the newest of shard 0's it has), or
 * cannot. All go back to the oldest step any shard resumed at. */
void psd_run_on_shard_resumed(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardCkpt *ck = m->hdr->shard_ckpt;
    shard_peer_t *sh = &s->sh.shard[i];
    if (!s->opts.resume_dir || sh->resumed || shards_ready(s) || s->phase != PHASE_WAIT) {
        psd_peers_drop_shard(s, i, "RESUMED, which psd does not wait for");
        return;
    }
    if (ck->error && ck->error[0]) {
        PS_ERROR("psd shard %d (%s pid %u) cannot resume: %s", i, sh->hostname, sh->pid, ck->error);
        psd_peers_finish(s, PSD_EXIT_USAGE, "a psd shard cannot resume");
        return;
    }
    if (ck->step > s->store.steps) { /* it chose from a list shard 0 has gone back from since */
        PS_DEBUG("psd shard %d resumed at step %" PRIu64 "; shard 0 has gone back to %" PRIu64 ": again", i, ck->step,
                 s->store.steps);
        psd_shard0_send_resume(s, i);
        return;
    }
    sh->resumed = true;
    sh->resumed_step = ck->step;
    sh->resumed_version = ck->version;
    if (ck->step < s->store.steps) { /* it has none as new: shard 0 and the others go back */
        PS_WARN("psd shard %d has no checkpoint of step %" PRIu64 " (its newest usable one is of step %" PRIu64
                "): every shard goes back to a step all of them have", i, s->store.steps, ck->step);
        if (resume_at(s, ck->step) != 0) {
            psd_peers_finish(s, PSD_EXIT_USAGE, "the psd shards have no checkpoint of one step");
            return;
        }
        for (int j = 1; j < s->sh.n; j++) {
            shard_peer_t *o = &s->sh.shard[j];
            if (o->joined && o->resumed && o->resumed_step != s->store.steps) psd_shard0_send_resume(s, j);
        }
    }
    if (!psd_shard0_all_resumed(s)) return;
    for (int j = 1; j < s->sh.n; j++)
        if (s->sh.shard[j].resumed_version != s->store.cur->version) {
            PS_ERROR("psd shard %d resumed step %" PRIu64 " at version %" PRIu64 ", shard 0 at %" PRIu64
                     ": their checkpoints are not of one run", j, s->store.steps, s->sh.shard[j].resumed_version,
                     s->store.cur->version);
            psd_peers_finish(s, PSD_EXIT_USAGE, "the psd shards' checkpoints are not of one run");
            return;
        }
    PS_INFO("all %d psd shards resumed at step %" PRIu64, s->sh.n, s->store.steps);
    s->sh.resume_agreed = true;
    s->ck.safe = s->store.steps; /* every shard has it */
    if (s->epoch >= (uint32_t)s->cfg.epochs) { /* the end of the run: only the weights file is left to write */
        PS_INFO("the shards' checkpoints are at the end of the run (%d epochs): nothing to train", s->cfg.epochs);
        s->epoch--; /* the last epoch trained, as the end of the run writes it */
        s->t_start = ps_now();
        run_end(s);
        return;
    }
    psd_shard0_go(s);
}

/* Act on the events the layers below raised (psd_core.h), in their order;
 * an action may raise more. Called after each call into a lower layer that
 * can raise one, and by the shell after each message, tick and signal. */
void psd_run_events(srv_t *s)
{
    while (s->events) {
        if (s->phase == PHASE_DONE) { /* the run ended meanwhile: nothing is left to act on */
            s->events = 0;
            return;
        }
        if (s->events & PSD_EV_CKPT_DUE) {
            s->events &= ~PSD_EV_CKPT_DUE;
            psd_run_take_checkpoint(s, false);
            if (s->cfg.sync != PS_SYNC_BSP) psd_push_maybe_step(s); /* the pushes not yet applied (psd_push_maybe_step stopped for it) */
        } else if (s->events & PSD_EV_STEP_APPLIED) {
            s->events &= ~PSD_EV_STEP_APPLIED;
            deferred_checkpoint(s);
        } else if (s->events & PSD_EV_EPOCH_TRAINED) {
            s->events &= ~PSD_EV_EPOCH_TRAINED;
            if (s->phase == PHASE_TRAIN) psd_valid_start(s);
        } else if (s->events & PSD_EV_VALIDATED) {
            s->events &= ~PSD_EV_VALIDATED;
            after_validation(s);
        } else if (s->events & PSD_EV_SAVED) {
            s->events &= ~PSD_EV_SAVED;
            end_run(s);
        } else {
            s->events &= ~PSD_EV_SHARDS_JOINED;
            psd_shard0_go(s);
        }
    }
}

/* ---- registration ------------------------------------------------------ */

/* A slot for a new worker: the next one never used, or once all
 * max_workers were taken, the one gone longest whose worker has given psd
 * up and that holds nothing: no push or chunks of one, no parameter slot,
 * no shared region, no validation part. A worker waits s->silence * 3 + 10
 * s for psd while it trains (ASSIGN's step timeout), then registers again;
 * one that sends after its slot was given away is told to register again
 * as a stranger of this run (handle). The gone slot of the registering
 * worker's own identity (`own`, maybe NULL) is taken first, whatever its
 * age: that worker is the one registering. NULL: none. */
static bool slot_holds_nothing(const srv_t *s, const worker_t *w)
{
    if (w->state != W_GONE || psd_contrib_started(&w->contrib) || w->st_member || w->n_gch || w->contrib.push.mask ||
        w->hold || w->shm_grad || w->val_pending)
        return false;
    for (int j = 0; j < s->n_parts; j++)
        if (!s->parts[j].done && s->parts[j].worker == (int)(w - s->w)) return false;
    return true;
}

static worker_t *free_slot(srv_t *s, worker_t *own)
{
    if (s->n < s->max_workers) return &s->w[s->n];
    if (own && slot_holds_nothing(s, own)) return own;
    const double now = ps_now(), after = s->silence * 3 + 10;
    worker_t *best = NULL;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (now - w->gone_at >= after && slot_holds_nothing(s, w) && (!best || w->gone_at < best->gone_at)) best = w;
    }
    return best;
}

void psd_run_on_register(srv_t *s, ps_msg_t *m)
{
    Psd__Register *r = m->hdr->reg;
    const char *host = r->hostname && r->hostname[0] ? r->hostname : "?";
    worker_t *w = psd_peers_find_worker(s, m->ident, m->ident_len);
    if (w && w->state == W_ASSIGNED) { /* its REGISTER was sent twice: answer again */
        if (!w->assign_wait) psd_peers_send_assign(s, w);
        return;
    }
    if (w && w->state != W_GONE) { /* registering again while psd counts it in: it lost us */
        PS_WARN("rank %u (%s pid %u) registers again; taking it as a new worker", w->rank, w->hostname, w->pid);
        psd_run_worker_gone(s, w);
    }
    worker_t *const own = w; /* its gone slot, if it had one */
    w = s->phase == PHASE_DONE ? NULL : free_slot(s, w);
    if (!w) {
        PS_WARN("refused a worker from %s pid %u: %s", host, r->pid,
                s->phase != PHASE_DONE ? "no free worker slot" : "the run is over");
        psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED,
                         s->phase != PHASE_DONE ? "psd has no free worker slot" : "the run is over");
        return;
    }
    const bool reused = w < s->w + s->n;
    const double gone_for = ps_now() - w->gone_at;
    { /* a reused slot's buffers are kept for the new worker, emptied */
        psd_share_t share = w->share;
        zmq_msg_t *gch = w->gch;
        uint8_t *gch_in = w->gch_in;
        int n_gch_cap = w->n_gch_cap;
        memset(w, 0, sizeof *w);
        w->share = share;
        psd_share_reset(&w->share);
        w->gch = gch;
        w->gch_in = gch_in;
        w->n_gch_cap = n_gch_cap;
        if (gch_in) memset(gch_in, 0, (size_t)n_gch_cap);
    }
    for (int i = 0; i < s->n; i++) /* a gone slot of the same identity (a worker that registers again) is
                                    * forgotten: its messages are this one's now, wherever the slots lie */
        if (&s->w[i] != w && s->w[i].ident_len == m->ident_len && memcmp(s->w[i].ident, m->ident, m->ident_len) == 0)
            s->w[i].ident_len = 0;
    memcpy(w->ident, m->ident, m->ident_len);
    w->ident_len = m->ident_len;
    w->rank = (uint32_t)(w - s->w);
    snprintf(w->hostname, sizeof w->hostname, "%s", host);
    snprintf(w->host_id, sizeof w->host_id, "%s", r->host_id && r->host_id[0] ? r->host_id : host);
    snprintf(w->device, sizeof w->device, "%s", r->device && r->device[0] ? r->device : "cpu");
    w->pid = r->pid;
    if (s->stream && !w->gch) { /* its chunks of a step (made once per worker slot) */
        w->gch = calloc((size_t)s->st.nc, sizeof *w->gch);
        w->gch_in = calloc((size_t)s->st.nc, 1);
        w->n_gch_cap = s->st.nc;
        if (!w->gch || !w->gch_in) {
            free(w->gch);
            free(w->gch_in);
            psd_share_free(&w->share);
            memset(w, 0, sizeof *w);
            if (reused) { /* free again, with nothing */
                w->state = W_GONE;
                w->gone_at = ps_now();
            }
            PS_WARN("refused a worker from %s pid %u: out of memory", host, r->pid);
            psd_peers_send_error_ident(s, m->ident, m->ident_len, PSD__ERR_CODE__ERR_REFUSED, "psd is out of memory");
            return;
        }
    }
    w->state = W_ASSIGNED;
    if (s->net.shm && getrandom(w->shm_token, sizeof w->shm_token, 0) != (ssize_t)sizeof w->shm_token)
        memset(w->shm_token, 0, sizeof w->shm_token); /* an all-zero token is never accepted */
    if (sharded(s) && getrandom(w->shard_token, sizeof w->shard_token, 0) != (ssize_t)sizeof w->shard_token) {
        PS_ERROR("getrandom: %s", strerror(errno));
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd failed");
        return;
    }
    w->last_seen = ps_now();
    w->seq_in = m->hdr->seq;
    psd_peers_note_conn(s, &w->conn, m);
    if (!reused) s->n++;
    s->registrations++;
    if (reused && w == own)
        PS_INFO("rank %u registers again in its own slot: every one of psd's %d worker slots was taken (%" PRIu64
                " registrations this run)",
                w->rank, s->max_workers, s->registrations);
    else if (reused)
        PS_INFO("rank %u is given to a new worker: every one of psd's %d worker slots was taken, and its last "
                "worker was lost %.0f s ago (%" PRIu64 " registrations this run)",
                w->rank, s->max_workers, gone_for, s->registrations);
    char dev[48];
    if (r->device_index >= 0) snprintf(dev, sizeof dev, "%s:%d", w->device, r->device_index);
    else snprintf(dev, sizeof dev, "%s", w->device);
    PS_INFO("worker registered: rank %u, %s pid %u, %s%s%s%s (%d ready before it)", w->rank, w->hostname, w->pid, dev,
            r->identity_hint && r->identity_hint[0] ? ", task " : "", r->identity_hint ? r->identity_hint : "",
            m->hdr->run_id ? ", rejoining" : "", live_workers(s));
    if (sharded(s) && !shards_ready(s)) { /* its ASSIGN names every shard */
        w->assign_wait = true;
        if (all_shards(s))
            PS_INFO("rank %u waits for the psd shards to %s", w->rank,
                    s->opts.resume_dir ? "resume" : "have their parts of the initial values");
        else
            PS_INFO("rank %u waits for %d more psd shard%s", w->rank, s->sh.n - 1 - shards_joined(s),
                    s->sh.n - 1 - shards_joined(s) == 1 ? "" : "s");
        return;
    }
    if (sharded(s)) psd_peers_shards_worker(s, w);
    psd_peers_send_assign(s, w);
}

/* Workers whose connection closed (the shell drained their last words) are
 * lost at once (a process that ends, killed or crashed, has its
 * connections closed by its kernel): nobody waits worker_timeout for it.
 * One still alive reconnects, is told it was declared lost, and registers
 * again, as after a timeout. Workers lost in the same tick are given
 * nothing of each other's (psd_give_hand_out, psd_give_take_pool and
 * psd_valid_least_busy pass over conn_closed). */
void psd_run_closed(srv_t *s, double now)
{
    for (int i = 0; i < s->n && s->phase != PHASE_DONE; i++) {
        worker_t *w = &s->w[i];
        if (!w->conn_closed) continue;
        w->conn_closed = false;
        if (w->state == W_GONE) continue;
        PS_WARN("rank %u (%s pid %u) lost: its connection closed, %.1f s after its last message, while %s; going "
                "on without it",
                w->rank, w->hostname, w->pid, now - w->last_seen, psd_wstate_name[w->state]);
        psd_run_worker_gone(s, w);
    }
}

/* The tick: the start timeout; workers silent past server.worker_timeout
 * while psd waits for them (silence counted only over time psd was there
 * to hear, ps_hearing_t), one whose push a psd shard never got whole, one
 * registered and never ready; an epoch nobody comes back to finish. */
void psd_run_tick(srv_t *s, double now)
{
    if (s->phase == PHASE_WAIT) {
        if (now > s->phase_deadline) {
            int ready = 0;
            for (int i = 0; i < s->n; i++) ready += s->w[i].state == W_READY;
            PS_ERROR("start timeout: %d of %d workers registered, %d ready after %.0f s%s", s->n, s->cfg.workers,
                     ready, s->cfg.start_timeout, sharded(s) && !all_shards(s) ? " (not every psd shard joined)"
                     : sharded(s) && !shards_ready(s)
                         ? (s->opts.resume_dir ? " (not every psd shard resumed)"
                                               : " (not every psd shard has its part of the initial values)")
                         : "");
            psd_peers_finish(s, PSD_EXIT_START_TIMEOUT, "not all workers came in time");
        }
    } else if (s->phase == PHASE_TRAIN || s->phase == PHASE_VALIDATE) {
        for (int i = 0; i < s->n && s->phase != PHASE_DONE; i++) {
            worker_t *w = &s->w[i];
            bool waited_for = (w->state == W_TRAIN && !psd_contrib_held(&w->contrib) && !w->ssp_wait &&
                               !w->contrib.owed && !w->contrib.waits_go) || w->state == W_VALIDATING;
            if (w->contrib.state == PSD_CONTRIB_OWN && now - ps_heard_at(&s->hearing, w->contrib.own_at) >= s->silence) {
                /* a shard never got all of its push: it died between its messages */
                PS_WARN("rank %u (%s pid %u) lost: psd shards are missing part of its push for %.1f s; going on "
                        "without it", w->rank, w->hostname, w->pid, now - w->contrib.own_at);
                psd_run_worker_gone(s, w);
                w->lost_silent = true;
                continue;
            }
            if (w->state == W_ASSIGNED && now - w->last_seen > s->cfg.start_timeout) {
                /* registered and never said its data was ready: its slot is not waited for */
                PS_WARN("rank %u (%s pid %u) registered %.0f s ago and never said it was ready; forgetting it",
                        w->rank, w->hostname, w->pid, now - w->last_seen);
                psd_run_worker_gone(s, w);
                w->lost_silent = true;
                continue;
            }
            if (!waited_for || now - ps_heard_at(&s->hearing, w->last_seen) < s->silence) continue;
            time_t last = time(NULL) - (time_t)(now - w->last_seen);
            struct tm tm;
            char when[32];
            gmtime_r(&last, &tm);
            strftime(when, sizeof when, "%H:%M:%SZ", &tm);
            PS_WARN("rank %u (%s pid %u) lost: nothing from it for %.1f s (last message at %s) while %s; "
                    "going on without it",
                    w->rank, w->hostname, w->pid, now - w->last_seen, when, psd_wstate_name[w->state]);
            psd_run_worker_gone(s, w);
            w->lost_silent = true;
        }
        bool waiting = s->smp.n_pool > 0 && live_workers(s) == 0, orphans = false;
        for (int i = 0; i < s->n_parts && s->phase == PHASE_VALIDATE; i++)
            orphans |= !s->parts[i].done && s->parts[i].worker < 0;
        waiting |= orphans && !psd_valid_least_busy(s); /* with live workers they wait for one to answer */
        if (waiting && s->phase != PHASE_DONE && now > s->orphan_deadline) {
            PS_ERROR("no worker came back within %.0f s to finish epoch %u", s->cfg.start_timeout, s->epoch + 1);
            psd_run_take_checkpoint(s, false);
            psd_run_poll_checkpoint(s, true);
            psd_peers_finish(s, PSD_EXIT_WORKER_LOST, "no workers left");
        }
    }
}

/* The workers' slots (max_workers of MAX_WORKERS, 0: all): 0, or -1. */
int psd_run_workers_init(srv_t *s, int max_workers)
{
    s->w = calloc(MAX_WORKERS, sizeof *s->w);
    s->max_workers = max_workers > 0 && max_workers < MAX_WORKERS ? max_workers : MAX_WORKERS;
    return s->w ? 0 : -1;
}

/* What each slot holds let go (pushes, shared regions, shares, row lists,
 * streamed chunks), at the run's end while the holder and the sockets'
 * regions are still there. */
void psd_run_workers_release(srv_t *s)
{
    for (int i = 0; s->w && i < s->n; i++) {
        worker_t *w = &s->w[i];
        psd_step_release_push(s, w);
        psd_peers_shm_forget(s, w);
        psd_share_free(&w->share);
        psd_peers_rows_free(w);
        free(w->gch);
        free(w->gch_in);
        w->gch = NULL;
        w->gch_in = NULL;
    }
}

void psd_run_workers_free(srv_t *s)
{
    free(s->w);
    s->w = NULL;
}
