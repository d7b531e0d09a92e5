/* psd_stream.c - streamed steps (train.stream): each chunk of the model
 * is reduced and stepped as soon as every contributor has sent it, and its
 * new weights go out while the rest still arrives; a contributor lost in
 * the middle of a step is settled chunk by chunk. */
#include "psd_core.h"

/* Contributor j's weight (its share of the step's samples) and wire type. */
static void stream_weights(srv_t *s)
{
    uint64_t total = 0;
    for (int j = 0; j < s->st.k; j++) total += s->w[s->st.mem[j]].contrib.head.batch;
    for (int j = 0; j < s->st.k; j++) {
        const worker_t *w = &s->w[s->st.mem[j]];
        s->step_wt[j] = (double)w->contrib.head.batch / (double)total;
        s->step_bf16[j] = psd_step_wire_bf16(s, w);
    }
}

/* Send w the tensors made since the last it got, whole (so that it uses
 * them where they arrive), with the CRC-32 of the version in the message
 * that completes it (--x-verify-weights). */
static void stream_send(srv_t *s, worker_t *w, psd_arena_t *a, bool complete)
{
    if (w->st_sent == s->st.n_tord) return;
    ps_frame_t fr[PS_MAX_TENSORS];
    int n = 0;
    for (; w->st_sent < s->st.n_tord; w->st_sent++, n++) {
        psd_store_tensor_frame(&s->store, a, s->st.tord[w->st_sent], &fr[n]);
        s->ep.bytes_out += fr[n].nbytes;
    }
    Psd__Header h;
    Psd__Weights wt = PSD__WEIGHTS__INIT;
    psd_peers_hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_WEIGHTS);
    wt.version = s->st.open ? s->store.cur->version + 1 : s->store.cur->version;
    wt.step = s->step + 1;
    wt.parts = (uint32_t)s->layout.n_tensors;
    if (complete && s->opts.verify_weights) wt.crc = psd_store_current_crc(&s->store);
    h.body_case = PSD__HEADER__BODY_WEIGHTS;
    h.weights = &wt;
    psd_peers_send_to(s, w, &h, fr, n);
}

/* Chunk c's new values are made: its tensor is complete with its last. */
static void stream_made(srv_t *s, int c)
{
    int t = s->store.chunks[c].t;
    s->st.n_made++;
    if (++s->st.tmade[t] == s->st.tchunks[t]) s->st.tord[s->st.n_tord++] = t;
}

/* The step's contributors are every worker that began its push; they are
 * fixed from here, and the next version is built in st.next. */
static bool stream_open(srv_t *s)
{
    psd_arena_t *next = psd_store_stream_begin(&s->store);
    if (!next) {
        PS_ERROR("no free parameter arena (too many pull replies in flight)");
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return false;
    }
    s->st.next = next;
    s->st.open = true;
    s->st.k = 0;
    for (int i = 0; i < s->n; i++)
        if (psd_contrib_started(&s->w[i].contrib)) {
            s->st.mem[s->st.k++] = i;
            s->w[i].st_member = true;
        }
    stream_weights(s);
    psd_step_lr(s);
    return true;
}

/* No chunk of the streamed step under way has taken it yet: with clipping
 * none does before the whole gradient's norm is known. */
static bool stream_none_applied(const srv_t *s) { return s->cfg.clip_norm > 0 || s->st.n_done == 0; }

/* w, a contributor lost before any chunk took the step, with others left:
 * whether its batch is trained depends on whether the step is taken, so it
 * is set aside (its samples are not handed out with the rest of w's).
 * 0, or -1 out of memory. */
static void set_aside(void *ud, uint64_t p)
{
    srv_t *s = ud;
    s->st.lost_pos[s->st.lost_n++] = p;
}

static int stream_set_lost_aside(srv_t *s, worker_t *w)
{
    size_t need = s->st.lost_n + w->contrib.head.batch;
    if (need > s->st.lost_cap) { /* only when a contributor is lost: never per step */
        uint64_t *p = realloc(s->st.lost_pos, need * sizeof *p);
        if (!p) return -1;
        s->st.lost_pos = p;
        s->st.lost_cap = need;
    }
    psd_share_walk(&w->share, w->share.consumed, w->contrib.head.batch, set_aside, s);
    w->share.consumed += w->contrib.head.batch;
    s->st.lost_loss += w->contrib.head.loss;
    s->st.lost_correct += w->contrib.head.correct;
    return 0;
}

