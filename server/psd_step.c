/* psd_step.c - the step: the contributors' reduction and the optimizer
 * over psd's part of the parameters (through the holder, psd_hold.h), the
 * shards told to take the same step, its accounting (samples trained, the
 * loss, divergence, the curve), pull answers (bsp, async, ssp's hold-back)
 * and the weights replies. Push intake is psd_push.c's. */
#include "psd_core.h"

static void send_weights(srv_t *s, worker_t *w);

/* ssp: w may not train its next step before the slowest (clock m) catches
 * up: it has already done train.staleness steps more */
static bool ssp_held(const srv_t *s, const worker_t *w, uint64_t m)
{
    return s->cfg.sync == PS_SYNC_SSP && psd_ssp_held(w->clock, m, (uint64_t)s->cfg.staleness);
}

/* w asked for weights to train on: send them, or with ssp hold them back
 * while it is too far ahead (psd_step_ssp_release answers it later) */
void psd_step_answer_pull(srv_t *s, worker_t *w)
{
    if (s->cfg.sync == PS_SYNC_SSP) {
        uint64_t m = psd_give_min_clock(s);
        if (ssp_held(s, w, m)) {
            w->ssp_wait = true;
            return;
        }
        uint64_t lead = m != UINT64_MAX && w->clock > m ? w->clock - m : 0;
        if (lead > s->ep.lead_max) s->ep.lead_max = lead;
    }
    w->ssp_wait = false;
    psd_give_rebalance(s, w); /* before the weights: w has not begun its next batch */
    send_weights(s, w);
}

/* ssp: answer the workers held back that the slowest has come close enough
 * to (it pushed, reached its barrier, or was lost). psd's own waiting is not
 * the worker's silence: its timeout counts from here. */
void psd_step_ssp_release(srv_t *s)
{
    if (s->cfg.sync != PS_SYNC_SSP) return;
    uint64_t m = psd_give_min_clock(s); /* answering a worker moves no clock */
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (!w->ssp_wait) continue;
        if (w->state != W_TRAIN) {
            w->ssp_wait = false;
            continue;
        }
        if (ssp_held(s, w, m)) continue;
        w->last_seen = ps_now();
        psd_step_answer_pull(s, w);
    }
}

/* The step's per-contributor room (weights, wire types): 0, or -1. */
int psd_step_init(srv_t *s)
{
    s->step_bf16 = calloc(MAX_WORKERS, sizeof *s->step_bf16);
    s->step_wt = calloc(MAX_WORKERS, sizeof *s->step_wt);
    return s->step_bf16 && s->step_wt ? 0 : -1;
}

void psd_step_free(srv_t *s)
{
    free(s->step_bf16);
    free(s->step_wt);
    s->step_bf16 = NULL;
    s->step_wt = NULL;
}

/* Its gradients come as bfloat16: on the wire with train.wire_gradients: bf16. */
bool psd_step_wire_bf16(const srv_t *s, const worker_t *w)
{
    return !w->shm && s->cfg.wire_gradients == PS_WIRE_BF16;
}

/* The chunks of its streamed push let go (train.stream). */
static void release_chunks(worker_t *w)
{
    if (w->n_gch > 0) {
        for (int c = 0; c < w->n_gch_cap; c++)
            if (w->gch_in[c] == 1) zmq_msg_close(&w->gch[c]);
        memset(w->gch_in, 0, (size_t)w->n_gch_cap);
    }
    w->n_gch = 0;
    w->st_member = w->st_req = false;
    w->st_sent = 0;
}

void psd_step_release_push(srv_t *s, worker_t *w)
{
    psd_contrib_release(&w->contrib, &s->holder);
    release_chunks(w);
}

/* w's step times (compute and wait, seconds, from the part that completes
 * its push): the epoch's sums, its moving average (for "slowest worker")
 * and its histograms in /metrics. Values out of range are not counted. */
