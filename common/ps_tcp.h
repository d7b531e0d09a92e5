/* ps_tcp.h - the congestion control of psd's tcp connections
 * (server.tcp_congestion).
 *
 * Some hosts make BBR the kernel's default (net.ipv4.tcp_congestion_control).
 * BBR paces its packets from timers; over loopback that reorders them
 * between the CPUs' receive queues, every reordering looks like a loss, and
 * the connection keeps cutting its window: a raw ZeroMQ round trip of 4 MiB
 * each way moved 3.8-4.4 GB/s under BBR and 6.8-8.6 GB/s under reno or cubic
 * on the same 2-core VM (bench/wire_probe). The setting:
 *   auto   a loopback connection whose congestion control paces (bbr*)
 *          switches to reno (which any process may choose); nothing else is
 *          touched. The default.
 *   off    the kernel's choice, always.
 *   NAME   every tcp connection uses NAME (reno, cubic, bbr, ...: one of
 *          net.ipv4.tcp_available_congestion_control that this process may
 *          set: net.ipv4.tcp_allowed_congestion_control, or any as root).
 * psd applies it to the connections its peers' messages arrive on (libzmq's
 * ZMQ_SRCFD), and sends it to workers in ASSIGN, which apply it to theirs:
 * each side sets the direction it sends in. */
#ifndef PS_TCP_H
#define PS_TCP_H

#include <stdbool.h>
#include <stddef.h>

#define PS_TCP_CC_MAX 16 /* the kernel's TCP_CA_NAME_MAX, with the NUL */

/* 0 if `setting` ("auto", "off" or a name) can be used on this host, else
 * -1 and why in err (for a configuration error at startup). */
int ps_tcp_cc_check(const char *setting, char *err, size_t errlen);

/* Apply `setting` to connected socket fd (not tcp: nothing). 1 changed
 * (*was, *now: the names before and after, each PS_TCP_CC_MAX bytes, may be
 * NULL), 0 nothing to change, -errno when the kernel refused. */
int ps_tcp_cc_apply(int fd, const char *setting, char *was, char *now);

/* Once per connection: apply `setting` to srcfd, the connection a message
 * came on (its ZMQ_SRCFD), unless it is the one *last names (fd + 1, 0 =
 * none yet). The first change this process makes is logged at info level
 * when `tell` (psd), else at debug (a worker: not once per rank); the first
 * refusal as a warning. */
void ps_tcp_cc_conn(int *last, int srcfd, const char *setting, bool tell);

#endif
