#!/bin/bash
# How long workers wait: MLP 784-1024-1024-10, batch 256 per worker, 2 CPU
# workers (1 thread each) on psd's host, through shared memory and over tcp
# (--no-shm). Prints each run's worker_wait_frac (the part of a worker's step
# spent between asking for weights and getting them: push, pull, psd's step
# and waiting for the other worker, as the workers measure it), worker_step_ms
# and samples/s of the last epoch. Not a test.
#   bash bench/wait_bench.sh [EPOCHS]        (default 2)
set -euo pipefail
EPOCHS=${1:-2}
. "$(dirname "$0")/lib.sh"
bench_setup

run() { # $1 name, $2 pworker flags
    "$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers 2 --epochs "$EPOCHS" \
        --set 'model.layers=[784,1024,1024,10]' --set train.batch_size=256 --set checkpoint.dir= \
        --metrics "$WORK/m-$1.jsonl" --save "" 2>"$WORK/psd-$1.log" &
    local psd=$!
    # shellcheck disable=SC2086
    "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" --threads 1 $2 2>"$WORK/w0-$1.log" &
    # shellcheck disable=SC2086
    "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" --threads 1 $2 2>"$WORK/w1-$1.log" &
    wait
    python3 - "$1" "$WORK/m-$1.jsonl" <<'PY'
import json, sys
d = json.loads(open(sys.argv[2]).read().splitlines()[-1])
print(f"{sys.argv[1]:14s} worker_wait_frac {d['worker_wait_frac']:.3f}  worker_step_ms {d['worker_step_ms']:.1f}  "
      f"{d['epoch_samples_per_s']:.0f} samples/s  val_acc {d['val_acc']:.4f}")
PY
}
echo "MLP 784-1024-1024-10, batch 256/worker, 2 workers x 1 thread, $EPOCHS epochs, $(date -u +%F), $(nproc) cores"
run shared-memory ""
run tcp --no-shm
