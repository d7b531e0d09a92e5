/* psw_model.h - an MLP on a backend: parameters, activations, gradients.
 *
 * Parameters and gradients each live in one contiguous backend buffer laid
 * out by ps_layout_t (common/ps_model.h): W0 (sizes[1],sizes[0]), b0,
 * W1, b1, ... Hidden layers use ReLU; the last layer feeds softmax
 * cross-entropy. */
#ifndef PSW_MODEL_H
#define PSW_MODEL_H

#include <stdint.h>

#include "ps_model.h"
#include "psw_backend.h"

typedef struct psw_model psw_model_t;

/* Called during backward as soon as the gradient of tensor `tensor` (index in
 * the layout) is complete, last layer first. The backend may still be working
 * asynchronously on earlier layers. Called once with tensor -1 before, when
 * the forward pass has been issued (a long step's sign of life). */
typedef void (*psw_grad_ready_fn)(void *ud, int tensor);

/* Borrow be; batches up to max_batch. Returns NULL on allocation failure.
 * Caller owns (psw_model_destroy). */
psw_model_t *psw_model_new(psw_backend_t *be, const ps_layout_t *layout, int max_batch);

/* Embedding bags before the MLP (a layout with a table E (rows, D)): an
 * example is `fields` bags of `per_field` row ids of E, and the MLP's input
 * (sizes[0] = fields x D) is the bags' sums (or means). */
typedef struct {
    int fields, per_field, mean;
} psw_bags_t;
psw_model_t *psw_model_new_bags(psw_backend_t *be, const ps_layout_t *layout, int max_batch, const psw_bags_t *bags);
/* For evaluation only (psw_model_eval*, psw_model_prob1), on a host-visible
 * backend: computes from params_host (n_params floats laid out by layout)
 * in place, borrowed for the model's life; no parameter or gradient
 * buffers of its own (psd eval of a large table: the model once in memory). */
psw_model_t *psw_model_new_eval(psw_backend_t *be, const ps_layout_t *layout, int max_batch, const psw_bags_t *bags,
                                const float *params_host);
void psw_model_destroy(psw_model_t **m);

/* Copy n_params host floats into the parameter buffer. */
void psw_model_set_params(psw_model_t *m, const float *params_host);
/* Host-visible backends only: compute from the parameter tensors at
 * tensors[k] (k in layout order; read, never written: the frames of a
 * WEIGHTS message, a read-only mapping of psd's version) and write
 * gradients to grads (n_params floats in layout order, e.g. the region psd
 * reads them from), instead of the model's own buffers; NULL goes back to
 * its own. The caller keeps them valid while the model computes. */
void psw_model_borrow(psw_model_t *m, const float *const *tensors, float *grads);
/* Device buffers of the arena (for backends/tests). */
float *psw_model_params(psw_model_t *m);
float *psw_model_grads(psw_model_t *m);
/* Copy the gradient arena to host (n_params floats). */
void psw_model_get_grads(psw_model_t *m, float *grads_host);

/* Forward + backward on a batch: x_host (B, sizes[0]) floats, labels_host (B)
 * int32. Gradients are of the mean loss over the batch. Adds the batch's loss
 * sum and correct count to *loss_sum / *correct. ready (may be NULL) is called
 * per tensor as its gradient completes. */
void psw_model_train_step(psw_model_t *m, const float *x_host, const int32_t *labels_host, int B,
                          double *loss_sum, int64_t *correct, psw_grad_ready_fn ready, void *ud);

/* Forward only: adds loss sum and correct count. */
void psw_model_eval(psw_model_t *m, const float *x_host, const int32_t *labels_host, int B,
                    double *loss_sum, int64_t *correct);

/* The same for a model with bags: ids_host (B, fields, per_field) rows of E
 * instead of x. The gradient of E (dense: every row, zero where no bag of
 * the batch has it) is ready last, after b0. */
void psw_model_train_bags(psw_model_t *m, const uint32_t *ids_host, const int32_t *labels_host, int B,
                          double *loss_sum, int64_t *correct, psw_grad_ready_fn ready, void *ud);
void psw_model_eval_bags(psw_model_t *m, const uint32_t *ids_host, const int32_t *labels_host, int B,
                         double *loss_sum, int64_t *correct);

/* After a forward pass of B examples: the softmax probability of class 1
 * (for 2 classes: of a click) of each, to p_host (B floats). */
void psw_model_prob1(psw_model_t *m, float *p_host, int B);

#endif
