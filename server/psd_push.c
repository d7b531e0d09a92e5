/* psd_push.c - what workers send for a step and what it sets off: push
 * intake (whole, in parts, streamed, in shared memory: the frames through
 * the holder, psd_hold.h), pulls, the psd shards' word that they have a
 * worker's push (SHARD_HAVE) or their blocks' norms (SHARD_NORM), and the
 * decision to step (psd_push_maybe_step). The step itself is psd_step.c's, a
 * streamed one psd_stream.c's. Raises PSD_EV_EPOCH_TRAINED and
 * PSD_EV_STEP_APPLIED (psd_core.h) for psd_run.c. */
#include "psd_core.h"

/* The last frame of a PULL (or a PUSH) with want_rows: the table rows the
 * worker's next batch reads, kept for the reply (psd_want_take). 0, or -1
 * (dropped, logged). */
static int want_take(srv_t *s, worker_t *w, ps_msg_t *m)
{
    char why[256];
    if (psd_want_take(&s->holder, &w->contrib.push, m, s->holder.batch_rows, why, sizeof why) != 0) {
        psd_peers_drop(s, w, "PULL %s", why);
        return -1;
    }
    return 0;
}

void psd_push_on_pull(srv_t *s, worker_t *w, ps_msg_t *m)
{
    if (w->state != W_TRAIN) {
        psd_peers_drop(s, w, "PULL while %s", psd_wstate_name[w->state]);
        return;
    }
    uint64_t v = m->hdr->pull->min_version;
    if (v > s->store.cur->version) {
        psd_peers_drop(s, w, "PULL of version %" PRIu64 ", current is %" PRIu64, v, s->store.cur->version);
        return;
    }
    if (m->hdr->pull->want_rows && want_take(s, w, m) != 0) return;
    if (psd_contrib_own_done(&w->contrib)) { /* its last push still waits for the step (it was given more samples since, or
                        * with shards, this asks for the step's version after a push's last part):
                        * answer with the version that step makes; its gradient, in flight or in
                        * its shared region, must not be overwritten before */
        w->contrib.pull_after = true;
        return;
    }
    if (s->st.open || s->stepping || s->fold.on) { /* a streamed step is half taken (maybe in place), psd
                                       * shards take a step (clipping: waiting for their norms), or the
                                       * step's sum is being made (psd_fold.c): the version it makes, not
                                       * the one its push would be stale against */
        w->contrib.owed = true;
        return;
    }
    psd_step_answer_pull(s, w);
}

/* The tensors of a PUSH not streamed: in frames, taken by the holder, or
 * in its shared region (named in the header). Returns whether its push is
 * now whole here, or -1 (dropped, logged). */
static int take_whole(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Push *p = m->hdr->push;
    psd_push_t *pu = &w->contrib.push;
    uint64_t in_shm = 0;
    for (size_t i = 0; i < p->n_shm_tensors; i++) {
        uint32_t t = p->shm_tensors[i];
        if (t >= (uint32_t)s->layout.n_tensors || ((pu->mask | in_shm) & (1ull << t))) {
            psd_peers_drop(s, w, "PUSH of tensor %u: not in the model or already received", t);
            return -1;
        }
        in_shm |= 1ull << t;
    }
    psd_took_t took;
    char why[256];
    if (psd_push_take(&s->holder, pu, m, psd_step_wire_bf16(s, w), in_shm, &took, why, sizeof why) != 0) {
        psd_peers_drop(s, w, "PUSH %s", why);
        return -1;
    }
    s->ep.bytes_in += took.bytes + took.want_bytes;
    if (took.row_push) {
        s->ep.rows_in += took.rows;
        s->ep.rows_pushes++;
    }
    pu->mask |= in_shm;
    pu->shm |= in_shm;
    return pu->mask == s->holder.all;
}

