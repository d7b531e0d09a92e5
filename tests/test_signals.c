/* How a daemon counts SIGINT/SIGTERM (ps_stop_signal_note): the first asks
 * for a clean stop, another for an exit now, but the first one again within
 * PS_SIGNAL_ECHO_S is the same request (timeout(1) signals the command and
 * its process group: twice at once). Each test runs in its own process, so
 * each starts with no signal counted. */
#include <criterion/criterion.h>
#include <signal.h>
#include <time.h>

#include "ps_util.h"

static void sleep_s(double s)
{
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

Test(signals, the_same_signal_at_once_is_one_request)
{
    cr_assert_eq(ps_stop_signal_note(SIGTERM), 1);
    cr_assert_eq(ps_stop_signal_note(SIGTERM), 0, "an echo");
    cr_assert_eq(ps_stop_signal_note(SIGTERM), 0, "and another");
    sleep_s(PS_SIGNAL_ECHO_S * 1.5);
    cr_assert_eq(ps_stop_signal_note(SIGTERM), 2, "later: a second request");
    cr_assert_eq(ps_stop_signal_note(SIGTERM), 3, "after a second request, every one counts");
}

Test(signals, another_signal_at_once_is_a_second_request)
{
    cr_assert_eq(ps_stop_signal_note(SIGINT), 1);
    cr_assert_eq(ps_stop_signal_note(SIGTERM), 2);
}
