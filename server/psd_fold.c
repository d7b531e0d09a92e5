/* psd_fold.c - server.grad_room: what psd holds of the gradients that come
 * over the wire does not grow with the workers. In bsp, with one psd and
 * dense tensors, a worker on the wire (not shared memory) whose weights
 * reply did not say `go` announces its push (the header alone) and sends
 * its tensors when psd sends GO. Once every worker training has begun its
 * push (so the step's samples, the weights' denominator, are known), psd
 * sums the pushes into the step's sum in rank order, each as soon as the
 * ones before it are in, letting its frames go; it asks for the next
 * announced push only then. The step is then taken on the sum as its one
 * contributor of weight 1: the same arithmetic, so the same bits, as summing
 * every push at the step (psd_store_fold).
 *
 * The room: grad_room gradients at once. With no more workers on the wire
 * than that, every reply says go and nothing is summed early (the step as
 * before); with more, the grad_room - 1 lowest ranks on the wire may send at
 * once and the sum takes the last place. A worker that joins meanwhile may
 * hold one more for a step. */
#include "psd_core.h"

bool psd_fold_wanted(const srv_t *s)
{
    if (s->fold.on) return true;
    for (int i = 0; i < s->n; i++)
        if (s->w[i].state == W_TRAIN && s->w[i].contrib.waits_go) return true;
    return false;
}

/* Every worker training has begun its push: the sum's contributors are the
 * workers with a push begun (a worker past its share's end may hold its last). */
static bool begin(srv_t *s)
{
    uint64_t total = 0;
    for (int i = 0; i < s->n; i++) {
        const worker_t *w = &s->w[i];
        if (w->state == W_TRAIN && !psd_contrib_started(&w->contrib)) return false; /* its samples not known yet */
        if (psd_contrib_started(&w->contrib)) total += w->contrib.head.batch;
    }
    for (int i = 0; i < s->n; i++) s->w[i].contrib.in_fold = psd_contrib_started(&s->w[i].contrib);
    s->fold.on = true;
    s->fold.total = total;
    s->fold.summed = 0;
    s->fold.next = 0;
    s->fold.count = 0;
    return true;
}

static void send_go(srv_t *s, worker_t *w)
{
    Psd__Header h;
    Psd__Heartbeat hb;
    psd_peers_heartbeat_hdr(s, w, &h, &hb);
    h.type = PSD__MSG_TYPE__MSG_GO;
    psd_peers_send_to(s, w, &h, NULL, 0);
    w->contrib.waits_go = false;
}

/* w's push into the sum with its weight, its frames let go (its batch is
 * accounted with the step, or when it is lost before: psd_run.c). */
static int fold_one(srv_t *s, worker_t *w)
{
    psd_push_t *p = &w->contrib.push;
    const float *shm = w->shm ? w->shm_grad : NULL;
    if (psd_hold_gather(&s->holder, &p, &shm, 1) != 0) return -1;
    const void *const(*g)[PS_MAX_TENSORS] = (const void *const(*)[PS_MAX_TENSORS])s->holder.g;
    psd_store_fold(&s->store, g, s->holder.bf16, (double)w->contrib.head.batch / (double)s->fold.total,
                   s->fold.count > 0);
    s->fold.summed += w->contrib.head.batch;
    s->fold.count++;
    w->contrib.folded = true;
    psd_push_release(&s->holder, p); /* (it stays HELD: it counts for the step) */
    return 0;
}

bool psd_fold_progress(srv_t *s)
{
    if (!s->fold.on && !begin(s)) return false;
    for (; s->fold.next < s->n; s->fold.next++) {
        worker_t *w = &s->w[s->fold.next];
        psd_contrib_t *c = &w->contrib;
        if (!c->in_fold || c->folded) continue; /* not a contributor (or lost since: its push went) */
        if (psd_contrib_held(c)) {
            if (fold_one(s, w) != 0) {
                PS_ERROR("out of memory for a step's contributors");
                psd_peers_finish(s, PSD_EXIT_ERROR, "psd out of memory");
                return false;
            }
            continue;
        }
        if (c->waits_go) send_go(s, w);
        return false; /* its push is on its way */
    }
    if (s->fold.count == 0) { /* every contributor lost: nothing to step */
        s->fold.on = false;
        return false;
    }
    psd_step_take(s, NULL);
    return true;
}
