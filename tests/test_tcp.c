/* server.tcp_congestion (common/ps_tcp.h): the setting's check, and its
 * effect on a real loopback tcp connection. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ps_tcp.h"
#include "ps_util.h"

static int fds[3]; /* listener, client, accepted */

/* a connected pair over 127.0.0.1 */
static void setup(void)
{
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    fds[0] = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert(fds[0] >= 0);
    cr_assert_eq(bind(fds[0], (struct sockaddr *)&a, sizeof a), 0);
    cr_assert_eq(listen(fds[0], 1), 0);
    cr_assert_eq(getsockname(fds[0], (struct sockaddr *)&a, &len), 0);
    fds[1] = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_eq(connect(fds[1], (struct sockaddr *)&a, sizeof a), 0);
    fds[2] = accept(fds[0], NULL, NULL);
    cr_assert(fds[2] >= 0);
}

static void teardown(void)
{
    for (int i = 0; i < 3; i++) close(fds[i]);
}

static void cc_of(int fd, char *out)
{
    char b[PS_TCP_CC_MAX] = "";
    socklen_t len = sizeof b - 1;
    cr_assert_eq(getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, b, &len), 0);
    b[sizeof b - 1] = '\0';
    strcpy(out, b);
}

static int set_cc(int fd, const char *name)
{
    return setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name, (socklen_t)strlen(name));
}

TestSuite(tcp, .init = setup, .fini = teardown);

Test(tcp, settings_are_checked_with_a_reason)
{
    char err[512];
    cr_assert_eq(ps_tcp_cc_check("auto", err, sizeof err), 0);
    cr_assert_eq(ps_tcp_cc_check("off", err, sizeof err), 0);
    cr_assert_eq(ps_tcp_cc_check("reno", err, sizeof err), 0, "reno is always allowed: %s", err);
    cr_assert_eq(ps_tcp_cc_check("Reno!", err, sizeof err), -1);
    cr_assert(strstr(err, "server.tcp_congestion") && strstr(err, "not auto, off"), "%s", err);
    cr_assert_eq(ps_tcp_cc_check("no_such_cc", err, sizeof err), -1);
    cr_assert(strstr(err, "no_such_cc") && strstr(err, "available: "), "names what is available: %s", err);
    cr_assert_eq(ps_tcp_cc_check("a_name_far_too_long", err, sizeof err), -1);
}

Test(tcp, a_name_is_set_and_off_changes_nothing)
{
    char before[PS_TCP_CC_MAX], now[PS_TCP_CC_MAX], was[PS_TCP_CC_MAX] = "", to[PS_TCP_CC_MAX] = "";
    cc_of(fds[1], before);
    cr_assert_eq(ps_tcp_cc_apply(fds[1], "off", NULL, NULL), 0);
    cc_of(fds[1], now);
    cr_assert_str_eq(now, before);
    int rc = ps_tcp_cc_apply(fds[1], "reno", was, to);
    cc_of(fds[1], now);
    cr_assert_str_eq(now, "reno");
    if (strcmp(before, "reno") == 0) {
        cr_assert_eq(rc, 0, "nothing to change");
    } else {
        cr_assert_eq(rc, 1);
        cr_assert_str_eq(was, before);
        cr_assert_str_eq(to, "reno");
    }
    cr_assert_eq(ps_tcp_cc_apply(fds[1], "reno", NULL, NULL), 0, "already reno");
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    cr_assert_eq(ps_tcp_cc_apply(u, "reno", NULL, NULL), 0, "not tcp: left alone");
    close(u);
}

/* auto: a loopback connection under bbr goes to reno; any other stays */
Test(tcp, auto_moves_loopback_off_bbr_only)
{
    char now[PS_TCP_CC_MAX], was[PS_TCP_CC_MAX];
    cr_assert_eq(set_cc(fds[2], "reno"), 0);
    cr_assert_eq(ps_tcp_cc_apply(fds[2], "auto", NULL, NULL), 0);
    cc_of(fds[2], now);
    cr_assert_str_eq(now, "reno", "auto leaves a congestion control that does not pace");
    if (set_cc(fds[2], "bbr") != 0) { /* not on this kernel, or not allowed: nothing more to see */
        cr_log_warn("bbr cannot be set here (%s): auto's switch from it is not exercised", strerror(errno));
        return;
    }
    cr_assert_eq(ps_tcp_cc_apply(fds[2], "auto", was, NULL), 1);
    cc_of(fds[2], now);
    cr_assert_str_eq(now, "reno");
    cr_assert_str_eq(was, "bbr");
}

