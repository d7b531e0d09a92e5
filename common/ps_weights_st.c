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

int ps_weights_save_st(const char *path, const ps_layout_t *l, const float *params, const ps_weights_meta_t *meta,
                       char *err, size_t errlen)
{
    if (!ps_weights_is_st(path)) {
        snprintf(err, errlen, "%s: a safetensors file's name ends in .safetensors", path);
        return -1;
    }
    return ps_weights_save(path, l, params, meta, err, errlen);
}

/* Where each file tensor's values start among v (ps_st_load's: each
 * tensor's floats after those of the ones before it): f->n pointers, or
 * NULL when out of memory. */
static const float **values_of(const ps_st_file_t *f, const float *v)
{
    const float **at = malloc((f->n ? f->n : 1) * sizeof *at);
    for (size_t k = 0; at && k < f->n; v += f->t[k].numel, k++) at[k] = v;
    return at;
}

/* The index of tensor `name` in f, or f->n. */
static size_t index_of(const ps_st_file_t *f, const char *name)
{
    const ps_st_tensor_t *t = ps_st_find(f, name);
    return t ? (size_t)(t - f->t) : f->n;
}

/* A layout of f's tensors in their order. 0, or -1 with a message. */
static int layout_of(const ps_st_file_t *f, const char *path, ps_layout_t *l, char *err, size_t errlen)
{
    if (f->n > PS_MAX_TABLE) {
        snprintf(err, errlen, "%s: %zu tensors, psd takes at most %d", path, f->n, PS_MAX_TABLE);
        return -1;
    }
    ps_tensor_spec_t *sp = calloc(f->n ? f->n : 1, sizeof *sp);
    if (!sp) {
        snprintf(err, errlen, "%s: out of memory", path);
        return -1;
    }
    for (size_t i = 0; i < f->n; i++) {
        snprintf(sp[i].name, sizeof sp[i].name, "%s", f->t[i].name);
        sp[i].ndim = f->t[i].ndim;
        memcpy(sp[i].shape, f->t[i].shape, sizeof sp[i].shape);
        sp[i].init.kind = PS_INIT_ZEROS; /* the file's values replace them */
    }
    char why[400];
    int rc = ps_layout_init_specs(l, sp, (int)f->n, why, sizeof why);
    if (rc != 0) snprintf(err, errlen, "%s: %s", path, why);
    free(sp);
    return rc;
}

int ps_layout_from_st(const char *path, ps_layout_t *l, char *err, size_t errlen)
{
    ps_st_file_t f;
    if (ps_st_load(path, &f, NULL, err, errlen) != 0) return -1; /* the header: the values are read when needed */
    int rc = layout_of(&f, path, l, err, errlen);
    ps_st_free(&f);
    return rc;
}

typedef struct {
    float *params;
    const float *const *src; /* each tensor of the table's values */
} copy_arg_t;

static void copy_piece(const ps_tensor_info_t *t, int k, size_t off, size_t n, void *arg)
{
    const copy_arg_t *a = arg;
    memcpy(a->params + t->offset + off, a->src[k] + off, n * sizeof *a->params);
}

int ps_st_init_values(const char *path, const ps_layout_t *l, float *params, const ps_piece_t *own, char *err,
                      size_t errlen)
{
    ps_st_file_t f;
    float *v = NULL;
    if (ps_st_load(path, &f, &v, err, errlen) != 0) return -1;
    int rc = -1;
    const int nt = ps_layout_ntab(l);
    const float **at = values_of(&f, v), **src = calloc((size_t)nt, sizeof *src);
    bool *seen = calloc(f.n ? f.n : 1, 1);
    if (!at || !src || !seen) {
        snprintf(err, errlen, "%s: out of memory", path);
        goto out;
    }
    for (int t = 0; t < nt; t++) {
        const ps_tensor_info_t *ti = ps_layout_tensor(l, t);
        const size_t i = index_of(&f, ti->name);
        char a[256], b[256];
        if (i == f.n) {
            snprintf(err, errlen, "%s: no tensor %s (model.init gives every tensor's initial values)", path, ti->name);
            goto out;
        }
        if (f.t[i].ndim != ti->ndim || memcmp(f.t[i].shape, ti->shape, (size_t)ti->ndim * sizeof *ti->shape) != 0) {
            ps_shape_str(ti->ndim, ti->shape, a, sizeof a);
            ps_shape_str(f.t[i].ndim, f.t[i].shape, b, sizeof b);
            snprintf(err, errlen, "%s: tensor %s has shape %s, the run's model %s", path, ti->name, b, a);
            goto out;
        }
        src[t] = at[i];
        seen[i] = true;
    }
    for (size_t i = 0; i < f.n; i++) /* every tensor of the file is one of the run's */
        if (!seen[i]) {
            snprintf(err, errlen, "%s: tensor %s is not in the run's model (model.tensors)", path, f.t[i].name);
            goto out;
        }
    copy_arg_t ca = {params, src};
    for (int u = 0; u < l->n_tensors; u++) {
        size_t from = own ? own[u].off : 0, n = own ? own[u].n : l->t[u].numel;
        if (n) ps_unit_tensors(l, u, from, n, copy_piece, &ca);
    }
    rc = 0;
out:
    free(at);
    free(src);
    free(seen);
    free(v);
    ps_st_free(&f);
    return rc;
}

