/* psw_model.c - an MLP on a backend: forward, softmax cross-entropy, backward.
 *
 * Buffers (all backend memory, sized for max_batch rows):
 *   act[0]            input x (B, sizes[0])
 *   act[i+1]          output of layer i (B, sizes[i+1]); for hidden layers
 *                     ReLU is applied in place, so it holds the post-ReLU
 *                     activation, which is all relu_bwd needs (y > 0 iff the
 *                     pre-activation > 0). act[L] holds the logits.
 *   delta[0], delta[1] gradients w.r.t. layer outputs, (B, max of sizes[1..L]),
 *                     used alternately while walking backward
 *   labels            (B) int32
 *   ids               with bags: (B, fields, per_field) uint32 rows of E;
 *                     act[0] is then the bags' output, and delta[] also
 *                     holds the gradient w.r.t. it (B, sizes[0])
 *   params, grads     one arena each, layout->n_params floats */
#include "psw_model.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

struct psw_model {
    ps_layout_t layout;
    psw_backend_t *be; /* borrowed */
    int max_batch;
    float *params, *grads;       /* its own buffers, or borrowed gradients */
    float *own_params, *own_grads;
    const float *pt[PS_MAX_TENSORS]; /* borrowed parameter tensors (psw_model_borrow), or NULL */
    float *act[PS_MAX_LAYERS + 1];
    float *delta[2];
    int32_t *labels;
    psw_bags_t bags;   /* fields 0: no bags */
    uint32_t *ids;
    float *logits_host; /* (max_batch, classes): psw_model_prob1 */
    /* host-visible backends: dE_clean is a table gradient that is zero but
     * for the rows of the last batch's bags (prev_ids, n_prev of them), so
     * the next backward zeroes those rows, not the whole table */
    float *dE_clean;
    uint32_t *prev_ids;
    size_t n_prev;
};

static float *tensor(float *arena, const ps_layout_t *l, int k) { return arena + l->t[k].offset; }

/* parameter tensor k: borrowed, or in the model's own buffer (only read) */
static float *param(psw_model_t *m, int k) { return m->pt[k] ? (float *)m->pt[k] : tensor(m->params, &m->layout, k); }

psw_model_t *psw_model_new(psw_backend_t *be, const ps_layout_t *layout, int max_batch)
{
    return psw_model_new_bags(be, layout, max_batch, NULL);
}

static psw_model_t *model_new(psw_backend_t *be, const ps_layout_t *layout, int max_batch, const psw_bags_t *bags,
                              const float *params_host);

psw_model_t *psw_model_new_bags(psw_backend_t *be, const ps_layout_t *layout, int max_batch, const psw_bags_t *bags)
{
    return model_new(be, layout, max_batch, bags, NULL);
}

psw_model_t *psw_model_new_eval(psw_backend_t *be, const ps_layout_t *layout, int max_batch, const psw_bags_t *bags,
                                const float *params_host)
{
    assert(be && be->host_visible && params_host);
    return model_new(be, layout, max_batch, bags, params_host);
}

/* params_host: computes from it in place (evaluation only), no parameter
 * or gradient buffers of its own */
static psw_model_t *model_new(psw_backend_t *be, const ps_layout_t *layout, int max_batch, const psw_bags_t *bags,
                              const float *params_host)
{
    assert(be && layout);
    assert(layout->n_layers >= 1 && layout->n_layers <= PS_MAX_LAYERS);
    assert(layout->n_tensors == 2 * layout->n_layers + (layout->table >= 0) && layout->n_params > 0);
    assert(max_batch >= 1);
    assert(!bags == (layout->table < 0));
    assert(!bags || (bags->fields >= 1 && bags->per_field >= 1 &&
                     (uint64_t)bags->fields * layout->t[layout->table].cols == (uint64_t)layout->sizes[0]));

    psw_model_t *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->layout = *layout;
    m->be = be;
    m->max_batch = max_batch;

    const ps_layout_t *l = &m->layout;
    const size_t mb = (size_t)max_batch;
    int max_out = bags ? l->sizes[0] : 1;
    for (int i = 1; i < l->n_sizes; i++)
        if (l->sizes[i] > max_out) max_out = l->sizes[i];

    if (params_host) {
        for (int k = 0; k < l->n_tensors; k++) m->pt[k] = params_host + l->t[k].offset;
    } else {
        m->params = be->alloc(be, l->n_params * sizeof(float));
        m->grads = be->alloc(be, l->n_params * sizeof(float));
        if (!m->params || !m->grads) goto fail;
        m->own_params = m->params;
        m->own_grads = m->grads;
    }
    for (int i = 0; i < l->n_sizes; i++) {
        m->act[i] = be->alloc(be, mb * (size_t)l->sizes[i] * sizeof(float));
        if (!m->act[i]) goto fail;
    }
    for (int i = 0; i < 2; i++) {
        m->delta[i] = be->alloc(be, mb * (size_t)max_out * sizeof(float));
        if (!m->delta[i]) goto fail;
    }
    m->labels = be->alloc(be, mb * sizeof(int32_t));
    m->logits_host = malloc(mb * (size_t)l->sizes[l->n_layers] * sizeof(float));
    if (!m->labels || !m->logits_host) goto fail;
    if (bags) {
        m->bags = *bags;
        m->ids = be->alloc(be, mb * (size_t)bags->fields * (size_t)bags->per_field * sizeof(uint32_t));
        if (!m->ids) goto fail;
        if (be->host_visible && !(m->prev_ids = malloc(mb * (size_t)bags->fields * (size_t)bags->per_field *
                                                       sizeof(uint32_t))))
            goto fail;
    }
    return m;

fail:
    psw_model_destroy(&m);
    return NULL;
}

