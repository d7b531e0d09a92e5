#include "psd_shm.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ps_log.h"
#include "ps_util.h"

#define MAX_CONN 8
#define BACKLOG 1024 /* connections the kernel holds while every MAX_CONN is taken */
#define HELLO_TIMEOUT_S 2.0

typedef struct {
    struct psd_shm *sh;
    uv_poll_t poll;
    int fd;          /* -1: not open */
    bool closing;    /* its handle's close callback has not run yet */
    double deadline;
} conn_t;

struct psd_shm {
    uv_poll_t lpoll;
    int lfd;
    int ro_fd;
    uint32_t slots;
    uint64_t slot_bytes;
    psd_shm_hello_fn fn;
    void *ud;
    conn_t c[MAX_CONN];
    int open_handles;  /* handles not closed yet */
    bool closing;
    bool paused;       /* every conn_t taken: new connections wait in the kernel's backlog */
};

static void handle_gone(psd_shm_t *sh)
{
    if (--sh->open_handles == 0 && sh->closing) free(sh);
}

static void listen_closed(uv_handle_t *h) { handle_gone(h->data); }

static void on_listen(uv_poll_t *p, int status, int events);

static void conn_closed(uv_handle_t *h)
{
    conn_t *k = h->data;
    psd_shm_t *sh = k->sh;
    k->closing = false;
    if (sh->paused && !sh->closing) { /* a place again: take what waits in the backlog */
        sh->paused = false;
        uv_poll_start(&sh->lpoll, UV_READABLE, on_listen);
    }
    handle_gone(sh);
}

static void conn_close(conn_t *k)
{
    if (k->fd < 0) return;
    uv_poll_stop(&k->poll);
    uv_close((uv_handle_t *)&k->poll, conn_closed);
    k->closing = true;
    close(k->fd);
    k->fd = -1;
}

static void reply(int fd, int status, const char *msg, int pass_fd, uint32_t slots, uint64_t slot_bytes)
{
    ps_shm_reply_t r;
    memset(&r, 0, sizeof r);
    memcpy(r.magic, PS_SHM_MAGIC, sizeof r.magic);
    r.status = status;
    r.slots = slots;
    r.slot_bytes = slot_bytes;
    snprintf(r.message, sizeof r.message, "%s", msg);
    (void)ps_shm_send(fd, &r, sizeof r, pass_fd); /* a worker that went away learns nothing */
}

/* The hello is there (or the peer hung up): judge it, answer, close. */
static void on_conn(uv_poll_t *p, int status, int events)
{
    (void)events;
    conn_t *k = p->data;
    psd_shm_t *sh = k->sh;
    ps_shm_hello_t h;
    int mfd = -1;
    int rc = status < 0 ? status : ps_shm_recv(k->fd, &h, sizeof h, &mfd, MSG_DONTWAIT);
    if (rc == -EAGAIN) return;
    char why[160] = "";
    if (rc == 0 && (memcmp(h.magic, PS_SHM_MAGIC, sizeof h.magic) != 0 || mfd < 0)) {
        rc = -EBADMSG;
        snprintf(why, sizeof why, "%s", mfd < 0 ? "no memfd came with it" : "not a psd hello");
    } else if (rc == 0) {
        rc = sh->fn(sh->ud, &h, mfd, why, sizeof why);
    } else {
        snprintf(why, sizeof why, "unreadable: %s", strerror(-rc));
    }
    if (mfd >= 0) close(mfd);
    if (rc == 0) {
        reply(k->fd, 0, "", sh->ro_fd, sh->slots, sh->slot_bytes);
    } else {
        PS_WARN("refused a shared-memory request: %s", why);
        reply(k->fd, rc, why, -1, 0, 0);
    }
    conn_close(k);
}

/* MAX_CONN requests at a time; while every place is taken the listening
 * socket is not read and new connections wait in the kernel's backlog (a
 * worker's connect and hello wait up to 5 s) until a request is answered or
 * dropped (64 workers starting at once on 2 cores used to find 8 pending,
 * be refused and fall back to the wire). */
static void on_listen(uv_poll_t *p, int status, int events)
{
    (void)status;
    (void)events;
    psd_shm_t *sh = p->data;
    for (;;) {
        conn_t *k = NULL;
        for (int i = 0; i < MAX_CONN && !k; i++)
            if (sh->c[i].fd < 0 && !sh->c[i].closing) k = &sh->c[i];
        if (!k) {
            uv_poll_stop(&sh->lpoll);
            sh->paused = true;
            return;
        }
        int fd = accept4(sh->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) PS_WARN("shared memory socket: accept: %s", strerror(errno));
            return;
        }
        if (uv_poll_init(p->loop, &k->poll, fd) != 0) {
            PS_WARN("refused a shared-memory request: cannot watch its connection");
            close(fd);
            continue;
        }
        sh->open_handles++;
        k->fd = fd;
        k->sh = sh;
        k->deadline = ps_now() + HELLO_TIMEOUT_S;
        k->poll.data = k;
        uv_poll_start(&k->poll, UV_READABLE | UV_DISCONNECT, on_conn);
    }
}

int psd_shm_listen(psd_shm_t **out, uv_loop_t *loop, const char *name, int ro_fd, uint32_t slots,
                   uint64_t slot_bytes, psd_shm_hello_fn fn, void *ud)
{
    *out = NULL;
    psd_shm_t *sh = calloc(1, sizeof *sh);
    if (!sh) return -ENOMEM;
    for (int i = 0; i < MAX_CONN; i++) sh->c[i].fd = -1;
    sh->ro_fd = ro_fd;
    sh->slots = slots;
    sh->slot_bytes = slot_bytes;
    sh->fn = fn;
    sh->ud = ud;
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    sh->lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (sh->lfd < 0 || bind(sh->lfd, (struct sockaddr *)&a, alen) != 0 || listen(sh->lfd, BACKLOG) != 0 ||
        uv_poll_init(loop, &sh->lpoll, sh->lfd) != 0) {
        int e = -errno;
        if (sh->lfd >= 0) close(sh->lfd);
        free(sh);
        return e ? e : -EIO;
    }
    sh->open_handles = 1;
    sh->lpoll.data = sh;
    uv_poll_start(&sh->lpoll, UV_READABLE, on_listen);
    *out = sh;
    return 0;
}

void psd_shm_expire(psd_shm_t *sh, double now)
{
    if (!sh) return;
    for (int i = 0; i < MAX_CONN; i++)
        if (sh->c[i].fd >= 0 && now > sh->c[i].deadline) {
            PS_WARN("dropped a shared-memory connection that sent nothing for %.0f s", HELLO_TIMEOUT_S);
            conn_close(&sh->c[i]);
        }
}

void psd_shm_close(psd_shm_t *sh)
{
    if (!sh) return;
    sh->closing = true;
    for (int i = 0; i < MAX_CONN; i++) conn_close(&sh->c[i]);
    uv_poll_stop(&sh->lpoll);
    uv_close((uv_handle_t *)&sh->lpoll, listen_closed);
    close(sh->lfd);
}