/* once per connection: a connection already given the setting is not
 * looked at again; a new one (another fd) is */
Test(tcp, each_connection_once)
{
    int last = 0;
    char now[PS_TCP_CC_MAX];
    ps_tcp_cc_conn(&last, fds[1], "reno", false);
    cr_assert_eq(last, fds[1] + 1);
    cc_of(fds[1], now);
    cr_assert_str_eq(now, "reno");
    if (set_cc(fds[1], "bbr") == 0) { /* changed behind its back: not looked at again */
        ps_tcp_cc_conn(&last, fds[1], "reno", false);
        cc_of(fds[1], now);
        cr_assert_str_eq(now, "bbr");
    }
    ps_tcp_cc_conn(&last, fds[2], "reno", false);
    cr_assert_eq(last, fds[2] + 1);
    cc_of(fds[2], now);
    cr_assert_str_eq(now, "reno");
    int before = last;
    ps_tcp_cc_conn(&last, -1, "reno", false);
    cr_assert_eq(last, before, "no fd (ZMQ_SRCFD unknown): nothing");
}

/* Endpoints (ps_endpoint_check): what psd binds and workers, shards,
 * psctl and psbench connect to. libzmq takes a port above 65535 modulo
 * 65536 (tcp://127.0.0.1:99999 listens on 34463), so those are refused. */
static void ep_ok(const char *ep, ps_ep_use_t use)
{
    char why[400] = "";
    cr_expect_eq(ps_endpoint_check(ep, use, why, sizeof why), 0, "%s refused: %s", ep, why);
}

static void ep_bad(const char *ep, ps_ep_use_t use, const char *part)
{
    char why[400] = "";
    cr_expect_eq(ps_endpoint_check(ep, use, why, sizeof why), -1, "%s taken", ep);
    cr_expect(strstr(why, part) != NULL, "%s: '%s' lacks '%s'", ep, why, part);
}

Test(endpoints, ports_hosts_and_paths)
{
    ep_ok("tcp://127.0.0.1:5555", PS_EP_CONNECT);
    ep_ok("tcp://node-7.cluster:65535", PS_EP_CONNECT);
    ep_ok("ipc:///tmp/psd.sock", PS_EP_CONNECT);
    ep_ok("ipc://@psd-abstract", PS_EP_CONNECT);
    ep_ok("tcp://0.0.0.0:0", PS_EP_BIND);
    ep_ok("tcp://*:*", PS_EP_BIND);
    ep_ok("tcp://lo:5555", PS_EP_BIND); /* an interface */
    ep_ok("tcp://eth0:1:5555", PS_EP_BIND); /* an interface's alias */
    ep_bad("tcp://127.0.0.1:99999", PS_EP_BIND, "from 0 to 65535");
    ep_bad("tcp://127.0.0.1:65536", PS_EP_CONNECT, "from 1 to 65535");
    ep_bad("tcp://127.0.0.1:0", PS_EP_CONNECT, "from 1 to 65535");
    ep_bad("tcp://127.0.0.1:*", PS_EP_CONNECT, "from 1 to 65535");
    ep_bad("tcp://127.0.0.1:-1", PS_EP_BIND, "port");
    ep_bad("tcp://127.0.0.1:55x", PS_EP_BIND, "port");
    ep_bad("tcp://127.0.0.1:000005555", PS_EP_BIND, "port");
    ep_bad("tcp://127.0.0.1:", PS_EP_BIND, "port");
    ep_bad("tcp://127.0.0.1", PS_EP_CONNECT, "tcp://HOST:PORT");
    ep_bad("tcp://:5555", PS_EP_BIND, "tcp://HOST:PORT");
    ep_ok("tcp://localhost:5555", PS_EP_CONNECT);
    ep_ok("tcp://[::1]:5555", PS_EP_CONNECT);
    ep_ok("tcp://[::1]:0", PS_EP_BIND);
    ep_ok("tcp://[2001:db8::7]:5555", PS_EP_CONNECT);
    ep_ok("tcp://[::ffff:10.0.0.1]:5555", PS_EP_CONNECT);
    ep_bad("tcp://::1:5555", PS_EP_CONNECT, "an IPv6 address goes in brackets: tcp://[ADDR]:PORT");
    ep_bad("tcp://[::1]", PS_EP_CONNECT, "in brackets");
    ep_bad("tcp://[::1:5555", PS_EP_CONNECT, "in brackets");
    ep_bad("tcp://[node7]:5555", PS_EP_CONNECT, "in brackets");
    ep_bad("tcp://[]:5555", PS_EP_BIND, "in brackets");
    ep_bad("tcp://[::1]:65536", PS_EP_CONNECT, "from 1 to 65535");
    ep_bad("tcp://*:5555", PS_EP_CONNECT, "for listening");
    ep_bad("udp://127.0.0.1:5555", PS_EP_CONNECT, "not a tcp:// or ipc://");
    ep_bad("127.0.0.1:5555", PS_EP_CONNECT, "not a tcp:// or ipc://");
    ep_bad("", PS_EP_CONNECT, "empty");
    ep_bad("ipc://", PS_EP_BIND, "1 to 107 bytes");
    char longp[160] = "ipc:///";
    memset(longp + 7, 'a', 106); /* "/" and 106 more: 107 bytes of path, the most a unix socket takes */
    ep_ok(longp, PS_EP_BIND);
    longp[113] = 'a';
    ep_bad(longp, PS_EP_BIND, "1 to 107 bytes");
}