void psw_model_destroy(psw_model_t **pm)
{
    assert(pm);
    psw_model_t *m = *pm;
    if (!m) return;
    psw_backend_t *be = m->be;
    /* Nothing may still be reading or writing the buffers. */
    be->sync(be);
    if (m->own_params || m->own_grads) {
        if (m->own_params) be->free(be, m->own_params);
        if (m->own_grads) be->free(be, m->own_grads);
    } else { /* psw_model_new failed half way */
        if (m->params) be->free(be, m->params);
        if (m->grads) be->free(be, m->grads);
    }
    for (int i = 0; i < m->layout.n_sizes; i++)
        if (m->act[i]) be->free(be, m->act[i]);
    for (int i = 0; i < 2; i++)
        if (m->delta[i]) be->free(be, m->delta[i]);
    if (m->labels) be->free(be, m->labels);
    if (m->ids) be->free(be, m->ids);
    free(m->logits_host);
    free(m->prev_ids);
    free(m);
    *pm = NULL;
}

void psw_model_borrow(psw_model_t *m, const float *const *tensors, float *grads)
{
    assert(m && m->be->host_visible && (tensors || m->own_params)); /* an eval model has no params of its own */
    for (int k = 0; k < m->layout.n_tensors; k++) m->pt[k] = tensors ? tensors[k] : NULL;
    m->grads = grads ? grads : m->own_grads;
}

void psw_model_set_params(psw_model_t *m, const float *params_host)
{
    assert(m && params_host && m->params);
    memset(m->pt, 0, sizeof m->pt);
    m->be->upload(m->be, m->params, params_host, m->layout.n_params * sizeof(float));
    m->be->sync(m->be);
}

float *psw_model_params(psw_model_t *m)
{
    assert(m);
    return m->params;
}

float *psw_model_grads(psw_model_t *m)
{
    assert(m);
    return m->grads;
}

void psw_model_get_grads(psw_model_t *m, float *grads_host)
{
    assert(m && grads_host && m->grads);
    m->be->download(m->be, grads_host, m->grads, m->layout.n_params * sizeof(float));
    m->be->sync(m->be);
}

/* Upload the batch (x_host, or ids_host with bags), run every layer, and
 * apply the loss. Leaves the logits in act[L] and, when dlogits is not
 * NULL, d(mean loss)/d(logits) in dlogits. */
static void forward(psw_model_t *m, const float *x_host, const uint32_t *ids_host, const int32_t *labels_host,
                    int B, float *dlogits, double *loss_sum, int64_t *correct)
{
    assert(labels_host && (m->bags.fields ? ids_host != NULL : x_host != NULL));
    assert(B >= 1 && B <= m->max_batch);
    psw_backend_t *be = m->be;
    const ps_layout_t *l = &m->layout;
    const int L = l->n_layers;

    if (m->bags.fields) {
        const psw_bags_t *g = &m->bags;
        be->upload(be, m->ids, ids_host, (size_t)B * (size_t)g->fields * (size_t)g->per_field * sizeof(uint32_t));
        be->embag_fwd(be, m->act[0], param(m, l->table), m->ids, B, g->fields, g->per_field, l->t[l->table].cols,
                      g->mean);
    } else {
        be->upload(be, m->act[0], x_host, (size_t)B * (size_t)l->sizes[0] * sizeof(float));
    }
    be->upload(be, m->labels, labels_host, (size_t)B * sizeof(int32_t));
    for (int i = 0; i < L; i++) {
        be->linear_fwd(be, m->act[i + 1], m->act[i], param(m, 2 * i),
                       param(m, 2 * i + 1), B, l->sizes[i], l->sizes[i + 1]);
        if (i < L - 1)
            be->relu_fwd(be, m->act[i + 1], m->act[i + 1], (size_t)B * (size_t)l->sizes[i + 1]);
    }
    double ls = 0.0;
    int64_t c = 0;
    be->xent(be, dlogits, m->act[L], m->labels, B, l->sizes[L], 1.0f / (float)B, &ls, &c);
    if (loss_sum) *loss_sum += ls;
    if (correct) *correct += c;
}