void psd_step_note_times(srv_t *s, worker_t *w, double compute_s, double wait_s)
{
    if (!(isfinite(compute_s) && isfinite(wait_s) && compute_s >= 0 && wait_s >= 0 && compute_s < 1e6 && wait_s < 1e6))
        return;
    s->ep.compute_s += compute_s;
    s->ep.wait_s += wait_s;
    s->ep.timed++;
    w->compute_ewma = w->compute_ewma > 0 ? 0.9 * w->compute_ewma + 0.1 * compute_s : compute_s;
    psd_hist_add(&w->h_wait, wait_s);
    psd_hist_add(&w->h_compute, compute_s);
}

/* samples trained this epoch, with their summed loss and correct count */
void psd_step_count_trained(srv_t *s, uint64_t samples, double loss, uint64_t correct)
{
    s->ep.samples += samples;
    s->ep.loss += loss;
    s->ep.correct += correct;
}

/* w's batch is trained: its samples seen, its statistics counted */
void psd_step_account_batch(srv_t *s, worker_t *w)
{
    const psd_contrib_head_t *h = &w->contrib.head;
    psd_share_consume(&w->share, &s->smp, h->batch);
    psd_step_count_trained(s, h->batch, h->loss, h->correct);
}

/* The statistics of the step's contributors, their pushes released; those
 * that asked get the new version once it is made (psd_step_done). */
void psd_step_account_step(srv_t *s, uint64_t total, const worker_t *only)
{
    double step_loss = 0;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (!psd_contrib_held(&w->contrib) || (only && w != only)) continue;
        psd_step_account_batch(s, w);
        step_loss += w->contrib.head.loss;
        psd_contrib_applied(&w->contrib, &s->holder, w->st_req); /* a streamed reply has gone out already */
        release_chunks(w);
    }
    s->last_loss = step_loss / (double)total;
}

/* A step taken: its count, timing and loss curve. */
static void count_step(srv_t *s)
{
    s->ep.step_n++;
    s->step++;
    s->epoch_step++;
    double now = ps_now();
    if (s->last_step_t > 0 && s->epoch_step > 1) {
        int during = s->ck.writer != NULL;
        s->int_sum[during] += now - s->last_step_t;
        s->int_n[during]++;
    }
    s->last_step_t = now;
    if (s->curve_every == 0) s->curve_every = 1;
    if (s->step % s->curve_every == 0) {
        if (s->n_curve == PSD_CURVE_MAX) { /* keep every other point, record half as often */
            for (int i = 0; i < PSD_CURVE_MAX / 2; i++) s->curve[i] = s->curve[2 * i + 1];
            s->n_curve = PSD_CURVE_MAX / 2;
            s->curve_every *= 2;
        }
        if (s->step % s->curve_every == 0) {
            s->curve[s->n_curve].step = s->step;
            s->curve[s->n_curve++].loss = (float)s->last_loss;
        }
    }
}

/* The step just counted diverged (psd_diverge.h: its loss against the
 * run's first steps, the norms of its gradient and new weights, this psd's
 * part): the run ends with the reason (exit 1), no weights saved and no
 * checkpoint of it taken. */
static bool diverged(srv_t *s)
{
    psd_amax_t am = psd_store_step_amax(&s->store);
    psd_diverge_verdict_t v = psd_diverge_step(&s->dv, s->cfg.divergence_factor, s->step, s->last_loss,
                                               psd_amax_value(am.g), psd_amax_value(am.w));
    if (v == PSD_DIVERGE_OK) return false;
    char why[512];
    psd_diverge_message(&s->dv, v, s->epoch + 1, why, sizeof why);
    PS_ERROR("%s", why);
    s->ck.deferred = false;
    psd_peers_finish(s, PSD_EXIT_ERROR, v == PSD_DIVERGE_RISE ? "training diverged (the loss rose far above its start)"
                                                    : "training diverged (a norm or the loss is not finite)");
    return true;
}

/* The new version is current: count the step, answer the pulls. A streamed
 * step that every contributor left before any chunk took it (void) is no
 * step: not counted, only answered. */
void psd_step_done(srv_t *s, bool taken)
{
    if (taken) count_step(s);
    if (taken && diverged(s)) return;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        w->contrib.have = 0; /* HAVEs name a version: none of them counts for the next (a non-contributor's) */
        if (w->contrib.owed && w->state == W_TRAIN) {
            w->last_seen = ps_now(); /* psd's own waiting (a deferred pull) is not its silence */
            psd_step_answer_pull(s, w);
        }
        w->contrib.owed = false;
    }
    if (taken && s->cfg.ckpt_every_steps > 0 && s->step % (uint64_t)s->cfg.ckpt_every_steps == 0)
        raise_event(s, PSD_EV_CKPT_DUE);
}

