/* psd_eval.h - `psd eval WEIGHTS`: evaluate a weights file on the test set
 * in one process, with the same CPU code the workers use. */
#ifndef PSD_EVAL_H
#define PSD_EVAL_H

#include "ps_config.h"

/* Prints one line with samples, loss, accuracy and correct count; returns
 * the exit code (0, or 2 for bad files). */
int psd_eval_run(const ps_config_t *c, const char *weights_path, int threads);
/* `psd export WEIGHTS OUT.safetensors`: the weights (psd's file, or
 * safetensors) written as safetensors (ps_weights_st.h). Exit code: 0; 2 a
 * file that cannot be read; 1 one that cannot be written. */
int psd_export_run(const char *weights_path, const char *out_path);

#endif
