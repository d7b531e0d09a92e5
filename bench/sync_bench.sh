#!/bin/bash
# Consistency modes side by side: psd + 2 pworkers on Fashion-MNIST with
# psd's default settings (the README's default training: workers on psd's
# host, so through shared memory) and lr 0.05, in bsp, ssp
# (train.staleness 2) and async, ROUNDS rounds of the three in turn (runs on
# a shared VM drift; alternating keeps the modes comparable). Prints each
# run's samples/s (training samples / training wall time, validation and
# start-up excluded), final val_acc and the largest and mean staleness of
# the applied gradients, then the median samples/s per mode.
# With SLOW_MS=N worker 0 sleeps N ms a step (--x-slow-ms), to show what
# async and ssp are for: workers of unequal speed.
# Not a test: nothing passes or fails on speed.
#
#   bash bench/sync_bench.sh [EPOCHS] [ROUNDS]    (defaults 5 and 1: about 2 minutes a round)
#   SLOW_MS=2 bash bench/sync_bench.sh 2 1
set -euo pipefail
EPOCHS=${1:-5}
ROUNDS=${2:-1}
SLOW_MS=${SLOW_MS:-0}
. "$(dirname "$0")/lib.sh"
bench_setup
SLOW=()
[ "$SLOW_MS" != 0 ] && SLOW=(--x-slow-ms "$SLOW_MS")

one() { # MODE ROUND: one run; appends "MODE samples/s" to $WORK/sps
    local mode=$1 tag=$1-$2
    "$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers 2 \
        --metrics "$WORK/m-$tag.jsonl" --set checkpoint.dir= --set server.save= \
        --set run.epochs="$EPOCHS" --set optimizer.lr=0.05 --set train.sync="$mode" --set train.staleness=2 \
        2>"$WORK/psd-$tag.log" &
    local p=$!
    "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" "${SLOW[@]}" 2>"$WORK/w0-$tag.log" &
    local w0=$!
    "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" 2>"$WORK/w1-$tag.log" &
    local w1=$!
    local rc=0
    wait $p || rc=$?
    wait $w0 || rc=$?
    wait $w1 || rc=$?
    if [ $rc != 0 ]; then
        echo "$tag: a process failed (exit $rc); psd's log:" >&2
        tail -5 "$WORK/psd-$tag.log" >&2
        exit 1
    fi
    python3 - "$tag" "$mode" "$WORK/m-$tag.jsonl" "$WORK/sps" <<'PY'
import json, sys
tag, mode, path, out = sys.argv[1:5]
lines = [json.loads(l) for l in open(path)]
d = lines[-1]
# training samples / training seconds over the whole run (every epoch)
secs = sum(l["train_samples"] / l["samples_per_s"] for l in lines if l["samples_per_s"] > 0)
sps = sum(l["train_samples"] for l in lines) / secs
smax = max(l.get("staleness_max", 0) for l in lines)
smean = sum(l.get("staleness_mean", 0) for l in lines) / len(lines)
lead = max(l.get("ssp_lead_max", 0) for l in lines)
print(f"{tag}: {sps:.0f} samples/s over {len(lines)} epochs, val_acc {d['val_acc']:.4f}, "
      f"staleness max {smax:.0f} mean {smean:.2f}" + (f", ssp lead max {lead:.0f}" if mode == "ssp" else ""))
open(out, "a").write(f"{mode} {sps:.0f}\n")
PY
}

echo "$(date -u '+%F %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD), $(nproc) cores," \
    "$EPOCHS epochs, 2 workers, lr 0.05$([ "$SLOW_MS" = 0 ] || echo ", worker 0 slowed by $SLOW_MS ms a step")"
for r in $(seq 1 "$ROUNDS"); do
    for mode in bsp ssp async; do
        one "$mode" "$r"
    done
done
python3 - "$WORK/sps" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    mode, sps = line.split()
    runs.setdefault(mode, []).append(float(sps))
print("median samples/s: " + ", ".join(f"{m} {statistics.median(v):.0f}" for m, v in runs.items()))
PY
