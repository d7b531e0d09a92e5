/* psw_eval.c - a weights file's model on the test set, in one process, with
 * the workers' CPU code (psmodel.h: what `psd eval` uses). */
#include "psmodel.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "ps_ctr.h"
#include "psw_backend.h"
#include "psw_data.h"
#include "psw_model.h"

/* The test set the weights are evaluated on: the config's image files, or
 * (a model with an embedding table) its ctr task's test examples. 0, or -1
 * with a message. */
static int open_test(const ps_config_t *c, const ps_layout_t *l, psw_data_t *test, ps_ctr_t *gen, char *err,
                     size_t errlen)
{
    if (l->table >= 0) {
        if (c->kind != PS_MODEL_CTR || (int64_t)l->t[l->table].rows != c->ctr_rows ||
            l->t[l->table].cols != (uint64_t)c->ctr_dim || l->sizes[0] != c->ctr_fields * c->ctr_dim ||
            l->sizes[l->n_sizes - 1] != 2) {
            snprintf(err, errlen,
                     "the weights have an embedding table (%" PRIu64 " x %" PRIu64 "); the config must be the ctr "
                     "task they were trained on (model.kind ctr, ctr.rows %" PRIu64 ", ctr.dim %" PRIu64 ")",
                     l->t[l->table].rows, l->t[l->table].cols, l->t[l->table].rows, l->t[l->table].cols);
            return -1;
        }
        ps_ctr_from_config(c, gen);
        test->count = (size_t)c->ctr_test;
        return 0;
    }
    if (c->kind == PS_MODEL_CTR) {
        snprintf(err, errlen, "the config is a ctr task, the weights have no embedding table");
        return -1;
    }
    int classes = l->sizes[l->n_sizes - 1];
    if (psw_data_load(test, c->test_images, c->test_labels, 0, classes, c->norm_mean, c->norm_std, err, errlen) != 0)
        return -1;
    if (test->dim != (size_t)l->sizes[0]) {
        snprintf(err, errlen, "%s has %zu inputs per sample, the weights expect %d", c->test_images, test->dim,
                 l->sizes[0]);
        return -1;
    }
    return 0;
}

int psm_eval(const ps_config_t *c, const ps_layout_t *l, const float *params, int threads, psm_eval_t *out,
             char *err, size_t errlen)
{
    psw_data_t test = {0};
    ps_ctr_t gen = {0};
    psw_backend_t *be = NULL;
    psw_model_t *m = NULL;
    float *x = NULL;
    int32_t *y = NULL;
    uint32_t *ids = NULL, *order = NULL;
    float *scores = NULL;
    uint8_t *labels = NULL;
    *out = (psm_eval_t){.auc = NAN};
    int code = 2;
    if (open_test(c, l, &test, &gen, err, errlen) != 0) goto out;
    code = 1;
    int B = c->val_batch_size, ctr = l->table >= 0;
    size_t per = ctr ? (size_t)gen.fields * (size_t)gen.per_field : 0;
    psw_bags_t bags = {.fields = gen.fields, .per_field = gen.per_field, .mean = c->ctr_mean};
    be = psw_backend_cpu_new(threads);
    m = be ? psw_model_new_eval(be, l, B, ctr ? &bags : NULL, params) : NULL; /* computes from params in place */
    x = ctr ? NULL : malloc((size_t)B * test.dim * sizeof *x);
    ids = ctr ? malloc((size_t)B * per * sizeof *ids) : NULL;
    y = malloc((size_t)B * sizeof *y);
    if (ctr) { /* the AUC needs every example's score */
        scores = malloc(test.count * sizeof *scores);
        labels = malloc(test.count);
        order = malloc(test.count * sizeof *order);
    }
    if (!m || !(ctr ? (void *)ids : (void *)x) || !y || (ctr && (!scores || !labels || !order))) {
        snprintf(err, errlen, "out of memory");
        goto out;
    }
    double loss = 0;
    int64_t correct = 0;
    for (size_t i = 0; i < test.count;) {
        int n = (int)(test.count - i < (size_t)B ? test.count - i : (size_t)B);
        if (ctr) { /* test examples follow the training ones */
            for (int b = 0; b < n; b++) {
                uint8_t label;
                ps_ctr_example(&gen, (uint64_t)c->ctr_train + i + (uint64_t)b, ids + (size_t)b * per, NULL, &label);
                y[b] = label;
                labels[i + (size_t)b] = label;
            }
            psw_model_eval_bags(m, ids, y, n, &loss, &correct);
            psw_model_prob1(m, scores + i, n);
        } else {
            psw_data_slice(&test, i, n, x, y);
            psw_model_eval(m, x, y, n, &loss, &correct);
        }
        i += (size_t)n;
    }
    out->samples = test.count;
    out->loss = loss;
    out->correct = correct;
    if (ctr) out->auc = ps_auc(scores, labels, test.count, order);
    code = 0;
out:
    psw_model_destroy(&m);
    if (be) be->destroy(be);
    psw_data_deinit(&test);
    free(x);
    free(y);
    free(ids);
    free(scores);
    free(labels);
    free(order);
    return code;
}

void psm_blas_tune(char **argv) { psw_blas_tune(argv); }
