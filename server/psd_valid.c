/* psd_valid.c - what a run knows of its data, and how it is validated:
 * the sizes and fingerprint the workers state (or the config's files give),
 * the held-out split of the training set, the validation parts handed to
 * the workers and their exact reduction in part order (named sums too),
 * each epoch's metrics line, the best epoch kept (train.keep_best), early
 * stopping (train.early_stop) and the closing test evaluation of a run with
 * a held-out split (on the last weights, and on the best epoch's). */
#include "psd_core.h"
#include "ps_weights_st.h"

/* Validation parts a worker holds at once: its own and one more, so that it
 * has the next at hand when it answers. The parts of workers that left wait
 * on psd (bounded by the parts) rather than pile up on one worker. */
#define PSD_VAL_PENDING_MAX 2
/* Validation ids in one VALIDATE (they travel in its header, which is at
 * most PS_MAX_HEADER bytes): more parts than workers when there are more. */
#define PSD_VAL_PART_MAX 65536

/* ---- the data --------------------------------------------------------- */

int psd_valid_data_setup(srv_t *s, size_t train, size_t test, const char *data_id)
{
    psd_val_part_t *v = &s->vl;
    size_t n_val = ps_data_val_count(train, s->cfg.val_fraction, (uint64_t)s->cfg.val_size);
    if (n_val >= train && n_val > 0) {
        PS_ERROR("data.val_fraction/val_size: %zu of the %zu training samples held out leaves none to train on",
                 n_val, train);
        return -1;
    }
    free(v->val_ids);
    free(v->train_ids);
    v->val_ids = v->train_ids = NULL;
    if (n_val > 0) {
        v->val_ids = malloc(n_val * sizeof *v->val_ids);
        v->train_ids = malloc((train - n_val) * sizeof *v->train_ids);
        if (!v->val_ids || !v->train_ids || ps_data_split(train, n_val, s->cfg.seed, v->val_ids, v->train_ids) != 0) {
            PS_ERROR("out of memory for the validation split of %zu samples", train);
            return -1;
        }
    }
    v->n_val = n_val;
    s->train_count = train;
    s->test_count = test;
    s->n_pos = train - n_val;
    snprintf(v->data_id, sizeof v->data_id, "%s", data_id ? data_id : "");
    v->id_known = data_id != NULL;
    psd_samples_free(&s->smp);
    if (psd_samples_init(&s->smp, s->n_pos) != 0) {
        PS_ERROR("out of memory for %zu training samples", s->n_pos);
        return -1;
    }
    v->known = true;
    if (n_val > 0)
        PS_INFO("data: %zu training samples, %zu of them held out for validation (drawn by run.seed), %zu test "
                "samples%s%s%s", train, n_val, test, v->data_id[0] ? " (data " : "", v->data_id,
                v->data_id[0] ? ")" : "");
    else
        PS_INFO("data: %zu training samples, %zu test samples%s%s%s; no held-out validation set "
                "(data.val_fraction): every epoch validates on the test set", train, test,
                v->data_id[0] ? " (data " : "", v->data_id, v->data_id[0] ? ")" : "");
    return 0;
}

static void data_free(srv_t *s)
{
    free(s->vl.val_ids);
    free(s->vl.train_ids);
    s->vl.val_ids = s->vl.train_ids = NULL;
}

/* A worker's READY against the run's data: the first worker's sizes and
 * fingerprint are the run's where neither the config nor a checkpoint gave
 * them. 1: it fits; 0: refused (it is told why, naming both); -1: the
 * message is dropped (or psd ends the run). */
/* The ctr task's data: generated from the config, its test examples' labels
 * kept for AUC and the planted model's figures on them logged. */
static int ctr_setup(srv_t *s)
{
    ps_ctr_t g;
    ps_ctr_from_config(&s->cfg, &g);
    s->train_count = (size_t)s->cfg.ctr_train;
    if (s->cfg.train_limit > 0 && (size_t)s->cfg.train_limit < s->train_count)
        s->train_count = (size_t)s->cfg.train_limit;
    s->test_count = (size_t)s->cfg.ctr_test;
    uint32_t rows[PS_CTR_MAX_IDS];
    double opt = 0;
    uint64_t clicks = 0;
    s->val_scores = malloc(s->test_count * sizeof *s->val_scores);
    s->test_labels = malloc(s->test_count);
    s->auc_order = malloc(s->test_count * sizeof *s->auc_order);
    if (!s->val_scores || !s->test_labels || !s->auc_order) {
        PS_ERROR("out of memory for %zu test examples", s->test_count);
        return -1;
    }
    for (size_t i = 0; i < s->test_count; i++) {
        double p = ps_ctr_example(&g, (uint64_t)s->cfg.ctr_train + i, rows, NULL, &s->test_labels[i]);
        opt += ps_logloss(p, s->test_labels[i]);
        clicks += s->test_labels[i];
        s->val_scores[i] = (float)p;
    }
    s->ctr_opt_auc = ps_auc(s->val_scores, s->test_labels, s->test_count, s->auc_order);
    double r = (double)clicks / (double)s->test_count;
    s->ctr_opt_loss = opt / (double)s->test_count;
    s->ctr_const_loss = ps_logloss(r, 1) * r + ps_logloss(r, 0) * (1 - r);
    PS_INFO("ctr task: %d fields x %d values from %lld (zipf %.2f), table %lld x %d; on the %zu test examples "
            "the planted model's log-loss is %.4f (AUC %.4f), a constant's %.4f (click rate %.4f)",
            g.fields, g.per_field, (long long)s->cfg.ctr_vocab, g.zipf, (long long)s->cfg.ctr_rows,
            s->cfg.ctr_dim, s->test_count, s->ctr_opt_loss, s->ctr_opt_auc, s->ctr_const_loss, r);
    return psd_valid_data_setup(s, s->train_count, s->test_count, NULL);
}

