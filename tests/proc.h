/* proc.h - helpers for integration tests: start the real binaries on
 * loopback, wait with deadlines, and always end what was started, by PID. */
#ifndef TEST_PROC_H
#define TEST_PROC_H

#include <stddef.h>
#include <sys/types.h>

/* Start argv (NULL-terminated) with stdout+stderr appended to log. The pid is
 * remembered so that proc_reap_all() can end it. */
pid_t proc_spawn(const char *const *argv, const char *log);
/* Directory the started processes run in (their relative files land there). */
void proc_set_cwd(const char *dir);
/* Wait up to timeout_s: exit code, 128+signal if killed by one, or -1 on
 * timeout (the process is then killed with SIGKILL and reaped). */
int proc_wait(pid_t pid, double timeout_s);
/* SIGKILL and reap every process still running that proc_spawn started. */
void proc_reap_all(void);
/* A TCP port on 127.0.0.1 that was free a moment ago. */
int free_port(void);
/* A slow network link: a process (ended by proc_reap_all like the others)
 * that listens on 127.0.0.1:listen_port and relays every connection (up to
 * 8) to 127.0.0.1:target_port, each direction of each connection at most
 * bytes_per_s; either side's end (or error) closes both. Its pid once it
 * listens, or -1. */
pid_t proc_slow_link(int listen_port, int target_port, double bytes_per_s);
/* Whole file as a string (caller frees), or NULL. */
char *slurp(const char *path);
/* Number after "key": in a JSON line, or NAN. */
double json_num(const char *line, const char *key);
/* The last line of a text (pointer into it). */
const char *last_line(const char *text);
/* Count lines. */
int count_lines(const char *text);

#endif
