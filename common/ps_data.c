/* ps_data.c - data fingerprints, the validation split, sum names (ps_data.h). */
#include "ps_data.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ps_rng.h"

bool ps_data_id_ok(const char *id)
{
    size_t n = strlen(id);
    if (n > PS_DATA_ID_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if (id[i] < 0x20 || id[i] > 0x7e) return false;
    return true;
}

bool ps_sum_name_ok(const char *name)
{
    static const char *const taken[] = {"loss", "acc", "correct", "count", "samples", "auc"};
    size_t n = strlen(name);
    if (n < 1 || n > PS_SUM_NAME_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= '0' && name[i] <= '9') || name[i] == '_'))
            return false;
    for (size_t i = 0; i < sizeof taken / sizeof *taken; i++)
        if (strcmp(name, taken[i]) == 0) return false;
    return true;
}

int ps_data_split(size_t n, size_t val, uint64_t seed, uint32_t *val_ids, uint32_t *train_ids)
{
    if (val > n || n > (size_t)UINT32_MAX + 1) return -1;
    uint8_t *in_val = calloc(n ? n : 1, 1);
    uint32_t *perm = malloc((n ? n : 1) * sizeof *perm);
    if (!in_val || !perm) {
        free(in_val);
        free(perm);
        return -1;
    }
    ps_rng_permutation(perm, n, seed, 77); /* a stream of its own: the epochs' permutations use 1000 + epoch */
    for (size_t i = 0; i < val; i++) in_val[perm[i]] = 1;
    size_t a = 0, b = 0;
    for (size_t i = 0; i < n; i++) {
        if (in_val[i]) val_ids[a++] = (uint32_t)i;
        else train_ids[b++] = (uint32_t)i;
    }
    free(in_val);
    free(perm);
    return 0;
}

size_t ps_data_val_count(size_t n, double val_fraction, uint64_t val_size)
{
    if (val_size > 0) return val_size > n ? n : (size_t)val_size;
    if (!(val_fraction > 0)) return 0;
    double v = floor(val_fraction * (double)n + 0.5);
    if (v < 1) v = 1;
    return v > (double)n ? n : (size_t)v;
}
