/* Unit tests of a contributor's part in a step (server/psd_contrib.c),
 * without processes: a PUSH's header is checked against the contributor and
 * the run's limits, each refusal with its reason and a non-finite loss told
 * apart (the model diverged); the lifecycle IDLE -> TAKING -> OWN -> HELD
 * with and without other psd shards' word, in either order; the head set by
 * the first part; a pull asked for is owed once the step took the push
 * (not when a streamed step replied already); release lets the frames go
 * back to a real holder, which then takes the same tensors again. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "psd_contrib.h"

static const psd_contrib_limits_t LIM = {.version = 7, .exact = true, .batch_size = 32, .left = 100, .shm = false};

static int check(const psd_contrib_t *c, psd_contrib_head_t h, size_t frames, size_t shm,
                 const psd_contrib_limits_t *lim, char *why)
{
    why[0] = 0;
    return psd_contrib_check(c, &h, frames, shm, lim, why, 200);
}

Test(contrib, a_push_header_is_checked_against_the_contributor_and_the_run)
{
    psd_contrib_t c = {0};
    char why[200];
    const psd_contrib_head_t ok = {.version = 7, .batch = 32, .loss = 12.5, .correct = 30};
    cr_assert_eq(check(&c, ok, 1, 0, &LIM, why), PSD_CONTRIB_OK, "%s", why);
    struct {
        psd_contrib_head_t h;
        size_t frames, shm;
        const char *says;
    } bad[] = {
        {{6, 32, 1, 0}, 1, 0, "computed on version 6, current is 7"},       /* bsp: the current version only */
        {{8, 32, 1, 0}, 1, 0, "computed on version 8, current is 7"},
        {{7, 0, 1, 0}, 1, 0, "batch of 0"},
        {{7, 33, 1, 0}, 1, 0, "batch of 33 (train.batch_size 32"},
        {{7, 32, -1, 0}, 1, 0, "invalid statistics"},
        {{7, 32, 1, 33}, 1, 0, "invalid statistics"},
        {{7, 32, 1, 0}, 0, 0, "without tensors"},
        {{7, 32, 1, 0}, 0, 2, "shared memory psd does not share"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(check(&c, bad[i].h, bad[i].frames, bad[i].shm, &LIM, why), PSD_CONTRIB_BAD, "case %zu", i);
        cr_assert(strstr(why, bad[i].says), "case %zu: \"%s\" does not say \"%s\"", i, why, bad[i].says);
    }
    psd_contrib_limits_t lim = LIM;
    lim.left = 10; /* its share's samples left bound the batch too */
    cr_assert_eq(check(&c, ok, 1, 0, &lim, why), PSD_CONTRIB_BAD);
    cr_assert(strstr(why, "10 samples left"), "%s", why);
    lim = LIM;
    lim.exact = false; /* async and ssp: an older version is fine, a newer one is not */
    cr_assert_eq(check(&c, (psd_contrib_head_t){3, 32, 1, 0}, 1, 0, &lim, why), PSD_CONTRIB_OK, "%s", why);
    cr_assert_eq(check(&c, (psd_contrib_head_t){8, 32, 1, 0}, 1, 0, &lim, why), PSD_CONTRIB_BAD);
    lim.shm = true;
    cr_assert_eq(check(&c, (psd_contrib_head_t){7, 32, 1, 0}, 0, 2, &lim, why), PSD_CONTRIB_OK, "%s", why);
    /* a loss that is not finite is no bad message: the model diverged */
    cr_assert_eq(check(&c, (psd_contrib_head_t){7, 32, NAN, 0}, 1, 0, &LIM, why), PSD_CONTRIB_DIVERGED);
    cr_assert_eq(check(&c, (psd_contrib_head_t){7, 32, INFINITY, 0}, 1, 0, &LIM, why), PSD_CONTRIB_DIVERGED);
}

Test(contrib, the_first_part_sets_the_head_and_the_rest_must_carry_it)
{
    psd_contrib_t c = {0};
    char why[200];
    const psd_contrib_head_t h = {7, 20, 3.25, 11};
    psd_contrib_part(&c, &h);
    cr_assert_eq(c.state, PSD_CONTRIB_TAKING);
    cr_assert(psd_contrib_started(&c) && !psd_contrib_own_done(&c) && !psd_contrib_held(&c));
    cr_assert_eq(check(&c, h, 1, 0, &LIM, why), PSD_CONTRIB_OK, "%s", why);
    const psd_contrib_head_t other[] = {{7, 21, 3.25, 11}, {7, 20, 3.5, 11}, {7, 20, 3.25, 12}};
    for (size_t i = 0; i < 3; i++) {
        cr_assert_eq(check(&c, other[i], 1, 0, &LIM, why), PSD_CONTRIB_BAD, "case %zu", i);
        cr_assert(strstr(why, "another batch than the parts before it"), "%s", why);
    }
    psd_contrib_part(&c, &other[0]); /* a later part leaves the head as the first set it */
    cr_assert_eq(c.head.batch, 20);
    cr_assert_eq(c.head.loss, 3.25);
}

