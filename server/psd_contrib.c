/* psd_contrib.c - one contributor's part in a step (see psd_contrib.h). */
#include "psd_contrib.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>

int psd_contrib_check(const psd_contrib_t *c, const psd_contrib_head_t *h, size_t n_frames, size_t n_shm,
                      const psd_contrib_limits_t *lim, char *why, size_t why_len)
{
    if (c->state == PSD_CONTRIB_HELD) {
        snprintf(why, why_len, "second PUSH for version %" PRIu64, h->version);
        return PSD_CONTRIB_BAD;
    }
    if (lim->exact ? h->version != lim->version : h->version > lim->version) {
        snprintf(why, why_len, "PUSH computed on version %" PRIu64 ", current is %" PRIu64, h->version, lim->version);
        return PSD_CONTRIB_BAD;
    }
    if (h->batch == 0 || h->batch > lim->batch_size || h->batch > lim->left) {
        snprintf(why, why_len, "PUSH of a batch of %u (train.batch_size %u, %" PRIu64 " samples left)", h->batch,
                 lim->batch_size, lim->left);
        return PSD_CONTRIB_BAD;
    }
    if (!isfinite(h->loss)) return PSD_CONTRIB_DIVERGED;
    if (h->loss < 0 || h->correct > h->batch) {
        snprintf(why, why_len, "PUSH with invalid statistics");
        return PSD_CONTRIB_BAD;
    }
    if (c->state != PSD_CONTRIB_IDLE && (h->batch != c->head.batch || h->correct != c->head.correct ||
                                         h->loss != c->head.loss || h->version != c->head.version)) {
        snprintf(why, why_len, "PUSH part for another batch than the parts before it");
        return PSD_CONTRIB_BAD;
    }
    if (lim->announce) { /* its header alone, before anything else of the push */
        if (c->state != PSD_CONTRIB_IDLE || n_frames > 0 || n_shm > 0) {
            snprintf(why, why_len, "PUSH announced %s", c->state != PSD_CONTRIB_IDLE ? "after its parts" : "with tensors");
            return PSD_CONTRIB_BAD;
        }
        return PSD_CONTRIB_OK;
    }
    if (c->waits_go) {
        snprintf(why, why_len, "PUSH of an announced push before psd's GO");
        return PSD_CONTRIB_BAD;
    }
    if (n_frames < 1 && n_shm < 1) {
        snprintf(why, why_len, "PUSH without tensors");
        return PSD_CONTRIB_BAD;
    }
    if (n_shm > 0 && !lim->shm) {
        snprintf(why, why_len, "PUSH of tensors in shared memory psd does not share with it");
        return PSD_CONTRIB_BAD;
    }
    return PSD_CONTRIB_OK;
}

void psd_contrib_part(psd_contrib_t *c, const psd_contrib_head_t *h)
{
    if (c->state != PSD_CONTRIB_IDLE) return;
    c->state = PSD_CONTRIB_TAKING;
    c->head = *h;
}

/* Held once its own part is whole and every other shard has its part. */
static bool settle(psd_contrib_t *c, uint32_t shards)
{
    if (c->state >= PSD_CONTRIB_OWN)
        c->state = (c->have & shards) == shards ? PSD_CONTRIB_HELD : PSD_CONTRIB_OWN;
    return c->state == PSD_CONTRIB_HELD;
}

bool psd_contrib_own(psd_contrib_t *c, double now, uint32_t shards)
{
    c->state = PSD_CONTRIB_OWN;
    c->own_at = now;
    return settle(c, shards);
}

bool psd_contrib_have(psd_contrib_t *c, int i, uint32_t shards)
{
    c->have |= 1u << i;
    return settle(c, shards);
}

void psd_contrib_applied(psd_contrib_t *c, psd_hold_t *h, bool replied)
{
    c->owed = c->pull_after && !replied;
    psd_contrib_release(c, h);
}

void psd_contrib_release(psd_contrib_t *c, psd_hold_t *h)
{
    psd_push_release(h, &c->push);
    c->state = PSD_CONTRIB_IDLE;
    c->pull_after = false;
    c->have = 0;
    c->waits_go = c->in_fold = c->folded = false;
}
