/* psd_give.c - positions of the epoch to workers (EPOCH messages): an
 * epoch's split, a lost worker's positions handed out, the pool taken by a
 * worker that joins, async/ssp rebalancing. The accounting itself is
 * psd_samples.c's (plain data); this file decides who and sends. */
#include "psd_core.h"

/* ssp: the clock (pushes applied this epoch) of the slowest worker still
 * training, UINT64_MAX if none is */
uint64_t psd_give_min_clock(const srv_t *s)
{
    uint64_t m = UINT64_MAX;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_TRAIN && s->w[i].clock < m) m = s->w[i].clock;
    return m;
}

/* An EPOCH header for w in the current epoch (ep: its body, the caller's, initialised here). */
static void epoch_hdr(srv_t *s, worker_t *w, Psd__Header *h, Psd__Epoch *ep, bool append)
{
    psd__epoch__init(ep);
    psd_peers_hdr_for(s, w, h, PSD__MSG_TYPE__MSG_EPOCH);
    ep->epoch = s->epoch;
    ep->world = (uint32_t)live_workers(s);
    ep->version = s->store.cur->version;
    ep->append = append;
    if (!append) ep->last_val = told_val(s);
    h->body_case = PSD__HEADER__BODY_EPOCH;
    h->epoch = ep;
}

/* Give positions pos[0..n) (sorted or not) to w: EPOCH message (append:
 * more for the current epoch) with the ranges and the sample ids. */
static int give_positions(srv_t *s, worker_t *w, const uint64_t *pos, size_t n, bool append)
{
    uint32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    if (!ids) return -ENOMEM;
    if (!append) psd_share_reset(&w->share);
    int first_range = w->share.n_ranges;
    if (psd_share_add(&w->share, pos, n) != 0) {
        free(ids);
        return -ENOMEM;
    }
    for (size_t i = 0; i < n; i++) ids[i] = s->smp.perm[pos[i]];
    uint32_t on_host = 0;
    for (int j = 0; j < s->n; j++)
        on_host += s->w[j].state != W_GONE && strcmp(s->w[j].host_id, w->host_id) == 0;
    Psd__Header h;
    Psd__Epoch ep;
    int nr = w->share.n_ranges - first_range;
    Psd__Range *rs = calloc((size_t)(nr > 0 ? nr : 1), sizeof *rs);
    Psd__Range **rp = calloc((size_t)(nr > 0 ? nr : 1), sizeof *rp);
    if (!rs || !rp) {
        free(ids);
        free(rs);
        free(rp);
        return -ENOMEM;
    }
    for (int i = 0; i < nr; i++) {
        psd__range__init(&rs[i]);
        rs[i].begin = w->share.ranges[first_range + i].begin;
        rs[i].end = w->share.ranges[first_range + i].end;
        rp[i] = &rs[i];
    }
    epoch_hdr(s, w, &h, &ep, append);
    ep.workers_on_host = on_host;
    ep.ranges = rp;
    ep.n_ranges = (size_t)nr;
    ps_frame_t fr = {.data = ids, .nbytes = 4 * n, .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)n};
    if (!append) w->clock = 0; /* ssp's clocks start again each epoch */
    else if (w->state != W_TRAIN) { /* (re)joining the epoch: level with the slowest, so nobody waits for
                                     * it, nor it (back from its barrier) for them */
        uint64_t m = psd_give_min_clock(s);
        if (m != UINT64_MAX) w->clock = m;
    }
    w->state = w->share.consumed < w->share.assigned || !append ? W_TRAIN : w->state;
    w->last_seen = ps_now();
    psd_peers_send_to(s, w, &h, &fr, n ? 1 : 0);
    free(ids);
    free(rs);
    free(rp);
    return 0;
}

/* Split positions among the given workers, contiguously, in slot order. */
void psd_give_spread(srv_t *s, const uint64_t *pos, size_t n, worker_t **to, int k, bool append)
{
    for (int i = 0; i < k; i++) {
        size_t b = psd_split_at(n, i, k), e = psd_split_at(n, i + 1, k);
        if (append && e == b) continue;
        if (give_positions(s, to[i], pos + b, e - b, append) != 0) {
            PS_ERROR("out of memory assigning samples");
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
            return;
        }
    }
}