Test(contrib, one_psd_holds_a_push_once_its_own_part_is_whole)
{
    psd_contrib_t c = {0};
    char why[200];
    psd_contrib_part(&c, &(psd_contrib_head_t){7, 20, 3.0, 1});
    cr_assert(psd_contrib_own(&c, 42.0, 0), "no other shard: held at once");
    cr_assert_eq(c.state, PSD_CONTRIB_HELD);
    cr_assert_eq(c.own_at, 42.0);
    cr_assert(psd_contrib_own_done(&c));
    cr_assert_eq(check(&c, (psd_contrib_head_t){7, 20, 3.0, 1}, 1, 0, &LIM, why), PSD_CONTRIB_BAD);
    cr_assert(strstr(why, "second PUSH for version 7"), "%s", why);
}

Test(contrib, with_psd_shards_it_is_held_once_every_other_shard_has_its_part_in_any_order)
{
    const uint32_t shards = (1u << 1) | (1u << 2); /* shards 1 and 2 besides this one */
    /* their word first, then its own part */
    psd_contrib_t a = {0};
    cr_assert_not(psd_contrib_have(&a, 1, shards), "no part of its own yet");
    cr_assert_eq(a.state, PSD_CONTRIB_IDLE, "a shard's word alone starts nothing");
    cr_assert_not(psd_contrib_have(&a, 2, shards));
    psd_contrib_part(&a, &(psd_contrib_head_t){7, 20, 3.0, 1});
    cr_assert(psd_contrib_own(&a, 1.0, shards));
    cr_assert_eq(a.state, PSD_CONTRIB_HELD);
    /* its own part first, then their word one by one */
    psd_contrib_t b = {0};
    psd_contrib_part(&b, &(psd_contrib_head_t){7, 20, 3.0, 1});
    cr_assert_not(psd_contrib_own(&b, 1.0, shards));
    cr_assert_eq(b.state, PSD_CONTRIB_OWN);
    cr_assert(psd_contrib_own_done(&b) && !psd_contrib_held(&b));
    cr_assert_not(psd_contrib_have(&b, 2, shards));
    b.have = 0; /* a step of others: the word named the last version, it counts no more */
    cr_assert_eq(b.state, PSD_CONTRIB_OWN, "its own part stays whole");
    cr_assert_not(psd_contrib_have(&b, 1, shards));
    cr_assert(psd_contrib_have(&b, 2, shards));
    cr_assert_eq(b.state, PSD_CONTRIB_HELD);
}

/* A holder over one 4-float tensor for 2 contributors. */
typedef struct {
    ps_layout_t l;
    ps_config_t c;
    psd_store_t s;
    psd_hold_t h;
} rig_t;

static void rig_init(rig_t *r)
{
    memset(r, 0, sizeof *r);
    cr_assert_eq(ps_layout_init(&r->l, (const int[]){2, 2}, 2), 0); /* 2 x 2 and 2 */
    ps_config_defaults(&r->c);
    psd_optim_t o = {.kind = PS_OPT_SGD};
    cr_assert_eq(psd_store_init(&r->s, &r->l, &o, 7), 0);
    cr_assert_eq(psd_hold_init(&r->h, &r->s, &r->l, &r->c, false, 2), 0);
}

static void rig_deinit(rig_t *r)
{
    psd_hold_deinit(&r->h);
    psd_store_deinit(&r->s);
    ps_config_free(&r->c);
    ps_layout_free(&r->l);
}

/* Every tensor of the layout in one PUSH (f32), taken into c's push. */
static int push_all(rig_t *r, psd_contrib_t *c)
{
    ps_msg_t m;
    Psd__Header hdr = PSD__HEADER__INIT;
    Psd__Push push = PSD__PUSH__INIT;
    Psd__TensorDesc d[PS_MAX_TENSORS], *dp[PS_MAX_TENSORS];
    memset(&m, 0, sizeof m);
    hdr.body_case = PSD__HEADER__BODY_PUSH;
    hdr.push = &push;
    hdr.tensors = dp;
    m.hdr = &hdr;
    m.srcfd = -1;
    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (int t = 0; t < r->l.n_tensors; t++) {
        d[t] = (Psd__TensorDesc)PSD__TENSOR_DESC__INIT;
        d[t].id = (uint32_t)t;
        d[t].dtype = PSD__DTYPE__DT_F32;
        d[t].nbytes = r->l.t[t].numel * 4;
        dp[t] = &d[t];
        cr_assert_eq(zmq_msg_init_size(&m.frames[t], d[t].nbytes), 0);
        memcpy(zmq_msg_data(&m.frames[t]), v, d[t].nbytes);
    }
    m.n_frames = r->l.n_tensors;
    hdr.n_tensors = (size_t)r->l.n_tensors;
    psd_took_t took;
    char why[200];
    int rc = psd_push_take(&r->h, &c->push, &m, false, 0, &took, why, sizeof why);
    for (int t = 0; t < m.n_frames; t++) zmq_msg_close(&m.frames[t]);
    return rc;
}

