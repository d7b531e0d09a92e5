/* psw_fork.c - forked children of a worker do not hold its connections.
 *
 * A child forked without exec (a torch DataLoader's reader processes)
 * inherits libzmq's fds of the connections to psd and its shards: when the
 * worker dies, the kernel keeps those connections open while a child lives,
 * and psd notices the loss only by silence (--worker-timeout) instead of at
 * once. So every live client is in a list here, with the fds of its
 * connections as its sockets' monitors told them (CONNECTED, until
 * DISCONNECTED or CLOSED), and a fork child handler closes them in the child.
 * That only drops the child's references: the parent's connections stay.
 *
 * The list and the fds noted are the lock's; the lock is taken across
 * fork() (prepare, released in the parent and in the child), so the child
 * sees them whole. The child handler runs where only async-signal-safe calls
 * are allowed: it walks the list and calls fstat() and close(), nothing else.
 * An fd is closed only if it is still the socket noted (its device and inode):
 * one libzmq closed and the number given to something else is left alone. */
#include "psw_client_int.h"

#include <pthread.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static psw_client_t *live;    /* the clients not destroyed, linked by fork_next/fork_prev */
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void before_fork(void) { pthread_mutex_lock(&lock); }

static void in_parent(void) { pthread_mutex_unlock(&lock); }

static void in_child(void)
{
    for (psw_client_t *c = live; c; c = c->fork_next)
        for (int k = 0; k < PS_MAX_SHARDS; k++) {
            pswc_conn_t *x = &c->conn[k];
            struct stat st;
            if (x->fd >= 0 && fstat(x->fd, &st) == 0 && st.st_dev == x->dev && st.st_ino == x->ino) close(x->fd);
            x->fd = -1;
        }
    pthread_mutex_unlock(&lock);
}

static void install(void)
{
    int rc = pthread_atfork(before_fork, in_parent, in_child);
    if (rc != 0)
        PS_WARN("cannot register the fork handler (%s): a forked child keeps this worker's connections to psd open",
                strerror(rc));
}

void pswc_fork_add(psw_client_t *c)
{
    int rc = pthread_once(&once, install);
    if (rc != 0) PS_WARN("cannot register the fork handler: %s", strerror(rc));
    pthread_mutex_lock(&lock);
    for (int k = 0; k < PS_MAX_SHARDS; k++) c->conn[k].fd = -1;
    c->fork_prev = NULL;
    c->fork_next = live;
    if (live) live->fork_prev = c;
    live = c;
    pthread_mutex_unlock(&lock);
}

void pswc_fork_remove(psw_client_t *c)
{
    pthread_mutex_lock(&lock);
    if (c->fork_prev) c->fork_prev->fork_next = c->fork_next;
    else if (live == c) live = c->fork_next;
    if (c->fork_next) c->fork_next->fork_prev = c->fork_prev;
    c->fork_prev = c->fork_next = NULL;
    pthread_mutex_unlock(&lock);
}

void pswc_fork_event(psw_client_t *c, int k, uint16_t event, uint32_t value)
{
    const int fd = (int)value;
    pswc_conn_t *x = &c->conn[k];
    if (event == ZMQ_EVENT_CONNECTED) {
        /* the socket now: if libzmq closed it already, its DISCONNECTED
         * (sent before the close) comes next and forgets it */
        struct stat st;
        pthread_mutex_lock(&lock);
        x->fd = -1;
        if (fd >= 0 && fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) {
            x->fd = fd;
            x->dev = st.st_dev;
            x->ino = st.st_ino;
        }
        pthread_mutex_unlock(&lock);
    } else if ((event == ZMQ_EVENT_DISCONNECTED || event == ZMQ_EVENT_CLOSED) && x->fd == fd) {
        pthread_mutex_lock(&lock);
        x->fd = -1;
        pthread_mutex_unlock(&lock);
    }
}

void pswc_fork_forget(psw_client_t *c, int k)
{
    pthread_mutex_lock(&lock);
    c->conn[k].fd = -1;
    pthread_mutex_unlock(&lock);
}

void pswc_fork_drain(psw_client_t *c, int k)
{
    uint16_t event;
    uint32_t value;
    while (c->sh.mon[k] && ps_zmq_monitor_event(c->sh.mon[k], &event, &value) == 0) pswc_fork_event(c, k, event, value);
}