/* The streamed step has ended: the batches set aside count as trained if it
 * was taken (their gradients are in it), else they are handed out again. */
static void stream_settle_lost(srv_t *s)
{
    if (s->st.lost_n == 0) return;
    if (s->st.voided) {
        PS_WARN("the streamed step took no step: the %zu samples of the contributors lost in it are trained again",
                s->st.lost_n);
        psd_give_hand_out(s, s->st.lost_pos, s->st.lost_n, "the lost contributors'");
    } else {
        for (size_t i = 0; i < s->st.lost_n; i++) psd_samples_mark(&s->smp, s->st.lost_pos[i]);
        psd_step_count_trained(s, s->st.lost_n, s->st.lost_loss, s->st.lost_correct);
    }
    s->st.lost_n = 0;
    s->st.lost_loss = 0;
    s->st.lost_correct = 0;
}

/* The stream part (psd_stream_part_t) for the model's chunks of chunk_bytes: 0, or -1 (out
 * of memory; psd_stream_free frees what was made). Called once the model is known
 * (psd_model.c); the part is this file's from then on. */
int psd_stream_init(srv_t *s, size_t chunk_bytes)
{
    psd_stream_part_t *st = &s->st;
    st->cf = ps_chunk_floats(chunk_bytes);
    st->nc = s->store.n_chunks;
    for (int t = 0, k = 0; t < s->layout.n_tensors; k += st->tchunks[t], t++) {
        st->tfirst[t] = k;
        st->tchunks[t] = (int)((s->layout.t[t].numel + st->cf - 1) / st->cf);
    }
    st->have = calloc((size_t)st->nc, sizeof *st->have);
    st->done = calloc((size_t)st->nc, 1);
    st->ready = calloc(ST_BATCH, sizeof *st->ready);
    st->rq = calloc((size_t)st->nc, sizeof *st->rq);
    st->src = calloc((size_t)ST_BATCH * MAX_WORKERS, sizeof *st->src);
    st->mem = calloc(MAX_WORKERS, sizeof *st->mem);
    return st->have && st->done && st->ready && st->rq && st->src && st->mem ? 0 : -1;
}

void psd_stream_free(srv_t *s)
{
    psd_stream_part_t *st = &s->st;
    free(st->have);
    free(st->done);
    free(st->ready);
    free(st->rq);
    free(st->src);
    free(st->mem);
    free(st->lost_pos);
    memset(st, 0, sizeof *st);
}

/* Step every chunk that every contributor has sent; send the new values to
 * the workers waiting for them; once all are made, the version is current
 * and the step done. */
