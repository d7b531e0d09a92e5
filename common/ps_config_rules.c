/* ps_config_rules.c - the rules between a config's keys (one model kind's
 * keys against another's, the data split, the metrics keep_best and
 * early_stop name, the schedule against the run, the ctr task, the
 * listening endpoint): ps_config_validate checks each key against its own
 * range first (ps_config.c), then these. */
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "ps_assert.h"
#include "ps_config.h"
#include "ps_ctr.h"
#include "ps_data.h"
#include "ps_tsched.h"
#include "ps_util.h"

#define set_err ps_set_err
#define MAX_NORM_INPUT 1e6         /* the largest input magnitude data.normalize_* may make */

/* schedule.name torch: schedule.torch read, and what psd cannot follow refused */
static int check_torch_schedule(const ps_config_t *c, char *err, size_t errlen)
{
    if (c->sched != PS_SCHED_TORCH) {
        if (c->sched_torch[0] || c->sched_interval != PS_INTERVAL_EPOCH) {
            set_err(err, errlen, "schedule.torch and schedule.interval are read with schedule.name: torch (it is %s)",
                    ps_sched_name(c->sched));
            return -1;
        }
        return 0;
    }
    ps_tsched_t ts;
    if (!c->sched_torch[0]) {
        set_err(err, errlen, "schedule.name torch: schedule.torch gives the scheduler, e.g. \"StepLR(step_size=30, "
                "gamma=0.1)\"");
        return -1;
    }
    if (ps_tsched_parse(c->sched_torch, &ts, err, errlen) != 0) return -1;
    if (c->warmup_epochs > 0) {
        set_err(err, errlen, "schedule.warmup_epochs: not with schedule.name torch (a LinearLR in a SequentialLR "
                "warms up)");
        return -1;
    }
    if (ps_tsched_cycled_momentum(&ts) >= 0 && c->opt == PS_OPT_ADAGRAD) {
        set_err(err, errlen, "schedule.torch: OneCycleLR's cycle_momentum needs an optimizer with momentum or beta1 "
                "(sgd, adam, adamw), not adagrad");
        return -1;
    }
    if (ps_tsched_has_floor(&ts))
        for (int g = 0; g < c->n_groups; g++)
            if (c->groups[g].lr_scale != 1.0) {
                set_err(err, errlen, "schedule.torch: CosineAnnealingLR's eta_min with optimizer.groups of another "
                        "lr_scale (%s): psd scales one rate for all; give eta_min=0", c->groups[g].match);
                return -1;
            }
    return 0;
}

