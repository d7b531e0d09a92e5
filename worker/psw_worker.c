/* psw_worker.c - the training loop of one worker. */
#include "psw_worker.h"

#include <errno.h>
#include <libgen.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_auth.h"
#include "ps_ctr.h"
#include "ps_log.h"
#include "ps_model.h"
#include "ps_rng.h"
#include "ps_util.h"
#include "psw_backend.h"
#include "cuda/psw_cuda.h"
#include "psw_data.h"
#include "psw_model.h"
#include "psworker.h"

typedef struct {
    const psw_worker_opts_t *o;
    psw_client_t *c;
    psw_assign_t a;
    ps_layout_t layout;  /* psd's model */
    /* the table on psd (a.ctr.table_on_psd): the model's table is the rows
     * of one batch (mlayout: layout with a batch's most rows), read
     * through local ids (the batch's rows renumbered in the order of their
     * ids); else mlayout is layout */
    int on_psd;
    ps_layout_t mlayout;
    uint32_t *local;
    psw_data_t train, test;
    psw_backend_t *be;
    psw_model_t *m;
    int max_batch;
    float *x;          /* (max_batch, dim) host batch */
    int32_t *y;        /* (max_batch) */
    int ctr;           /* model.kind ctr: examples from the generator, the model's input is bags of rows */
    ps_ctr_t gen;
    uint32_t *bag_ids; /* (max_batch, fields, per_field) rows of E */
    float *scores;     /* ctr: the click probabilities of a validation range, for psd's AUC */
    uint32_t *touched; /* ctr: the rows of E the batch uses, sorted, and their gradient (row-sparse push) */
    float *row_vals;
    uint32_t *next_bags, *want; /* ctr: the next batch's bags, and the rows they read (asked for with the push) */
    int32_t *next_y;            /* and its labels: the next step takes them instead of making them again */
    size_t next_at;             /* 1 + the position of that batch, 0 = none made */
    int next_B;                 /* its size */
    uint64_t pushes_rows, pushes_whole, repulls, steps;
    size_t scores_cap;
    float *grads_host; /* non-host backends: gradients copied here for the wire (pinned) */
    /* a device backend with a replica of the table: a step uploads the rows
     * its batch reads (dev_ids, dev_vals: device memory, a batch's rows at
     * most), and a push as rows downloads the touched rows of the gradient
     * (gathered to dev_vals, then to rows_host: pinned), not the table */
    uint32_t *dev_ids;
    float *dev_vals, *rows_host;
    size_t dev_nt;    /* rows in dev_ids this step */
    int dev_rows_dl;  /* this step's table gradient goes down as those rows */
    double beat_at;   /* the step's start, or its last HEARTBEAT to psd */
    int split;         /* push tensor by tensor, as each is ready */
    int ready_order[PS_MAX_TENSORS], n_ready, ticket[PS_MAX_TENSORS];
    size_t batch_rows; /* the table on psd: rows of the batch in training (its gradient's rows 0..n-1) */
    /* epoch state */
    uint32_t epoch;
    uint32_t *ids;     /* this epoch's sample ids */
    size_t n_ids, pos, ids_cap;
    int in_epoch;
    int registered;    /* data loaded and checked in an earlier session */
} wk_t;

