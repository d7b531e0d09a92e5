#include "ps_log.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <string.h>
#include <time.h>

ps_log_level_t ps_log_level_ = PS_LOG_INFO;
static char log_role[64] = "psd";
static int log_json;

void ps_log_set_json(int on) { log_json = on; }

static char status[512];   /* the live line, "" = none */

static void status_draw(void)
{
    struct winsize ws;
    int cols = ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 ? ws.ws_col : 80;
    char buf[600];
    /* the line cut so that it never wraps, over whatever was there */
    int n = snprintf(buf, sizeof buf, "\r%.*s\x1b[K", cols - 1, status);
    if (n > 0) fwrite(buf, 1, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1, stderr);
    fflush(stderr);
}

void ps_log_status(const char *line)
{
    int had = status[0] != '\0';
    snprintf(status, sizeof status, "%s", line ? line : "");
    if (status[0]) {
        status_draw();
    } else if (had) {
        fputs("\r\x1b[K", stderr);
        fflush(stderr);
    }
}

/* Length of the valid UTF-8 sequence at p (1-4), or 0. */
static int utf8_len(const unsigned char *p)
{
    if (p[0] < 0x80) return 1;
    int n = p[0] >= 0xf0 && p[0] <= 0xf4 ? 4 : p[0] >= 0xe0 ? 3 : p[0] >= 0xc2 && p[0] < 0xe0 ? 2 : 0;
    if (n == 0) return 0;
    for (int i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80) return 0;
    uint32_t cp = n == 2 ? (uint32_t)(p[0] & 0x1f) : n == 3 ? (uint32_t)(p[0] & 0x0f) : (uint32_t)(p[0] & 0x07);
    for (int i = 1; i < n; i++) cp = cp << 6 | (p[i] & 0x3f);
    if ((n == 3 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)))
        return 0; /* overlong, surrogate, beyond U+10FFFF */
    return n;
}

size_t ps_json_escape(char *out, size_t n, const char *s)
{
    size_t k = 0;
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        char buf[8];
        size_t m;
        int u = utf8_len(p);
        if (*p == '"' || *p == '\\') {
            buf[0] = '\\';
            buf[1] = (char)*p;
            m = 2;
        } else if (*p < 0x20 || *p == 0x7f) {
            m = (size_t)snprintf(buf, sizeof buf, "\\u%04x", *p);
        } else if (u == 0) {
            memcpy(buf, "\xef\xbf\xbd", 3); /* U+FFFD */
            m = 3;
            u = 1;
        } else {
            memcpy(buf, p, (size_t)u);
            m = (size_t)u;
        }
        if (k + m + 1 > n) break;
        memcpy(out + k, buf, m);
        k += m;
        p += u ? u : 1;
    }
    if (n) out[k] = '\0';
    return k;
}

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
    static const char *names[] = {"error", "warn", "info", "debug"};
    char line[4096], msg[2048], when[40];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900, tm.tm_mon + 1,
             tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (log_json) {
        char role[160], body[sizeof line - 200];
        ps_json_escape(role, sizeof role, log_role);
        ps_json_escape(body, sizeof body, msg);
        snprintf(line, sizeof line - 1, "{\"ts\":\"%s\",\"role\":\"%s\",\"level\":\"%s\",\"msg\":\"%s\"}", when,
                 role, names[level], body);
    } else {
        snprintf(line, sizeof line - 1, "%s %s %s %s", when, log_role, tags[level], msg);
    }
    /* one write per line so that lines of several processes do not interleave */
    size_t len = strlen(line);
    line[len++] = '\n';
    if (status[0]) fputs("\r\x1b[K", stderr); /* the log line takes the status line's place */
    fwrite(line, 1, len, stderr);
    if (status[0]) status_draw();
    fflush(stderr);
}
