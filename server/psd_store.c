#include "psd_store.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static float *alloc_floats(size_t n)
{
    size_t bytes = (n * sizeof(float) + 63) & ~(size_t)63;
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (p) memset(p, 0, bytes);
    return p;
}

int psd_store_init(psd_store_t *s, const ps_layout_t *l, const psd_optim_t *opt, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    s->layout = *l;
    s->opt = *opt;
    s->grad = alloc_floats(l->n_params);
    int slots = psd_optim_slots(opt);
    if (slots >= 1) s->s0 = alloc_floats(l->n_params);
    if (slots >= 2) s->s1 = alloc_floats(l->n_params);
    psd_arena_t *a = &s->arenas[0];
    a->w = alloc_floats(l->n_params);
    s->n_arenas = 1;
    if (!s->grad || !a->w || (slots >= 1 && !s->s0) || (slots >= 2 && !s->s1)) {
        psd_store_deinit(s);
        return -ENOMEM;
    }
    ps_model_init_params(l, a->w, seed);
    atomic_store(&a->refs, 1);
    a->version = 0;
    s->cur = a;
    return 0;
}

void psd_store_deinit(psd_store_t *s)
{
    for (int i = 0; i < s->n_arenas; i++) free(s->arenas[i].w);
    free(s->grad);
    free(s->s0);
    free(s->s1);
    memset(s, 0, sizeof *s);
}

psd_arena_t *psd_store_ref_current(psd_store_t *s)
{
    atomic_fetch_add_explicit(&s->cur->refs, 1, memory_order_relaxed);
    return s->cur;
}

void psd_store_frame_free(void *data, void *hint)
{
    (void)data;
    psd_arena_t *a = hint;
    atomic_fetch_sub_explicit(&a->refs, 1, memory_order_release);
}

/* An arena no frame references, for the next version. */
static psd_arena_t *free_arena(psd_store_t *s)
{
    for (int i = 0; i < s->n_arenas; i++) {
        psd_arena_t *a = &s->arenas[i];
        if (a != s->cur && atomic_load_explicit(&a->refs, memory_order_acquire) == 0) return a;
    }
    if (s->n_arenas == PSD_MAX_ARENAS) return NULL;
    psd_arena_t *a = &s->arenas[s->n_arenas];
    a->w = alloc_floats(s->layout.n_params);
    if (!a->w) return NULL;
    atomic_store(&a->refs, 0);
    s->n_arenas++;
    return a;
}

double psd_store_step(psd_store_t *s, int n, const float *const (*grads)[PS_MAX_TENSORS],
                      const double *weight, double clip_norm, double lr)
{
    psd_arena_t *next = free_arena(s);
    if (!next) return -1;
    const ps_layout_t *l = &s->layout;
    /* reduce: grad = sum_k weight[k] * g_k, in the contributors' order */
    double sumsq = 0;
    for (int t = 0; t < l->n_tensors; t++) {
        float *acc = s->grad + l->t[t].offset;
        size_t numel = l->t[t].numel;
        for (int k = 0; k < n; k++) {
            const float *g = grads[k][t];
            const float wk = (float)weight[k];
            if (k == 0)
                for (size_t i = 0; i < numel; i++) acc[i] = wk * g[i];
            else
                for (size_t i = 0; i < numel; i++) acc[i] += wk * g[i];
        }
        sumsq += psd_sumsq(acc, numel);
    }
    float scale = psd_clip_scale(sumsq, clip_norm);
    s->steps++;
    for (int t = 0; t < l->n_tensors; t++) {
        size_t off = l->t[t].offset;
        if (s->before_update) s->before_update(s->before_update_ud, off, l->t[t].numel);
        psd_optim_apply(&s->opt, s->cur->w + off, next->w + off, s->grad + off, scale,
                        s->s0 ? s->s0 + off : NULL, s->s1 ? s->s1 + off : NULL, l->t[t].numel, lr,
                        s->steps);
    }
    next->version = s->cur->version + 1;
    atomic_store(&next->refs, 1);
    atomic_fetch_sub_explicit(&s->cur->refs, 1, memory_order_release);
    s->cur = next;
    return sqrt(sumsq);
}
