#!/bin/bash
# The shared worker library as a program outside this build sees it:
# `meson install` into a scratch root; libpsworker.so.3 exports psw_*
# symbols only; a small C program built with `pkg-config --cflags --libs
# psworker` and nothing else registers with a real psd (loopback, a free
# port, psd ended by its pid).
#   bash tests/pkgconfig.sh BUILD_DIR
set -euo pipefail
B=$(cd "${1:?usage: tests/pkgconfig.sh BUILD_DIR}" && pwd)
T=$(mktemp -d /tmp/psd-pc-XXXXXX)
pid=
cleanup() { if [ -n "$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi; rm -rf "$T"; }
trap cleanup EXIT
fail() { echo "pkgconfig: $*" >&2; exit 1; }

DESTDIR=$T meson install -C "$B" --no-rebuild --quiet >"$T/install.log" 2>&1 ||
    { cat "$T/install.log" >&2; fail "meson install failed"; }
pc=$(find "$T" -name psworker.pc | head -n 1)
so=$(find "$T" -name 'libpsworker.so.3' | head -n 1)
[ -n "$pc" ] || fail "no psworker.pc installed"
[ -n "$so" ] || fail "no libpsworker.so.3 installed"
[ -f "$(dirname "$so")/libpsworker.so" ] || fail "no libpsworker.so link for -lpsworker"

# the library exports the protocol client's API only
others=$(nm -D --defined-only "$so" | awk '{print $NF}' | grep -v '^psw_' || true)
[ -z "$others" ] || fail "libpsworker.so.3 exports more than psw_*: $others"
n=$(nm -D --defined-only "$so" | grep -c ' psw_' || true)
[ "$n" -gt 10 ] || fail "libpsworker.so.3 exports $n psw_* symbols"

cat >"$T/prog.c" <<'C'
#include <psworker.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    char err[256];
    psw_info_t info = {.device = "cpu", .device_index = -1};
    psw_client_t *c = argc == 2 ? psw_client_new(argv[1], &info, err, sizeof err) : NULL;
    if (!c) {
        fprintf(stderr, "prog: %s\n", argc == 2 ? err : "usage: prog ENDPOINT");
        return 1;
    }
    psw_assign_t a;
    if (psw_client_register(c, &a, 60, err, sizeof err) != 0) {
        fprintf(stderr, "prog: register: %s\n", err);
        psw_client_destroy(&c);
        return 1;
    }
    printf("registered: rank %u, %d layer sizes, batch %u, run %016llx\n", a.rank, a.n_sizes, a.batch_size,
           (unsigned long long)a.run_id);
    psw_client_leave(c, "pkg-config test done");
    psw_client_destroy(&c);
    return a.n_sizes >= 2 && a.batch_size > 0 ? 0 : 1;
}
C
export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$T
flags=$(pkg-config --cflags --libs psworker) || fail "pkg-config --cflags --libs psworker failed"
cc -std=c17 -Wall -Werror "$T/prog.c" -o "$T/prog" $flags || fail "cannot build against the installed library ($flags)"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$B/psd" --listen "tcp://127.0.0.1:$port" --workers 1 --epochs 1 --set checkpoint.dir= --metrics "" --save "" \
    --start-timeout 60 >"$T/psd.log" 2>&1 &
pid=$!
out=$(LD_LIBRARY_PATH=$(dirname "$so") timeout 90 "$T/prog" "tcp://127.0.0.1:$port") ||
    { cat "$T/psd.log" >&2; fail "the program built with pkg-config did not register"; }
echo "$out"
libs=$(LD_LIBRARY_PATH=$(dirname "$so") ldd "$T/prog") # whole, then searched: grep -q would end ldd early (pipefail)
grep -q "$(dirname "$so")/libpsworker.so.3" <<<"$libs" || fail "the program is not linked to the installed library"
grep -q "worker registered: rank 0" "$T/psd.log" || { cat "$T/psd.log" >&2; fail "psd did not see it register"; }
echo "pkgconfig: ok ($flags)"
