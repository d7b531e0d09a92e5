#include "psd_eval.h"

#include <stdio.h>
#include <stdlib.h>

#include "ps_log.h"
#include "ps_weights.h"
#include "psw_backend.h"
#include "psw_data.h"
#include "psw_model.h"

int psd_eval_run(const ps_config_t *c, const char *weights_path, int threads)
{
    char err[512];
    ps_layout_t l;
    float *params = NULL;
    ps_weights_meta_t meta;
    psw_data_t test;
    psw_backend_t *be = NULL;
    psw_model_t *m = NULL;
    float *x = NULL;
    int32_t *y = NULL;
    int code = 2;
    if (ps_weights_load(weights_path, &l, &params, &meta, err, sizeof err) != 0) {
        fprintf(stderr, "psd eval: %s\n", err);
        return 2;
    }
    int classes = l.sizes[l.n_sizes - 1];
    if (psw_data_load(&test, c->test_images, c->test_labels, 0, classes, c->norm_mean, c->norm_std, err,
                      sizeof err) != 0) {
        fprintf(stderr, "psd eval: %s\n", err);
        free(params);
        return 2;
    }
    if (test.dim != (size_t)l.sizes[0]) {
        fprintf(stderr, "psd eval: %s has %zu inputs per sample, the weights expect %d\n", c->test_images,
                test.dim, l.sizes[0]);
        goto out;
    }
    code = 1;
    int B = c->val_batch_size;
    be = psw_backend_cpu_new(threads);
    m = be ? psw_model_new(be, &l, B) : NULL;
    x = malloc((size_t)B * test.dim * sizeof *x);
    y = malloc((size_t)B * sizeof *y);
    if (!m || !x || !y) {
        fprintf(stderr, "psd eval: out of memory\n");
        goto out;
    }
    psw_model_set_params(m, params);
    double loss = 0;
    int64_t correct = 0;
    for (size_t i = 0; i < test.count;) {
        int n = (int)(test.count - i < (size_t)B ? test.count - i : (size_t)B);
        psw_data_slice(&test, i, n, x, y);
        psw_model_eval(m, x, y, n, &loss, &correct);
        i += (size_t)n;
    }
    printf("eval %s: %zu samples, loss %.9g, accuracy %.4f (%lld correct), run %016llx, step %llu, epoch %u\n",
           weights_path, test.count, test.count ? loss / (double)test.count : 0,
           test.count ? (double)correct / (double)test.count : 0, (long long)correct,
           (unsigned long long)meta.run_id, (unsigned long long)meta.step, meta.epoch + 1);
    code = 0;
out:
    psw_model_destroy(&m);
    if (be) be->destroy(be);
    psw_data_deinit(&test);
    free(params);
    free(x);
    free(y);
    return code;
}
