/* ps_groups.h - optimizer groups (optimizer.groups): hyper-parameters that
 * differ per tensor, chosen by a glob on the tensor's name.
 *
 * A group is {match: GLOB, weight_decay: WD, lr_scale: S}: a tensor takes
 * the first group whose match (fnmatch(3), no flags: '*' also crosses
 * dots) fits its name; tensors no group fits take optimizer.weight_decay
 * and lr_scale 1. Only these two vary: momentum, betas and eps stay
 * run-wide (every tensor keeps the same optimizer state slots). */
#ifndef PS_GROUPS_H
#define PS_GROUPS_H

#include <stdbool.h>
#include <stddef.h>

#define PS_GROUPS_MAX 64      /* groups in optimizer.groups */
#define PS_GROUP_MATCH_MAX 255 /* bytes of a group's match */

typedef struct {
    char match[PS_GROUP_MATCH_MAX + 1];
    bool has_wd;         /* weight_decay given: else optimizer.weight_decay */
    double weight_decay; /* >= 0, finite */
    double lr_scale;     /* > 0, finite: multiplies the scheduled lr (1 unless given) */
} ps_group_t;

/* A group with nothing set yet (lr_scale 1, no weight_decay, no match). */
void ps_group_clear(ps_group_t *g);

/* Group i complete and in range: a match of 1 to PS_GROUP_MATCH_MAX
 * bytes, weight_decay >= 0 and lr_scale > 0, both finite. 0, or -1 with
 * "optimizer.groups[i]: ..." in err. (ps_config reads and writes groups.) */
int ps_group_check(const ps_group_t *g, int i, char *err, size_t errlen);

/* The first of groups[0, n) whose match fits name, or -1. */
int ps_groups_find(const ps_group_t *groups, int n, const char *name);

#endif