/* What the run knows of its data from the start: the ctr task's (its
 * sizes, and its test set's figures for the planted model), a tensors
 * model's sizes from the config (else the first worker's), or the config's
 * IDX files (read, checked against the model, hashed for ASSIGN); and the
 * validation curve's room. 0, or -1 (logged). Freed by psd_valid_free. */
int psd_valid_data_init(srv_t *s)
{
    s->val_curve = calloc((size_t)s->cfg.epochs, sizeof *s->val_curve); /* the live page's (none: not drawn) */
    if (s->cfg.kind == PS_MODEL_CTR) return ctr_setup(s);
    if (s->cfg.kind == PS_MODEL_TENSORS || s->cfg.kind == PS_MODEL_FROM_WORKER) { /* the workers hold the data;
                                                                                    * psd hands out indices */
        if (s->cfg.train_size < 1 || s->cfg.test_size < 1) return 0; /* the first worker's (psd_valid_data_ready_ok) */
        size_t train = (size_t)s->cfg.train_size;
        if (s->cfg.train_limit > 0 && (size_t)s->cfg.train_limit < train) train = (size_t)s->cfg.train_limit;
        return psd_valid_data_setup(s, train, (size_t)s->cfg.test_size, NULL); /* the fingerprint: the first worker's */
    }
    const char *roles[4] = {"train_images", "train_labels", "test_images", "test_labels"};
    const char *paths[4] = {s->cfg.train_images, s->cfg.train_labels, s->cfg.test_images, s->cfg.test_labels};
    char err[512];
    ps_idx_t idx[4] = {0};
    int rc = -1;
    for (int i = 0; i < 4; i++) {
        snprintf(s->files[i].role, sizeof s->files[i].role, "%s", roles[i]);
        snprintf(s->files[i].path, sizeof s->files[i].path, "%s", paths[i]);
        if (ps_idx_load(&idx[i], paths[i], i % 2 == 0 ? 3 : 1, err, sizeof err) != 0) {
            PS_ERROR("%s: %s", roles[i], err);
            goto out;
        }
        int h = ps_file_hash(paths[i], &s->files[i].size, &s->files[i].hash);
        if (h != 0) {
            PS_ERROR("%s: %s", paths[i], strerror(-h));
            goto out;
        }
    }
    int classes = s->cfg.sizes[s->cfg.n_sizes - 1];
    for (int k = 0; k < 2; k++) {
        ps_idx_t *im = &idx[2 * k], *lb = &idx[2 * k + 1];
        if (im->count != lb->count) {
            PS_ERROR("%s has %zu images but %s has %zu labels", paths[2 * k], im->count, paths[2 * k + 1],
                     lb->count);
            goto out;
        }
        if (im->item != (size_t)s->cfg.sizes[0]) {
            PS_ERROR("%s: %zu pixels per image, but model.layers starts with %d", paths[2 * k], im->item,
                     s->cfg.sizes[0]);
            goto out;
        }
        for (size_t j = 0; j < lb->count; j++)
            if (lb->data[j] >= classes) {
                PS_ERROR("%s: label %u of sample %zu, but the model has %d classes", paths[2 * k + 1],
                         lb->data[j], j, classes);
                goto out;
            }
    }
    s->train_count = idx[0].count;
    if (s->cfg.train_limit > 0 && (size_t)s->cfg.train_limit < s->train_count)
        s->train_count = (size_t)s->cfg.train_limit;
    s->test_count = idx[2].count;
    rc = psd_valid_data_setup(s, s->train_count, s->test_count, NULL); /* the files' hashes are checked in ASSIGN */
out:
    for (int i = 0; i < 4; i++) ps_idx_deinit(&idx[i]);
    return rc;
}

int psd_valid_data_ready_ok(srv_t *s, worker_t *w, const Psd__Ready *r)
{
    const char *id = r->data_id ? r->data_id : "";
    if (!ps_data_id_ok(id)) {
        psd_peers_drop(s, w, "READY with a data fingerprint that is not up to %d printable characters", PS_DATA_ID_MAX);
        return -1;
    }
    if (!s->vl.known) {
        if (r->train_count < 1 || r->test_count < 1 || r->train_count > UINT32_MAX || r->test_count > UINT32_MAX) {
            char why[200];
            snprintf(why, sizeof why, "its data has %" PRIu64 " training and %" PRIu64 " test samples (1 to 2^32-1 "
                     "of each)", r->train_count, r->test_count);
            PS_ERROR("rank %u (%s pid %u) refused: %s", w->rank, w->hostname, w->pid, why);
            psd_peers_send_shutdown(s, w, 2, why);
            return 0;
        }
        size_t train = (size_t)r->train_count;
        if (s->cfg.train_limit > 0 && (size_t)s->cfg.train_limit < train) train = (size_t)s->cfg.train_limit;
        if (psd_valid_data_setup(s, train, (size_t)r->test_count, id) != 0) {
            psd_peers_finish(s, PSD_EXIT_ERROR, "psd cannot lay out the workers' data");
            return -1;
        }
        PS_INFO("the run's data is rank %u's: %zu training and %zu test samples, fingerprint '%s'", w->rank,
                s->train_count, s->test_count, id);
        return 1;
    }
    uint64_t train = r->train_count;
    if (s->cfg.train_limit > 0 && (uint64_t)s->cfg.train_limit < train) train = (uint64_t)s->cfg.train_limit;
    bool sizes = train == s->train_count && r->test_count == s->test_count;
    if (sizes && !s->vl.id_known) { /* the config gave the sizes: the fingerprint is the first worker's */
        snprintf(s->vl.data_id, sizeof s->vl.data_id, "%s", id);
        s->vl.id_known = true;
        if (id[0]) PS_INFO("the run's data fingerprint is rank %u's: '%s'", w->rank, id);
        return 1;
    }
    if (sizes && strcmp(id, s->vl.data_id) == 0) return 1;
    char why[PS_DATA_ID_MAX * 2 + 200];
    snprintf(why, sizeof why, "its data ('%s': %" PRIu64 " training, %" PRIu64 " test samples) is not the run's ('%s': "
             "%zu training, %zu test samples)", id, train, r->test_count, s->vl.data_id, s->train_count,
             s->test_count);
    PS_ERROR("rank %u (%s pid %u) refused: %s", w->rank, w->hostname, w->pid, why);
    psd_peers_send_shutdown(s, w, 2, why);
    return 0;
}

