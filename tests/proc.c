#include "proc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 128 /* psd and 64 workers (it_many.c), and more */
static pid_t procs[MAX_PROCS];
static char proc_cwd[512];

void proc_set_cwd(const char *dir) { snprintf(proc_cwd, sizeof proc_cwd, "%s", dir ? dir : ""); }

static void remember(pid_t pid)
{
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i] == 0) {
            procs[i] = pid;
            break;
        }
}

pid_t proc_spawn(const char *const *argv, const char *log)
{
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        /* killed with the test process, also when Criterion kills that on a
         * timeout or it crashes (its teardown then never ends what it started) */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(125);
        if (proc_cwd[0] && chdir(proc_cwd) != 0) _exit(126);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        /* nothing of the test process's own (Criterion's arenas in /dev/shm,
         * its pipes): the binaries start as they would by hand */
        if (close_range(3, ~0U, 0) != 0) _exit(124);
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    remember(pid);
    return pid;
}

static void forget(pid_t pid)
{
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i] == pid) procs[i] = 0;
}

int proc_wait(pid_t pid, double timeout_s)
{
    struct timespec ts = {0, 10 * 1000 * 1000};
    for (double waited = 0; waited < timeout_s; waited += 0.01) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) {
            forget(pid);
            return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        }
        if (r < 0) {
            forget(pid);
            return -2;
        }
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    forget(pid);
    return -1;
}

void proc_reap_all(void)
{
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i] > 0) {
            kill(procs[i], SIGKILL);
            waitpid(procs[i], NULL, 0);
            procs[i] = 0;
        }
}

int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

/* ---- slow link ------------------------------------------------------------ */

#define LINK_MAX 8
#define LINK_BUF 65536
typedef struct {
    int fd[2];              /* 0: the connecting side, 1: the target */
    char buf[2][LINK_BUF];  /* buf[d]: read from fd[d], to write to fd[1 - d] */
    size_t len[2], off[2];
    double tokens[2];       /* bytes direction d may still read now */
} link_t;

static int loopback_socket(int port, bool listening)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0) return -1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc = listening ? bind(fd, (struct sockaddr *)&a, sizeof a) : connect(fd, (struct sockaddr *)&a, sizeof a);
    if (rc != 0 || (listening && listen(fd, LINK_MAX) != 0)) {
        close(fd);
        return -1;
    }
    return fd;
}

static void link_close(link_t *l)
{
    close(l->fd[0]);
    close(l->fd[1]);
    l->fd[0] = l->fd[1] = -1;
}

static void link_serve(int lfd, int target_port, double rate)
{
    static link_t links[LINK_MAX];
    for (int i = 0; i < LINK_MAX; i++) links[i].fd[0] = links[i].fd[1] = -1;
    const double burst = rate / 100 > LINK_BUF ? rate / 100 : LINK_BUF; /* 10 ms of the rate, at least a buffer */
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    double last = (double)t0.tv_sec + (double)t0.tv_nsec * 1e-9;
    for (;;) {
        struct pollfd pf[1 + 2 * LINK_MAX];
        int who[1 + 2 * LINK_MAX], n = 0;
        pf[n] = (struct pollfd){.fd = lfd, .events = POLLIN};
        who[n++] = -1;
        bool throttled = false;
        for (int i = 0; i < LINK_MAX; i++) {
            link_t *l = &links[i];
            if (l->fd[0] < 0) continue;
            for (int d = 0; d < 2; d++) {
                short ev = 0;
                if (l->len[d] == 0 && l->tokens[d] >= 1) ev |= POLLIN;
                if (l->len[d] == 0 && l->tokens[d] < 1) throttled = true;
                if (l->len[1 - d] > 0) ev |= POLLOUT;
                /* nothing to do on it now: left out, so that a hangup reported while its
                 * buffer waits to drain does not wake poll again and again */
                pf[n] = (struct pollfd){.fd = ev ? l->fd[d] : -1, .events = ev};
                who[n++] = 2 * i + d;
            }
        }
        if (poll(pf, (nfds_t)n, throttled ? 1 : 100) < 0 && errno != EINTR) _exit(1);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double now = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
        for (int i = 0; i < LINK_MAX; i++)
            for (int d = 0; d < 2; d++) {
                links[i].tokens[d] += rate * (now - last);
                if (links[i].tokens[d] > burst) links[i].tokens[d] = burst;
            }
        last = now;
        for (int k = 0; k < n; k++) {
            if (!pf[k].revents) continue;
            if (who[k] < 0) {
                int c = accept(lfd, NULL, NULL);
                if (c < 0) continue;
                int t = loopback_socket(target_port, false);
                int slot = -1;
                for (int i = 0; i < LINK_MAX && slot < 0; i++)
                    if (links[i].fd[0] < 0) slot = i;
                if (t < 0 || slot < 0) {
                    close(c);
                    if (t >= 0) close(t);
                    continue;
                }
                fcntl(c, F_SETFL, O_NONBLOCK);
                fcntl(t, F_SETFL, O_NONBLOCK);
                links[slot] = (link_t){.fd = {c, t}};
                continue;
            }
            link_t *l = &links[who[k] / 2];
            int d = who[k] % 2;
            if (l->fd[0] < 0) continue;
            if ((pf[k].revents & POLLOUT) && l->len[1 - d] > 0) { /* the other direction's bytes go out here */
                ssize_t w = write(l->fd[d], l->buf[1 - d] + l->off[1 - d], l->len[1 - d] - l->off[1 - d]);
                if (w < 0 && errno != EAGAIN && errno != EINTR) {
                    link_close(l);
                    continue;
                }
                if (w > 0 && (l->off[1 - d] += (size_t)w) == l->len[1 - d]) l->len[1 - d] = l->off[1 - d] = 0;
            }
            if ((pf[k].revents & (POLLIN | POLLHUP | POLLERR)) && l->len[d] == 0 && l->tokens[d] >= 1) {
                size_t want = l->tokens[d] < LINK_BUF ? (size_t)l->tokens[d] : LINK_BUF;
                ssize_t r = read(l->fd[d], l->buf[d], want);
                if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
                    link_close(l);
                    continue;
                }
                if (r > 0) {
                    l->len[d] = (size_t)r;
                    l->off[d] = 0;
                    l->tokens[d] -= (double)r;
                }
            }
        }
    }
}

pid_t proc_slow_link(int listen_port, int target_port, double bytes_per_s)
{
    int lfd = loopback_socket(listen_port, true);
    if (lfd < 0) return -1;
    pid_t pid = fork();
    if (pid < 0) {
        close(lfd);
        return -1;
    }
    if (pid == 0) {
        signal(SIGPIPE, SIG_IGN);
        link_serve(lfd, target_port, bytes_per_s);
        _exit(0);
    }
    close(lfd);
    remember(pid);
    return pid;
}

char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    if (buf) buf[n] = '\0';
    fclose(f);
    return buf;
}

double json_num(const char *line, const char *key)
{
    char pat[128];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = line ? strstr(line, pat) : NULL;
    if (!p) return NAN;
    return strtod(p + strlen(pat), NULL);
}

const char *last_line(const char *text)
{
    size_t n = strlen(text);
    while (n > 0 && text[n - 1] == '\n') n--;
    while (n > 0 && text[n - 1] != '\n') n--;
    return text + n;
}

int count_lines(const char *text)
{
    int n = 0;
    for (const char *p = text; *p; p++) n += *p == '\n';
    return n;
}