/* ps_endpoint_bindable(ep): 0 (part NULL), or -1 with part in its reason */
static void bindable(const char *ep, const char *part)
{
    char why[400] = "";
    int rc = ps_endpoint_bindable(ep, why, sizeof why);
    cr_expect_eq(rc, part ? -1 : 0, "%s: %d (%s)", ep, rc, why);
    if (part) cr_expect(strstr(why, part) != NULL, "%s: '%s' lacks '%s'", ep, why, part);
}

/* To listen, an interface or an IP address of this host: libzmq binds no
 * host name ("No such device"); checked where psd starts, not with the
 * config (ps_endpoint_bindable). */
Test(endpoints, listening_needs_an_interface_or_an_address)
{
    const char *ok[] = {"tcp://lo:5555", "tcp://127.0.0.1:0", "tcp://127.1:0", "tcp://0.0.0.0:5555", "tcp://*:*",
                        "ipc:///tmp/x", "tcp://[::1]:0", "tcp://[::]:5555"};
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) bindable(ok[i], NULL);
    bindable("tcp://localhost:5555", "not a host name");
    bindable("tcp://no-such-if0:5555", "no interface or IP address of that name here");
    bindable("tcp://a-host-name-longer-than-an-interface-name:5555", "no interface or IP address of that name");
}

/* Listening beyond loopback needs keys or --insecure: only numeric
 * 127.0.0.0/8, localhost and ipc:// count as this host. */
Test(endpoints, loopback_is_numeric_or_localhost)
{
    cr_expect(ps_endpoint_is_loopback("tcp://127.0.0.1:5555"));
    cr_expect(ps_endpoint_is_loopback("tcp://127.1.2.3:0"));
    cr_expect(ps_endpoint_is_loopback("tcp://127.1:0"), "the short form libzmq binds too");
    cr_expect(ps_endpoint_is_loopback("tcp://localhost:5555"));
    cr_expect(ps_endpoint_is_loopback("ipc:///tmp/x"));
    cr_expect(!ps_endpoint_is_loopback("tcp://127.attacker.example:5555"), "a name that begins with 127.");
    cr_expect(!ps_endpoint_is_loopback("tcp://127.0.0.1.nip.io:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://0.0.0.0:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://*:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://10.0.0.1:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://[::]:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://eth0:5555"));
    cr_expect(ps_endpoint_is_loopback("tcp://[::1]:5555"));
    cr_expect(ps_endpoint_is_loopback("tcp://[::ffff:127.0.0.1]:5555"), "127.0.0.1 mapped into IPv6");
    cr_expect(!ps_endpoint_is_loopback("tcp://[::ffff:10.0.0.1]:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://[2001:db8::1]:5555"));
    cr_expect(!ps_endpoint_is_loopback("tcp://[::2]:5555"));
}

