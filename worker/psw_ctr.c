/* psw_ctr.c - the click-through generator (common/ps_ctr.h) in the worker
 * library's API (psw_ctr_examples): for workers that bring their own model
 * of the task, such as psd.ctr in the Python package. Owns nothing. */
#include <errno.h>
#include <stdio.h>

#include "ps_ctr.h"
#include "psworker.h"

int psw_ctr_examples(const psw_ctr_gen_t *g, const uint64_t *index, size_t n, uint32_t *rows, uint8_t *labels,
                     double *p_click, char *err, size_t errlen)
{
    if (!g || (n && (!index || !rows || !labels))) {
        if (err && errlen) snprintf(err, errlen, "psw_ctr_examples: a NULL argument");
        return -EINVAL;
    }
    const ps_ctr_t c = {.fields = g->fields, .per_field = g->per_field, .vocab = g->vocab, .zipf = g->zipf,
                        .rows = g->rows, .weight_std = g->weight_std, .bias = g->bias, .seed = g->seed};
    char why[256];
    if (ps_ctr_check(&c, why, sizeof why) != 0) {
        if (err && errlen) snprintf(err, errlen, "%s", why);
        return -EINVAL;
    }
    const size_t per = (size_t)c.fields * (size_t)c.per_field;
    for (size_t i = 0; i < n; i++) {
        const double p = ps_ctr_example(&c, index[i], rows + i * per, NULL, &labels[i]);
        if (p_click) p_click[i] = p;
    }
    return 0;
}