/* ---- parts ------------------------------------------------------------ */

/* The weights of the best epoch as frames (VAL_TEST_BEST) for w: copied
 * at send; bfloat16 where w takes weights so (over the wire). */
static int best_frames(srv_t *s, const worker_t *w, ps_frame_t *fr)
{
    const ps_layout_t *l = &s->layout;
    for (int i = 0; i < l->n_tensors; i++) {
        const ps_tensor_info_t *t = &l->t[i];
        bool h = s->vl.best_w16 != NULL && !w->shm;
        fr[i] = (ps_frame_t){.data = h ? (const void *)(s->vl.best_w16 + t->offset) : (const void *)(s->vl.best_w + t->offset),
                             .nbytes = t->numel * (h ? 2 : 4), .id = (uint32_t)i,
                             .dtype = h ? PSD__DTYPE__DT_BF16 : PSD__DTYPE__DT_F32, .rows = t->rows,
                             .cols = t->cols, .copy = true};
        s->ep.bytes_out += fr[i].nbytes;
    }
    return l->n_tensors;
}

static void send_validate(srv_t *s, worker_t *w, vpart_t *p)
{
    Psd__Header h;
    Psd__Validate v = PSD__VALIDATE__INIT;
    ps_frame_t fr[PS_MAX_TENSORS + 1]; /* the table on psd: its rows' ids too */
    psd_peers_hdr_for(s, w, &h, PSD__MSG_TYPE__MSG_VALIDATE);
    v.epoch = s->vl.epoch;
    v.version = s->vl.version;
    v.begin = p->begin;
    v.end = p->end;
    v.split = (Psd__Split)s->vl.split;
    v.final = s->vl.kind != VAL_EPOCH;
    if (s->vl.split == PSD__SPLIT__SPLIT_VAL) {
        v.ids = s->vl.val_ids + p->begin;
        v.n_ids = (size_t)(p->end - p->begin);
    }
    h.body_case = PSD__HEADER__BODY_VALIDATE;
    h.validate = &v;
    p->worker = (int)(w - s->w);
    w->val_pending++;
    w->state = W_VALIDATING;
    w->last_seen = ps_now();
    if (s->vl.kind == VAL_TEST_BEST) {
        int n = best_frames(s, w, fr);
        psd_peers_send_to(s, w, &h, fr, n);
        return;
    }
    int n = psd_step_weights_frames(s, w, fr, &v.shm_slot, &v.crc);
    if (s->table_on_psd) {
        psd_step_range_rows_send(s, w, &h, fr, n);
        return;
    }
    psd_peers_send_to(s, w, &h, fr, n);
}

/* The live worker with the fewest validation parts pending, or NULL. */
worker_t *psd_valid_least_busy(srv_t *s)
{
    worker_t *best = NULL;
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        if (w->state < W_READY || w->state > W_VALIDATED || w->conn_closed) continue;
        if (!best || w->val_pending < best->val_pending) best = w;
    }
    return best;
}

/* The parts no worker holds (their worker left or died, or there are more
 * parts than workers) to the least busy live workers, up to
 * PSD_VAL_PENDING_MAX each; the rest wait for an answer or a worker joining. */
void psd_valid_give_orphans(srv_t *s)
{
    for (int i = 0; i < s->n_parts && s->phase == PHASE_VALIDATE; i++) {
        vpart_t *p = &s->parts[i];
        if (p->done || p->worker >= 0) continue;
        worker_t *to = psd_valid_least_busy(s);
        if (!to || to->val_pending >= PSD_VAL_PENDING_MAX) return;
        send_validate(s, to, p);
    }
}

/* Parts of a set of n samples to the live workers: one each, more when the
 * set is larger than PSD_VAL_PART_MAX a part (held-out ids go in headers). */