Test(contrib, applied_owes_the_pull_it_asked_for_and_release_lets_its_frames_go)
{
    rig_t r;
    rig_init(&r);
    psd_contrib_t c = {0};
    const psd_contrib_head_t h = {0, 4, 2.0, 3};
    cr_assert_eq(push_all(&r, &c), 0);
    cr_assert_eq(c.push.mask, r.h.all);
    cr_assert_neq(c.push.frames, 0, "the frames are kept until the step");
    psd_contrib_part(&c, &h);
    c.pull_after = true; /* Push.pull */
    cr_assert(psd_contrib_own(&c, 1.0, 0));
    psd_contrib_applied(&c, &r.h, false);
    cr_assert_eq(c.state, PSD_CONTRIB_IDLE);
    cr_assert(c.owed, "it asked for the version its step makes");
    cr_assert_not(c.pull_after);
    cr_assert_eq(c.push.mask, 0);
    cr_assert_eq(c.push.frames, 0);
    cr_assert_eq(c.head.batch, 4, "the last push's head stays");
    /* the same tensors again: nothing of the last push is left to refuse them */
    cr_assert_eq(push_all(&r, &c), 0);
    psd_contrib_part(&c, &h);
    c.pull_after = true;
    cr_assert(psd_contrib_own(&c, 2.0, 0));
    psd_contrib_applied(&c, &r.h, true); /* a streamed step sent it each tensor already */
    cr_assert_not(c.owed);
    /* a push that goes without a step (its worker lost): released, nothing owed by it */
    cr_assert_eq(push_all(&r, &c), 0);
    psd_contrib_part(&c, &h);
    c.have = 1u << 1;
    psd_contrib_release(&c, &r.h);
    cr_assert_eq(c.state, PSD_CONTRIB_IDLE);
    cr_assert_eq(c.have, 0);
    cr_assert_eq(c.push.frames, 0);
    psd_push_free(&c.push);
    rig_deinit(&r);
}

/* server.grad_room: an announced push is its header alone, first (its
 * batch checked as any push's); its tensors come after psd's GO, in parts
 * that must match the header; a part before the GO, an announcement with
 * tensors or after parts, is refused. Release forgets the announcement. */
Test(contrib, an_announced_push_is_its_header_then_its_tensors_on_go)
{
    psd_contrib_t c = {0};
    char why[200];
    const psd_contrib_head_t h = {.version = 7, .batch = 32, .loss = 12.5, .correct = 30};
    psd_contrib_limits_t ann = LIM;
    ann.announce = true;
    cr_assert_eq(check(&c, h, 1, 0, &ann, why), PSD_CONTRIB_BAD, "an announcement with tensors");
    cr_assert(strstr(why, "announced with tensors"), "%s", why);
    cr_assert_eq(check(&c, (psd_contrib_head_t){7, 33, 1, 0}, 0, 0, &ann, why), PSD_CONTRIB_BAD, "its batch checked");
    cr_assert_eq(check(&c, h, 0, 0, &ann, why), PSD_CONTRIB_OK, "%s", why);
    psd_contrib_part(&c, &h);
    c.waits_go = true;
    cr_assert_eq(c.state, PSD_CONTRIB_TAKING);
    cr_assert_eq(check(&c, h, 1, 0, &LIM, why), PSD_CONTRIB_BAD, "tensors before the GO");
    cr_assert(strstr(why, "before psd's GO"), "%s", why);
    cr_assert_eq(check(&c, h, 0, 0, &ann, why), PSD_CONTRIB_BAD, "announced twice");
    c.waits_go = false; /* GO sent */
    cr_assert_eq(check(&c, (psd_contrib_head_t){7, 16, 12.5, 30}, 1, 0, &LIM, why), PSD_CONTRIB_BAD, "another batch");
    cr_assert_eq(check(&c, h, 1, 0, &LIM, why), PSD_CONTRIB_OK, "%s", why);
    cr_assert(psd_contrib_own(&c, 1.0, 0));
    c.in_fold = c.folded = true;
    psd_contrib_release(&c, NULL);
    cr_assert(c.state == PSD_CONTRIB_IDLE && !c.waits_go && !c.in_fold && !c.folded);
}
