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

/* path names a safetensors file (ends in ".safetensors"). */
bool ps_weights_is_st(const char *path);
/* Write layout l's arena params as safetensors. 0, or -1 with a message. */
int ps_weights_save_st(const char *path, const ps_layout_t *l, const float *params, const ps_weights_meta_t *meta,
                       char *err, size_t errlen);
/* Read a built-in model's weights: a safetensors file (by its name) of the
 * tensors above, in any order and dtype (F32, F16, BF16), or psd's own
 * weights file. *params: a new arena laid out by *l (caller frees). 0, or -1
 * with a message naming what does not fit. */
int ps_weights_load_any(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta, char *err,
                        size_t errlen);

#endif
