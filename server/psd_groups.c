/* psd_groups.c - optimizer groups over a layout (see psd_groups.h). */
#include "psd_groups.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int psd_groups_init(psd_groups_t *g, const ps_layout_t *l, float wd, const ps_group_t *groups, int n)
{
    memset(g, 0, sizeof *g);
    if (n <= 0) return 0;
    const int nt = ps_layout_ntab(l);
    g->span = malloc((size_t)(nt > 0 ? nt : 1) * sizeof *g->span); /* at most one a tensor */
    g->first = malloc(((size_t)l->n_tensors + 1) * sizeof *g->first);
    if (!g->span || !g->first) {
        psd_groups_deinit(g);
        return -ENOMEM;
    }
    int k = 0;
    for (int u = 0; u < l->n_tensors; u++) {
        const ps_tensor_info_t *ut = &l->t[u];
        g->first[u] = k;
        for (int i = ut->first; i < ut->first + ut->count; i++) {
            const ps_tensor_info_t *t = ps_layout_tensor(l, i);
            const int gi = ps_groups_find(groups, n, t->name);
            const float w = gi >= 0 && groups[gi].has_wd ? (float)groups[gi].weight_decay : wd;
            const double s = gi >= 0 ? groups[gi].lr_scale : 1.0;
            const size_t b = t->offset - ut->offset, e = b + t->numel;
            psd_span_t *last = k > g->first[u] ? &g->span[k - 1] : NULL;
            if (last && last->weight_decay == w && last->lr_scale == s) { /* packed with no gap: extends it */
                last->end = e;
                continue;
            }
            g->span[k++] = (psd_span_t){.begin = b, .end = e, .weight_decay = w, .lr_scale = s};
        }
    }
    g->first[l->n_tensors] = k;
    return 0;
}

void psd_groups_deinit(psd_groups_t *g)
{
    free(g->span);
    free(g->first);
    memset(g, 0, sizeof *g);
}

void psd_groups_range(const psd_groups_t *g, int u, size_t from, size_t n, int *a, int *b)
{
    int lo = g->first[u], hi = g->first[u + 1];
    while (lo < hi) { /* the first span that ends after from */
        const int mid = lo + (hi - lo) / 2;
        if (g->span[mid].end <= from) lo = mid + 1;
        else hi = mid;
    }
    *a = lo;
    int e = lo;
    while (e < g->first[u + 1] && g->span[e].begin < from + n) e++;
    *b = e;
}

#define NAMES_SHOWN 3

void psd_groups_describe(const ps_layout_t *l, const ps_group_t *groups, int n,
                         void (*say)(void *ud, bool warn, const char *line), void *ud)
{
    if (n <= 0) return;
    const int nt = ps_layout_ntab(l);
    char line[1024];
    for (int gi = -1; gi < n; gi++) { /* -1: the tensors no group fits */
        int count = 0;
        size_t used = 0;
        line[0] = '\0';
        for (int i = 0; i < nt; i++) {
            const char *name = ps_layout_tensor(l, i)->name;
            if (ps_groups_find(groups, n, name) != gi) continue;
            if (count < NAMES_SHOWN && used < sizeof line)
                used += (size_t)snprintf(line + used, sizeof line - used, "%s%.80s", count ? ", " : ": ", name);
            count++;
        }
        if (count > NAMES_SHOWN && used < sizeof line) snprintf(line + used, sizeof line - used, ", ...");
        char out[1280];
        if (gi < 0)
            snprintf(out, sizeof out, "optimizer.groups: %d of %d tensors take the defaults%s", count, nt, line);
        else if (count == 0)
            snprintf(out, sizeof out, "optimizer.groups[%d] (%.80s) matches none of the model's %d tensors", gi,
                     groups[gi].match, nt);
        else
            snprintf(out, sizeof out, "optimizer.groups[%d] (%.80s): %d tensor%s%s", gi, groups[gi].match, count,
                     count == 1 ? "" : "s", line);
        say(ud, gi >= 0 && count == 0, out);
    }
}
