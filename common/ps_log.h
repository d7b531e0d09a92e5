/* ps_log.h - leveled logging with a role and a timestamp, to stderr.
 *
 *   2026-11-30T10:40:01.123Z psd INFO  epoch 1/15 ...
 *
 * or, for log collectors (ps_log_set_json), one JSON object a line:
 *
 *   {"ts":"2026-11-30T10:40:01.123Z","role":"psd","level":"info","msg":"epoch 1/15 ..."}
 *
 * The level is checked before formatting. Workers other than rank 0 set their
 * level to WARN unless --verbose (ps_log_set_level). */
#ifndef PS_LOG_H
#define PS_LOG_H

#include "ps_config.h" /* ps_log_level_t */

void ps_log_set_role(const char *role); /* "psd", "worker 3"; copied */
void ps_log_set_level(ps_log_level_t level);
void ps_log_set_json(int on);
/* Write s as the body of a JSON string (quotes, backslashes and control
 * characters escaped; bytes that are not UTF-8 become U+FFFD) into out (n
 * bytes, NUL-terminated, truncated at a character boundary). Returns the
 * length written. */
size_t ps_json_escape(char *out, size_t n, const char *s);

/* A live status line at the bottom of a terminal (stderr must be one):
 * drawn with "\r" and erase-to-end-of-line, cut to the terminal's width,
 * erased before each log line and drawn again after it. NULL or "" removes
 * it. Never use it when stderr is not a terminal. */
void ps_log_status(const char *line);
ps_log_level_t ps_log_get_level(void);
void ps_log_write(ps_log_level_t level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

extern ps_log_level_t ps_log_level_;

#define PS_LOG(lvl, ...)                                  \
    do {                                                  \
        if ((lvl) <= ps_log_level_) ps_log_write((lvl), __VA_ARGS__); \
    } while (0)
#define PS_ERROR(...) PS_LOG(PS_LOG_ERROR, __VA_ARGS__)
#define PS_WARN(...) PS_LOG(PS_LOG_WARN, __VA_ARGS__)
#define PS_INFO(...) PS_LOG(PS_LOG_INFO, __VA_ARGS__)
#define PS_DEBUG(...) PS_LOG(PS_LOG_DEBUG, __VA_ARGS__)

/* Parse "error|warn|info|debug"; -1 if unknown. */
int ps_log_level_parse(const char *s, ps_log_level_t *out);

#endif
