/* it_http.c - integration tests (see itest.h). */
#include <criterion/criterion.h>

#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"
#include "ps_util.h"

/* GET path on 127.0.0.1:port: the status code, or -1 (no connection, or
 * closed or silent for 10 s without an answer). */
static int get_code(int port, const char *pathq)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char req[256], out[4096];
    int len = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n", pathq);
    size_t got = 0;
    ssize_t r;
    if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0 && write(fd, req, (size_t)len) == len)
        while (got + 1 < sizeof out && (r = read(fd, out + got, sizeof out - 1 - got)) > 0) got += (size_t)r;
    out[got] = '\0';
    close(fd);
    int code = -1;
    return sscanf(out, "HTTP/1.1 %d", &code) == 1 ? code : -1;
}

#define IDLE_CONNS 500

/* psd --http with 500 idle connections open (they connect and send
 * nothing, as a port scanner or a stuck client does): /healthz is still
 * answered within a second, because at its limit psd closes the oldest
 * connection that has no request yet instead of refusing the newcomer, and
 * it says so once in its log. psd runs with a file-descriptor soft limit of
 * 1024, as in a container. */
Test(short, http_healthz_answers_with_500_idle_connections)
{
    struct rlimit lim;
    cr_assert_eq(getrlimit(RLIMIT_NOFILE, &lim), 0);
    cr_assert_geq(lim.rlim_max, IDLE_CONNS + 64, "this test needs %d file descriptors", IDLE_CONNS + 64);
    lim.rlim_cur = lim.rlim_max < 1024 ? lim.rlim_max : 1024; /* psd inherits it */
    cr_assert_eq(setrlimit(RLIMIT_NOFILE, &lim), 0);

    int port = free_port();
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    const char *args[] = {"--http", addr, "--set", "checkpoint.dir=", NULL};
    run_t r;
    pid_t p = start_psd(&r, "idle", 2, args); /* no worker comes: it waits, serving HTTP */
    double t0 = ps_now();
    while (get_code(port, "/healthz") != 200 && ps_now() - t0 < 60) usleep(50000);
    cr_assert_eq(get_code(port, "/healthz"), 200, "psd serves HTTP");

    static int fds[IDLE_CONNS];
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    double opened = ps_now();
    for (int i = 0; i < IDLE_CONNS; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        cr_assert_geq(fds[i], 0, "socket %d: %s", i, strerror(errno));
        int rc = connect(fds[i], (struct sockaddr *)&a, sizeof a);
        cr_assert(rc == 0 || errno == EINPROGRESS, "connect %d: %s", i, strerror(errno));
    }
    /* every handshake done (in psd's accept queue at least): did not hang */
    static struct pollfd pf[IDLE_CONNS];
    for (int done = 0; done < IDLE_CONNS && ps_now() - opened < 60;) {
        done = 0;
        for (int i = 0; i < IDLE_CONNS; i++) pf[i] = (struct pollfd){.fd = fds[i], .events = POLLOUT};
        cr_assert_geq(poll(pf, IDLE_CONNS, 100), 0);
        for (int i = 0; i < IDLE_CONNS; i++) done += (pf[i].revents & POLLOUT) != 0;
    }
    for (int i = 0; i < IDLE_CONNS; i++) {
        int e = 0;
        socklen_t el = sizeof e;
        getsockopt(fds[i], SOL_SOCKET, SO_ERROR, &e, &el);
        cr_assert_eq(e, 0, "idle connection %d: %s", i, strerror(e));
    }

    double bound = sanitized() ? 3.0 : 1.0, t1 = ps_now();
    int code = get_code(port, "/healthz");
    double took = ps_now() - t1, since_open = ps_now() - opened;
    cr_log_info("/healthz with %d idle connections: %d in %.1f ms", IDLE_CONNS, code, took * 1e3);
    cr_assert_eq(code, 200, "/healthz with %d idle connections open", IDLE_CONNS);
    cr_assert_lt(took, bound, "/healthz answered in %.3f s, not within %.0f s", took, bound);

    /* psd still holds hundreds of them (those it closed read as EOF), unless
     * the idle deadline (5 s) came first on a slow machine */
    int held = 0;
    for (int i = 0; i < IDLE_CONNS; i++) pf[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
    cr_assert_geq(poll(pf, IDLE_CONNS, 0), 0);
    for (int i = 0; i < IDLE_CONNS; i++) held += pf[i].revents == 0;
    cr_log_info("psd holds %d of the %d idle connections", held, IDLE_CONNS);
    if (since_open < 4.0)
        cr_assert_geq(held, 200, "psd holds hundreds of idle connections open, not %d", held);
    else
        cr_log_warn("%.1f s from the first connection to the answer: not counting the ones psd holds", since_open);

    t1 = ps_now();
    cr_assert_eq(get_code(port, "/healthz"), 200, "a second /healthz");
    cr_assert_lt(ps_now() - t1, bound, "the second /healthz within %.0f s", bound);
    for (int i = 0; i < IDLE_CONNS; i++) close(fds[i]);
    cr_assert_eq(get_code(port, "/metrics"), 200, "serving once they are gone");

    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 60), 0);
    char *log = slurp(r.psd_log);
    cr_assert(log && count_in(log, "connections open, the limit") == 1, "said once that it closes idle ones: %s",
              log ? log : "(no log)");
    free(log);
}
