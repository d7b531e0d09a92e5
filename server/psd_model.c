/* psd_model.c - the model's part of srv_t: the store (master weights,
 * optimizer state), the parameter holder, the packed tensor table ASSIGN
 * carries, and what depends on the model's tensors (streamed chunks, the
 * table stepped by rows). Set up at start from the config, or, with
 * model.kind from_worker, when the first worker's values come
 * (psd_offer.c). Below psd_run.c; calls nothing of the coordinator. */
#include "psd_core.h"
#include "ps_table.h"
#include "ps_weights_st.h"

static int oom(srv_t *s)
{
    PS_ERROR("out of memory for %zu parameters", s->layout.n_params);
    return PSD_EXIT_ERROR;
}

/* psd_groups_describe's lines into the log */
static void say_group(void *ud, bool warn, const char *line)
{
    (void)ud;
    if (warn) PS_WARN("%s", line);
    else PS_INFO("%s", line);
}

/* The store's pieces (own[]: whole tensors for one psd) of the initial
 * values: each tensor whole in values[t], or (values NULL) laid out as the
 * model in arena. */
static void take_values(srv_t *s, const float *const *values, const float *arena)
{
    for (int t = 0; t < s->layout.n_tensors; t++) {
        const ps_piece_t *p = &s->store.own[t];
        const float *src = values ? values[t] : arena + s->layout.t[t].offset;
        if (p->n) memcpy(s->store.cur->w + s->layout.t[t].offset + p->off, src + p->off, p->n * sizeof(float));
    }
}

int psd_model_setup(srv_t *s, const float *const *values)
{
    const ps_config_t *c = &s->cfg;
    const psd_run_opts_t *opts = &s->opts;
    if (ps_table_pack(&s->layout, &s->table_pb, &s->table_pb_len) != 0) return oom(s);
    char terr[300];
    if (c->sched == PS_SCHED_TORCH && ps_tsched_parse(c->sched_torch, &s->tsched, terr, sizeof terr) != 0) {
        PS_ERROR("%s", terr); /* ps_config_validate parsed it: not reached */
        return PSD_EXIT_USAGE;
    }
    psd_optim_t opt;
    psd_optim_from_config(&opt, c);
    if (psd_store_init_part(&s->store, &s->layout, &opt, c->seed, 0, opts->shards) != 0 ||
        psd_store_groups(&s->store, c->groups, c->n_groups) != 0 ||
        psd_hold_init(&s->holder, &s->store, &s->layout, c, opts->shards > 1, MAX_WORKERS) != 0) {
        return oom(s);
    }
    psd_groups_describe(&s->layout, c->groups, c->n_groups, say_group, NULL); /* once: the table is known now */
    int code;
    if (sharded(s) && (code = psd_shard0_check_parts(s)) != 0) return code;
    /* values the config does not draw (model.init's file, the first
     * worker's): psd shards that do not resume fetch their parts of them
     * from here (psd_shard0.c), so the file is read here only, once */
    const bool file = c->kind == PS_MODEL_TENSORS && c->init_file[0];
    if (sharded(s) && !opts->resume_dir && (file || values) && psd_shard0_init_new(s) != 0) return oom(s);
    char lerr[512];
    if (file) {
        float *to = s->sh.init ? s->sh.init : s->store.cur->w; /* every piece, or this store's */
        if (ps_st_init_values(c->init_file, &s->layout, to, s->sh.init || !sharded(s) ? NULL : s->store.own, lerr,
                              sizeof lerr) != 0) {
            PS_ERROR("model.init: %s", lerr);
            return PSD_EXIT_USAGE;
        }
        if (s->sh.init) take_values(s, NULL, s->sh.init);
    }
    if (values) { /* the first worker's (model.kind from_worker) */
        take_values(s, values, NULL);
        if (s->sh.init) psd_shard0_init_keep(s, values);
    }
    s->holder.verify = opts->verify_weights;
    int threads = psd_step_threads(c);
    if (psd_store_set_parallel(&s->store, threads, (size_t)c->chunk_bytes) != 0) {
        PS_ERROR("out of memory for the step's threads");
        return PSD_EXIT_ERROR;
    }
    /* psd_main refuses streamed steps with shards. With an embedding table
     * they would step and send the table whole: the table's rows are worth
     * far more than overlapping the step (a 1M x 32 table: 128 MB a push
     * against a batch's rows), so psd steps whole and says so. */
    s->stream = c->stream && s->sh.n == 1 && s->layout.table < 0;
    if (c->stream && s->layout.table >= 0)
        PS_WARN("train.stream: the model has an embedding table, so steps are whole (not streamed): the table "
                "goes by rows, which a streamed step would send whole");
    /* the table stepped row by row (psd_rows.h): one psd, steps not
     * streamed, or psd shards whose pieces of it are all whole rows (else
     * rows straddle two shards: the table goes whole and is stepped densely) */
    if (s->layout.table >= 0 && !s->stream && (s->sh.n == 1 || ps_shards_table_rows(&s->layout, s->sh.n)) &&
        psd_store_lazy_table(&s->store, (size_t)c->workers * s->holder.room_rows, MAX_WORKERS) != 0) {
        PS_ERROR("out of memory for the table's row steps");
        return PSD_EXIT_ERROR;
    }
    if (s->layout.table >= 0) {
        const double mb = (double)s->layout.t[s->layout.table].numel * 4.0 / 1048576.0;
        bool big = mb > c->ctr_worker_table_mb;
        s->table_on_psd = psd_table_on_psd(c, &s->layout, s->store.n_lazy > 0);
        s->holder.table_on_psd = s->table_on_psd;
        if (s->table_on_psd)
            PS_INFO("the embedding table (%.0f MiB) stays on psd: workers hold only the rows of their batch, "
                    "over the wire (ctr.worker_table_mb %g)", mb, c->ctr_worker_table_mb);
        else if (big)
            PS_WARN("the embedding table (%.0f MiB, over ctr.worker_table_mb %g) goes to every worker whole: a table "
                    "only psd holds needs model.kind ctr, its rows stepped lazily (one psd, or shards whose pieces are "
                    "whole rows), "
                    "steps not streamed, f32 weights and gradients, and no other sparse-rows tensor", mb,
                    c->ctr_worker_table_mb);
    }
    if (s->stream && psd_stream_init(s, (size_t)c->chunk_bytes) != 0) {
        PS_ERROR("out of memory for streamed steps");
        return PSD_EXIT_ERROR;
    }
    s->model_ready = true;
    return 0;
}

/* The model's part freed at the run's end: the holder, the store, the
 * packed tensor table. */
void psd_model_free(srv_t *s)
{
    psd_hold_deinit(&s->holder);
    psd_store_deinit(&s->store);
    free(s->table_pb);
    s->table_pb = NULL;
}
