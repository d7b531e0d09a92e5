/* psmodel.h - the built-in models, their data and the CPU backend as a
 * library (libpsmodel), for what runs a model outside a training worker:
 * `psd eval` and pworker's BLAS set-up. Its internals (psw_model.h,
 * psw_data.h, psw_backend.h) stay the worker's; psd sees only this header.
 *
 * Ownership: the caller owns what it passes; nothing is kept between calls. */
#ifndef PSMODEL_H
#define PSMODEL_H

#include <stddef.h>
#include <stdint.h>

#include "ps_config.h"
#include "ps_model.h"

/* A model evaluated on a test set. */
typedef struct {
    size_t samples;
    double loss;      /* summed over the samples */
    int64_t correct;
    double auc;       /* the click-through task's AUC; NaN for the MLP */
} psm_eval_t;

/* Evaluate the weights `params` (laid out by l) on the test set the config
 * names: its image files, or, for weights with an embedding table, its
 * click-through task's test examples; on `threads` CPU threads with the
 * workers' own code. 0; 2 (bad files or a config that does not fit the
 * weights); 1 (out of memory); the message in err. */
int psm_eval(const ps_config_t *c, const ps_layout_t *l, const float *params, int threads, psm_eval_t *out,
             char *err, size_t errlen);

/* If OpenBLAS chose generic kernels on a CPU with AVX2/AVX-512, set
 * OPENBLAS_CORETYPE and re-exec argv (returns only if nothing to do). Call
 * first thing in main. */
void psm_blas_tune(char **argv);

#endif