static void hand_parts(srv_t *s, val_kind_t kind, int split, uint64_t version, uint32_t epoch)
{
    s->phase = PHASE_VALIDATE;
    s->vl.kind = kind;
    s->vl.split = split;
    s->vl.version = version;
    s->vl.epoch = epoch;
    worker_t *to[MAX_WORKERS];
    int k = 0;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state >= W_READY && s->w[i].state <= W_VALIDATED) to[k++] = &s->w[i];
    uint64_t T = split == PSD__SPLIT__SPLIT_VAL ? s->vl.n_val : s->test_count;
    uint64_t parts = k > 0 ? (uint64_t)k : 1;
    if (split == PSD__SPLIT__SPLIT_VAL && (T + PSD_VAL_PART_MAX - 1) / PSD_VAL_PART_MAX > parts)
        parts = (T + PSD_VAL_PART_MAX - 1) / PSD_VAL_PART_MAX;
    free(s->parts);
    s->parts = calloc((size_t)parts, sizeof *s->parts);
    if (!s->parts) {
        s->n_parts = 0;
        psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
        return;
    }
    s->n_parts = (int)parts;
    for (uint64_t i = 0; i < parts; i++)
        s->parts[i] = (vpart_t){.begin = T * i / parts, .end = T * (i + 1) / parts, .worker = -1};
    for (int i = 0; i < s->n; i++) {
        worker_t *w = &s->w[i];
        w->val_pending = 0;
        if (w->state == W_BARRIER && w->barrier_at > 0) w->barrier_wait_s += ps_now() - w->barrier_at;
        w->barrier_at = 0;
        if (w->state == W_VALIDATED) w->state = W_READY; /* validated the last set: free for this one */
    }
    for (int i = 0; i < k && i < s->n_parts; i++) send_validate(s, to[i], &s->parts[i]);
    psd_valid_give_orphans(s);
    if (k == 0) {
        s->orphan_deadline = ps_now() + s->cfg.start_timeout;
        PS_WARN("no workers to validate epoch %u; waiting up to %.0f s for one to join", s->epoch + 1,
                s->cfg.start_timeout);
    }
}

void psd_valid_start(srv_t *s)
{
    /* every position trained once: the bookkeeping of samples moved between workers */
    uint64_t unseen = psd_samples_unseen(&s->smp);
    if (unseen || s->smp.twice)
        PS_ERROR("epoch %u: %" PRIu64 " training samples were trained twice and %" PRIu64 " not at all (a bug in "
                 "psd's bookkeeping)", s->epoch + 1, s->smp.twice, unseen);
    double dt = ps_now() - s->t_epoch;
    s->train_s_total += dt;
    s->samples_total += s->ep.samples;
    s->t_epoch = dt; /* the epoch's training time, for the metrics */
    hand_parts(s, VAL_EPOCH, s->vl.n_val ? PSD__SPLIT__SPLIT_VAL : PSD__SPLIT__SPLIT_TEST, s->store.cur->version,
               s->epoch);
}

/* ---- results ---------------------------------------------------------- */

/* The named sums of an answer against the run's (the first answer's names
 * are the run's): their values into p. false: they do not fit (dropped). */
static bool take_sums(srv_t *s, worker_t *w, const Psd__ValResult *v, vpart_t *p)
{
    psd_val_part_t *vl = &s->vl;
    if (v->n_sums > PS_MAX_SUMS) {
        psd_peers_drop(s, w, "VAL_RESULT with %zu named sums (at most %d)", v->n_sums, PS_MAX_SUMS);
        return false;
    }
    for (size_t i = 0; i < v->n_sums; i++) {
        const Psd__NamedSum *x = v->sums[i];
        if (!x->name || !ps_sum_name_ok(x->name) || !isfinite(x->value)) {
            psd_peers_drop(s, w, "VAL_RESULT with an invalid named sum %zu (a name of [a-z0-9_], not one of psd's own, and a "
                 "finite value)", i);
            return false;
        }
        for (size_t j = 0; j < i; j++)
            if (strcmp(v->sums[j]->name, x->name) == 0) {
                psd_peers_drop(s, w, "VAL_RESULT names the sum '%s' twice", x->name);
                return false;
            }
    }
    if (!vl->sums_known) { /* the run's first answer: its names are the run's */
        for (size_t i = 0; i < v->n_sums; i++) snprintf(vl->names[i], sizeof vl->names[i], "%s", v->sums[i]->name);
        vl->n_sums = (int)v->n_sums;
        vl->sums_known = true;
    }
    bool same = v->n_sums == (size_t)vl->n_sums;
    for (size_t i = 0; same && i < v->n_sums; i++) same = strcmp(v->sums[i]->name, vl->names[i]) == 0;
    if (!same) {
        char have[PS_MAX_SUMS * (PS_SUM_NAME_MAX + 1) + 8] = "";
        size_t at = 0;
        for (int i = 0; i < vl->n_sums; i++)
            at += (size_t)snprintf(have + at, sizeof have - at, "%s%s", i ? "," : "", vl->names[i]);
        psd_peers_drop(s, w, "VAL_RESULT with other named sums (%zu) than the run's first answer (%s)", v->n_sums,
             at ? have : "none");
        return false;
    }
    for (size_t i = 0; i < v->n_sums; i++) p->sums[i] = v->sums[i]->value;
    return true;
}

static void parts_done(srv_t *s);
static void end_validation(srv_t *s);

