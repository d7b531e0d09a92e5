/* ps_groups.c - optimizer groups (see ps_groups.h). */
#include "ps_groups.h"

#include <fnmatch.h>
#include <math.h>
#include <string.h>

#include "ps_assert.h"

void ps_group_clear(ps_group_t *g)
{
    memset(g, 0, sizeof *g);
    g->lr_scale = 1.0;
}

int ps_group_check(const ps_group_t *g, int i, char *err, size_t errlen)
{
    const size_t len = strnlen(g->match, sizeof g->match);
    if (len == 0 || len == sizeof g->match) {
        ps_set_err(err, errlen, "optimizer.groups[%d]: match: a glob of 1 to %d bytes is needed", i,
                   PS_GROUP_MATCH_MAX);
        return -1;
    }
    if (g->has_wd && !(isfinite(g->weight_decay) && g->weight_decay >= 0.0)) {
        ps_set_err(err, errlen, "optimizer.groups[%d] (%.60s): weight_decay %g must be >= 0", i, g->match,
                   g->weight_decay);
        return -1;
    }
    if (!(isfinite(g->lr_scale) && g->lr_scale > 0.0)) {
        ps_set_err(err, errlen, "optimizer.groups[%d] (%.60s): lr_scale %g must be > 0", i, g->match, g->lr_scale);
        return -1;
    }
    return 0;
}

int ps_groups_find(const ps_group_t *groups, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (fnmatch(groups[i].match, name, 0) == 0) return i;
    return -1;
}
