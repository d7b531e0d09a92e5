#include "ps_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

ps_log_level_t ps_log_level_ = PS_LOG_INFO;
static char log_role[64] = "psd";

void ps_log_set_role(const char *role) { snprintf(log_role, sizeof log_role, "%s", role); }
void ps_log_set_level(ps_log_level_t level) { ps_log_level_ = level; }
ps_log_level_t ps_log_get_level(void) { return ps_log_level_; }

int ps_log_level_parse(const char *s, ps_log_level_t *out)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcmp(s, names[i]) == 0) {
            *out = (ps_log_level_t)i;
            return 0;
        }
    return -1;
}

void ps_log_write(ps_log_level_t level, const char *fmt, ...)
{
    static const char *tags[] = {"ERROR", "WARN ", "INFO ", "DEBUG"};
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s %s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, log_role, tags[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    /* one write per line so that lines of several processes do not interleave */
    size_t len = strlen(line);
    line[len++] = '\n';
    fwrite(line, 1, len, stderr);
    fflush(stderr);
}
