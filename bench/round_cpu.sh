#!/bin/bash
# Where the CPU of one push+pull round goes: the raw ZeroMQ round-trip probe
# (build/wire_probe --cc=auto 4 2 1: 5 runs of 2 s) against psd + psbench
# with 1 worker over tcp loopback (plain SGD on one 4 MiB tensor, 4 epochs of
# Fashion-MNIST's batches: about 3700 rounds), each sampled system-wide by
# perf (cpu-clock, 2999 Hz, start-up skipped). Prints, per round, the
# microseconds of CPU spent by each side's ZeroMQ I/O threads (split into the
# kernel's receive copy, its send copy, and everything else: TCP/IP, socket
# calls, epoll, libzmq), by the programs' own threads (psd's step, psbench),
# and idle, next to the round time. On N cores a round offers N x its time.
# Needs perf (Debian: linux-perf) and permission to sample the whole system
# (root, or kernel.perf_event_paranoid <= 0). Not a test.
#
#   bash bench/round_cpu.sh
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
command -v perf >/dev/null || { echo "round_cpu: needs perf (apt-get install linux-perf)" >&2; exit 2; }

perf record -q -a -F 2999 -D 300 -o "$WORK/raw.perf" -- \
    "$ROOT/build/wire_probe" --cc=auto 4 2 1 >"$WORK/raw.out" 2>"$WORK/perf.log"
RAW=$(awk '{print $6}' "$WORK/raw.out")
# shellcheck disable=SC2016 # expanded by the inner bash
perf record -q -a -F 2999 -D 1500 -o "$WORK/psd.perf" -- bash -c '
    "$1/build/psd" --listen "tcp://127.0.0.1:$2" --workers 1 --epochs 4 --set "model.layers=[784,1338]" \
        --set optimizer.momentum=0 --set optimizer.weight_decay=0 --set schedule.name=constant \
        --set checkpoint.dir= --metrics "" --save "" 2>"$3/psd.log" &
    "$1/build/psbench" --connect "tcp://127.0.0.1:$2" --workers 1 --no-shm >"$3/psbench.txt"
    wait $!' _ "$ROOT" "$PORT" "$WORK" 2>>"$WORK/perf.log"
PSD=$(awk '/^aggregate/ {print $3}' "$WORK/psbench.txt")

# $1: perf data, $2: GB/s of its rounds (8 MiB each), $3: "probe" or "psd".
# A sample's side: the process its thread belongs to (the probe's client is
# the parent process, the lowest pid; its server a child); its class: the
# thread kind, and for ZeroMQ's I/O threads the kernel function.
account() {
    perf script -i "$1" -F comm,pid,tid,ip,sym 2>/dev/null | awk -v gbs="$2" -v run="$3" -v cpus="$(nproc)" '
        { n++; split($2, id, "/"); pid = id[1] + 0; comm = $1; sym = $4
          if (comm == "swapper") { c["idle"]++; next }
          if (comm == "psd" || comm == "psbench") side[pid] = comm
          if (comm ~ /^ZMQbg/) {
              cls = sym == "_copy_to_iter" ? "recv copy" : sym == "_copy_from_iter" ? "send copy" : "other"
              io[pid] = 1; c[pid "\t" cls]++
          } else if (comm == "psd" || comm == "psbench" || comm == "wire_probe") c[pid "\tthreads"]++
          else c["others"]++ }
        END {
            round = 8.388608 / gbs * 1000; low = 1e12
            for (p in io) if (p + 0 < low) low = p + 0
            for (k in c) {
                split(k, f, "\t"); key = k
                if (f[2] != "") {
                    who = run == "probe" ? (f[1] + 0 == low ? "client" : "server") : side[f[1]]
                    key = who " " f[2]
                }
                t[key] += c[k]
            }
            printf "%s: round %.0f us (%.3f GB/s); CPU per round, us:\n", run, round, gbs
            for (k in t) printf "  %-22s %6.0f\n", k, t[k] / n * cpus * round
        }' | { read -r head; echo "$head"; sort; }
}
account "$WORK/raw.perf" "$RAW" probe
account "$WORK/psd.perf" "$PSD" psd
echo "($(nproc) CPUs: a round offers $(nproc) x its time; perf slows both runs a little)"
