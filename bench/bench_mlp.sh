#!/bin/bash
# Benchmark: psd + 2 pworkers against PyTorch DDP (gloo) on the same task.
#
#   bash bench/bench_mlp.sh [EPOCHS]
#
# Task (both sides): MLP 784-256-128-10, Fashion-MNIST, batch 64 per worker,
# SGD momentum 0.9, lr 0.05 constant, 5 epochs, 2 processes with 1 thread
# each (OPENBLAS_NUM_THREADS=1). samples/s = training samples / training wall
# time, excluding start-up and validation, on both sides.
#
# OpenBLAS kernels: Debian's OpenBLAS 0.3.21 does not recognise the CPU of
# our build machines and falls back to generic "Prescott" kernels. pworker
# detects that and selects kernels for the CPU's AVX2/AVX-512 (see
# worker/cpu/psw_blas_tune.c). For a fair comparison PyTorch is run with the
# same kernels (OPENBLAS_CORETYPE), and also as Debian ships it.
# Not a test: nothing here passes or fails on speed.
set -euo pipefail
EPOCHS=${1:-5}
. "$(dirname "$0")/lib.sh"
bench_setup --bench
cat > "$WORK/bench.yaml" <<YAML
run: {seed: 42, epochs: $EPOCHS}
model: {layers: [784, 256, 128, 10]}
train: {batch_size: 64}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9, nesterov: false, weight_decay: 0}
schedule: {name: constant}
server: {metrics: "$WORK/metrics.jsonl", save: ""}
checkpoint: {dir: ""}
YAML

export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
"$ROOT/build/psd" --config "$WORK/bench.yaml" --listen "tcp://127.0.0.1:$PORT" --workers 2 \
    2> "$WORK/psd.log" &
PSD=$!
"$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" --threads 1 --verbose 2> "$WORK/w0.log" &
W0=$!
"$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" --threads 1 2> "$WORK/w1.log" &
W1=$!
wait $PSD
wait $W0 $W1
CORE=$(sed -n 's/.*OpenBLAS \([A-Za-z0-9]*\) kernels.*/\1/p' "$WORK/w0.log" | head -1)
LAST=$(tail -1 "$WORK/metrics.jsonl")
PSD_SPS=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["samples_per_s"])' "$LAST")
PSD_ACC=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["val_acc"])' "$LAST")
echo "psd + 2 pworkers (OpenBLAS $CORE kernels): $PSD_SPS samples/s, test accuracy $PSD_ACC"

torch_run() { # label, then env assignments
    local label=$1; shift
    local out
    out=$(env "$@" /usr/bin/python3 bench/torch_ddp_mlp.py --procs 2 --epochs "$EPOCHS" 2>&1 | grep '^RESULT' | tail -1)
    python3 - "$label" "${out#RESULT }" <<'PY'
import json, sys
r = json.loads(sys.argv[2])
print("%s: %.0f samples/s, test accuracy %.4f" % (sys.argv[1], r["samples_per_s"], r["test_acc"]))
print("TORCH %s %s %s" % (sys.argv[1].split()[0], r["samples_per_s"], r["test_acc"]))
PY
}
T1=$(torch_run "pytorch-ddp-same-kernels (gloo, 2x1 thread, OPENBLAS_CORETYPE=$CORE)" OPENBLAS_CORETYPE="$CORE")
T2=$(torch_run "pytorch-ddp-debian-default (gloo, 2x1 thread, Debian's kernel choice)" -u OPENBLAS_CORETYPE)
echo "$T1" | grep -v '^TORCH'
echo "$T2" | grep -v '^TORCH'
python3 - "$PSD_SPS" "$PSD_ACC" "$(echo "$T1" | grep '^TORCH')" "$(echo "$T2" | grep '^TORCH')" <<'PY'
import sys
sps, acc = float(sys.argv[1]), float(sys.argv[2])
for line in sys.argv[3:]:
    _, name, tsps, tacc = line.split()
    print("ratio psd / %s: %.2fx samples/s, accuracy %+.2f points" % (name, sps / float(tsps), 100 * (acc - float(tacc))))
PY
