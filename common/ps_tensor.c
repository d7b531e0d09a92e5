/* ps_tensor.c - a tensor as a user states it (ps_tensor.h). */
#include "ps_tensor.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_rng.h"

/* The counter-based generator: splitmix64's output function applied to a
 * counter. Value j of a key is mix(key + (j + 1) * golden), so any j is
 * drawn without drawing those before it. */
#define GOLDEN 0x9e3779b97f4a7c15ULL
#define INIT_KEY 0x7e15a1c0de5eedULL /* keys of tensor inits: other streams than the data's */

#define mix ps_mix64

static const char *const init_names[PS_INIT_COUNT] = {
    "zeros", "ones", "constant", "normal", "uniform", "kaiming_uniform", "kaiming_normal",
    "xavier_uniform", "xavier_normal", "he_uniform_builtin",
};

const char *ps_init_name(ps_init_kind_t k) { return k < PS_INIT_COUNT ? init_names[k] : "?"; }

static int has_param(ps_init_kind_t k) { return k == PS_INIT_CONSTANT || k == PS_INIT_NORMAL || k == PS_INIT_UNIFORM; }

int ps_init_parse(const char *s, ps_init_t *out, char *err, size_t errlen)
{
    const char *colon = strchr(s, ':');
    size_t n = colon ? (size_t)(colon - s) : strlen(s);
    for (int k = 0; k < PS_INIT_HE; k++) {
        if (strlen(init_names[k]) != n || strncmp(s, init_names[k], n) != 0) continue;
        if (has_param((ps_init_kind_t)k) != (colon != NULL)) {
            snprintf(err, errlen, "init '%s': %s", s,
                     colon ? "takes no parameter" : "needs a parameter, e.g. normal:0.02, uniform:0.05, constant:0.1");
            return -1;
        }
        double v = 0;
        if (colon) {
            char *end;
            errno = 0;
            v = strtod(colon + 1, &end);
            if (errno || end == colon + 1 || *end || !isfinite(v) ||
                (k != PS_INIT_CONSTANT && !(v >= 0))) {
                snprintf(err, errlen, "init '%s': the parameter must be a finite number%s", s,
                         k != PS_INIT_CONSTANT ? " >= 0" : "");
                return -1;
            }
        }
        *out = (ps_init_t){(ps_init_kind_t)k, v};
        return 0;
    }
    snprintf(err, errlen, "unknown init '%s' (zeros, ones, constant:V, normal:STD, uniform:BOUND, kaiming_uniform, "
             "kaiming_normal, xavier_uniform, xavier_normal)", s);
    return -1;
}

void ps_init_str(const ps_init_t *in, char *out, size_t n)
{
    if (has_param(in->kind)) snprintf(out, n, "%s:%.17g", ps_init_name(in->kind), in->value);
    else snprintf(out, n, "%s", ps_init_name(in->kind));
}

void ps_shape_str(int ndim, const uint64_t *shape, char *out, size_t n)
{
    size_t at = 0;
    at += (size_t)snprintf(out, n, "[");
    for (int d = 0; d < ndim && at < n; d++)
        at += (size_t)snprintf(out + at, n - at, "%s%" PRIu64, d ? ", " : "", shape[d]);
    if (at < n) snprintf(out + at, n - at, "]");
}

uint64_t ps_shape_numel(int ndim, const uint64_t *shape)
{
    uint64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] == 0 || shape[d] > PS_MAX_NUMEL / numel) return 0;
        numel *= shape[d];
    }
    return numel;
}

void ps_tensor_fans(int ndim, const uint64_t *shape, double *fan_in, double *fan_out)
{
    if (ndim < 2) {
        *fan_in = *fan_out = ndim == 1 ? (double)shape[0] : 1.0;
        return;
    }
    double rf = 1;
    for (int d = 2; d < ndim; d++) rf *= (double)shape[d];
    *fan_in = (double)shape[1] * rf;
    *fan_out = (double)shape[0] * rf;
}

/* Uniform in [0, 1) with 24 bits, and in (0, 1] with 53. */
static float u24(uint64_t x) { return (float)(x >> 40) * (1.0f / 16777216.0f); }
static double u53_open0(uint64_t x) { return ((double)(x >> 11) + 1.0) * (1.0 / 9007199254740992.0); }