/* This host: loopback, its host name, an address of one of its interfaces;
 * nothing else (and no name is looked up). */
Test(endpoints, this_host_is_loopback_its_name_or_its_addresses)
{
    cr_expect(ps_endpoint_is_this_host("tcp://127.0.0.1:5555"));
    cr_expect(ps_endpoint_is_this_host("ipc:///tmp/x"));
    char me[256] = "", ep[300];
    cr_assert_eq(gethostname(me, sizeof me - 1), 0);
    snprintf(ep, sizeof ep, "tcp://%s:5555", me);
    cr_expect(ps_endpoint_is_this_host(ep), "%s", ep);
    struct ifaddrs *ifs = NULL;
    cr_assert_eq(getifaddrs(&ifs), 0);
    int seen = 0;
    for (const struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
        char a[INET_ADDRSTRLEN];
        inet_ntop(AF_INET, &((const struct sockaddr_in *)(const void *)i->ifa_addr)->sin_addr, a, sizeof a);
        snprintf(ep, sizeof ep, "tcp://%s:5555", a);
        cr_expect(ps_endpoint_is_this_host(ep), "%s (interface %s)", ep, i->ifa_name);
        seen++;
    }
    freeifaddrs(ifs);
    cr_expect(seen >= 1, "no IPv4 address on any interface (not even 127.0.0.1)");
    cr_expect(!ps_endpoint_is_this_host("tcp://192.0.2.1:5555"), "TEST-NET-1 is nobody's");
    cr_expect(!ps_endpoint_is_this_host("tcp://[2001:db8::1]:5555"));
    cr_expect(!ps_endpoint_is_this_host("tcp://node-elsewhere.invalid:5555"));
    cr_expect(!ps_endpoint_is_this_host("tcp://:5555"));
}

/* A tcp:// endpoint to an IPv6 address: its socket needs ZMQ_IPV6. */
Test(endpoints, ipv6_addresses_are_in_brackets)
{
    cr_expect(ps_endpoint_is_ipv6("tcp://[::1]:5555"));
    cr_expect(ps_endpoint_is_ipv6("tcp://[fe80::1]:0"));
    cr_expect(!ps_endpoint_is_ipv6("tcp://127.0.0.1:5555"));
    cr_expect(!ps_endpoint_is_ipv6("tcp://eth0:1:5555"), "an interface's alias");
    cr_expect(!ps_endpoint_is_ipv6("ipc:///tmp/[::1]:5"));
    cr_expect(!ps_endpoint_is_ipv6("tcp://[node]:5"));
}

/* ZMQ_IPV6 for IPv6 addresses, and for host names whose addresses are all
 * IPv6 (such a name is tested end to end in test_integration's
 * a_run_over_ipv6_loopback); everything else keeps libzmq's IPv4 lookup. */
Test(endpoints, ipv6_for_addresses_and_ipv6_only_names)
{
    cr_expect(ps_endpoint_wants_ipv6("tcp://[::1]:5555"));
    cr_expect(ps_endpoint_wants_ipv6("tcp://[2001:db8::1]:5555"));
    cr_expect(!ps_endpoint_wants_ipv6("tcp://127.0.0.1:5555"));
    cr_expect(!ps_endpoint_wants_ipv6("tcp://*:5555"));
    cr_expect(!ps_endpoint_wants_ipv6("tcp://localhost:5555"), "localhost has 127.0.0.1 (IPv4 kept)");
    cr_expect(!ps_endpoint_wants_ipv6("tcp://no-such-host.invalid:5555"), "an unknown name keeps IPv4");
    cr_expect(!ps_endpoint_wants_ipv6("ipc:///tmp/[::1]:5"));
}
