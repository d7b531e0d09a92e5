/* ps_tensor.h - a tensor as a user states it: name, shape, kind and how
 * its initial values are drawn (model.tensors, a safetensors file, the
 * first worker's table). The layout (ps_model.h) places such tensors in
 * one arena; this file knows single tensors only. */
#ifndef PS_TENSOR_H
#define PS_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#define PS_MAX_TENSORS 64  /* units of a layout (ps_model.h: one tensor, or small ones packed) */
#define PS_MAX_TABLE 16384 /* tensors in a table */
#define PS_NAME_MAX 255    /* bytes of a tensor's name */
#define PS_MAX_DIMS 8      /* dimensions of a tensor's shape */
#define PS_MAX_NUMEL (1ull << 61) /* elements of a tensor, and of the whole arena */

typedef enum { PS_TENSOR_DENSE = 0, PS_TENSOR_ROWS } ps_tensor_kind_t; /* stepped whole | by rows (sparse) */

/* How a tensor's initial values are drawn (ps_model_init_pieces). The
 * general ones are counter-based: value j of tensor k depends on (seed, k,
 * j) only, so a psd shard draws its piece alone. PS_INIT_HE is the built-in
 * models' He-uniform draw (a xoshiro stream per tensor), kept bit for bit. */
typedef enum {
    PS_INIT_ZEROS = 0,
    PS_INIT_ONES,
    PS_INIT_CONSTANT,        /* value */
    PS_INIT_NORMAL,          /* N(0, value^2) */
    PS_INIT_UNIFORM,         /* U(-value, value) */
    PS_INIT_KAIMING_UNIFORM, /* U(-b, b), b = sqrt(6 / fan_in) (torch.nn.init, relu gain) */
    PS_INIT_KAIMING_NORMAL,  /* N(0, 2 / fan_in) */
    PS_INIT_XAVIER_UNIFORM,  /* U(-b, b), b = sqrt(6 / (fan_in + fan_out)) */
    PS_INIT_XAVIER_NORMAL,   /* N(0, 2 / (fan_in + fan_out)) */
    PS_INIT_HE,              /* the built-in models' weights */
    PS_INIT_COUNT
} ps_init_kind_t;

typedef struct {
    ps_init_kind_t kind;
    double value; /* constant's value, normal's std, uniform's bound */
} ps_init_t;

/* One tensor as a user states it (model.tensors). */
typedef struct {
    char name[PS_NAME_MAX + 1];
    int ndim;                     /* 0 (a scalar) .. PS_MAX_DIMS */
    uint64_t shape[PS_MAX_DIMS];
    ps_tensor_kind_t kind;
    ps_init_t init;
} ps_tensor_spec_t;

/* "[32, 1, 5, 5]" ("[]" for a scalar): a shape for messages and YAML. */
void ps_shape_str(int ndim, const uint64_t *shape, char *out, size_t n);
/* Elements of a shape (1 for a scalar), or 0 when over PS_MAX_NUMEL or a
 * dimension is 0. */
uint64_t ps_shape_numel(int ndim, const uint64_t *shape);

/* A table of n tensors that a layout can hold: 1 to PS_MAX_TABLE of
 * them, names of 1 to PS_NAME_MAX bytes and none twice, 0 to PS_MAX_DIMS
 * dimensions none 0, at most 2^61 floats in all, sparse rows of 2
 * dimensions or more. 0, or -1 with a message naming the tensor. */
int ps_tensors_check(const ps_tensor_spec_t *specs, int n, char *err, size_t errlen);
/* No name given twice: 0, or -1 naming the first tensor (in order) whose
 * name an earlier one has ("tensor 3: the name b is also tensor 1's").
 * Sorted, not pairwise: a table may have thousands. */
int ps_tensors_unique(const ps_tensor_spec_t *specs, int n, char *err, size_t errlen);

/* fan_in, fan_out as torch.nn.init computes them: shape[1] x the receptive
 * field (the product of shape[2:]) and shape[0] x it; a 1-D tensor has
 * fan_in = fan_out = shape[0]. */
void ps_tensor_fans(int ndim, const uint64_t *shape, double *fan_in, double *fan_out);

/* Values [from, to) of tensor `index` (of that shape)'s init (not PS_INIT_HE) into dst
 * (to - from floats), from the counter-based generator keyed by (seed,
 * index): any piece alone gives the same values as the whole. */
void ps_tensor_init_values(const ps_init_t *init, int ndim, const uint64_t *shape, int index, uint64_t seed,
                           uint64_t from, uint64_t to, float *dst);

/* An init as text: "zeros", "ones", "kaiming_uniform", ...,
 * "constant:0.1", "normal:0.02", "uniform:0.05" (the parameter after the
 * colon). Parse: 0, or -1 with a message listing what is accepted. */
int ps_init_parse(const char *s, ps_init_t *out, char *err, size_t errlen);
void ps_init_str(const ps_init_t *in, char *out, size_t n);
const char *ps_init_name(ps_init_kind_t k);

#endif
