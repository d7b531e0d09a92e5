/* ps_weights_st.h - the built-in models' weights as safetensors, the format
 * PyTorch and Hugging Face users load (ps_safetensors.h): tensors named as
 * torch.nn would name them, "fc1.weight" (out, in), "fc1.bias" (out), ...,
 * "fcK.*" for K layers, then "embedding.weight" (rows, dim) for the
 * click-through model's table; metadata: format "psd", run_id (16 hex
 * digits), step, epoch (1-based), activation "relu". `psd export` writes
 * them; `psd eval` reads them as it reads psd's own weights files. */
#ifndef PS_WEIGHTS_ST_H
#define PS_WEIGHTS_ST_H

#include <stdbool.h>
#include <stddef.h>

#include "ps_model.h"
#include "ps_weights.h"

/* The layout a config trains (ps_config_layout), and with model.kind
 * tensors without model.tensors the table model.init's file holds, in the
 * order of its data. 0, or -1 with a message. */
int ps_run_layout(const ps_config_t *c, ps_layout_t *l, char *err, size_t errlen);
/* A layout of the tensors a safetensors file holds, in its data's order.
 * 0, or -1 with a message. */
int ps_layout_from_st(const char *path, ps_layout_t *l, char *err, size_t errlen);
/* Initial values from a safetensors file (model.init): every tensor of l
 * must be in it with l's shape, and the file may hold no other; its values
 * (any of F32, F16, BF16) go into params' pieces own[t] (NULL: whole
 * tensors). 0, or -1 with a message naming the tensor. */
int ps_st_init_values(const char *path, const ps_layout_t *l, float *params, const ps_piece_t *own, char *err,
                      size_t errlen);

/* path names a safetensors file (ends in ".safetensors"). */
bool ps_weights_is_st(const char *path);
/* Write layout l's arena params as safetensors: the table's names and
 * shapes, F32. 0, or -1 with a message. */
int ps_weights_save_st(const char *path, const ps_layout_t *l, const float *params, const ps_weights_meta_t *meta,
                       char *err, size_t errlen);
/* Read weights: a safetensors file (by its name) of a built-in model's
 * tensors above, in any order, or of any other table (taken in the order of
 * the file's data), in any dtype (F32, F16, BF16); or psd's own weights
 * file (any format). *params: a new arena laid out by *l (caller frees). 0, or -1
 * with a message naming what does not fit. */
int ps_weights_load_any(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta, char *err,
                        size_t errlen);

#endif
