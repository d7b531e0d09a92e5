/* ps_data.h - what psd and its workers agree on about a run's data: the
 * fingerprint a worker gives of its data, the held-out validation split of
 * the training set, and the names of the sums a validation result carries.
 * Pure functions; the caller owns every buffer. */
#ifndef PS_DATA_H
#define PS_DATA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PS_DATA_ID_MAX 255  /* bytes of a data fingerprint */
#define PS_MAX_SUMS 16      /* named sums in a validation result */
#define PS_SUM_NAME_MAX 32  /* bytes of a sum's name */

/* A fingerprint: up to PS_DATA_ID_MAX printable ASCII bytes ("" too). */
bool ps_data_id_ok(const char *id);

/* A sum's name: 1 to PS_SUM_NAME_MAX of [a-z0-9_], and none of the names
 * psd's own figures take (loss, acc, correct, count, samples, auc). */
bool ps_sum_name_ok(const char *name);

/* The validation split of a training set of n samples: val samples drawn
 * by seed (a permutation's first val), val_ids (val of them) and train_ids
 * (the n - val others) each in increasing order. The same for the same
 * (n, val, seed) on any machine. 0, or -1 when val > n or out of memory. */
int ps_data_split(size_t n, size_t val, uint64_t seed, uint32_t *val_ids, uint32_t *train_ids);

/* The validation samples data.val_fraction or data.val_size ask of a
 * training set of n (the fraction rounded to the nearest, at least 1). */
size_t ps_data_val_count(size_t n, double val_fraction, uint64_t val_size);

#endif
