/* ps_weights_st.c - the built-in models' weights as safetensors
 * (ps_weights_st.h). */
#include "ps_weights_st.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_safetensors.h"

bool ps_weights_is_st(const char *path)
{
    size_t n = strlen(path), k = strlen(".safetensors");
    return n > k && strcmp(path + n - k, ".safetensors") == 0;
}

/* Tensor t's name in layout l. */
static void name_of(const ps_layout_t *l, int t, char *out, size_t n)
{
    if (t == l->table) snprintf(out, n, "embedding.weight");
    else snprintf(out, n, "fc%d.%s", t / 2 + 1, t % 2 ? "bias" : "weight");
}

int ps_weights_save_st(const char *path, const ps_layout_t *l, const float *params, const ps_weights_meta_t *meta,
                       char *err, size_t errlen)
{
    char names[PS_MAX_TENSORS][32];
    uint64_t shapes[PS_MAX_TENSORS][2];
    ps_st_out_t t[PS_MAX_TENSORS];
    for (int i = 0; i < l->n_tensors; i++) {
        name_of(l, i, names[i], sizeof names[i]);
        bool vec = i != l->table && i % 2 == 1; /* a bias */
        shapes[i][0] = (uint64_t)l->t[i].rows;
        shapes[i][1] = (uint64_t)l->t[i].cols;
        t[i] = (ps_st_out_t){names[i], vec ? 1 : 2, shapes[i], params + l->t[i].offset};
    }
    char run[24], step[24], epoch[16];
    snprintf(run, sizeof run, "%016" PRIx64, meta->run_id);
    snprintf(step, sizeof step, "%" PRIu64, meta->step);
    snprintf(epoch, sizeof epoch, "%u", meta->epoch + 1);
    const char *mk[5] = {"format", "run_id", "step", "epoch", "activation"};
    const char *mv[5] = {"psd", run, step, epoch, "relu"};
    return ps_st_save(path, t, (size_t)l->n_tensors, mk, mv, 5, err, errlen);
}

static const char *meta_of(const ps_st_file_t *f, const char *k)
{
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta_key[i], k) == 0) return f->meta_val[i];
    return NULL;
}

/* The values of tensor `name` (shape r x c, or r for c 0) from the file's
 * values v into dst. -1 with a message when missing or of another shape. */
static int take(const ps_st_file_t *f, const float *v, const char *path, const char *name, uint64_t r, uint64_t c,
                float *dst, char *err, size_t errlen)
{
    uint64_t at = 0;
    for (size_t i = 0; i < f->n; i++) {
        const ps_st_tensor_t *t = &f->t[i];
        if (strcmp(t->name, name) == 0) {
            bool ok = c ? t->ndim == 2 && t->shape[0] == r && t->shape[1] == c : t->ndim == 1 && t->shape[0] == r;
            if (!ok) {
                snprintf(err, errlen, "%s: tensor %s has another shape than the layers before and after it "
                         "make (%" PRIu64 " x %" PRIu64 ")", path, name, r, c ? c : 1);
                return -1;
            }
            memcpy(dst, v + at, t->numel * sizeof *dst);
            return 0;
        }
        at += t->numel;
    }
    snprintf(err, errlen, "%s: no tensor %s (a built-in model's weights: fc1.weight, fc1.bias, ..., and "
             "embedding.weight for the click-through model)", path, name);
    return -1;
}

int ps_weights_load_any(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta, char *err,
                        size_t errlen)
{
    if (!ps_weights_is_st(path)) return ps_weights_load(path, l, params, meta, err, errlen);
    *params = NULL;
    ps_st_file_t f;
    float *v = NULL;
    if (ps_st_load(path, &f, &v, err, errlen) != 0) return -1;
    int rc = -1, sizes[PS_MAX_LAYERS + 1], n_sizes = 0;
    const ps_st_tensor_t *e = ps_st_find(&f, "embedding.weight");
    for (int k = 1; k <= PS_MAX_LAYERS; k++) { /* fc1..fcK: the sizes from their weights */
        char name[32];
        snprintf(name, sizeof name, "fc%d.weight", k);
        const ps_st_tensor_t *w = ps_st_find(&f, name);
        if (!w) break;
        if (w->ndim != 2 || w->shape[0] < 1 || w->shape[1] < 1 || w->shape[0] > INT32_MAX || w->shape[1] > INT32_MAX ||
            (n_sizes && (uint64_t)sizes[n_sizes - 1] != w->shape[1])) {
            snprintf(err, errlen, "%s: %s is not (out, in) with in the out of the layer before it", path, name);
            goto out;
        }
        if (!n_sizes) sizes[n_sizes++] = (int)w->shape[1];
        sizes[n_sizes++] = (int)w->shape[0];
    }
    size_t expect = 2 * (size_t)(n_sizes ? n_sizes - 1 : 0) + (e ? 1 : 0);
    if (n_sizes < 2 || f.n != expect) {
        snprintf(err, errlen, "%s: not a built-in model's weights: %zu tensors, fc1.weight ... as psd names them "
                 "expected (psd export writes them)", path, f.n);
        goto out;
    }
    if (e && (e->ndim != 2 || e->shape[0] < 1 || e->shape[1] < 1 || e->shape[1] > 4096 || e->shape[0] > UINT32_MAX)) {
        snprintf(err, errlen, "%s: embedding.weight is not (rows, dim) with dim at most 4096", path);
        goto out;
    }
    if (ps_layout_init_table(l, sizes, n_sizes, e ? e->shape[0] : 0, e ? (int)e->shape[1] : 0) != 0) {
        snprintf(err, errlen, "%s: layer sizes psd cannot lay out", path);
        goto out;
    }
    if (!(*params = calloc(l->n_params ? l->n_params : 1, sizeof **params))) { /* the gaps between tensors 0 */
        snprintf(err, errlen, "%s: out of memory for %zu parameters", path, l->n_params);
        goto out;
    }
    for (int t = 0; t < l->n_tensors; t++) {
        char name[32];
        name_of(l, t, name, sizeof name);
        bool vec = t != l->table && t % 2 == 1;
        if (take(&f, v, path, name, (uint64_t)l->t[t].rows, vec ? 0 : (uint64_t)l->t[t].cols, *params + l->t[t].offset,
                 err, errlen) != 0)
            goto out;
    }
    const char *run = meta_of(&f, "run_id"), *step = meta_of(&f, "step"), *epoch = meta_of(&f, "epoch");
    meta->run_id = run ? strtoull(run, NULL, 16) : 0;
    meta->step = step ? strtoull(step, NULL, 10) : 0;
    unsigned long ep = epoch ? strtoul(epoch, NULL, 10) : 0;
    meta->epoch = ep > 0 && ep <= UINT32_MAX ? (uint32_t)(ep - 1) : 0;
    rc = 0;
out:
    if (rc != 0) {
        free(*params);
        *params = NULL;
    }
    free(v);
    ps_st_free(&f);
    return rc;
}