void ps_tensor_init_values(const ps_init_t *init, int ndim, const uint64_t *shape, int index, uint64_t seed,
                           uint64_t from, uint64_t to, float *dst)
{
    double fi, fo;
    ps_tensor_fans(ndim, shape, &fi, &fo);
    const uint64_t key = mix(seed ^ mix(INIT_KEY + (uint64_t)index));
    double a = 0; /* the bound or the standard deviation */
    switch (init->kind) {
    case PS_INIT_ZEROS: memset(dst, 0, (to - from) * sizeof *dst); return;
    case PS_INIT_ONES:
    case PS_INIT_CONSTANT:
        for (uint64_t j = from; j < to; j++) dst[j - from] = init->kind == PS_INIT_ONES ? 1.0f : (float)init->value;
        return;
    case PS_INIT_UNIFORM: a = init->value; break;
    case PS_INIT_KAIMING_UNIFORM: a = sqrt(6.0 / fi); break;
    case PS_INIT_XAVIER_UNIFORM: a = sqrt(6.0 / (fi + fo)); break;
    case PS_INIT_NORMAL: a = init->value; break;
    case PS_INIT_KAIMING_NORMAL: a = sqrt(2.0 / fi); break;
    case PS_INIT_XAVIER_NORMAL: a = sqrt(2.0 / (fi + fo)); break;
    default: memset(dst, 0, (to - from) * sizeof *dst); return; /* PS_INIT_HE: ps_model.c draws it */
    }
    const int normal = init->kind == PS_INIT_NORMAL || init->kind == PS_INIT_KAIMING_NORMAL ||
                       init->kind == PS_INIT_XAVIER_NORMAL;
    const float bound = (float)a;
    for (uint64_t j = from; j < to; j++) {
        if (normal) { /* Box-Muller from counters 2j and 2j + 1: one of its pair */
            double r = sqrt(-2.0 * log(u53_open0(mix(key + (2 * j + 1) * GOLDEN))));
            double th = 2.0 * M_PI * u53_open0(mix(key + (2 * j + 2) * GOLDEN));
            dst[j - from] = (float)(a * r * cos(th));
        } else {
            dst[j - from] = (2.0f * u24(mix(key + (j + 1) * GOLDEN)) - 1.0f) * bound;
        }
    }
}

typedef struct {
    const char *name;
    int i;
} named_t;

static int by_name(const void *a, const void *b)
{
    const named_t *x = a, *y = b;
    int c = strncmp(x->name, y->name, PS_NAME_MAX + 1);
    return c ? c : (x->i > y->i) - (x->i < y->i);
}

int ps_tensors_unique(const ps_tensor_spec_t *specs, int n, char *err, size_t errlen)
{
    named_t *ix = malloc((size_t)n * sizeof *ix);
    int bad = -1, was = -1;
    if (!ix) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    for (int i = 0; i < n; i++) ix[i] = (named_t){specs[i].name, i};
    qsort(ix, (size_t)n, sizeof *ix, by_name);
    for (int i = 1, first = 0; i < n; i++) {
        if (strncmp(ix[i].name, ix[i - 1].name, PS_NAME_MAX + 1) != 0) {
            first = i;
        } else if (bad < 0 || ix[i].i < bad) {
            bad = ix[i].i;
            was = ix[first].i;
        }
    }
    free(ix);
    if (bad < 0) return 0;
    snprintf(err, errlen, "tensor %d: the name %.*s is also tensor %d's", bad, PS_NAME_MAX, specs[bad].name, was);
    return -1;
}

int ps_tensors_check(const ps_tensor_spec_t *specs, int n, char *err, size_t errlen)
{
    if (n < 1 || n > PS_MAX_TABLE || !specs) {
        snprintf(err, errlen, "a model of %d tensors (1 to %d)", n, PS_MAX_TABLE);
        return -1;
    }
    if (ps_tensors_unique(specs, n, err, errlen) != 0) return -1;
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        const ps_tensor_spec_t *sp = &specs[i];
        size_t len = strnlen(sp->name, sizeof sp->name);
        char shp[256];
        if (len == 0 || len > PS_NAME_MAX) {
            snprintf(err, errlen, "tensor %d: a name of 1 to %d bytes is needed", i, PS_NAME_MAX);
            return -1;
        }
        if (sp->ndim < 0 || sp->ndim > PS_MAX_DIMS) {
            snprintf(err, errlen, "tensor %s: %d dimensions (0 to %d)", sp->name, sp->ndim, PS_MAX_DIMS);
            return -1;
        }
        uint64_t numel = ps_shape_numel(sp->ndim, sp->shape);
        ps_shape_str(sp->ndim, sp->shape, shp, sizeof shp);
        if (numel == 0 || numel + 16 > PS_MAX_NUMEL - total) {
            snprintf(err, errlen, "tensor %s: shape %s has a dimension 0 or makes the model over 2^61 floats",
                     sp->name, shp);
            return -1;
        }
        total += numel + 16; /* with the alignment between tensors */
        if (sp->kind == PS_TENSOR_ROWS && sp->ndim < 2) {
            snprintf(err, errlen, "tensor %s: sparse rows need a shape of 2 dimensions or more (rows, ...), not %s",
                     sp->name, shp);
            return -1;
        }
        if (sp->init.kind >= PS_INIT_COUNT || (sp->init.kind != PS_INIT_CONSTANT && !(sp->init.value >= 0))) {
            snprintf(err, errlen, "tensor %s: an unknown init or a negative parameter", sp->name);
            return -1;
        }
    }
    return 0;
}