void psd_stream_progress(srv_t *s)
{
    const bool clip = s->cfg.clip_norm > 0;
    if (!s->st.open) { /* every worker training must have begun its push */
        int k = 0;
        for (int i = 0; i < s->n; i++) {
            if (psd_contrib_started(&s->w[i].contrib)) k++;
            else if (s->w[i].state == W_TRAIN) return;
        }
        if (k == 0) return;
        s->st.k = k;
        s->st.rescan = true;
    }
    if (s->st.rescan) { /* once per step (and per contributor lost); then psd_stream_take queues them */
        s->st.rq_head = s->st.rq_tail = 0;
        for (int c = 0; c < s->st.nc; c++)
            if (!s->st.done[c] && s->st.have[c] == s->st.k) s->st.rq[s->st.rq_tail++] = c;
        s->st.rescan = false;
    }
    if (s->st.open && s->st.k == 0) { /* every contributor was lost: the rest take no step */
        if (stream_none_applied(s)) { /* nor did any chunk */
            psd_store_stream_void(&s->store);
            s->st.voided = true;
        }
        for (int c = 0; c < s->st.nc; c++) {
            if (s->st.done[c] && !clip) continue;
            psd_store_stream_keep(&s->store, s->st.next, c);
            s->st.done[c] = 1;
            stream_made(s, c);
        }
        s->st.n_done = s->st.nc;
        s->st.rq_head = s->st.rq_tail = 0; /* kept: none of them is stepped (with no contributor) */
    }
    for (;;) {
        int m = 0;
        while (s->st.rq_head < s->st.rq_tail && m < ST_BATCH) s->st.ready[m++] = s->st.rq[s->st.rq_head++];
        if (m == 0) break;
        if (!s->st.open && !stream_open(s)) return;
        for (int j = 0; j < m; j++) {
            int c = s->st.ready[j];
            for (int k = 0; k < s->st.k; k++) {
                const worker_t *w = &s->w[s->st.mem[k]];
                s->st.src[(size_t)j * (size_t)s->st.k + (size_t)k] =
                    w->gch_in[c] == 2 ? (const void *)(w->shm_grad + s->store.chunks[c].off)
                                      : (const void *)zmq_msg_data(&w->gch[c]);
            }
        }
        psd_store_stream_chunks(&s->store, s->st.next, s->st.ready, m, s->st.k, s->st.src, s->step_bf16, s->step_wt,
                                clip, s->lr);
        for (int j = 0; j < m; j++) {
            int c = s->st.ready[j];
            s->st.done[c] = 1;
            s->st.n_done++;
            if (!clip) stream_made(s, c);
            for (int k = 0; k < s->st.k; k++) { /* its frames are no longer needed */
                worker_t *w = &s->w[s->st.mem[k]];
                if (w->gch_in[c] == 1) zmq_msg_close(&w->gch[c]);
                w->gch_in[c] = 3;
            }
        }
    }
    if (!s->st.open) return;
    if (clip && s->st.n_made == 0 && s->st.n_done == s->st.nc) { /* the global norm is known: apply */
        psd_store_stream_apply(&s->store, s->st.next, s->cfg.clip_norm, s->lr);
        for (int c = 0; c < s->st.nc; c++) stream_made(s, c);
    }
    psd_arena_t *a = s->st.next;
    bool complete = s->st.n_made == s->st.nc;
    if (complete) {
        psd_store_stream_end(&s->store, a);
        s->st.open = false;
    }
    for (int i = 0; i < s->n; i++)
        if (s->w[i].st_req && s->w[i].state != W_GONE) stream_send(s, &s->w[i], a, complete);
    if (!complete) return;
    uint64_t total = 0;
    for (int i = 0; i < s->n; i++)
        if (psd_contrib_held(&s->w[i].contrib)) total += s->w[i].contrib.head.batch;
    memset(s->st.have, 0, (size_t)s->st.nc * sizeof *s->st.have);
    memset(s->st.done, 0, (size_t)s->st.nc);
    s->st.n_done = s->st.n_made = s->st.n_tord = 0;
    s->st.rq_head = s->st.rq_tail = 0;
    memset(s->st.tmade, 0, sizeof s->st.tmade);
    stream_settle_lost(s);
    if (total > 0) psd_step_account_step(s, total, NULL); /* none: every contributor was lost (counted then) */
    psd_step_done(s, !s->st.voided);
    s->st.voided = false;
    raise_event(s, PSD_EV_STEP_APPLIED);
}

/* w is gone: its chunks of the step no longer count. If it was a
 * contributor of the step under way, its gradient is in the chunks stepped
 * (or, with clipping, reduced) already and cannot be taken out again: the
 * remaining chunks are stepped with the other contributors' gradients,
 * weighted among themselves, and its batch counts as trained. With
 * clipping (no chunk takes the step before the end) that holds only if the
 * step is taken: its batch is set aside until the step ends
 * (stream_settle_lost). If it was the last contributor and no chunk has
 * taken the step, the step is void (psd_stream_progress) and its batch is
 * still to be trained, as a gradient lost before a whole step. (A
 * contributor is one from the step's first chunks on: it is in some.) */
void psd_stream_forget(srv_t *s, worker_t *w)
{
    if (!w->gch) return;
    for (int c = 0; c < s->st.nc; c++)
        if ((w->gch_in[c] == 1 || w->gch_in[c] == 2) && !s->st.done[c]) s->st.have[c]--;
    if (!w->st_member) return;
    if (s->st.k == 1 && stream_none_applied(s))
        PS_WARN("rank %u, the last contributor of a streamed step, was lost in the middle of it, before any chunk "
                "took the step: no step is taken, and its batch of %u is still to be trained", w->rank,
                w->contrib.head.batch);
    else if (stream_none_applied(s)) { /* reduced into some chunks, applied only if the step is taken */
        PS_WARN("rank %u was lost in the middle of a streamed step, before any chunk took the step: its gradient is in "
                "%d of %d chunks, the others go on without it; its batch of %u counts as trained if the step is taken, "
                "else it is trained again", w->rank, s->st.n_done, s->st.nc, w->contrib.head.batch);
        if (stream_set_lost_aside(s, w) != 0) psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
    } else {
        PS_WARN("rank %u was lost in the middle of a streamed step: its gradient is in %d of %d chunks, the others "
                "are stepped without it; its batch of %u counts as trained", w->rank, s->st.n_done, s->st.nc,
                w->contrib.head.batch);
        psd_step_account_batch(s, w);
    }
    int k = 0;
    for (int j = 0; j < s->st.k; j++)
        if (&s->w[s->st.mem[j]] != w) s->st.mem[k++] = s->st.mem[j];
    s->st.k = k;
    s->st.rescan = true;
    w->st_member = false;
    if (k > 0) stream_weights(s);
}

