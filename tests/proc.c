#include "proc.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_PROCS 64
static pid_t procs[MAX_PROCS];
static char proc_cwd[512];

void proc_set_cwd(const char *dir) { snprintf(proc_cwd, sizeof proc_cwd, "%s", dir ? dir : ""); }

pid_t proc_spawn(const char *const *argv, const char *log)
{
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        if (proc_cwd[0] && chdir(proc_cwd) != 0) _exit(126);
        int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    for (int i = 0; i < MAX_PROCS; i++)
        if (procs[i] == 0) {
            procs[i] = pid;
            break;
        }
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