void psd_valid_on_result(srv_t *s, worker_t *w, ps_msg_t *m)
{
    Psd__ValResult *v = m->hdr->val_result;
    vpart_t *p = NULL;
    for (int i = 0; i < s->n_parts && s->phase == PHASE_VALIDATE; i++)
        if (s->parts[i].begin == v->begin && s->parts[i].worker == (int)(w - s->w) && !s->parts[i].done)
            p = &s->parts[i];
    if (!p || w->state != W_VALIDATING || v->epoch != s->vl.epoch || v->version != s->vl.version ||
        (int)v->split != s->vl.split) {
        psd_peers_drop(s, w, "VAL_RESULT for epoch %u version %" PRIu64 " from %" PRIu64 " while %s", v->epoch + 1,
             v->version, v->begin, psd_wstate_name[w->state]);
        return;
    }
    if (v->count != p->end - p->begin || v->correct > v->count || !isfinite(v->loss_sum) || v->loss_sum < 0) {
        psd_peers_drop(s, w, "VAL_RESULT with invalid sums (count %" PRIu64 ", expected %" PRIu64 ")", v->count,
             p->end - p->begin);
        return;
    }
    if (!take_sums(s, w, v, p)) return;
    if (s->cfg.kind == PS_MODEL_CTR && v->count > 0) { /* the click probabilities of the range, for the AUC */
        size_t n = 0;
        const float *sc = m->n_frames == 1 ? ps_msg_f32(m, 0, &n) : NULL;
        bool ok = sc && n == v->count;
        for (size_t i = 0; ok && i < n; i++) ok = sc[i] >= 0 && sc[i] <= 1; /* NaN fails too */
        if (!ok) {
            psd_peers_drop(s, w, "VAL_RESULT without the range's %" PRIu64 " scores in [0, 1]", v->count);
            return;
        }
        memcpy(s->val_scores + p->begin, sc, n * sizeof *sc);
    }
    p->loss = v->loss_sum;
    p->correct = v->correct;
    p->count = v->count;
    p->done = true;
    if (--w->val_pending == 0) w->state = W_VALIDATED;
    psd_valid_give_orphans(s);
    for (int i = 0; i < s->n_parts; i++)
        if (!s->parts[i].done) return;
    parts_done(s);
}

/* The parts' sums, added up in part order: the same sums every run. */
static psd_figs_t reduce_parts(const srv_t *s)
{
    psd_figs_t f = {.have = true};
    for (int i = 0; i < s->n_parts; i++) {
        f.loss += s->parts[i].loss;
        f.correct += s->parts[i].correct;
        f.count += s->parts[i].count;
        for (int j = 0; j < s->vl.n_sums; j++) f.sums[j] += s->parts[i].sums[j];
    }
    return f;
}

static double mean_of(double sum, uint64_t n) { return n ? sum / (double)n : 0; }

/* The figures f of the validation that just finished (the parts out now:
 * s->vl.kind, split, epoch) kept for the workers (told_val): the next
 * EPOCH and the SHUTDOWN tell them, names in the run's order. */
static void keep_told(srv_t *s, const psd_figs_t *f)
{
    psd_val_part_t *v = &s->vl;
    psd__val_sums__init(&v->told);
    v->told.epoch = v->epoch;
    v->told.split = (Psd__Split)v->split;
    v->told.final = v->kind != VAL_EPOCH;
    v->told.count = f->count;
    v->told.loss_sum = f->loss;
    v->told.correct = f->correct;
    for (int j = 0; j < v->n_sums; j++) {
        psd__named_sum__init(&v->told_sums[j]);
        v->told_sums[j].name = v->names[j];
        v->told_sums[j].value = f->sums[j];
        v->told_p[j] = &v->told_sums[j];
    }
    v->told.n_sums = (size_t)v->n_sums;
    v->told.sums = v->n_sums ? v->told_p : NULL;
    v->told_have = true;
}

/* The figure a metric names in an epoch's figures: true and *out, or false
 * when the workers report no such sum. */
static bool metric_value(const srv_t *s, const char *metric, const epoch_stats_t *e, const psd_figs_t *f,
                         double *out)
{
    if (strcmp(metric, "val_loss") == 0) *out = e->val_loss;
    else if (strcmp(metric, "val_acc") == 0) *out = e->val_acc;
    else if (strcmp(metric, "val_auc") == 0) *out = e->auc;
    else {
        for (int j = 0; j < s->vl.n_sums; j++)
            if (strcmp(metric + 4, s->vl.names[j]) == 0) {
                *out = mean_of(f->sums[j], f->count);
                return true;
            }
        return false;
    }
    return true;
}

/* ---- metrics lines ---------------------------------------------------- */

/* ,"<prefix>loss":...,"<prefix>acc":...,... of figures f */
static void put_figs(FILE *f, const srv_t *s, const char *prefix, const psd_figs_t *x)
{
    fprintf(f, ",\"%sloss\":%.9g,\"%sacc\":%.9g,\"%scorrect\":%" PRIu64 ",\"%ssamples\":%" PRIu64, prefix,
            mean_of(x->loss, x->count), prefix, mean_of((double)x->correct, x->count), prefix, x->correct, prefix,
            x->count);
    for (int j = 0; j < s->vl.n_sums; j++)
        fprintf(f, ",\"%s%s\":%.9g", prefix, s->vl.names[j], mean_of(x->sums[j], x->count));
}

/* The epoch's line of the metrics file (README "Metrics file", schema 2):
 * built whole, then written and synced in one go (psd_metrics.h). */