void psd_push_on_push(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Push *p = m->hdr->push;
    if (w->state != W_TRAIN) {
        psd_peers_drop(s, w, "PUSH while %s", psd_wstate_name[w->state]);
        return;
    }
    const psd_contrib_head_t head = {p->version, p->batch, p->loss_sum, p->correct};
    const psd_contrib_limits_t lim = {
        .version = s->store.cur->version,
        .exact = s->cfg.sync == PS_SYNC_BSP,
        .batch_size = (uint32_t)s->cfg.batch_size,
        .left = w->share.assigned - w->share.consumed,
        .shm = w->shm,
        .announce = p->announce,
    };
    char why[256];
    int rc = psd_contrib_check(&w->contrib, &head, m->n_frames, p->n_shm_tensors, &lim, why, sizeof why);
    if (rc == PSD_CONTRIB_DIVERGED) {
        /* not a bad message: the model diverged. Dropping it would only get
         * the workers declared lost one after the other. */
        PS_ERROR("training diverged at step %" PRIu64 " (epoch %u): rank %u's batch loss is %s; lower "
                 "optimizer.lr, add warm-up (schedule.warmup_epochs) or clip (optimizer.clip_norm)",
                 s->step + 1, s->epoch + 1, w->rank, isnan(p->loss_sum) ? "NaN" : "infinite");
        psd_peers_finish(s, PSD_EXIT_ERROR, "training diverged (loss not finite)");
        return;
    }
    if (rc != PSD_CONTRIB_OK) {
        psd_peers_drop(s, w, "%s", why);
        return;
    }
    for (int i = 0; i < s->n && &s->w[i] != w && !psd_contrib_started(&w->contrib); i++) /* (rank order) */
        if (s->w[i].state == W_TRAIN && !psd_contrib_started(&s->w[i].contrib)) {
            s->ep.ahead++; /* begun before a lower rank: what a sum in rank order must wait on */
            break;
        }
    if (p->announce) { /* its tensors come on GO (psd_fold.c) */
        if (!psd_fold_roomed(s, w)) {
            psd_peers_drop(s, w, "PUSH announced, which psd did not ask of it");
            return;
        }
        psd_contrib_part(&w->contrib, &head);
        w->contrib.waits_go = true;
        psd_push_maybe_step(s);
        return;
    }
    int whole = s->stream ? psd_stream_take(s, w, m) : take_whole(s, w, m);
    if (whole < 0) return;
    w->contrib.pull_after |= p->pull;
    if (p->release && w->hold) { /* it reads no more of its slot: the step may update it in place */
        psd_store_frame_free(NULL, w->hold);
        w->hold = NULL;
    }
    psd_contrib_part(&w->contrib, &head);
    if (!whole) { /* more parts to come */
        if (s->stream) psd_push_maybe_step(s); /* its chunks may complete some */
        return;
    }
    bool held = psd_contrib_own(&w->contrib, ps_now(), shard_bits(s));
    psd_step_note_times(s, w, p->compute_s, p->wait_s); /* from the part that completes the push */
    if (held) psd_push_maybe_step(s);
}

/* bsp: once every worker still training has pushed for this version,
 * reduce and apply. async and ssp: apply each push as it completes. */