/* Check a streamed PUSH's frames (chunks) and tensors in shared memory
 * (every chunk of them), then keep them: whether w's push is now whole
 * (1) or not (0), or -1 when it was dropped (logged). */
int psd_stream_take(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__Push *p = m->hdr->push;
    const ps_layout_t *l = &s->layout;
    if (!w->gch) {
        psd_peers_drop(s, w, "streamed PUSH before its assignment");
        return -1;
    }
    if (s->st.open && !w->st_member) {
        psd_peers_drop(s, w, "PUSH for a step it is not part of");
        return -1;
    }
    uint64_t in_shm = 0;
    for (size_t i = 0; i < p->n_shm_tensors; i++) {
        uint32_t t = p->shm_tensors[i];
        bool bad = t >= (uint32_t)l->n_tensors || (in_shm & (1ull << t)); /* every chunk of it still to come */
        for (int c = bad ? 0 : s->st.tfirst[t], e = bad ? 0 : c + s->st.tchunks[t]; c < e && !bad; c++)
            bad = w->gch_in[c] != 0;
        if (bad) {
            psd_peers_drop(s, w, "PUSH of tensor %u: not in the model or already received", t);
            return -1;
        }
        in_shm |= 1ull << t;
    }
    int cs[PS_MAX_FRAMES];
    const bool bf16 = psd_step_wire_bf16(s, w);
    for (int i = 0; i < m->n_frames; i++) {
        const Psd__TensorDesc *d = m->hdr->tensors[i];
        size_t n = 0;
        bool ok = bf16 ? ps_msg_bf16(m, i, &n) != NULL : ps_msg_f32(m, i, &n) != NULL;
        int c = ok && d->id < (uint32_t)l->n_tensors ? ps_chunk_find(l, s->st.cf, (int)d->id, d->offset, n) : -1;
        if (c < 0) {
            psd_peers_drop(s, w, "PUSH frame %d is no chunk of the model (tensor %u, %zu %s at %" PRIu64
                 "; train.stream: chunks of %zu)", i, d->id, n, bf16 ? "bf16" : "f32", d->offset, s->st.cf);
            return -1;
        }
        bool dup = w->gch_in[c] != 0 || (in_shm & (1ull << d->id)); /* not twice, nor also in shared memory */
        for (int j = 0; j < i; j++) dup |= cs[j] == c;
        if (dup) {
            psd_peers_drop(s, w, "PUSH of chunk %d of tensor %u: already received", c, d->id);
            return -1;
        }
        cs[i] = c;
    }
    for (int t = 0; t < l->n_tensors; t++) {
        if (!(in_shm & (1ull << t))) continue;
        for (int c = s->st.tfirst[t], e = c + s->st.tchunks[t]; c < e; c++) {
            w->gch_in[c] = 2;
            w->n_gch++;
            if (++s->st.have[c] == s->st.k && s->st.open) s->st.rq[s->st.rq_tail++] = c;
        }
    }
    for (int i = 0; i < m->n_frames; i++) {
        int c = cs[i];
        s->ep.bytes_in += zmq_msg_size(&m->frames[i]);
        zmq_msg_init(&w->gch[c]);
        zmq_msg_move(&w->gch[c], &m->frames[i]);
        w->gch_in[c] = 1;
        w->n_gch++;
        if (++s->st.have[c] == s->st.k && s->st.open) s->st.rq[s->st.rq_tail++] = c;
    }
    if (p->pull && !w->shm && s->cfg.wire_weights == PS_WIRE_F32) w->st_req = true;
    return w->n_gch == s->st.nc;
}