/* async and ssp (train.rebalance): w is about to get the weights of its next
 * batch and has more than that batch left, while other workers wait at their
 * barrier with nothing to train. The samples after its next batch are shared
 * among w and them in proportion to their speeds (psd_rebalance_plan): the
 * epoch ends when the slowest finishes, and no fast worker waits for it with
 * nothing to do. w learns of its shorter share (EPOCH keep) before the
 * weights, so it never begins a batch it no longer has; the others get
 * theirs as lost workers' samples are given (EPOCH append). */
void psd_give_rebalance(srv_t *s, worker_t *w)
{
    if (s->cfg.sync == PS_SYNC_BSP || !s->cfg.rebalance || s->phase != PHASE_TRAIN || w->state != W_TRAIN)
        return;
    const uint64_t B = (uint64_t)s->cfg.batch_size, left = psd_share_left(&w->share);
    if (left <= B) return; /* nothing to spare after its next batch */
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_BARRIER && !s->w[i].conn_closed && &s->w[i] != w) to[k++] = &s->w[i];
    if (k == 0) return;
    bool timed = w->compute_ewma > 0;
    for (int i = 0; i < k; i++) timed = timed && to[i]->compute_ewma > 0;
    double rate[MAX_WORKERS + 1];
    rate[0] = timed ? 1.0 / w->compute_ewma : 1.0;
    for (int i = 0; i < k; i++) rate[1 + i] = timed ? 1.0 / to[i]->compute_ewma : 1.0;
    uint64_t give[MAX_WORKERS];
    const uint64_t moved = psd_rebalance_plan(left, B, timed ? rate : NULL, k, give);
    if (moved == 0) return;
    const uint64_t keep = w->share.assigned - moved;
    uint64_t *pos = psd_share_positions(&w->share, keep, (size_t)moved);
    if (!pos) {
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    psd_share_trim(&w->share, keep);
    Psd__Header h;
    Psd__Epoch ep;
    epoch_hdr(s, w, &h, &ep, true);
    ep.keep = keep;
    psd_peers_send_to(s, w, &h, NULL, 0);
    PS_DEBUG("rank %u gives %" PRIu64 " of its %" PRIu64 " samples left in epoch %u to %d worker%s done with theirs",
             w->rank, moved, left, s->epoch + 1, k, k == 1 ? "" : "s");
    uint64_t off = 0;
    for (int i = 0; i < k && s->phase == PHASE_TRAIN; i++) {
        if (give[i] && give_positions(s, to[i], pos + off, (size_t)give[i], true) != 0)
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        off += give[i];
    }
    s->ep.moved += moved;
    free(pos);
}

/* Samples waiting for a worker (the pool) to ready worker w, in training:
 * true if it took them. */
bool psd_give_take_pool(srv_t *s, worker_t *w)
{
    if (s->phase != PHASE_TRAIN || s->smp.n_pool == 0 || w->state != W_READY || w->conn_closed) return false;
    PS_INFO("rank %u takes the %zu samples that were waiting for a worker", w->rank, s->smp.n_pool);
    size_t n = s->smp.n_pool;
    s->smp.n_pool = 0;
    if (give_positions(s, w, s->smp.pool, n, false) != 0) psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
    return true;
}

/* Untrained samples of the epoch (positions pos[0..n), `what` for the log)
 * to the workers training or at their barrier, else to a worker that
 * joined during the epoch and waits for the next one, else they wait for a
 * worker to join. */
void psd_give_hand_out(srv_t *s, const uint64_t *pos, size_t n, const char *what)
{
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if ((s->w[i].state == W_TRAIN || s->w[i].state == W_BARRIER) && !s->w[i].conn_closed) to[k++] = &s->w[i];
    if (k > 0) {
        PS_INFO("%s %zu samples of epoch %u go to %d other worker%s", what, n, s->epoch + 1, k, k == 1 ? "" : "s");
        psd_give_spread(s, pos, n, to, k, true);
        return;
    }
    psd_samples_pool_add(&s->smp, pos, n);
    bool taken = false;
    for (int i = 0; i < s->n && !taken; i++) taken = psd_give_take_pool(s, &s->w[i]);
    if (!taken) {
        s->orphan_deadline = ps_now() + s->cfg.start_timeout;
        PS_WARN("no worker left in epoch %u: %zu samples wait up to %.0f s for a worker to join", s->epoch + 1,
                s->smp.n_pool, s->cfg.start_timeout);
    }
}