void psd_push_maybe_step(srv_t *s)
{
    if (s->phase != PHASE_TRAIN || s->stepping) return;
    if (s->cfg.sync != PS_SYNC_BSP) {
        for (int i = 0; i < s->n && s->phase == PHASE_TRAIN; i++)
            if (psd_contrib_held(&s->w[i].contrib)) {
                psd_step_take(s, &s->w[i]);
                if (s->events & PSD_EV_CKPT_DUE) return; /* the checkpoint first: psd_run.c steps on after it */
            }
        if (s->phase != PHASE_TRAIN) return;
        psd_step_ssp_release(s);
    } else if (s->stream) {
        psd_stream_progress(s);
        if (s->phase != PHASE_TRAIN || s->st.open) return;
        for (int i = 0; i < s->n; i++)
            if (psd_contrib_started(&s->w[i].contrib)) return; /* the step waits for a worker to begin its push */
    } else if (psd_fold_wanted(s)) { /* pushes announced: the sum made as they come */
        if (!psd_fold_progress(s)) return;
        if (s->phase != PHASE_TRAIN || s->stepping) return;
    } else {
        int pending = 0;
        for (int i = 0; i < s->n; i++) {
            worker_t *w = &s->w[i];
            bool held = psd_contrib_held(&w->contrib);
            if (w->state == W_TRAIN && !held) return;                         /* still waiting for it */
            if (psd_contrib_own_done(&w->contrib) && !held) return; /* or for a shard to have all of its push */
            pending += held;
        }
        if (pending > 0) psd_step_take(s, NULL);
        if (s->phase != PHASE_TRAIN || s->stepping) return;
    }
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_TRAIN) return;
    if (s->smp.n_pool > 0) return; /* samples wait for a worker to join */
    raise_event(s, PSD_EV_EPOCH_TRAINED);
}

void psd_push_on_shard_norm(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardNorm *n = m->hdr->shard_norm;
    if (!s->stepping || n->version != s->store.cur->version || s->sh.shard[i].norm_in) {
        psd_peers_drop_shard(s, i, "NORM for version %" PRIu64 " (current %" PRIu64 ")", n->version,
             s->store.cur->version);
        return;
    }
    ps_piece_t p[PS_MAX_TENSORS];
    ps_shard_pieces(&s->layout, i, s->sh.n, p);
    size_t want = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) want += (p[t].n + PSD_NORM_BLOCK - 1) / PSD_NORM_BLOCK;
    if (n->n_block_sq != want) {
        psd_peers_drop_shard(s, i, "NORM with %zu blocks, it has %zu", n->n_block_sq, want);
        return;
    }
    for (size_t j = 0; j < want; j++)
        if (n->block_sq[j] < 0) { /* sums of squares (NaN or inf: a diverging gradient, as with one psd) */
            psd_peers_drop_shard(s, i, "NORM with a negative sum of squares");
            return;
        }
    size_t j = 0;
    for (int t = 0; t < s->layout.n_tensors; t++) {
        size_t b = ps_layout_first_block(&s->layout, t) + p[t].off / PSD_NORM_BLOCK;
        for (size_t o = 0; o < p[t].n; o += PSD_NORM_BLOCK) s->store.blk_sq[b++] = n->block_sq[j++];
    }
    s->sh.shard[i].norm_in = true;
    for (int k = 1; k < s->sh.n; k++)
        if (!s->sh.shard[k].norm_in) return;
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
    psd_peers_shards_send_all(s, &h);
    s->stepping = false;
    if (psd_store_apply(&s->store, sumsq, s->cfg.clip_norm, s->lr) != 0) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    psd_step_done(s, true);
    raise_event(s, PSD_EV_STEP_APPLIED);
    psd_push_maybe_step(s);
}

void psd_push_on_shard_have(srv_t *s, int i, ps_msg_t *m)
{
    Psd__ShardHave *hv = m->hdr->shard_have;
    worker_t *w = hv->rank < (uint32_t)s->n ? &s->w[hv->rank] : NULL;
    if (hv->refused && hv->refused[0]) { /* a message of rank the shard cannot take: its run ends */
        if (w && w->state != W_GONE) psd_peers_refuse_after(s, w, "psd shard %d: %s", i, hv->refused);
        else PS_DEBUG("shard %d refused a message of rank %u, no longer in the run: %s", i, hv->rank, hv->refused);
        return;
    }
    if (!w || (w->state != W_TRAIN && w->state != W_BARRIER) || s->stepping || hv->version != s->store.cur->version) {
        /* a worker lost meanwhile, or declared gone: nothing to wait for */
        PS_DEBUG("shard %d has rank %u's push for version %" PRIu64 "; not needed", i, hv->rank, hv->version);
        return;
    }
    if (psd_contrib_have(&w->contrib, i, shard_bits(s))) psd_push_maybe_step(s);
}
