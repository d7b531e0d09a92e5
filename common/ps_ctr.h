/* ps_ctr.h - a click-through-style task with a planted ground truth.
 *
 * Every example has `fields` categorical fields, each with `per_field`
 * values drawn from a Zipf distribution over `vocab` values (value 0 the
 * most frequent). The label is drawn from a known logistic model:
 *
 *   p(click) = sigmoid(bias + sum_f mean_j w(f, v_fj)),  w(f, v) ~ N(0, weight_std^2)
 *
 * so the best log-loss any model can reach on a set of examples is that of
 * p itself, which the generator reports with every example. Each (field,
 * value) pair is hashed into one of `rows` rows of an embedding table (the
 * hashing trick: pairs may share a row when rows < fields x vocab).
 *
 * Examples are a pure function of (seed, index): any process makes any
 * example without a file, the same bits everywhere, so psd hands out
 * example indices exactly as it hands out Fashion-MNIST sample ids. Nothing
 * here allocates. */
#ifndef PS_CTR_H
#define PS_CTR_H

#include <stddef.h>
#include <stdint.h>

#define PS_CTR_MAX_IDS 256 /* fields x per_field */

typedef struct {
    int fields;          /* categorical fields per example */
    int per_field;       /* values per field and example (1: one-hot; more: a bag) */
    uint64_t vocab;      /* distinct values per field */
    double zipf;         /* exponent s > 0 of the values' Zipf distribution */
    uint64_t rows;       /* embedding rows the (field, value) pairs are hashed into */
    double weight_std;   /* spread of the planted weights */
    double bias;         /* planted bias (sets the click rate) */
    uint64_t seed;
} ps_ctr_t;

struct ps_config;
/* The generator of a config's ctr.* keys (model.kind: ctr). */
void ps_ctr_from_config(const struct ps_config *c, ps_ctr_t *g);

/* Checks a generator's parameters: 0, or -1 with a message in err. */
int ps_ctr_check(const ps_ctr_t *g, char *err, size_t errlen);

/* Example `index`: rows[f * per_field + j] = the embedding row of field f's
 * j-th value, values[same] = that value, *label = 0 or 1; returns the
 * planted p(click). values may be NULL. */
double ps_ctr_example(const ps_ctr_t *g, uint64_t index, uint32_t *rows, uint64_t *values, uint8_t *label);

/* The planted weight of value v of field f. */
double ps_ctr_weight(const ps_ctr_t *g, int f, uint64_t v);

/* The embedding row of value v of field f. */
uint32_t ps_ctr_row(const ps_ctr_t *g, int f, uint64_t v);

/* A Zipf(s) rank in [0, n) from the generator state x (rejection-inversion,
 * Hoermann and Derflinger 1996: exact, no table, O(1) expected). */
uint64_t ps_zipf(uint64_t *x, uint64_t n, double s);

/* -log of the probability p gave to label y (p clamped to [1e-7, 1 - 1e-7]). */
double ps_logloss(double p, int y);

/* Area under the ROC curve of scores against 0/1 labels (ties count one
 * half), using order[n] as scratch; 0.5 when one class is absent. */
double ps_auc(const float *score, const uint8_t *label, size_t n, uint32_t *order);

#endif
