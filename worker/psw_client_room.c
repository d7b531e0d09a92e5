/* psw_client_room.c - announced pushes (psd's server.grad_room, protocol
 * 10): a worker on the wire that psd's ASSIGN told to announce, whose last
 * WEIGHTS did not say `go`, sends a push's header alone (Push.announce) and
 * keeps its tensors (the caller's buffers, counted as in flight, so that
 * psw_client_push_wait waits for them) until psd's GO; then they go as one
 * PUSH. Whatever else the worker sends meanwhile (its barrier, a pull, a
 * validation result) waits for the GO, so psd gets the push first; messages
 * that come before the GO are kept for psw_client_next (c->room.defer).
 * Ownership: c->room is the client's, used by the caller's thread only. */
#include "psw_client_int.h"

/* Whether this push must be announced: psd asked, this step was not let go, one psd on the wire. */
static bool must_announce(const psw_client_t *c)
{
    return c->room.announce && !c->room.go && !c->shm && !c->stream_cf && c->ops == &pswc_one_ops;
}

int pswc_room_push(psw_client_t *c, Psd__Header *h, int n, const int *ids, const float *const *grads,
                   const size_t *numel)
{
    pswc_room_t *r = &c->room;
    if (!r->pending && !must_announce(c)) return 0;
    if (r->n + n > PS_MAX_TENSORS) return -EINVAL;
    if (!r->pending) { /* the header goes now: psd knows the step's samples once every worker's is in */
        r->push = *h->push;
        r->push.announce = true;
        Psd__Push *body = h->push;
        h->push = &r->push;
        int rc = ps_msg_send(c->sock, NULL, 0, h, NULL, 0);
        h->push = body;
        r->push.announce = false;
        if (rc < 0) return rc;
        r->pending = true;
        r->n = 0;
    }
    r->push.pull = r->push.pull || h->push->pull;
    for (int i = 0; i < n; i++) {
        r->ids[r->n] = ids[i];
        r->grads[r->n] = grads[i];
        r->numel[r->n++] = numel[i];
    }
    atomic_fetch_add_explicit(&c->push_inflight, n, memory_order_relaxed); /* the caller's buffers, until sent */
    return 1;
}

/* psd's GO: the tensors kept go now, as one push (the announced header's batch). */
int pswc_room_go(psw_client_t *c)
{
    pswc_room_t *r = &c->room;
    if (!r->pending) {
        PS_WARN("dropped a GO from psd: no push announced");
        return 0;
    }
    r->pending = false;
    r->go = true; /* parts still to come go straight */
    atomic_fetch_sub_explicit(&c->push_inflight, r->n, memory_order_relaxed); /* counted again as they are sent */
    Psd__Header h;
    pswc_header_init(c, &h, PSD__MSG_TYPE__MSG_PUSH);
    Psd__Push p = r->push;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    return c->ops->push(c, &h, r->n, r->ids, r->grads, r->numel, NULL, NULL, 0);
}

void pswc_room_drop(psw_client_t *c)
{
    pswc_room_t *r = &c->room;
    if (!r->pending) return;
    r->pending = false;
    atomic_fetch_sub_explicit(&c->push_inflight, r->n, memory_order_relaxed);
    pthread_mutex_lock(&c->push_mu);
    pthread_cond_broadcast(&c->push_cv);
    pthread_mutex_unlock(&c->push_mu);
}

int pswc_room_settle(psw_client_t *c, double timeout_s, char *err, size_t errlen)
{
    pswc_room_t *r = &c->room;
    const double deadline = ps_now() + timeout_s;
    while (r->pending) {
        double left = deadline - ps_now();
        if (left <= 0) {
            snprintf(err, errlen, "psd did not ask for the push announced within %.0f s", timeout_s);
            return -ETIMEDOUT;
        }
        zmq_pollitem_t it = {c->sock, 0, ZMQ_POLLIN, 0};
        int k = zmq_poll(&it, 1, (long)(left * 1000) + 1);
        if (k < 0) {
            snprintf(err, errlen, "zeromq: %s", zmq_strerror(zmq_errno()));
            return -zmq_errno();
        }
        if (k == 0) continue;
        ps_msg_t m = {0};
        char why[256];
        if (ps_msg_recv(c->sock, &m, false, 0, why, sizeof why) != 0) {
            PS_WARN("dropped a message from psd: %s", why);
            ps_msg_deinit(&m);
            continue;
        }
        const int type = (int)m.hdr->type;
        if (type == PSD__MSG_TYPE__MSG_GO) {
            ps_msg_deinit(&m);
            int rc = pswc_room_go(c);
            if (rc < 0) return rc;
            break;
        }
        if (type == PSD__MSG_TYPE__MSG_HEARTBEAT) {
            ps_msg_deinit(&m);
            continue;
        }
        if (r->n_defer == PSWC_ROOM_DEFER) {
            ps_msg_deinit(&m);
            snprintf(err, errlen, "psd sent more than %d messages before asking for the push announced",
                     PSWC_ROOM_DEFER);
            return -EPROTO;
        }
        pswc_msg_move(&r->defer[r->n_defer++], &m); /* for psw_client_next */
        if (type == PSD__MSG_TYPE__MSG_SHUTDOWN || type == PSD__MSG_TYPE__MSG_ERROR) {
            pswc_room_drop(c); /* the run is over for it: the push will not be asked for */
            break;
        }
    }
    return 0;
}

bool pswc_room_next(psw_client_t *c)
{
    pswc_room_t *r = &c->room;
    if (r->n_defer == 0) return false;
    ps_msg_deinit(&c->cur);
    pswc_msg_move(&c->cur, &r->defer[0]);
    for (int i = 1; i < r->n_defer; i++) pswc_msg_move(&r->defer[i - 1], &r->defer[i]);
    r->n_defer--;
    c->from = 0;
    return true;
}

void pswc_room_free(psw_client_t *c)
{
    pswc_room_drop(c);
    for (int i = 0; i < c->room.n_defer; i++) ps_msg_deinit(&c->room.defer[i]);
    c->room.n_defer = 0;
}
