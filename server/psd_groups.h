/* psd_groups.h - optimizer groups (optimizer.groups, ps_groups.h) laid
 * over a layout: for each unit, the runs of its floats whose tensors take
 * the same settings (spans).
 *
 * The step works per unit, in chunks; a unit packs several small tensors
 * that may fall in different groups, so a chunk is cut where the settings
 * change. Neighbouring tensors with equal settings share a span: a unit
 * whose tensors all agree is one span, and a chunk of it one optimizer
 * call, as without groups. */
#ifndef PSD_GROUPS_H
#define PSD_GROUPS_H

#include <stdbool.h>
#include <stddef.h>

#include "ps_groups.h"
#include "ps_model.h"

/* Floats [begin, end) of a unit, stepped with these settings. */
typedef struct {
    size_t begin, end;
    float weight_decay; /* the optimizer's weight decay there */
    double lr_scale;    /* the scheduled lr is multiplied by it */
} psd_span_t;

typedef struct {
    psd_span_t *span; /* unit u's spans: span[first[u], first[u + 1]), in order, covering its floats; NULL: no groups */
    int *first;       /* n_tensors + 1 */
} psd_groups_t;

/* The spans of layout l for groups[0, n) (a tensor no group fits takes
 * weight_decay wd and lr_scale 1). n == 0: no groups (g->span NULL: the
 * step's plain path). 0 or -ENOMEM. psd_groups_deinit frees. */
int psd_groups_init(psd_groups_t *g, const ps_layout_t *l, float wd, const ps_group_t *groups, int n);
void psd_groups_deinit(psd_groups_t *g);

/* The spans of unit u that meet its floats [from, from + n): [*a, *b). */
void psd_groups_range(const psd_groups_t *g, int u, size_t from, size_t n, int *a, int *b);

/* What groups[0, n) got of l's tensors, one line each into say (warn: a
 * group that got none): "optimizer.groups[0] (*.bias): 3 tensors: fc1.bias,
 * fc2.bias, fc3.bias", and the tensors left to the defaults. */
void psd_groups_describe(const ps_layout_t *l, const ps_group_t *groups, int n,
                         void (*say)(void *ud, bool warn, const char *line), void *ud);

#endif