static void write_metrics_line(srv_t *s, const epoch_stats_t *e, const psd_figs_t *vf)
{
    char *line = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&line, &len);
    if (!f) {
        psd_metrics_failed(&s->metrics, errno, "build");
        return;
    }
    fprintf(f,
            "{\"schema\":2,\"run_id\":\"%016" PRIx64 "\",\"epoch\":%u,\"step\":%" PRIu64
            ",\"train_loss\":%.9g,\"train_acc\":%.9g,\"train_samples\":%" PRIu64
            ",\"val_loss\":%.9g,\"val_acc\":%.9g,\"val_correct\":%" PRIu64 ",\"val_samples\":%" PRIu64
            ",\"val_set\":\"%s\""
            ",\"samples_per_s\":%.6g,\"epoch_samples_per_s\":%.6g,\"train_s\":%.6g,\"wall_s\":%.6g"
            ",\"workers\":%d,\"lr\":%.9g,\"worker_step_ms\":%.6g,\"worker_wait_frac\":%.6g,\"psd_step_ms\":%.6g"
            ",\"wire_bytes_in\":%" PRIu64 ",\"wire_bytes_out\":%" PRIu64 ",\"sync\":\"%s\""
            ",\"staleness_max\":%" PRIu64 ",\"staleness_mean\":%.6g,\"ssp_lead_max\":%" PRIu64
            ",\"psd_steps_in_place\":%" PRIu64 ",\"samples_moved\":%" PRIu64 ",\"pushes_ahead\":%" PRIu64,
            s->run_id, s->epoch + 1, s->step, e->train_loss, e->train_acc, s->ep.samples, e->val_loss,
            e->val_acc, e->correct, e->count, s->vl.n_val ? "held_out" : "test", e->sps, e->ep_sps,
            s->train_s_total, e->wall, e->workers, s->lr,
            s->ep.timed ? 1e3 * (s->ep.compute_s + s->ep.wait_s) / (double)s->ep.timed : 0.0,
            s->ep.compute_s + s->ep.wait_s > 0 ? s->ep.wait_s / (s->ep.compute_s + s->ep.wait_s) : 0.0,
            s->ep.step_n ? 1e3 * (s->store.step_s - s->ep.step_s0) / (double)s->ep.step_n : 0.0, s->ep.bytes_in, s->ep.bytes_out,
            ps_sync_name(s->cfg.sync), s->ep.stale_max, stale_mean(s), s->ep.lead_max,
            s->store.in_place - s->ep.in_place0, s->ep.moved, s->ep.ahead);
    for (int j = 0; j < s->vl.n_sums; j++)
        fprintf(f, ",\"val_%s\":%.9g", s->vl.names[j], mean_of(vf->sums[j], vf->count));
    if (s->cfg.kind == PS_MODEL_CTR)
        fprintf(f,
                ",\"optimum_loss\":%.9g,\"constant_loss\":%.9g,\"val_auc\":%.9g,\"optimum_auc\":%.9g"
                ",\"table_rows_in\":%" PRIu64 ",\"table_row_pushes\":%" PRIu64 ",\"table_rows_out\":%" PRIu64
                ",\"table_row_replies\":%" PRIu64,
                s->ctr_opt_loss, s->ctr_const_loss, e->auc, s->ctr_opt_auc, s->ep.rows_in, s->ep.rows_pushes,
                s->ep.rows_out, s->ep.rows_replies);
    const psd_best_t *kb = &s->vl.keep;
    if (psd_best_on(kb) && kb->has)
        fprintf(f, ",\"best_metric\":\"%s\",\"best_epoch\":%u,\"best_value\":%.9g", kb->metric, kb->epoch, kb->best);
    if (s->vl.test_last.have) put_figs(f, s, "test_", &s->vl.test_last);
    if (s->vl.test_best.have) put_figs(f, s, "best_test_", &s->vl.test_best);
    for (int k = WEND_LEFT; k < WEND_N; k++) fprintf(f, ",\"workers_%s\":%" PRIu64, psd_wend_name[k], s->ended[k]);
    if (s->vl.stopped_early) fputs(",\"stopped_early\":true", f);
    if (s->resumed) fprintf(f, ",\"resumed_from_step\":%" PRIu64, s->resumed_step);
    fputs("}\n", f);
    if (fclose(f) != 0 || !line) {
        free(line);
        psd_metrics_failed(&s->metrics, ENOMEM, "build");
        return;
    }
    psd_metrics_write(&s->metrics, line, len);
    free(line);
    if (s->opts.die_after_metrics > 0 && s->epoch + 1 == (uint32_t)s->opts.die_after_metrics)
        raise(SIGKILL); /* tests only: killed between an epoch's metrics line and its checkpoint */
}

/* ---- the best epoch, early stopping ----------------------------------- */

/* Epoch e's figures to keep_best and early_stop: the best epoch's weights
 * written (before the epoch's checkpoint, which records it as the best).
 * false: the run cannot go on (a metric no worker reports). */
static bool score_epoch(srv_t *s, const epoch_stats_t *e, const psd_figs_t *f)
{
    psd_best_t *b[2] = {&s->vl.keep, &s->vl.stop};
    for (int i = 0; i < 2; i++) {
        if (!psd_best_on(b[i])) continue;
        double v;
        if (!metric_value(s, b[i]->metric, e, f, &v)) {
            char why[200];
            snprintf(why, sizeof why, "train.%s.metric %s: the workers report no sum '%s'",
                     i ? "early_stop" : "keep_best", b[i]->metric, b[i]->metric + 4);
            PS_ERROR("%s", why);
            psd_peers_finish(s, PSD_EXIT_USAGE, why);
            return false;
        }
        bool better = psd_best_update(b[i], s->epoch + 1, v);
        if (i == 0 && better) {
            s->vl.best_version = s->store.cur->version;
            char err[512];
            ps_weights_meta_t meta = {.run_id = s->run_id, .step = s->step, .epoch = s->epoch}; /* 0-based */
            double t0 = ps_now();
            if (ps_weights_save(s->cfg.best_path, &s->layout, s->store.cur->w, &meta, err, sizeof err) != 0) {
                PS_ERROR("train.keep_best: %s", err);
                psd_peers_finish(s, PSD_EXIT_ERROR, "psd cannot write the best epoch's weights");
                return false;
            }
            PS_INFO("epoch %u is the best so far by %s (%.6g): weights kept in %s (%.2f s)", s->epoch + 1,
                    b[i]->metric, v, s->cfg.best_path, ps_now() - t0);
        }
    }
    const psd_best_t *st = &s->vl.stop;
    if (psd_best_on(st) && psd_best_stop(st) && s->epoch + 1 < (uint32_t)s->cfg.epochs) {
        s->vl.stopped_early = true;
        PS_INFO("stopping early after epoch %u: %s has not improved by more than %g for %d epochs (best %.6g at "
                "epoch %u)", s->epoch + 1, st->metric, st->min_delta, st->patience, st->best, st->epoch);
    }
    return true;
}

