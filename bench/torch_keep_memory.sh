#!/bin/bash
# A psd.torch worker with an 80 MB model over tcp (bench/torch_big_worker.py),
# with and without keep_memory (psw_keep_freed_memory), alternated RUNS times:
# the milliseconds a step, and the worker process's page faults and system
# time (GNU time). psd: 1 worker, plain SGD, batch 64, 640 samples, 2 epochs.
#   bash bench/torch_keep_memory.sh [RUNS]        (default 2)
# Not a test: nothing here passes or fails on speed.
set -euo pipefail
RUNS=${1:-2}
. "$(dirname "$0")/lib.sh"
bench_setup --bench
machine_line
printf 'model: {kind: from_worker}\ndata: {train_size: 640, test_size: 64}\ntrain: {batch_size: 64}\noptimizer: {name: sgd, lr: 0.01, momentum: 0, weight_decay: 0}\nschedule: {name: constant}\n' \
    >"$WORK/big.yaml"
run() { # $1 keep (1/0)
    local ep="tcp://127.0.0.1:$PORT"
    "$ROOT/build/psd" --config "$WORK/big.yaml" --listen "$ep" --workers 1 --epochs 2 --set checkpoint.dir= \
        --metrics "" --save "" 2>"$WORK/psd.log" &
    local psd=$!
    PYTHONPATH="$ROOT/python" PSD_WORKER_LIB="$ROOT/build/libpsworker.so.3" OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
        /usr/bin/time -f "  worker: %R page faults, %S s system, %U s user" /usr/bin/python3 \
        "$ROOT/bench/torch_big_worker.py" "$ep" 640 "$1" 2>&1 | grep -E "^keep_memory|page faults"
    wait $psd
}
for ((i = 1; i <= RUNS; i++)); do
    run 1
    run 0
done
