/* psd_eval.c - `psd eval WEIGHTS` (psd_eval.h): the weights file loaded,
 * evaluated by the model library (psmodel.h), one line printed. */
#include "psd_eval.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>

#include "ps_weights.h"
#include "psd_ckpt.h"
#include "ps_weights_st.h"
#include "psmodel.h"

int psd_eval_run(const ps_config_t *c, const char *weights_path, int threads)
{
    char err[512];
    ps_layout_t l;
    float *params = NULL;
    ps_weights_meta_t meta;
    if (ps_weights_load_any(weights_path, &l, &params, &meta, err, sizeof err) != 0) {
        fprintf(stderr, "psd eval: %s\n", err);
        return 2;
    }
    if (l.n_sizes == 0) { /* any table: psd does not know what computes it */
        fprintf(stderr, "psd eval: %s holds a model of %d tensors (%s, ...) that is not one of psd's built-in models: "
                        "evaluate it with the program that trained it\n", weights_path, ps_layout_ntab(&l),
                ps_layout_tensor(&l, 0)->name);
        free(params);
        ps_layout_free(&l);
        return 2;
    }
    psm_eval_t e;
    int code = psm_eval(c, &l, params, threads, &e, err, sizeof err);
    free(params);
    if (code != 0) {
        fprintf(stderr, "psd eval: %s\n", err);
        return code;
    }
    printf("eval %s: %zu samples, loss %.9g, accuracy %.4f (%lld correct), run %016llx, step %llu, epoch %u\n",
           weights_path, e.samples, e.samples ? e.loss / (double)e.samples : 0,
           e.samples ? (double)e.correct / (double)e.samples : 0, (long long)e.correct,
           (unsigned long long)meta.run_id, (unsigned long long)meta.step, meta.epoch + 1);
    if (!isnan(e.auc)) printf("eval %s: AUC %.9g\n", weights_path, e.auc);
    return 0;
}

/* path holds a checkpoint (psd_ckpt.h's magic). */
static bool is_ckpt(const char *path)
{
    char magic[4] = {0};
    FILE *f = fopen(path, "rb");
    bool yes = f && fread(magic, 1, 4, f) == 4 && memcmp(magic, "PSDC", 4) == 0;
    if (f) fclose(f);
    return yes;
}

int psd_export_run(const char *weights_path, const char *out_path)
{
    char err[512];
    ps_layout_t l;
    float *params = NULL;
    ps_weights_meta_t meta;
    psd_ckpt_meta_t cm;
    const bool ckpt = is_ckpt(weights_path);
    int rc = ckpt ? psd_ckpt_read_weights(weights_path, &l, &params, &cm, err, sizeof err)
                  : ps_weights_load_any(weights_path, &l, &params, &meta, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr, "psd export: %s\n", err);
        return 2;
    }
    if (ckpt) meta = (ps_weights_meta_t){.run_id = cm.run_id, .step = cm.step, .epoch = cm.epoch};
    rc = ps_weights_save_st(out_path, &l, params, &meta, err, sizeof err);
    free(params);
    if (rc != 0) {
        fprintf(stderr, "psd export: %s\n", err);
        ps_layout_free(&l);
        return 1;
    }
    printf("psd export: wrote %s: %d tensors, %zu parameters, run %016llx, step %llu\n", out_path, ps_layout_ntab(&l),
           ps_layout_numel(&l), (unsigned long long)meta.run_id, (unsigned long long)meta.step);
    ps_layout_free(&l);
    return 0;
}