int ps_run_layout(const ps_config_t *c, ps_layout_t *l, char *err, size_t errlen)
{
    if (c->kind == PS_MODEL_TENSORS && c->n_tensors == 0) return ps_layout_from_st(c->init_file, l, err, errlen);
    if (c->kind == PS_MODEL_TENSORS)
        return ps_layout_init_specs(l, c->tensors, c->n_tensors, err, errlen);
    if (ps_config_layout(c, l) != 0) {
        snprintf(err, errlen, "model.layers: sizes psd cannot lay out");
        return -1;
    }
    return 0;
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
    const size_t i = index_of(f, name);
    if (i == f->n) {
        snprintf(err, errlen, "%s: no tensor %s (a built-in model's weights: fc1.weight, fc1.bias, ..., and "
                 "embedding.weight for the click-through model)", path, name);
        return -1;
    }
    const ps_st_tensor_t *t = &f->t[i];
    bool ok = c ? t->ndim == 2 && t->shape[0] == r && t->shape[1] == c : t->ndim == 1 && t->shape[0] == r;
    if (!ok) {
        snprintf(err, errlen, "%s: tensor %s has another shape than the layers before and after it "
                 "make (%" PRIu64 " x %" PRIu64 ")", path, name, r, c ? c : 1);
        return -1;
    }
    for (size_t k = 0; k < i; k++) v += f->t[k].numel;
    memcpy(dst, v, t->numel * sizeof *dst);
    return 0;
}

int ps_weights_load_any(const char *path, ps_layout_t *l, float **params, ps_weights_meta_t *meta, char *err,
                        size_t errlen)
{
    if (!ps_weights_is_st(path)) return ps_weights_load(path, l, params, meta, err, errlen);
    *params = NULL;
    memset(l, 0, sizeof *l);
    ps_st_file_t f;
    float *v = NULL;
    if (ps_st_load(path, &f, &v, err, errlen) != 0) return -1;
    int rc = -1, sizes[PS_MAX_LAYERS + 1], n_sizes = 0;
    const ps_st_tensor_t *e = ps_st_find(&f, "embedding.weight");
    if (!ps_st_find(&f, "fc1.weight")) { /* not a built-in model: any table, in the file's order */
        if (layout_of(&f, path, l, err, errlen) != 0) goto out;
        if (!(*params = calloc(l->n_params ? l->n_params : 1, sizeof **params))) {
            snprintf(err, errlen, "%s: out of memory for %zu parameters", path, l->n_params);
            goto out;
        }
        const float *src = v;
        for (int t = 0; t < ps_layout_ntab(l); src += ps_layout_tensor(l, t)->numel, t++)
            memcpy(*params + ps_layout_tensor(l, t)->offset, src, ps_layout_tensor(l, t)->numel * sizeof **params);
        goto meta;
    }
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
        bool vec = l->t[t].ndim == 1;
        if (take(&f, v, path, l->t[t].name, l->t[t].rows, vec ? 0 : l->t[t].cols, *params + l->t[t].offset, err,
                 errlen) != 0)
            goto out;
    }
meta:;
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
        ps_layout_free(l);
    }
    free(v);
    ps_st_free(&f);
    return rc;
}