/* Tell the shards to take the same step: contributors, weights, rate. */
static void shards_step(srv_t *s, int k, const double *wt)
{
    uint32_t ranks[MAX_WORKERS];
    int j = 0;
    for (int i = 0; i < s->n && j < k; i++)
        if (psd_contrib_held(&s->w[i].contrib)) ranks[j++] = s->w[i].rank;
    Psd__Header h;
    Psd__ShardStep st = PSD__SHARD_STEP__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_SHARD_STEP;
    st.version = s->store.cur->version;
    st.ranks = ranks;
    st.n_ranks = (size_t)j;
    st.weights = (double *)wt;
    st.n_weights = (size_t)k;
    st.lr = s->lr;
    st.clip_norm = s->cfg.clip_norm;
    st.step = s->store.steps;
    st.cycled = s->momentum >= 0;
    st.momentum = s->momentum;
    h.body_case = PSD__HEADER__BODY_SHARD_STEP;
    h.shard_step = &st;
    psd_peers_shards_send_all(s, &h);
}

/* The learning rate of the step about to be taken (and the momentum a
 * OneCycleLR cycles, set in the store's optimizer). */
void psd_step_lr(srv_t *s)
{
    s->momentum = -1.0;
    if (s->cfg.sched == PS_SCHED_TORCH) { /* torch's scheduler steps: psd's optimizer steps, or epochs */
        int64_t k = s->cfg.sched_interval == PS_INTERVAL_STEP ? (int64_t)s->store.steps : (int64_t)s->epoch;
        s->lr = ps_tsched_lr(&s->tsched, k, s->cfg.lr, &s->momentum);
        if (s->momentum >= 0) psd_optim_set_momentum(&s->store.opt, s->momentum);
        return;
    }
    double frac = (double)s->epoch_step / s->spe;
    if (frac > 0.999999) frac = 0.999999; /* a redistributed epoch may take a few more steps */
    s->lr = psd_sched_lr(&s->cfg, (double)s->epoch + frac, s->spe);
}

/* The step's one contributor when psd_fold.c summed its pushes as they came:
 * the sum (its tensors psd_store_sum, f32), weighted back to the samples in
 * it when a contributor was lost after the sum began (1 otherwise). */
static int fold_contributor(srv_t *s, psd_push_t **ps, const float **shm, double *wt, uint64_t *total)
{
    psd_push_t *p = &s->fold.push;
    p->frames = p->rows = 0;
    p->mask = p->shm = s->holder.all;
    ps[0] = p;
    shm[0] = psd_store_sum(&s->store);
    wt[0] = s->fold.summed == s->fold.total ? 1.0 : (double)s->fold.total / (double)s->fold.summed;
    *total = s->fold.summed;
    s->fold.on = false;
    return 1;
}

/* Reduce the pushes held (every one, or only `only`'s: async and ssp apply
 * each push on its own), apply the optimizer, answer the pulls. Returns
 * with s->stepping set when shards must send their norms first, or with
 * the run ended if no arena was free. */