/* Backward walks layer L-1 down to 0. For layer i, once linear_bwd is
 * issued, ready() is called for W_i (tensor 2i) and then b_i (tensor 2i+1),
 * so the order is W_{L-1}, b_{L-1}, ..., W_0, b_0, then E with bags. The
 * first layer's dx is computed only for the bags. */
static void train(psw_model_t *m, const float *x_host, const uint32_t *ids_host, const int32_t *labels_host, int B,
                  double *loss_sum, int64_t *correct, psw_grad_ready_fn ready, void *ud)
{
    assert(m && m->grads); /* not a model made for evaluation only */
    psw_backend_t *be = m->be;
    const ps_layout_t *l = &m->layout;
    const int L = l->n_layers;

    int cur = 0; /* delta[cur] holds d(loss)/d(output of layer i) */
    forward(m, x_host, ids_host, labels_host, B, m->delta[cur], loss_sum, correct);
    if (ready) ready(ud, -1);
    for (int i = L - 1; i >= 0; i--) {
        float *dx = i > 0 || m->bags.fields ? m->delta[1 - cur] : NULL;
        be->linear_bwd(be, dx, tensor(m->grads, l, 2 * i), tensor(m->grads, l, 2 * i + 1),
                       m->delta[cur], m->act[i], param(m, 2 * i), B, l->sizes[i],
                       l->sizes[i + 1]);
        if (ready) {
            ready(ud, 2 * i);
            ready(ud, 2 * i + 1);
        }
        if (dx && i > 0) {
            /* act[i] is the post-ReLU output of layer i-1. */
            be->relu_bwd(be, dx, dx, m->act[i], (size_t)B * (size_t)l->sizes[i]);
            cur = 1 - cur;
        }
    }
    if (m->bags.fields) { /* delta[1 - cur]: d(loss)/d(bags' output) */
        const psw_bags_t *g = &m->bags;
        float *dE = tensor(m->grads, l, l->table);
        const size_t D = (size_t)l->t[l->table].cols, n = (size_t)B * (size_t)g->fields * (size_t)g->per_field;
        if (m->prev_ids && m->dE_clean == dE) /* only the rows the last batch wrote: a step costs its rows */
            for (size_t j = 0; j < m->n_prev; j++) memset(dE + (size_t)m->prev_ids[j] * D, 0, D * sizeof(float));
        else
            be->zero(be, dE, l->t[l->table].numel * sizeof(float));
        be->embag_bwd(be, dE, m->delta[1 - cur], m->ids, B, g->fields, g->per_field, (int)D, g->mean);
        if (m->prev_ids) {
            memcpy(m->prev_ids, ids_host, n * sizeof *ids_host);
            m->n_prev = n;
            m->dE_clean = dE;
        }
        if (ready) ready(ud, l->table);
    }
}

void psw_model_train_step(psw_model_t *m, const float *x_host, const int32_t *labels_host, int B,
                          double *loss_sum, int64_t *correct, psw_grad_ready_fn ready, void *ud)
{
    train(m, x_host, NULL, labels_host, B, loss_sum, correct, ready, ud);
}

void psw_model_train_bags(psw_model_t *m, const uint32_t *ids_host, const int32_t *labels_host, int B,
                          double *loss_sum, int64_t *correct, psw_grad_ready_fn ready, void *ud)
{
    train(m, NULL, ids_host, labels_host, B, loss_sum, correct, ready, ud);
}

void psw_model_eval(psw_model_t *m, const float *x_host, const int32_t *labels_host, int B,
                    double *loss_sum, int64_t *correct)
{
    assert(m);
    forward(m, x_host, NULL, labels_host, B, NULL, loss_sum, correct);
}

void psw_model_eval_bags(psw_model_t *m, const uint32_t *ids_host, const int32_t *labels_host, int B,
                         double *loss_sum, int64_t *correct)
{
    assert(m);
    forward(m, NULL, ids_host, labels_host, B, NULL, loss_sum, correct);
}

void psw_model_prob1(psw_model_t *m, float *p_host, int B)
{
    assert(m && p_host && B >= 0 && B <= m->max_batch);
    const int C = m->layout.sizes[m->layout.n_layers];
    assert(C >= 2);
    float *logits = m->logits_host;
    m->be->download(m->be, logits, m->act[m->layout.n_layers], (size_t)B * (size_t)C * sizeof *logits);
    m->be->sync(m->be);
    for (int b = 0; b < B; b++) {
        const float *l = logits + (size_t)b * (size_t)C;
        double mx = l[0], sum = 0;
        for (int c = 1; c < C; c++) mx = l[c] > mx ? l[c] : mx;
        for (int c = 0; c < C; c++) sum += exp((double)l[c] - mx);
        p_host[b] = (float)(exp((double)l[1] - mx) / sum);
    }
}