int ps_config_check_rules(const ps_config_t *c, char *err, size_t errlen)
{
    char num[32];
    if (c->kind == PS_MODEL_FROM_WORKER && (c->n_tensors || c->init_file[0])) {
        set_err(err, errlen, "model.kind from_worker: the first worker offers the tensors and their values; "
                "model.tensors and model.init are for model.kind tensors");
        return -1;
    }
    if (c->kind == PS_MODEL_TENSORS || c->kind == PS_MODEL_FROM_WORKER) {
        if (c->kind == PS_MODEL_TENSORS && c->n_tensors == 0 && !c->init_file[0]) {
            set_err(err, errlen, "model.kind tensors: model.tensors lists the tensors, or model.init names a "
                    "safetensors file that holds them");
            return -1;
        }
    }
    if (c->grad_room == 1) {
        set_err(err, errlen, "server.grad_room: 1 is too few: the step's sum takes one, a push another (0: no bound)");
        return -1;
    }
    if (c->val_fraction > 0 && c->val_size > 0) {
        set_err(err, errlen, "data.val_fraction and data.val_size: give one of them (the held-out validation part)");
        return -1;
    }
    if (c->kind == PS_MODEL_CTR && (c->val_fraction > 0 || c->val_size > 0)) {
        set_err(err, errlen, "data.val_fraction, data.val_size: model.kind ctr validates on its test examples "
                "(its AUC); a held-out split is for the other models");
        return -1;
    }
    const char *mkey[2] = {"train.keep_best.metric", "train.early_stop.metric"}, *mval[2] = {c->best_metric,
                                                                                          c->stop_metric};
    for (int i = 0; i < 2; i++) {
        const char *m = mval[i];
        if (!m[0]) continue;
        bool ok = strcmp(m, "val_loss") == 0 || strcmp(m, "val_acc") == 0 ||
                  (strcmp(m, "val_auc") == 0 && c->kind == PS_MODEL_CTR) ||
                  (strncmp(m, "val_", 4) == 0 && ps_sum_name_ok(m + 4));
        if (!ok) {
            set_err(err, errlen, "%s: '%.60s' is not a validation metric (val_loss, val_acc, %sor val_NAME of a "
                    "named sum your workers report)", mkey[i], m, c->kind == PS_MODEL_CTR ? "val_auc, " : "");
            return -1;
        }
    }
    if (c->best_metric[0] && !c->best_path[0]) {
        set_err(err, errlen, "train.keep_best.path: where to keep the best epoch's weights (empty)");
        return -1;
    }
    if ((double)c->epochs < c->warmup_epochs) {
        ps_fmt_double(c->warmup_epochs, num, sizeof num);
        set_err(err, errlen, "schedule.warmup_epochs: %s exceeds run.epochs (%d)", num,
                c->epochs);
        return -1;
    }
    if (check_torch_schedule(c, err, errlen) != 0) return -1;
    if (c->sched == PS_SCHED_COSINE && c->min_lr > c->lr) {
        char lr[32];
        ps_fmt_double(c->min_lr, num, sizeof num);
        ps_fmt_double(c->lr, lr, sizeof lr);
        set_err(err, errlen, "schedule.min_lr: %s exceeds optimizer.lr (%s)", num, lr);
        return -1;
    }
    if (c->kind == PS_MODEL_CTR) {
        if (c->sizes[0] != c->ctr_fields * c->ctr_dim || c->sizes[c->n_sizes - 1] != 2) {
            set_err(err, errlen,
                    "model.layers: with model.kind: ctr the first size is ctr.fields x ctr.dim = %d and the last 2 "
                    "(click or not)",
                    c->ctr_fields * c->ctr_dim);
            return -1;
        }
        if (c->ctr_fields * c->ctr_per_field > PS_CTR_MAX_IDS) {
            set_err(err, errlen, "ctr.fields x ctr.per_field: %d ids per example, at most %d",
                    c->ctr_fields * c->ctr_per_field, PS_CTR_MAX_IDS);
            return -1;
        }
        if (c->ctr_rows * c->ctr_dim > INT32_MAX) {
            set_err(err, errlen, "ctr.rows x ctr.dim: %lld floats in the table, at most %d (dense tables for now)",
                    (long long)(c->ctr_rows * c->ctr_dim), INT32_MAX);
            return -1;
        }
        ps_ctr_t g;
        char why[128];
        ps_ctr_from_config(c, &g);
        if (ps_ctr_check(&g, why, sizeof why) != 0) {
            set_err(err, errlen, "ctr: %s", why);
            return -1;
        }
        if (c->ctr_train + c->ctr_test > UINT32_MAX) {
            set_err(err, errlen, "ctr.train + ctr.test: at most %u examples", UINT32_MAX);
            return -1;
        }
    }
    if (c->kind == PS_MODEL_MLP) {
        /* a pixel p in [0, 1] goes in as (p - mean) / std, in f32: beyond
         * this the first layer's sums and gradients swamp (or overflow)
         * f32 and the model cannot learn */
        const double in_max = fmax(fabs(c->norm_mean), fabs(1.0 - c->norm_mean)) / c->norm_std;
        if (!(in_max <= MAX_NORM_INPUT)) {
            char mean[32];
            ps_fmt_double(c->norm_std, num, sizeof num);
            ps_fmt_double(c->norm_mean, mean, sizeof mean);
            set_err(err, errlen,
                    "data.normalize_std: %s (with data.normalize_mean %s) makes the inputs (pixel/255 - mean) / std "
                    "as large as %.3g, and f32 training cannot learn from inputs beyond 1e6; the pixels' std is about "
                    "0.35 (0.3530 for Fashion-MNIST, 0.3081 for MNIST)",
                    num, mean, in_max);
            return -1;
        }
    }
    if (c->stream && c->sync != PS_SYNC_BSP) {
        set_err(err, errlen, "train.stream: true needs train.sync: bsp (async and ssp apply each push whole)");
        return -1;
    }
    char why[400];
    if (ps_endpoint_check(c->listen, PS_EP_BIND, why, sizeof why) != 0) {
        set_err(err, errlen, "server.listen: %s", why);
        return -1;
    }
    return 0;
}

