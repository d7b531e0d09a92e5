/* psd_contrib.h - one contributor's part in a step: a worker's push on
 * psd (shard 0, or the one psd: worker_t.c) and a worker's push forwarded
 * to a psd shard (psd_shard.c's fw_t.c: one of these plus the worker's
 * identity). Its lifecycle is one state, not a set of flags:
 *
 *   IDLE ──part──▶ TAKING ──own──▶ OWN ──have (every other shard)──▶ HELD
 *     ▲                              (no other shard: own goes to HELD)  │
 *     └──────────────── applied / release (the step took it, or it went)─┘
 *
 *   psd_contrib_check    a PUSH's header against the contributor and the
 *                        run's limits (before anything of it is kept)
 *   psd_contrib_part     a part of the push taken: its head (version, batch,
 *                        loss, correct) set by the first, the same in the rest
 *   psd_contrib_own      this psd's part of the push is whole
 *   psd_contrib_have     another psd shard has its part (SHARD_HAVE)
 *   psd_contrib_applied  the step took it: a pull it asked for is owed
 *   psd_contrib_release  its frames let go, back to IDLE
 *
 * The frames themselves are the holder's business (psd_hold.h: psd_push_take
 * fills c->push; psd_hold_gather reads it). Who decides when a step is
 * taken, and with whom, is the caller's (psd_push.c, psd_shard.c).
 * Ownership: a psd_contrib_t is part of its worker's record and belongs to
 * the loop thread of its psd. It knows nothing of srv_t. */
#ifndef PSD_CONTRIB_H
#define PSD_CONTRIB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "psd_hold.h"

typedef enum {
    PSD_CONTRIB_IDLE = 0, /* no push for the step in progress */
    PSD_CONTRIB_TAKING,   /* parts of its push came, more are to come */
    PSD_CONTRIB_OWN,      /* this psd's part is whole; other psd shards have not all said they have theirs */
    PSD_CONTRIB_HELD,     /* its whole push is held (here and on every shard): it counts for a step */
} psd_contrib_state_t;

/* What a push says of the batch it was computed for. */
typedef struct {
    uint64_t version;     /* the weights' version it was computed on */
    uint32_t batch;       /* samples */
    double loss;          /* their summed loss */
    uint64_t correct;     /* their correct predictions */
} psd_contrib_head_t;

typedef struct {
    psd_contrib_state_t state;
    psd_contrib_head_t head; /* valid from TAKING (kept after: the last push's) */
    psd_push_t push;      /* its frames (the holder's), and the table rows its next reply brings */
    double own_at;        /* when its own part became whole (OWN) */
    uint32_t have;        /* other psd shards that have their part (bit i; for the step in progress) */
    bool pull_after;      /* it asked for the version its step makes (Push.pull, or a PULL meanwhile) */
    bool owed;            /* a reply with the version the step in progress makes is owed to it */
    /* server.grad_room (psd_fold.c): a push announced (its head, TAKING, no tensors yet) waits for
     * psd's GO; once in the step's sum its frames are let go (folded, still HELD: it counts) */
    bool waits_go;        /* announced, GO not sent yet */
    bool in_fold;         /* a contributor of the sum being made (every worker training when it began) */
    bool folded;          /* in that sum: its batch accounted, its frames released */
} psd_contrib_t;

/* The run's limits a push is checked against. */
typedef struct {
    uint64_t version;     /* the current version */
    bool exact;           /* bsp: computed on the current version; else on it or an older one */
    uint32_t batch_size;  /* train.batch_size */
    uint64_t left;        /* samples its share has left */
    bool shm;             /* psd shares memory with it */
    bool announce;        /* the PUSH announces the push (no tensors: they come on GO), as psd asked */
} psd_contrib_limits_t;

enum { PSD_CONTRIB_OK = 0, PSD_CONTRIB_BAD = -1, PSD_CONTRIB_DIVERGED = 1 };

/* A PUSH's header (h: its head; n_frames, n_shm: its tensors by frame and in
 * shared memory) against c and the limits. PSD_CONTRIB_OK; PSD_CONTRIB_BAD
 * (why: the reason, for the caller's drop); PSD_CONTRIB_DIVERGED: its loss
 * is not finite (not a bad message: the model diverged). */
int psd_contrib_check(const psd_contrib_t *c, const psd_contrib_head_t *h, size_t n_frames, size_t n_shm,
                      const psd_contrib_limits_t *lim, char *why, size_t why_len);
/* A part of the push taken: the first sets the head (IDLE -> TAKING). */
void psd_contrib_part(psd_contrib_t *c, const psd_contrib_head_t *h);
/* This psd's part is whole at `now` (TAKING -> OWN, or HELD when every
 * shard of `shards` (bits of the other psd shards; 0: none) has its part).
 * Returns whether it is held. */
bool psd_contrib_own(psd_contrib_t *c, double now, uint32_t shards);
/* Psd shard i has its part. Returns whether it is held now. */
bool psd_contrib_have(psd_contrib_t *c, int i, uint32_t shards);
static inline bool psd_contrib_held(const psd_contrib_t *c) { return c->state == PSD_CONTRIB_HELD; }
static inline bool psd_contrib_started(const psd_contrib_t *c) { return c->state != PSD_CONTRIB_IDLE; }
/* Its own part is whole (OWN or HELD): its batch is done as far as it knows. */
static inline bool psd_contrib_own_done(const psd_contrib_t *c) { return c->state >= PSD_CONTRIB_OWN; }
/* The step took its push: a reply is owed if it asked for one and none
 * went out already (replied: a streamed step sent it each tensor). Its
 * frames go (psd_contrib_release). */
void psd_contrib_applied(psd_contrib_t *c, psd_hold_t *h, bool replied);
/* Its push goes (applied, stale, its worker lost): frames closed, row
 * buffers back to the holder, IDLE; the head (the last push's) and a
 * reply owed stay. */
void psd_contrib_release(psd_contrib_t *c, psd_hold_t *h);

#endif
