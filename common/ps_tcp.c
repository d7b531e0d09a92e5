/* ps_tcp.c - the congestion control of psd's tcp connections (ps_tcp.h). */
#include "ps_tcp.h"

#include "ps_log.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static bool is_off(const char *s) { return !s || !s[0] || strcmp(s, "off") == 0; }

static bool is_auto(const char *s) { return strcmp(s, "auto") == 0; }

/* a congestion control's name as the kernel spells them: [a-z0-9_], short */
static bool valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n >= PS_TCP_CC_MAX) return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= '0' && s[i] <= '9') || s[i] == '_')) return false;
    return true;
}

/* the first line of a /proc file, or "" */
static void read_line(const char *path, char *out, size_t n)
{
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f) return;
    if (fgets(out, (int)n, f)) out[strcspn(out, "\n")] = '\0';
    fclose(f);
}

int ps_tcp_cc_check(const char *setting, char *err, size_t errlen)
{
    if (is_off(setting) || is_auto(setting)) return 0;
    if (!valid_name(setting)) {
        snprintf(err, errlen, "server.tcp_congestion: \"%s\" is not auto, off or a congestion control's name",
                 setting);
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
    if (fd < 0) {
        snprintf(err, errlen, "server.tcp_congestion: cannot make a tcp socket to try \"%s\": %s", setting,
                 strerror(errno));
        return -1;
    }
    int rc = setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, setting, (socklen_t)strlen(setting));
    int e = errno;
    close(fd);
    if (rc == 0) return 0;
    char avail[256], allowed[256];
    read_line("/proc/sys/net/ipv4/tcp_available_congestion_control", avail, sizeof avail);
    read_line("/proc/sys/net/ipv4/tcp_allowed_congestion_control", allowed, sizeof allowed);
    snprintf(err, errlen,
             "server.tcp_congestion: this host does not let psd use \"%s\" (%s); available: %s; allowed without "
             "root: %s (or use auto or off)",
             setting, strerror(e), avail[0] ? avail : "?", allowed[0] ? allowed : "?");
    return -1;
}

/* the peer is this host's loopback (127.0.0.0/8, ::1, or 127.x mapped into IPv6) */
static bool loopback_peer(int fd)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0) return false;
    if (ss.ss_family == AF_INET) return (ntohl(((struct sockaddr_in *)&ss)->sin_addr.s_addr) >> 24) == 127;
    if (ss.ss_family != AF_INET6) return false;
    const struct in6_addr *a = &((struct sockaddr_in6 *)&ss)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(a)) return true;
    return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
}

int ps_tcp_cc_apply(int fd, const char *setting, char *was, char *now)
{
    if (fd < 0 || is_off(setting)) return 0;
    int proto = 0;
    socklen_t len = sizeof proto;
    if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &proto, &len) != 0 || proto != IPPROTO_TCP) return 0;
    char cur[PS_TCP_CC_MAX] = "";
    len = sizeof cur - 1;
    if (getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cur, &len) != 0) return -errno;
    cur[sizeof cur - 1] = '\0';
    const char *want = setting;
    if (is_auto(setting)) {
        if (strncmp(cur, "bbr", 3) != 0 || !loopback_peer(fd)) return 0;
        want = "reno";
    }
    if (strcmp(cur, want) == 0) return 0;
    if (setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, want, (socklen_t)strlen(want)) != 0) return -errno;
    if (was) snprintf(was, PS_TCP_CC_MAX, "%s", cur);
    if (now) snprintf(now, PS_TCP_CC_MAX, "%s", want);
    return 1;
}

void ps_tcp_cc_conn(int *last, int srcfd, const char *setting, bool tell)
{
    static atomic_bool told, warned;
    if (srcfd < 0 || *last == srcfd + 1 || is_off(setting)) return;
    *last = srcfd + 1;
    char was[PS_TCP_CC_MAX], now[PS_TCP_CC_MAX];
    int rc = ps_tcp_cc_apply(srcfd, setting, was, now);
    if (rc > 0 && !atomic_exchange(&told, true)) {
        if (tell)
            PS_INFO("tcp: %s -> %s congestion control on %s connections (server.tcp_congestion: %s; off keeps the "
                    "kernel's)", was, now, is_auto(setting) ? "loopback" : "its", setting);
        else
            PS_DEBUG("tcp: %s -> %s congestion control on the connection to psd (server.tcp_congestion: %s)", was,
                     now, setting);
    } else if (rc < 0 && !atomic_exchange(&warned, true)) {
        PS_WARN("tcp: could not set congestion control %s on a connection (server.tcp_congestion): %s; it keeps "
                "the kernel's", is_auto(setting) ? "reno" : setting, strerror(-rc));
    }
}
