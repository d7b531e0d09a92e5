#!/bin/bash
# The one-worker round over time: triples of (raw ZeroMQ probe, the probe with a
# one-thread SGD pass between, psd + psbench with 1 worker) back to back over tcp
# loopback, one triple every GAP seconds for MINUTES minutes, each line stamped;
# then the medians of the two ratios bench/wire_bench.sh reports (psd / raw probe,
# psd / probe with the SGD pass) and their spread. For telling a slow machine from
# a slow spell: the same host over half an hour, or two hosts with their ids
# (bench/lib.sh machine_line).
#
#   bash bench/round_pairs.sh [MINUTES, default 30] [GAP_SECONDS, default 45]
#
# Not a test: nothing here passes or fails on speed. ROUNDS (default 800) rounds a run.
set -euo pipefail
MINUTES=${1:-30}
GAP=${2:-45}
ROUNDS=${ROUNDS:-800}
. "$(dirname "$0")/lib.sh"
bench_setup
machine_line

r() { python3 -c "print(f'{$1 / $2:.2f}')"; }
RATIOS="" RATIOS_SGD=""
END=$((SECONDS + MINUTES * 60))
echo "time      raw_GB/s  raw+sgd_GB/s  psd_GB/s  psd/raw  psd/raw+sgd  psd_step_ms"
while :; do
    RAW=$("$ROOT/build/wire_probe" --cc=auto 4 0.3 | awk '/^zmq_tcp/ {print $4}')
    RSGD=$("$ROOT/build/wire_probe" --cc=auto 4 0.3 1 sync | awk '/^zmq_tcp_sync_sgd/ {print $6}')
    PSD=$(psbench_run 1 "tcp://127.0.0.1:$PORT" --no-shm 2>/dev/null)
    A=$(r "$PSD" "$RAW")
    B=$(r "$PSD" "$RSGD")
    RATIOS="$RATIOS $A" RATIOS_SGD="$RATIOS_SGD $B"
    printf '%s  %8s  %12s  %8s  %7s  %11s  %s\n' "$(date -u +%T)" "$RAW" "$RSGD" "$PSD" "$A" "$B" "$(step_ms 1)"
    [ "$SECONDS" -lt "$END" ] || break
    sleep "$GAP"
done
stats() {
    python3 -c "import statistics as s, sys; v = sorted(map(float, sys.argv[1:]));
print(f'median {s.median(v):.2f}, range {v[0]:.2f}-{v[-1]:.2f}, {len(v)} triples')" "$@"
}
# shellcheck disable=SC2086
echo "psd / raw probe:                 $(stats $RATIOS)   (goal >= 0.85)"
# shellcheck disable=SC2086
echo "psd / raw probe with SGD pass:   $(stats $RATIOS_SGD)   (goal >= 1.0)"
