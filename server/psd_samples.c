/* psd_samples.c - the sample accounting of an epoch as plain data
 * (psd_samples.h). */
#include "psd_samples.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int psd_samples_init(psd_samples_t *s, uint64_t n)
{
    memset(s, 0, sizeof *s);
    size_t m = n ? (size_t)n : 1;
    s->n = n;
    s->perm = malloc(m * sizeof *s->perm);
    s->pool = malloc(m * sizeof *s->pool);
    s->seen = calloc((m + 7) / 8, 1);
    if (!s->perm || !s->pool || !s->seen) {
        psd_samples_free(s);
        return -ENOMEM;
    }
    return 0;
}

void psd_samples_free(psd_samples_t *s)
{
    free(s->perm);
    free(s->pool);
    free(s->seen);
    memset(s, 0, sizeof *s);
}

static bool seen(const psd_samples_t *s, uint64_t p) { return s->seen[p / 8] & (1u << (p % 8)); }

size_t psd_samples_begin(psd_samples_t *s, bool keep_seen, uint64_t *out)
{
    if (!keep_seen) memset(s->seen, 0, (size_t)(s->n + 7) / 8);
    size_t k = 0;
    for (uint64_t p = 0; p < s->n; p++)
        if (!seen(s, p)) out[k++] = p;
    s->twice = 0;
    s->n_pool = 0;
    return k;
}

uint64_t psd_samples_unseen(const psd_samples_t *s)
{
    uint64_t k = 0;
    for (uint64_t p = 0; p < s->n; p++) k += !seen(s, p);
    return k;
}

void psd_samples_mark(psd_samples_t *s, uint64_t p)
{
    const uint8_t bit = (uint8_t)(1u << (p % 8));
    s->twice += (s->seen[p / 8] & bit) != 0;
    s->seen[p / 8] |= bit;
}

void psd_samples_pool_add(psd_samples_t *s, const uint64_t *pos, size_t n)
{
    memcpy(s->pool + s->n_pool, pos, n * sizeof *pos);
    s->n_pool += n;
}

void psd_share_reset(psd_share_t *sh) { sh->n_ranges = 0, sh->assigned = sh->consumed = 0; }

void psd_share_free(psd_share_t *sh)
{
    free(sh->ranges);
    memset(sh, 0, sizeof *sh);
}

static int range_add(psd_share_t *sh, uint64_t b, uint64_t e)
{
    if (sh->n_ranges > 0 && sh->ranges[sh->n_ranges - 1].end == b) {
        sh->ranges[sh->n_ranges - 1].end = e;
    } else {
        if (sh->n_ranges == sh->cap_ranges) {
            int cap = sh->cap_ranges ? 2 * sh->cap_ranges : 8;
            psd_range_t *r = realloc(sh->ranges, (size_t)cap * sizeof *r);
            if (!r) return -ENOMEM;
            sh->ranges = r;
            sh->cap_ranges = cap;
        }
        sh->ranges[sh->n_ranges++] = (psd_range_t){b, e};
    }
    sh->assigned += e - b;
    return 0;
}

int psd_share_add(psd_share_t *sh, const uint64_t *pos, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (range_add(sh, pos[i], pos[i] + 1) != 0) return -ENOMEM;
    return 0;
}

void psd_share_walk(const psd_share_t *sh, uint64_t from, uint64_t count, void (*fn)(void *, uint64_t), void *ud)
{
    uint64_t skip = from;
    for (int i = 0; i < sh->n_ranges && count > 0; i++) {
        uint64_t len = sh->ranges[i].end - sh->ranges[i].begin;
        if (skip >= len) {
            skip -= len;
            continue;
        }
        for (uint64_t p = sh->ranges[i].begin + skip; p < sh->ranges[i].end && count > 0; p++, count--) fn(ud, p);
        skip = 0;
    }
}

typedef struct {
    uint64_t *out;
    size_t n;
} collect_t;

static void collect(void *ud, uint64_t p)
{
    collect_t *c = ud;
    c->out[c->n++] = p;
}

uint64_t *psd_share_positions(const psd_share_t *sh, uint64_t from, size_t n)
{
    uint64_t *pos = malloc((n ? n : 1) * sizeof *pos);
    if (!pos) return NULL;
    collect_t c = {pos, 0};
    psd_share_walk(sh, from, n, collect, &c);
    return pos;
}

static void mark(void *ud, uint64_t p) { psd_samples_mark(ud, p); }

void psd_share_consume(psd_share_t *sh, psd_samples_t *s, uint64_t batch)
{
    psd_share_walk(sh, sh->consumed, batch, mark, s);
    sh->consumed += batch;
}

void psd_share_trim(psd_share_t *sh, uint64_t keep)
{
    uint64_t have = 0;
    for (int i = 0; i < sh->n_ranges; i++) {
        uint64_t len = sh->ranges[i].end - sh->ranges[i].begin;
        if (have + len >= keep) {
            sh->ranges[i].end = sh->ranges[i].begin + (keep - have);
            sh->n_ranges = i + 1;
            break;
        }
        have += len;
    }
    sh->assigned = keep;
}

uint64_t psd_rebalance_plan(uint64_t left, uint64_t B, const double *rate, int k, uint64_t *give)
{
    if (left <= B || k <= 0) return 0; /* nothing to spare after its next batch */
    double sum = rate ? rate[0] : 1.0;
    for (int i = 0; i < k; i++) sum += rate ? rate[1 + i] : 1.0;
    const uint64_t spare = left - B;
    uint64_t moved = 0;
    for (int i = 0; i < k; i++) {
        give[i] = (uint64_t)((double)spare * (rate ? rate[1 + i] : 1.0) / sum / (double)B) * B; /* sum <= spare */
        moved += give[i];
    }
    return moved;
}