void psd_step_take(srv_t *s, worker_t *only)
{
    uint64_t total = 0;
    int k = 0; /* contributors in rank order: the same sums every run */
    psd_push_t *ps[MAX_WORKERS];
    const float *shm[MAX_WORKERS];
    double *wt = s->step_wt;
    const bool summed = s->fold.on && !only; /* the pushes summed as they came: the sum is the one contributor */
    if (summed) k = fold_contributor(s, ps, shm, wt, &total);
    for (int i = 0; i < s->n && !summed; i++)
        if (psd_contrib_held(&s->w[i].contrib) && (!only || &s->w[i] == only)) total += s->w[i].contrib.head.batch;
    for (int i = 0; i < s->n && !summed; i++) {
        worker_t *w = &s->w[i];
        if (!psd_contrib_held(&w->contrib) || (only && w != only)) continue;
        ps[k] = &w->contrib.push;
        shm[k] = w->shm ? w->shm_grad : NULL;
        wt[k] = (double)w->contrib.head.batch / (double)total;
        k++;
    }
    if (psd_hold_gather(&s->holder, ps, shm, k) != 0) {
        PS_ERROR("out of memory for the table rows of a step");
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    psd_step_lr(s);
    if (sharded(s)) shards_step(s, k, wt);
    if (sharded(s) && s->cfg.clip_norm > 0) {
        /* the whole gradient's norm first: this part's blocks now, the
         * other shards' in their NORM messages (psd_push_on_shard_norm) */
        if (psd_hold_step(&s->holder, k, wt, 0, 0, true) != 0) {
            PS_ERROR("more table rows in a step than psd made room for");
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
        psd_step_account_step(s, total, NULL);
        s->stepping = true;
        s->stepping_since = ps_now();
        for (int i = 1; i < s->sh.n; i++) s->sh.shard[i].norm_in = false;
        return;
    }
    uint64_t computed_on = only ? only->contrib.head.version : s->store.cur->version;
    double norm = psd_hold_step(&s->holder, k, wt, s->cfg.clip_norm, s->lr, false);
    if (norm < 0) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    if (only) { /* versions applied since the one it was computed on */
        uint64_t stale = s->store.cur->version - 1 - computed_on;
        s->ep.stale_sum += stale;
        s->ep.stale_n++;
        if (stale > s->ep.stale_max) s->ep.stale_max = stale;
        only->clock++;
    }
    psd_step_account_step(s, total, only);
    psd_step_done(s, true);
}

/* Weights frames of the current version, sent without copying (as f32, or
 * from the version's bfloat16 copy with train.wire_weights: bf16); for a
 * worker on shared memory none: *slot (1-based) names the version's slot,
 * which the worker holds until it is sent another. With --x-verify-weights
 * *crc is the CRC-32 of what the worker gets, else 0. */
int psd_step_weights_frames(srv_t *s, worker_t *w, ps_frame_t *fr, uint32_t *slot, uint32_t *crc)
{
    *slot = 0;
    *crc = 0;
    if (w->shm) {
        if (w->hold) psd_store_frame_free(NULL, w->hold);
        w->hold = psd_store_ref_current(&s->store);
        *slot = (uint32_t)psd_store_slot(&s->store, w->hold) + 1;
        if (s->opts.verify_weights) *crc = psd_store_current_crc(&s->store);
        return 0;
    }
    int n = psd_hold_frames(&s->holder, fr, crc);
    for (int i = 0; i < n; i++) s->ep.bytes_out += fr[i].nbytes;
    return n;
}

/* The table on psd: a message's frames sent as copies, so that no reply
 * in flight holds a reference on the version: a step would then go out of
 * place and copy the whole table into the next arena. The frames are the
 * MLP's and a batch's rows, small next to the table. */
static int send_copied(srv_t *s, worker_t *w, Psd__Header *h, ps_frame_t *fr, int n)
{
    for (int i = 0; i < n; i++) fr[i].copy = true;
    return psd_peers_send_to(s, w, h, fr, n);
}

/* The table's frame *fr (a reference on the current version) becomes rows
 * ids[0, n) of it, gathered into vals (n x dim; copied by ZeroMQ at send),
 * with the epoch's byte and row counts. */
static void table_rows_frame(srv_t *s, ps_frame_t *fr, const uint32_t *ids, size_t n, float *vals)
{
    const ps_layout_t *l = &s->layout;
    const size_t D = (size_t)l->t[l->table].cols;
    const float *E = s->store.cur->w + l->t[l->table].offset;
    if (fr->ffn) fr->ffn((void *)fr->data, fr->hint); /* its reference to the version */
    s->ep.bytes_out -= fr->nbytes;
    psd_rows_gather(vals, E, D, ids, n);
    *fr = (ps_frame_t){.data = vals, .nbytes = n * D * sizeof(float), .id = (uint32_t)l->table,
                       .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)n, .cols = (uint32_t)D};
    s->ep.bytes_out += fr->nbytes;
    s->ep.rows_out += n;
}

static void send_weights(srv_t *s, worker_t *w)
{
    Psd__Header h;
    Psd__Weights wt = PSD__WEIGHTS__INIT;
    ps_frame_t fr[PS_MAX_TENSORS];
    psd_peers_hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_WEIGHTS);
    wt.version = s->store.cur->version;
    wt.step = s->step;
    wt.go = psd_fold_go(s, w);
    h.body_case = PSD__HEADER__BODY_WEIGHTS;
    h.weights = &wt;
    int n;
    if (w->shm) {
        n = psd_step_weights_frames(s, w, fr, &wt.shm_slot, &wt.crc);
        w->contrib.push.want.n = 0;
        w->contrib.push.want.has = false;
    } else {
        long rows;
        n = psd_hold_reply(&s->holder, &w->contrib.push, fr, &wt.crc, &rows);
        for (int i = 0; i < n; i++) s->ep.bytes_out += fr[i].nbytes;
        if (rows >= 0) {
            s->ep.rows_out += (uint64_t)rows;
            s->ep.rows_replies++;
            wt.rows = true;
        }
    }
    psd_peers_send_to(s, w, &h, fr, n);
    psd_hold_sent(&s->holder, &w->contrib.push);
}