/* The run's closing test evaluation (a held-out split only): the last
 * weights, then the best epoch's where it is another; false when none is
 * to be made (or the best cannot be read: the run ends with an error). */
static bool next_test(srv_t *s)
{
    psd_val_part_t *v = &s->vl;
    if (!v->n_val) return false;
    if (!v->test_last.have) {
        PS_INFO("testing the last weights (epoch %u) on the %zu test samples", s->epoch + 1, s->test_count);
        hand_parts(s, VAL_TEST_LAST, PSD__SPLIT__SPLIT_TEST, s->store.cur->version, s->epoch);
        return true;
    }
    if (!psd_best_on(&v->keep) || !v->keep.has || v->test_best.have) return false;
    if (v->keep.epoch == s->epoch + 1) { /* the last epoch is the best: the same weights */
        v->test_best = v->test_last;
        return false;
    }
    ps_layout_t l = {0};
    float *w = NULL;
    ps_weights_meta_t meta;
    char err[512], why[256];
    if (ps_weights_load_any(s->cfg.best_path, &l, &w, &meta, err, sizeof err) != 0 ||
        !ps_layout_same_table(&s->layout, &l, why, sizeof why) || meta.epoch + 1 != v->keep.epoch) {
        if (w) snprintf(err, sizeof err, "%s holds epoch %u's weights of another model or epoch (the best is %u)",
                        s->cfg.best_path, meta.epoch + 1, v->keep.epoch);
        PS_ERROR("train.keep_best: cannot test the best epoch: %s", err);
        ps_layout_free(&l);
        free(w);
        s->exit_code = PSD_EXIT_ERROR;
        return false;
    }
    ps_layout_free(&l);
    v->best_w = w;
    if (s->cfg.wire_weights == PS_WIRE_BF16) {
        v->best_w16 = malloc((size_t)s->layout.n_params * sizeof *v->best_w16);
        if (!v->best_w16) {
            PS_ERROR("out of memory for the best epoch's weights");
            s->exit_code = PSD_EXIT_ERROR;
            return false;
        }
        ps_f32_to_bf16_n(v->best_w16, w, (size_t)s->layout.n_params);
    }
    PS_INFO("testing the best epoch's weights (epoch %u, %s) on the %zu test samples", v->keep.epoch,
            s->cfg.best_path, s->test_count);
    hand_parts(s, VAL_TEST_BEST, PSD__SPLIT__SPLIT_TEST, v->best_version, v->keep.epoch - 1);
    return true;
}

/* The last epoch's held line (and the closing test's log line): written
 * by psd_run.c before the run's last checkpoint. */
void psd_valid_write_held(srv_t *s)
{
    psd_val_part_t *v = &s->vl;
    if (v->line_held && s->metrics.fd >= 0) write_metrics_line(s, &v->held, &v->held_figs);
    v->line_held = false;
    if (v->test_last.have) {
        char extra[256] = "";
        if (v->test_best.have)
            snprintf(extra, sizeof extra, "; best epoch %u (%s %.6g): test_loss %.4f test_acc %.4f", v->keep.epoch,
                     v->keep.metric, v->keep.best, mean_of(v->test_best.loss, v->test_best.count),
                     mean_of((double)v->test_best.correct, v->test_best.count));
        PS_INFO("test (%" PRIu64 " samples): last weights test_loss %.4f test_acc %.4f%s", v->test_last.count,
                mean_of(v->test_last.loss, v->test_last.count), mean_of((double)v->test_last.correct, v->test_last.count),
                extra);
    } else if (psd_best_on(&v->keep) && v->keep.has) {
        PS_INFO("best epoch %u by %s (%.6g), weights in %s (no held-out validation set: chosen on the test set)",
                v->keep.epoch, v->keep.metric, v->keep.best, s->cfg.best_path);
    }
}

/* The run's last epoch is validated and tested: psd_run.c ends the run. */
static void close_run(srv_t *s)
{
    s->vl.closing = true;
    s->events |= PSD_EV_VALIDATED;
}

static void end_test(srv_t *s)
{
    psd_val_part_t *v = &s->vl;
    psd_figs_t f = reduce_parts(s);
    keep_told(s, &f);
    if (v->kind == VAL_TEST_LAST) v->test_last = f;
    else v->test_best = f;
    free(v->best_w);
    free(v->best_w16);
    v->best_w = NULL;
    v->best_w16 = NULL;
    if (s->phase == PHASE_DONE || next_test(s)) return;
    close_run(s);
}

static void parts_done(srv_t *s)
{
    if (s->vl.kind != VAL_EPOCH) end_test(s);
    else end_validation(s);
}