static int resolve_path(const wk_t *w, const char *path, char *out, size_t n)
{
    if (!w->o->data_dir) return snprintf(out, n, "%s", path) >= (int)n ? -1 : 0;
    char tmp[PSW_PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s", path);
    return snprintf(out, n, "%s/%s", w->o->data_dir, basename(tmp)) >= (int)n ? -1 : 0;
}

/* Check every data file against psd's size and hash, then load the sets. */
static int load_data(wk_t *w, char *err, size_t errlen)
{
    char paths[4][PSW_PATH_MAX];
    for (int i = 0; i < 4; i++) {
        const psw_file_t *f = &w->a.files[i];
        if (resolve_path(w, f->path, paths[i], sizeof paths[i]) != 0) {
            snprintf(err, errlen, "data path too long: %s", f->path);
            return -1;
        }
        uint64_t size = 0, hash = 0;
        int rc = ps_file_hash(paths[i], &size, &hash);
        if (rc != 0) {
            snprintf(err, errlen, "data file %s: %s", paths[i], strerror(-rc));
            return -1;
        }
        if (size != f->size || hash != f->hash) {
            snprintf(err, errlen,
                     "data file %s differs from psd's (%llu bytes, hash %016llx; psd has %llu bytes, hash %016llx)",
                     paths[i], (unsigned long long)size, (unsigned long long)hash,
                     (unsigned long long)f->size, (unsigned long long)f->hash);
            return -1;
        }
    }
    int classes = w->a.sizes[w->a.n_sizes - 1];
    if (psw_data_load(&w->train, paths[0], paths[1], (size_t)w->a.train_limit, classes,
                      w->a.norm_mean, w->a.norm_std, err, errlen) != 0)
        return -1;
    if (psw_data_load(&w->test, paths[2], paths[3], 0, classes, w->a.norm_mean, w->a.norm_std, err,
                      errlen) != 0)
        return -1;
    if (w->train.dim != (size_t)w->a.sizes[0] || w->test.dim != (size_t)w->a.sizes[0]) {
        snprintf(err, errlen, "data has %zu inputs per sample, the model %d", w->train.dim,
                 w->a.sizes[0]);
        return -1;
    }
    ps_malloc_settle(); /* the files' decoding (pworker keeps freed memory: ps_malloc_keep) */
    return 0;
}

/* The GPU failed inside an op (the CUDA plugin exits the process after
 * this): psd is told which device and why, and the connection closed, which
 * sends that before the exit; psd goes on without this worker at once. */
static void on_device_failure(const char *message, void *ctx)
{
    wk_t *w = ctx;
    if (!w->c) return;
    char msg[1024];
    snprintf(msg, sizeof msg, "device cuda:%d failed: %s", w->o->device_index, message);
    psw_client_fail(w->c, 0, msg);
    psw_client_destroy(&w->c);
}

static int make_model(wk_t *w, unsigned workers_on_host, char *err, size_t errlen)
{
    int threads = w->o->threads;
    if (threads <= 0) {
        /* the CPUs this worker may use, shared with the other workers psd
         * has on this host; unless it was given a share of the host
         * (affinity mask or cgroup quota: taskset, SLURM's task binding, a
         * container's --cpus) and the workers' shares, each as large, fit
         * in the host: then they are their own (two workers each bound to
         * 8 of 16 CPUs take 8 each; isolcpus leaving 14 of 16 to every
         * process: 7 each). Workers that share one restriction that fits
         * (two in one 8-CPU cpuset of 16) still take 8 each: --threads. */
        bool bound = false;
        int cores = ps_cpus_usable(&bound, NULL);
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        int on_host = (int)(workers_on_host ? workers_on_host : 1);
        threads = bound && (long)on_host * cores <= online ? cores : cores / on_host;
        if (threads < 1) threads = 1;
    }
    if (w->o->device && strcmp(w->o->device, "cuda") == 0) {
        const psw_cuda_plugin_t *p = psw_cuda_load(err, errlen);
        if (!p) return -1;
        w->be = p->backend_new(w->o->device_index, err, errlen);
        if (!w->be) return -1;
        p->set_fatal_hook(on_device_failure, w);
        char name[128] = "?";
        p->device_name(w->o->device_index, name, sizeof name);
        PS_INFO("backend cuda: device %d (%s)", w->o->device_index, name);
    } else {
        w->be = psw_backend_cpu_new(threads);
        if (!w->be) {
            snprintf(err, errlen, "out of memory");
            return -1;
        }
        if (w->o->device_sim) { /* tests: the device code paths (uploads, downloads, pushes as the
                                 * tensors come down) on the CPU's ops, which give the same bits */
            w->be->host_visible = 0;
            w->be->name = "cpu-as-device";
        }
        PS_INFO("backend %s (OpenBLAS %s kernels), %d thread%s", w->be->name, psw_blas_core(), threads,
                threads == 1 ? "" : "s");
    }
    w->split = w->o->split_push || !w->be->host_visible;
    w->max_batch = (int)(w->a.batch_size > w->a.val_batch_size ? w->a.batch_size : w->a.val_batch_size);
    w->mlayout = w->layout;
    if (w->on_psd) {
        w->split = 0; /* the table's rows go in one push with the rest */
        /* a batch's rows: a training batch's (the rows psd sends with its weights), or on a
         * device backend a validation batch's too (uploaded batch by batch; on the CPU the
         * model reads the validation part's rows where they arrived) */
        uint64_t cap = (uint64_t)(w->be->host_visible ? (int)w->a.batch_size : w->max_batch) *
                       (uint64_t)(w->a.ctr.fields * w->a.ctr.per_field);
        if (cap > w->a.ctr.rows) cap = w->a.ctr.rows;
        if (ps_layout_init_table(&w->mlayout, w->a.sizes, w->a.n_sizes, cap, w->a.ctr.dim) != 0) {
            snprintf(err, errlen, "invalid model");
            return -1;
        }
        PS_INFO("the embedding table (%llu rows) stays on psd: this worker holds the rows of one batch (at most "
                "%llu)", (unsigned long long)w->a.ctr.rows, (unsigned long long)cap);
    }
    if (w->ctr) {
        psw_bags_t bags = {.fields = w->a.ctr.fields, .per_field = w->a.ctr.per_field, .mean = w->a.ctr.mean};
        w->m = psw_model_new_bags(w->be, &w->mlayout, w->max_batch, &bags);
        size_t per = (size_t)w->max_batch * (size_t)(bags.fields * bags.per_field);
        w->local = w->on_psd ? malloc(per * sizeof *w->local) : NULL;
        if (w->on_psd && !w->local) {
            snprintf(err, errlen, "out of memory for the model");
            return -1;
        }
        w->bag_ids = malloc(per * sizeof *w->bag_ids);
        w->touched = malloc(per * sizeof *w->touched);
        w->row_vals = malloc(per * (size_t)w->a.ctr.dim * sizeof *w->row_vals);
        w->next_bags = malloc(per * sizeof *w->next_bags);
        w->next_y = malloc((size_t)w->max_batch * sizeof *w->next_y);
        w->want = malloc(per * sizeof *w->want);
        if (!w->bag_ids || !w->touched || !w->row_vals || !w->next_bags || !w->next_y || !w->want) {
            snprintf(err, errlen, "out of memory for the model");
            return -1;
        }
    } else {
        w->m = psw_model_new(w->be, &w->layout, w->max_batch);
    }
    w->x = w->ctr ? NULL : malloc((size_t)w->max_batch * (size_t)w->a.sizes[0] * sizeof(float)); /* ctr: bags */
    w->y = malloc((size_t)w->max_batch * sizeof(int32_t));
    if (!w->be->host_visible) w->grads_host = w->be->host_alloc(w->be, w->mlayout.n_params * sizeof(float));
    if (!w->be->host_visible && w->ctr && !w->on_psd) {
        size_t per = (size_t)w->max_batch * (size_t)(w->a.ctr.fields * w->a.ctr.per_field);
        w->dev_ids = w->be->alloc(w->be, per * sizeof *w->dev_ids);
        w->dev_vals = w->be->alloc(w->be, per * (size_t)w->a.ctr.dim * sizeof *w->dev_vals);
        w->rows_host = w->be->host_alloc(w->be, per * (size_t)w->a.ctr.dim * sizeof *w->rows_host);
        if (!w->dev_ids || !w->dev_vals || !w->rows_host) {
            snprintf(err, errlen, "out of memory for the model");
            return -1;
        }
    }
    if (!w->m) { /* the weights, gradients and activations on the backend */
        snprintf(err, errlen, "out of %s memory for the model (%.1f MiB of parameters, batches of %d)",
                 w->be->host_visible ? "host" : "device", (double)w->mlayout.n_params * 4 / (1 << 20), w->max_batch);
        return -1;
    }
    if ((!w->ctr && !w->x) || !w->y || (!w->be->host_visible && !w->grads_host)) {
        snprintf(err, errlen, "out of memory for the model");
        return -1;
    }
    return 0;
}

/* The weights of ev for the model: on the CPU they are used where they
 * arrived (frames, psd's shared slot: valid until the next
 * psw_client_next, a slot only until the push that asks for the next
 * weights: psw_client_release_on_push), without a copy, and the gradient goes straight to the
 * region psd reads it from when there is one; device backends upload. With
 * the table on psd the event's table is the rows it brought: a training
 * batch's fit the model's table; a validation part's are uploaded batch by
 * batch (val_rows). With with_table false the table is not uploaded here:
 * the caller uploads the rows its batches read (val_rows, replica_rows). */
static int set_weights(wk_t *w, const psw_event_t *ev, bool with_table)
{
    if (ev->n_tensors != w->layout.n_tensors) return -1;
    for (int i = 0; i < ev->n_tensors; i++)
        if (ev->tensor_numel[i] != w->layout.t[i].numel && !(w->on_psd && i == w->layout.table)) return -1;
    if (w->be->host_visible) {
        psw_model_borrow(w->m, ev->tensors, psw_client_push_region(w->c));
        return 0;
    }
    float *p = psw_model_params(w->m);
    for (int i = 0; i < ev->n_tensors; i++) {
        if (i == w->layout.table && !with_table) continue;                                 /* the caller's */
        if (w->on_psd && i == w->layout.table && ev->tensor_numel[i] > w->mlayout.t[i].numel) return -1; /* more rows
                                                                                       than a batch reads */
        w->be->upload(w->be, p + w->mlayout.t[i].offset, ev->tensors[i], 4 * ev->tensor_numel[i]);
    }
    return 0;
}

/* model.kind ctr: examples first + idx[b] (idx NULL: first + b) for b < B,
 * as bags of rows and labels. */
static void ctr_batch(const wk_t *w, const uint32_t *idx, uint64_t first, int B, uint32_t *bags, int32_t *y)
{
    size_t n = (size_t)w->gen.fields * (size_t)w->gen.per_field;
    for (int b = 0; b < B; b++) {
        uint8_t label;
        ps_ctr_example(&w->gen, first + (idx ? idx[b] : (uint64_t)b), bags + (size_t)b * n, NULL, &label);
        y[b] = label;
    }
}

/* ctr: the rows of E that the B examples' bags (bags) read, sorted and
 * once each, to out; returns their count. */
static size_t touched_rows(const wk_t *w, const uint32_t *bags, int B, uint32_t *out)
{
    size_t n = (size_t)B * (size_t)(w->gen.fields * w->gen.per_field);
    memcpy(out, bags, n * sizeof *out);
    return ps_sort_unique_u32(out, n);
}

/* The batch made ahead (next_bags, next_y) and the current one trade places. */
static void swap_next(wk_t *w)
{
    uint32_t *b = w->bag_ids;
    int32_t *y = w->y;
    w->bag_ids = w->next_bags, w->next_bags = b;
    w->y = w->next_y, w->next_y = y;
}

/* ctr: the rows the epoch's next batch (from w->pos) reads, to w->want;
 * returns their count. 0 when it is not a whole batch: samples psd gives
 * this worker later (EPOCH append) would join it, with rows not asked for. */
static size_t next_rows(wk_t *w)
{
    size_t left = w->n_ids - w->pos;
    if (left == 0 || (left < w->a.batch_size && !w->on_psd)) return 0; /* the table on psd: a partial one too */
    int B = (int)(left < w->a.batch_size ? left : w->a.batch_size);
    ctr_batch(w, w->ids + w->pos, 0, B, w->next_bags, w->next_y);
    w->next_at = w->pos + 1;
    w->next_B = B;
    return touched_rows(w, w->next_bags, B, w->want);
}

/* The table on psd: bags[0, n) as indices into rows[0, k) (strictly
 * increasing), the rows the event brought. 0, or -1 if one is missing. */
static int to_local(const uint32_t *bags, size_t n, const uint32_t *rows, size_t k, uint32_t *local)
{
    for (size_t j = 0; j < n; j++) {
        ptrdiff_t i = ps_find_u32(rows, k, bags[j]);
        if (i < 0) return -1;
        local[j] = (uint32_t)i;
    }
    return 0;
}

/* A device backend with the table on psd: the rows of the validation
 * batch bags[0, B) to the model's table, from those psd sent for the range
 * (ev), and the bags as indices into them (w->local). 0, or -1 if psd's
 * rows lack one. */
static int val_rows(wk_t *w, const psw_event_t *ev, const uint32_t *bags, int B)
{
    const int t = w->layout.table;
    const size_t D = (size_t)w->layout.t[t].cols, nt = touched_rows(w, bags, B, w->touched);
    for (size_t j = 0; j < nt; j++) {
        ptrdiff_t i = ps_find_u32(ev->row_ids, ev->n_row_ids, w->touched[j]);
        if (i < 0) return -1;
        memcpy(w->row_vals + j * D, ev->tensors[t] + (size_t)i * D, D * sizeof(float));
    }
    w->be->upload(w->be, psw_model_params(w->m) + w->mlayout.t[t].offset, w->row_vals, nt * D * sizeof(float));
    return to_local(bags, (size_t)B * (size_t)(w->gen.fields * w->gen.per_field), w->touched, nt, w->local);
}

/* A device backend with a replica of the table: the rows ids[0, n) of the
 * event's table E (whole: the replica, psd's shared slot or a whole frame)
 * to the model's table, through dev_ids and dev_vals; the others stay as
 * they were (no batch of this step reads them). The whole table when that
 * is fewer bytes. */
static void replica_rows(wk_t *w, const float *E, const uint32_t *ids, size_t n)
{
    const int t = w->layout.table;
    const size_t D = (size_t)w->layout.t[t].cols;
    float *dst = psw_model_params(w->m) + w->mlayout.t[t].offset;
    w->dev_nt = n;
    w->be->upload(w->be, w->dev_ids, ids, n * sizeof *ids); /* also for the gradient's rows (grad_ready) */
    if (n * (D + 1) >= w->layout.t[t].numel) {
        w->be->upload(w->be, dst, E, w->layout.t[t].numel * sizeof *E);
        return;
    }
    for (size_t j = 0; j < n; j++) memcpy(w->row_vals + j * D, E + (size_t)ids[j] * D, D * sizeof *E);
    w->be->upload(w->be, w->dev_vals, w->row_vals, n * D * sizeof *E);
    w->be->scatter_rows(w->be, dst, w->dev_ids, w->dev_vals, n, (int)D);
}

/* A step that computes for long says it is alive every second, or three
 * times within psd's silence limit if that is shorter (psd takes a worker
 * it waits for and hears nothing from for its worker timeout, 5 s by
 * default, for lost). */
static void beat(wk_t *w)
{
    double now = ps_now(), every = w->a.silence_s > 0 && w->a.silence_s < 3.0 ? w->a.silence_s / 3 : 1.0;
    if (now - w->beat_at < every) return;
    psw_client_heartbeat(w->c, w->epoch);
    w->beat_at = now;
}

/* Backward reached tensor t: start copying its gradient to the wire buffer
 * (device backends) while earlier layers still compute. t = -1: the
 * forward pass is done. */
static void grad_ready(void *ud, int t)
{
    wk_t *w = ud;
    beat(w);
    if (t < 0) return;
    long slow = w->o->slow_ms; /* tests: a step that computes slowly, layer by layer (slow in all) */
    if (w->o->slow_rank_ms > 0 && w->a.world > w->a.rank) /* the higher ranks faster: pushes in reverse rank order */
        slow += (long)w->o->slow_rank_ms * (long)(w->a.world - 1 - w->a.rank);
    if (slow > 0) {
        long ns = slow * 1000000L / w->layout.n_tensors;
        nanosleep(&(struct timespec){ns / 1000000000L, ns % 1000000000L}, NULL);
    }
    if (!w->be->host_visible) {
        size_t off = w->mlayout.t[t].offset, numel = w->mlayout.t[t].numel;
        if (w->on_psd && t == w->layout.table) /* only the batch's rows have a gradient */
            numel = w->batch_rows * (size_t)w->mlayout.t[t].cols;
        if (w->dev_rows_dl && t == w->layout.table) { /* a replica pushed as rows: those rows down */
            const int D = w->mlayout.t[t].cols;
            w->be->gather_rows(w->be, w->dev_vals, psw_model_grads(w->m) + off, w->dev_ids, w->dev_nt, D);
            w->ticket[t] = w->be->download_async(w->be, w->rows_host, w->dev_vals, w->dev_nt * (size_t)D * 4);
        } else {
            w->ticket[t] = w->be->download_async(w->be, w->grads_host + off, psw_model_grads(w->m) + off, 4 * numel);
        }
    }
    w->ready_order[w->n_ready++] = t;
}

/* The last push's buffers (gradients, row lists) are released by ZeroMQ
 * (sent, or dropped with its connection) before they are written again;
 * never waits for ever. 0, or -ETIMEDOUT. */
static int push_done(wk_t *w)
{
    double since = ps_now();
    while (!psw_client_push_done(w->c)) {
        if (ps_now() - since > w->a.step_timeout_s) {
            PS_ERROR("the last push was not sent within %.0f s", w->a.step_timeout_s);
            return -ETIMEDOUT;
        }
        sched_yield();
    }
    return 0;
}

/* A step whose batch touched nt rows of the table (0: not counted) pushes
 * the table's gradient as those rows: when they are few, or always with the
 * table on psd. */
static bool as_rows(const wk_t *w, size_t nt)
{
    return nt > 0 && (w->on_psd || (double)nt < w->a.sparse_threshold * (double)w->layout.t[w->layout.table].rows);
}

/* One training step on the next batch of the epoch, then push: in one
 * message, or tensor by tensor as each gradient reaches host memory. */
static int train_step(wk_t *w, const psw_event_t *ev)
{
    int rc = push_done(w);
    if (rc < 0) return rc;
    w->beat_at = ps_now();
    if (set_weights(w, ev, !w->dev_ids) != 0) return -EPROTO; /* a device's replica: the batch's rows below */
    int B = (int)(w->n_ids - w->pos < w->a.batch_size ? w->n_ids - w->pos : w->a.batch_size);
    double loss = 0;
    int64_t correct = 0;
    size_t nt = 0; /* ctr: the rows of E the batch reads (w->touched) */
    w->n_ready = 0;
    if (w->ctr) {
        if (w->next_at == w->pos + 1 && w->next_B == B) { /* made when the last push asked for its rows */
            swap_next(w);
        } else {
            ctr_batch(w, w->ids + w->pos, 0, B, w->bag_ids, w->y);
        }
        w->next_at = 0;
        const uint32_t *bags = w->bag_ids;
        if (w->on_psd) { /* the batch's rows: those the event brought, or ask for them */
            nt = touched_rows(w, w->bag_ids, B, w->touched);
            if (ev->n_row_ids != nt || memcmp(ev->row_ids, w->touched, nt * sizeof *w->touched) != 0) {
                swap_next(w); /* kept for the answer */
                w->next_at = w->pos + 1;
                w->next_B = B;
                w->repulls++;
                return psw_client_pull_rows(w->c, ev->version, w->touched, nt);
            }
            to_local(w->bag_ids, (size_t)B * (size_t)(w->gen.fields * w->gen.per_field), w->touched, nt, w->local);
            bags = w->local;
            w->batch_rows = nt;
        } else if (w->dev_ids || (w->a.sparse_threshold > 0 && psw_client_rows_ok(w->c))) {
            /* the rows the batch reads: a push as rows sends their gradient, a device's replica
             * takes this version's values of them (and of no other row) */
            size_t k = touched_rows(w, w->bag_ids, B, w->touched);
            if (w->dev_ids) replica_rows(w, ev->tensors[w->layout.table], w->touched, k);
            if (w->a.sparse_threshold > 0 && psw_client_rows_ok(w->c)) nt = k;
        }
        w->dev_rows_dl = w->dev_ids && as_rows(w, nt);
        psw_model_train_bags(w->m, bags, w->y, B, &loss, &correct, grad_ready, w);
    } else {
        psw_data_gather(&w->train, w->ids + w->pos, B, w->x, w->y);
        psw_model_train_step(w->m, w->x, w->y, B, &loss, &correct, grad_ready, w);
    }
    w->pos += (size_t)B;
    w->steps++;
    int last = w->pos >= w->n_ids;

    const float *base = w->be->host_visible ? psw_model_grads(w->m) : w->grads_host; /* laid out as mlayout */
    psw_grad_t gr[PS_MAX_TENSORS];
    const int n = w->layout.n_tensors;
    for (int k = 0; k < n; k++) {
        int t = w->split ? w->ready_order[k] : k;
        gr[k] = (psw_grad_t){.tensor = (uint32_t)t, .data = base + w->mlayout.t[t].offset};
    }
    psw_push_t p = {.version = ev->version, .batch = (uint32_t)B, .loss_sum = loss, .correct = (uint64_t)correct,
                    .pull = !last, .n_grads = n, .grads = gr};
    const double few = nt ? w->a.sparse_threshold * (double)w->layout.t[w->layout.table].rows : 0;
    const bool rows_push = as_rows(w, nt);
    if (!w->be->host_visible && (rows_push || !w->split)) /* read whole from grads_host: every tensor down */
        for (int k = 0; k < w->n_ready; k++) w->be->wait(w->be, w->ticket[w->ready_order[k]]);
    if (rows_push) {
        /* few rows of the table touched (or the table on psd): push those (the others' gradient is zero) */
        const size_t D = (size_t)w->layout.t[w->layout.table].cols;
        const float *dE = base + w->mlayout.t[w->layout.table].offset, *vals = dE; /* on psd: rows 0..nt-1 */
        if (w->dev_rows_dl) {
            vals = w->rows_host; /* gathered on the device, downloaded (grad_ready) */
        } else if (!w->on_psd) {
            for (size_t i = 0; i < nt; i++)
                memcpy(w->row_vals + i * D, dE + (size_t)w->touched[i] * D, D * sizeof(float));
            vals = w->row_vals;
        }
        for (int k = 0; k < n; k++)
            if ((int)gr[k].tensor == w->layout.table)
                gr[k] = (psw_grad_t){.tensor = gr[k].tensor, .row_ids = w->touched, .n_rows = nt, .row_vals = vals};
        /* and the reply brings only the table rows the next batch reads, when they are few */
        size_t nw = last ? 0 : next_rows(w);
        if ((double)nw >= few && !w->on_psd) nw = 0;
        p.want = w->want;
        p.n_want = nw;
        rc = psw_client_push_v(w->c, &p);
        w->pushes_rows++;
    } else if (!w->split) {
        rc = psw_client_push_v(w->c, &p);
        w->pushes_whole += w->ctr;
    } else {
        w->pushes_whole += w->ctr;
        for (int k = 0; k < n && rc == 0; k++) { /* each tensor as soon as it is down */
            w->be->wait(w->be, w->ticket[gr[k].tensor]);
            p.grads = &gr[k];
            p.n_grads = 1;
            p.pull = k == n - 1 && !last;
            rc = psw_client_push_v(w->c, &p);
        }
    }
    if (rc < 0) return rc;
    if (last) {
        w->in_epoch = 0;
        rc = psw_client_barrier(w->c, w->epoch, w->n_ids);
    }
    return rc;
}

static int validate(wk_t *w, const psw_event_t *ev)
{
    const bool held_out = ev->split == PSW_SPLIT_VAL; /* training samples psd holds out */
    if (held_out ? w->ctr : ev->val_end > w->test.count) return -EPROTO;
    for (size_t i = 0; held_out && i < ev->n_val_ids; i++)
        if (ev->val_ids[i] >= w->train.count) return -EPROTO;
    if (!w->m) { /* joined while an epoch ended: validating before its first epoch */
        char err[512];
        if (make_model(w, 0, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            psw_client_fail(w->c, 0, err);
            return -ENODEV;
        }
    }
    int rc = push_done(w); /* a validation batch's rows go where the last push's were */
    if (rc < 0) return rc;
    if (set_weights(w, ev, !w->on_psd) != 0) return -EPROTO; /* the table on psd: batch by batch (val_rows) */
    size_t n = ev->val_end - ev->val_begin;
    if (w->ctr && n > w->scores_cap) {
        float *p = n <= SIZE_MAX / sizeof *p ? realloc(w->scores, n * sizeof *p) : NULL;
        if (!p) return -ENOMEM;
        w->scores = p;
        w->scores_cap = n;
    }
    double loss = 0, last_sent = ps_now();
    int64_t correct = 0;
    for (uint64_t i = ev->val_begin; i < ev->val_end;) {
        int B = (int)(ev->val_end - i < w->a.val_batch_size ? ev->val_end - i : w->a.val_batch_size);
        if (w->ctr) { /* test examples come after the training ones */
            ctr_batch(w, NULL, w->a.ctr.train + i, B, w->bag_ids, w->y);
            const uint32_t *bags = w->bag_ids;
            if (w->on_psd) { /* read through the rows psd sent for the range */
                if ((w->be->host_visible ? to_local(w->bag_ids, (size_t)B * (size_t)(w->gen.fields * w->gen.per_field),
                                                    ev->row_ids, ev->n_row_ids, w->local)
                                         : val_rows(w, ev, w->bag_ids, B)) != 0) {
                    PS_ERROR("psd's validation part lacks table rows its examples read");
                    return -EPROTO;
                }
                bags = w->local;
            }
            psw_model_eval_bags(w->m, bags, w->y, B, &loss, &correct);
            psw_model_prob1(w->m, w->scores + (i - ev->val_begin), B);
        } else {
            if (held_out) psw_data_gather(&w->train, ev->val_ids + (i - ev->val_begin), B, w->x, w->y);
            else psw_data_slice(&w->test, (size_t)i, B, w->x, w->y);
            psw_model_eval(w->m, w->x, w->y, B, &loss, &correct);
        }
        i += (uint64_t)B;
        if (ps_now() - last_sent > 1.0) { /* psd waits with a deadline: say we are alive */
            psw_client_heartbeat(w->c, ev->epoch);
            last_sent = ps_now();
        }
    }
    psw_val_t r = psw_val_for(ev);
    r.loss_sum = loss;
    r.correct = (uint64_t)correct;
    r.scores = w->ctr && n > 0 ? w->scores : NULL;
    return psw_client_val_result(w->c, &r);
}

/* EPOCH: this worker's samples for an epoch, or (append) more samples for
 * the current one, given up by a worker that was lost or left. */
static int start_epoch(wk_t *w, const psw_event_t *ev)
{
    if (!w->m) {
        char err[512];
        if (make_model(w, ev->workers_on_host, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            psw_client_fail(w->c, 0, err);
            return -ENODEV;
        }
    }
    for (size_t i = 0; i < ev->n_samples; i++)
        if (ev->samples[i] >= w->train.count) return -EPROTO;
    if (ev->append && ev->epoch != w->epoch) return -EPROTO;
    if (ev->keep > 0) { /* fewer: psd gave the rest to workers done with theirs, before this batch's weights */
        if (!w->in_epoch || ev->keep <= w->pos || ev->keep > w->n_ids) { /* its next batch at least */
            PS_ERROR("psd cut this worker's epoch to %llu samples, but it has %zu of which %zu are trained",
                     (unsigned long long)ev->keep, w->n_ids, w->pos);
            return -EPROTO;
        }
        PS_DEBUG("epoch %u: %llu of %zu samples kept", ev->epoch, (unsigned long long)ev->keep, w->n_ids);
        w->n_ids = (size_t)ev->keep;
        return 0;
    }
    size_t keep = ev->append ? w->n_ids : 0;
    if (keep + ev->n_samples > w->ids_cap) {
        uint32_t *p = realloc(w->ids, (keep + ev->n_samples) * sizeof *p);
        if (!p) return -ENOMEM;
        w->ids = p;
        w->ids_cap = keep + ev->n_samples;
    }
    if (ev->n_samples) memcpy(w->ids + keep, ev->samples, ev->n_samples * sizeof *w->ids);
    w->n_ids = keep + ev->n_samples;
    if (!ev->append) w->pos = w->next_at = 0;
    w->epoch = ev->epoch;
    PS_DEBUG("epoch %u: %zu samples%s", ev->epoch, ev->n_samples, ev->append ? " more" : "");
    if (w->pos >= w->n_ids) {
        w->in_epoch = 0;
        return psw_client_barrier(w->c, w->epoch, w->n_ids);
    }
    if (w->in_epoch) return 0; /* already training: the new samples come after */
    w->in_epoch = 1;
    if (w->on_psd) { /* the table on psd: with the rows of the first batch */
        size_t n = next_rows(w);
        return psw_client_pull_rows(w->c, ev->version, w->want, n);
    }
    return psw_client_pull(w->c, ev->version);
}

static void wk_deinit(wk_t *w)
{
    if (w->grads_host && w->be) w->be->host_free(w->be, w->grads_host);
    w->grads_host = NULL;
    if (w->be) {
        if (w->rows_host) w->be->host_free(w->be, w->rows_host);
        if (w->dev_ids) w->be->free(w->be, w->dev_ids);
        if (w->dev_vals) w->be->free(w->be, w->dev_vals);
    }
    w->rows_host = NULL;
    w->dev_ids = NULL;
    w->dev_vals = NULL;
    psw_model_destroy(&w->m);
    if (w->be) w->be->destroy(w->be);
    psw_data_deinit(&w->train);
    psw_data_deinit(&w->test);
    free(w->x);
    free(w->y);
    free(w->bag_ids);
    free(w->touched);
    free(w->row_vals);
    free(w->next_bags);
    free(w->next_y);
    free(w->want);
    free(w->local);
    free(w->scores);
    free(w->ids);
    psw_client_destroy(&w->c);
}

/* This worker's exit code for the one psd ended the run with. */
static int exit_code_of(int psd_code) { return psd_code < 0 || psd_code > 125 ? PSW_EXIT_ERROR : psd_code; }

static volatile sig_atomic_t leave_signal;
static void on_leave_signal(int sig) { leave_signal = sig; }

/* Register (again, after psd was lost) and check the assignment and the
 * data: true when this worker is in the run, else false with *result the
 * session's result (an exit code, or -1: psd lost, register again). */
static bool join(wk_t *w, const psw_info_t *info, double reg_timeout, int *result)
{
    const psw_worker_opts_t *o = w->o;
    char err[512];
    w->c = psw_client_new(o->connect, info, err, sizeof err);
    if (!w->c) {
        PS_ERROR("%s", err);
        *result = PSW_EXIT_USAGE;
        return false;
    }
    psw_assign_t a;
    int rc = psw_client_register(w->c, &a, reg_timeout, err, sizeof err);
    if (rc == -EACCES) {
        PS_ERROR("%s", err);
        *result = PSW_EXIT_USAGE;
        return false;
    }
    if (rc == -ESHUTDOWN) { /* psd ended the run while this worker registered again */
        int code = psw_client_shutdown_code(w->c);
        if (code != 0) PS_ERROR("%s", err);
        else PS_INFO("%s", err);
        *result = exit_code_of(code);
        return false;
    }
    if (rc == -ETIMEDOUT || rc == -ECONNRESET || rc == -ENOLINK) {
        if (!w->registered) PS_ERROR("%s", err);
        *result = w->registered ? -1 : PSW_EXIT_PSD_LOST;
        return false;
    }
    if (rc < 0) {
        PS_ERROR("%s", err);
        *result = PSW_EXIT_USAGE;
        return false;
    }
    if (a.model == PSW_MODEL_TENSORS) {
        psw_client_fail(w->c, 0, "pworker trains the built-in models only");
        PS_ERROR("psd's run trains a model of %d named tensors (model.kind tensors): pworker trains the built-in "
                 "models only; run the program that computes its gradients (a worker built on psworker.h)",
                 a.n_tensors);
        *result = PSW_EXIT_USAGE;
        return false;
    }
    char role[32];
    snprintf(role, sizeof role, "worker %u", a.rank);
    ps_log_set_role(role);
    ps_log_set_level(a.rank != 0 && !o->verbose ? PS_LOG_WARN : PS_LOG_INFO);
    if (!w->registered) {
        w->a = a;
        PS_INFO("registered with psd at %s: rank %u, run %016llx", o->connect, a.rank,
                (unsigned long long)a.run_id);
        if (ps_layout_init_table(&w->layout, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim) != 0) {
            PS_ERROR("psd sent an invalid model");
            *result = PSW_EXIT_USAGE;
            return false;
        }
        w->ctr = a.ctr.fields > 0;
        w->on_psd = w->ctr && a.ctr.table_on_psd;
        if (w->ctr) { /* no files: examples are made from their index */
            w->gen = (ps_ctr_t){.fields = a.ctr.fields, .per_field = a.ctr.per_field, .vocab = a.ctr.vocab,
                                .zipf = a.ctr.zipf, .rows = a.ctr.rows, .weight_std = a.ctr.weight_std,
                                .bias = a.ctr.bias, .seed = a.ctr.seed};
            w->train.count = a.train_limit && a.train_limit < a.ctr.train ? a.train_limit : a.ctr.train;
            w->test.count = a.ctr.test;
        } else if (load_data(w, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            psw_client_fail(w->c, 1, err);
            *result = PSW_EXIT_USAGE;
            return false;
        }
        PS_INFO("data checked: %zu training, %zu test samples", w->train.count, w->test.count);
        w->registered = 1;
    } else {
        /* the same run again (psd restarted, or this worker was declared lost) */
        if (a.n_sizes != w->a.n_sizes || memcmp(a.sizes, w->a.sizes, sizeof a.sizes) != 0 ||
            memcmp(a.files, w->a.files, sizeof a.files) != 0 || a.batch_size != w->a.batch_size ||
            a.val_batch_size != w->a.val_batch_size ||
            memcmp(&a.ctr, &w->a.ctr, sizeof a.ctr) != 0) {
            PS_ERROR("psd's model or data changed since this worker joined; not rejoining");
            *result = PSW_EXIT_USAGE;
            return false;
        }
        w->a = a;
        PS_WARN("rejoined run %016llx as rank %u", (unsigned long long)a.run_id, a.rank);
    }
    w->in_epoch = 0;
    w->n_ids = w->pos = w->next_at = 0;
    /* train_step reads the weights it was given (set_weights) only before
     * its push; the push that asks for the next ones ends that: psd may
     * step its shared slot in place */
    psw_client_release_on_push(w->c, 1);
    psw_client_ready(w->c, w->train.count, w->test.count, NULL); /* psd checked the files' hashes in ASSIGN */

    return true;
}

/* psd ends the run: what this worker did, logged; its exit code. */
static int on_shutdown(const wk_t *w, const psw_event_t *ev)
{
    if (w->ctr)
        PS_INFO("embedding table gradient pushed as rows %llu times, whole %llu times%s",
                (unsigned long long)w->pushes_rows, (unsigned long long)w->pushes_whole,
                w->on_psd ? "; the table stayed on psd" : "");
    if (w->be && !w->be->host_visible)
        PS_INFO("device copies: %llu bytes up, %llu bytes down; %llu training steps",
                (unsigned long long)w->be->bytes_up, (unsigned long long)w->be->bytes_down,
                (unsigned long long)w->steps);
    if (w->repulls)
        PS_INFO("%llu batches asked psd for their table rows again (samples added to the epoch)",
                (unsigned long long)w->repulls);
    if (ev->exit_code != 0) PS_ERROR("psd ended the run: %s", ev->message);
    else PS_INFO("psd ended the run: %s", ev->message[0] ? ev->message : "done");
    return exit_code_of(ev->exit_code);
}

/* The run's events until psd ends it: an exit code, or -1 (psd lost). */
static int follow(wk_t *w)
{
    char err[512];
    int rc;
    double timeout = w->a.start_timeout_s;
    for (;;) {
        psw_event_t ev;
        if (leave_signal) {
            PS_WARN("received %s: leaving the run", strsignal(leave_signal));
            psw_client_leave(w->c, "worker stopped by a signal");
            return PSW_EXIT_OK;
        }
        rc = psw_client_next(w->c, &ev, timeout, err, sizeof err);
        if (rc == -EINTR) continue;
        if (rc == -EACCES) {
            PS_ERROR("%s", err);
            return PSW_EXIT_USAGE;
        }
        if (rc == -ETIMEDOUT || rc == -ECONNRESET || rc == -ENOLINK) {
            PS_WARN("%s", err);
            return -1;
        }
        if (rc < 0) {
            PS_ERROR("%s", err);
            psw_client_fail(w->c, 0, err);
            return PSW_EXIT_USAGE;
        }
        timeout = w->a.step_timeout_s;
        switch (ev.kind) {
        case PSW_EV_EPOCH: rc = start_epoch(w, &ev); break;
        case PSW_EV_WEIGHTS:
            if (!w->in_epoch) {
                PS_WARN("dropped weights version %llu outside an epoch", (unsigned long long)ev.version);
                rc = 0;
                break;
            }
            rc = train_step(w, &ev);
            break;
        case PSW_EV_VALIDATE: rc = validate(w, &ev); break;
        case PSW_EV_SHUTDOWN: return on_shutdown(w, &ev);
        }
        if (rc == -ENODEV) return PSW_EXIT_ERROR; /* no backend: logged and told to psd already */
        if (rc == -EPROTO) {
            PS_ERROR("psd sent a message this worker cannot use (wrong model or data sizes)");
            psw_client_fail(w->c, 0, "invalid message from psd");
            return PSW_EXIT_USAGE;
        }
        if (rc < 0) {
            PS_ERROR("worker failed: %s", strerror(-rc));
            psw_client_fail(w->c, 0, strerror(-rc));
            return PSW_EXIT_ERROR;
        }
    }
}

/* One session with psd: register (again, after psd was lost), check data,
 * train until psd ends the run. Returns an exit code, or -1 when psd was lost
 * and the worker should register again. */
static int session(wk_t *w, const psw_info_t *info, double reg_timeout)
{
    int code;
    return join(w, info, reg_timeout, &code) ? follow(w) : code;
}

int psw_worker_run(const psw_worker_opts_t *o)
{
    wk_t w = {.o = o};
    uint8_t identity[16];
    psw_make_identity(identity, 0);
    psw_info_t info = {.device = o->device ? o->device : "cpu",
                       .device_index = o->device_index,
                       .identity_hint = getenv("SLURM_PROCID"),
                       .threads = (unsigned)(o->threads > 0 ? o->threads : 0),
                       .protocol = o->protocol,
                       .identity = identity,
                       .identity_len = sizeof identity,
                       .no_shm = o->no_shm};
    ps_keypair_t kp;
    char server_pub[PS_Z85_LEN], err[512];
    if (o->key_file || o->server_key) {
        if (!o->key_file || !o->server_key) {
            PS_ERROR("--key and --server-key go together");
            return PSW_EXIT_USAGE;
        }
        if (ps_auth_load_secret(o->key_file, &kp, err, sizeof err) != 0 ||
            ps_auth_load_public(o->server_key, server_pub, err, sizeof err) != 0) {
            PS_ERROR("%s", err);
            return PSW_EXIT_USAGE;
        }
        info.curve_public = kp.public_z85;
        info.curve_secret = kp.secret_z85;
        info.curve_server = server_pub;
    }
    struct sigaction sa = {.sa_handler = on_leave_signal};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);

    int code;
    double lost_at = 0, backoff = 0.25;
    for (;;) {
        code = session(&w, &info, lost_at ? 5.0 : o->register_timeout_s);
        if (w.c) {
            info.run_id = psw_client_run_id(w.c);
            info.prev_rank = w.a.rank;
            if (psw_client_verified(w.c))
                PS_INFO("%llu weights messages matched psd's checksums of their versions",
                        (unsigned long long)psw_client_verified(w.c));
        }
        psw_client_destroy(&w.c);
        if (code >= 0) break;
        /* psd lost: register again with back-off until retry_s has passed */
        if (!lost_at) lost_at = ps_now();
        if (ps_now() - lost_at > o->retry_s) {
            PS_ERROR("psd at %s did not come back within %.0f s; giving up", o->connect, o->retry_s);
            code = PSW_EXIT_PSD_LOST;
            break;
        }
        if (leave_signal) {
            code = PSW_EXIT_OK;
            break;
        }
        struct timespec ts = {(time_t)backoff, (long)((backoff - (double)(time_t)backoff) * 1e9)};
        nanosleep(&ts, NULL);
        backoff = backoff * 2 > 5 ? 5 : backoff * 2;
        if (ps_now() - lost_at > 1 && backoff >= 5) PS_DEBUG("registering again with psd at %s", o->connect);
    }
    wk_deinit(&w);
    memset(&kp, 0, sizeof kp);
    return code;
}