/* The table on psd: VALIDATE's table frame (the last one, a reference on
 * the version) becomes the rows its range's examples read: their ids, then
 * the rows (gathered, copied by ZeroMQ at send). Once per validation part,
 * so the buffers are allocated here; out of memory, the worker gets none
 * and fails its part. */
void psd_step_range_rows_send(srv_t *s, worker_t *w, Psd__Header *h, ps_frame_t *fr, int n)
{
    Psd__Validate *v = h->validate;
    const size_t per = (size_t)s->cfg.ctr_fields * (size_t)s->cfg.ctr_per_field;
    const size_t count = (size_t)(v->end - v->begin), D = (size_t)s->layout.t[s->layout.table].cols;
    uint32_t *buf = malloc((count * per > 0 ? count * per : 1) * sizeof *buf);
    float *vals = NULL;
    size_t k = 0;
    if (buf) {
        ps_ctr_t g;
        ps_ctr_from_config(&s->cfg, &g);
        uint8_t label;
        for (size_t i = 0; i < count; i++) /* test examples come after the training ones */
            ps_ctr_example(&g, (uint64_t)s->cfg.ctr_train + v->begin + i, buf + i * per, NULL, &label);
        k = ps_sort_unique_u32(buf, count * per);
        vals = malloc((k * D > 0 ? k * D : 1) * sizeof *vals);
    }
    if (!vals) {
        PS_ERROR("out of memory for the table rows of rank %u's validation part", w->rank);
        k = 0;
    }
    static const uint32_t none[1];
    const uint32_t *ids = buf ? buf : none; /* none: k is 0 */
    /* the values of the rows in this psd's piece of the table (a shard:
     * a slice of the sorted ids, none maybe; the worker asks the other
     * shards for theirs) */
    const ps_piece_t *own = &s->store.own[s->layout.table];
    size_t r0 = 0, r1 = 0, a = 0, b = k;
    if (own->n && ps_piece_rows(&s->layout, own, &r0, &r1)) {
        while (a < k && ids[a] < r0) a++;
        for (b = a; b < k && ids[b] < r1; b++) {}
    } else {
        b = a;
    }
    if (n > 0 && fr[n - 1].id == (uint32_t)s->layout.table) {
        table_rows_frame(s, &fr[n - 1], ids + a, b - a, vals);
    } else { /* a shard holding none of the table */
        fr[n++] = (ps_frame_t){.data = vals, .nbytes = 0, .id = (uint32_t)s->layout.table,
                               .dtype = PSD__DTYPE__DT_F32, .rows = 0, .cols = (uint32_t)D};
    }
    fr[n] = fr[n - 1];
    fr[n - 1] = (ps_frame_t){.data = ids, .nbytes = k * sizeof *ids, .id = (uint32_t)s->layout.table,
                             .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)k};
    s->ep.bytes_out += k * sizeof *ids;
    v->rows = true;
    v->crc = 0;
    send_copied(s, w, h, fr, n + 1);
    free(buf);
    free(vals);
}