static void end_validation(srv_t *s)
{
    if (s->tty) ps_log_status(NULL); /* the epoch's line takes its place */
    psd_figs_t fg = reduce_parts(s);
    keep_told(s, &fg);
    double loss = fg.loss;
    uint64_t correct = fg.correct, count = fg.count;
    double val_loss = count ? loss / (double)count : 0, val_acc = count ? (double)correct / (double)count : 0;
    double train_loss = s->ep.samples ? s->ep.loss / (double)s->ep.samples : 0;
    double train_acc = s->ep.samples ? (double)s->ep.correct / (double)s->ep.samples : 0;
    double ep_sps = s->t_epoch > 0 ? (double)s->ep.samples / s->t_epoch : 0;
    double sps = s->train_s_total > 0 ? (double)s->samples_total / s->train_s_total : 0;
    double wall = ps_now() - s->t_start;
    int workers = live_workers(s);
    char sums[PS_MAX_SUMS * (PS_SUM_NAME_MAX + 24)] = "";
    size_t at = 0;
    for (int j = 0; j < s->vl.n_sums && at < sizeof sums; j++) {
        s->vl.last_means[j] = mean_of(fg.sums[j], count);
        at += (size_t)snprintf(sums + at, sizeof sums - at, " val_%s %.4g", s->vl.names[j], s->vl.last_means[j]);
    }
    PS_INFO("epoch %u/%d step %" PRIu64 " train_loss %.4f train_acc %.4f val_loss %.4f val_acc %.4f "
            "(%" PRIu64 "/%" PRIu64 ")%s %.0f samples/s lr %.5g",
            s->epoch + 1, s->cfg.epochs, s->step, train_loss, train_acc, val_loss, val_acc, correct,
            count, sums, ep_sps, s->lr);
    double auc = s->cfg.kind == PS_MODEL_CTR ? ps_auc(s->val_scores, s->test_labels, s->test_count, s->auc_order) : 0;
    if (s->cfg.kind == PS_MODEL_CTR)
        PS_INFO("epoch %u: val log-loss %.4f, %.4f above the planted model's %.4f; AUC %.4f (planted %.4f)",
                s->epoch + 1, val_loss, val_loss - s->ctr_opt_loss, s->ctr_opt_loss, auc, s->ctr_opt_auc);
    if (s->cfg.sync != PS_SYNC_BSP) {
        char lead[128] = "";
        if (s->cfg.sync == PS_SYNC_SSP)
            snprintf(lead, sizeof lead, "; workers trained at most %" PRIu64 " steps ahead of the slowest (bound %d)",
                     s->ep.lead_max, s->cfg.staleness);
        PS_INFO("epoch %u: %s, staleness of the %" PRIu64 " gradients applied: max %" PRIu64 " mean %.2f versions%s",
                s->epoch + 1, ps_sync_name(s->cfg.sync), s->ep.stale_n, s->ep.stale_max, stale_mean(s), lead);
        if (s->ep.moved > 0) {
            char who[512];
            size_t wat = 0;
            for (int i = 0; i < s->n && wat < sizeof who; i++)
                if (s->w[i].state != W_GONE || s->w[i].share.consumed > 0)
                    wat += (size_t)snprintf(who + wat, sizeof who - wat, "%s rank %u %" PRIu64 "%s", wat ? "," : "",
                                            s->w[i].rank, s->w[i].share.consumed,
                                            s->w[i].state == W_GONE ? " (lost)" : "");
            PS_INFO("epoch %u: %" PRIu64 " samples moved from slower workers to those done with theirs; trained:%s",
                    s->epoch + 1, s->ep.moved, who);
        }
    }
    epoch_stats_t e = {.train_loss = train_loss, .train_acc = train_acc, .val_loss = val_loss, .val_acc = val_acc,
                       .sps = sps, .ep_sps = ep_sps, .wall = wall, .auc = auc, .correct = correct, .count = count,
                       .workers = workers};
    if (!score_epoch(s, &e, &fg)) return;
    bool last = s->epoch + 1 >= (uint32_t)s->cfg.epochs || s->vl.stopped_early;
    bool stop = s->opts.stop_after_epoch > 0 && s->epoch + 1 == (uint32_t)s->opts.stop_after_epoch && !last;
    s->val_acc_last = val_acc;
    s->val_loss_last = val_loss;
    s->val_epoch_last = s->epoch + 1;
    if (s->val_curve && s->n_val_curve < s->cfg.epochs) {
        s->val_curve[s->n_val_curve].epoch = s->epoch + 1;
        s->val_curve[s->n_val_curve].step = s->step;
        s->val_curve[s->n_val_curve].train_loss = (float)train_loss;
        s->val_curve[s->n_val_curve].val_loss = (float)val_loss;
        s->val_curve[s->n_val_curve++].val_acc = (float)val_acc;
    }
    if (last) { /* the line, once the closing test is in; then the checkpoint and the end */
        s->vl.held = e;
        s->vl.held_figs = fg;
        s->vl.line_held = true;
        if (!next_test(s) && s->phase != PHASE_DONE) close_run(s);
        return;
    }
    if (s->metrics.fd >= 0) write_metrics_line(s, &e, &fg);
    s->vl.closing = false;
    s->vl.stop_asked = stop;
    s->events |= PSD_EV_VALIDATED;
}

void psd_valid_free(srv_t *s)
{
    free(s->vl.best_w);
    free(s->vl.best_w16);
    s->vl.best_w = NULL;
    s->vl.best_w16 = NULL;
    data_free(s);
    free(s->val_scores);
    free(s->test_labels);
    free(s->auc_order);
    free(s->parts);
    free(s->val_curve);
    s->val_scores = NULL;
    s->test_labels = NULL;
    s->auc_order = NULL;
    s->parts = NULL;
    s->val_curve = NULL;
}
