#!/bin/bash
# Checkpoint cost on a 20M-parameter Adam model (MLP 784-4096-4096-10 =
# 20.0M parameters; weights + 2 Adam slots = 240 MB per checkpoint): psd + 1
# pworker train 200 steps with a checkpoint every 20 steps. Prints psd's
# checkpoint lines (size, write time, peak extra memory of the copy-on-write),
# the mean step interval with and without a checkpoint being written, and
# psd's peak resident memory. Not a test.
#   bash bench/ckpt_bench.sh
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
/usr/bin/time -f "psd peak RSS %M KiB" "$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers 1 --epochs 1 \
    --set model.layers=784,4096,4096,10 --set optimizer.name=adam --set optimizer.lr=0.001 \
    --set optimizer.weight_decay=0 --set schedule.name=constant --set data.train_limit=12800 \
    --set checkpoint.every_steps=20 --set checkpoint.every_epochs=0 --set checkpoint.keep=2 \
    --set "checkpoint.dir=$WORK/ckpt" --metrics "" --save "" 2> "$WORK/psd.log" &
PSD=$!
"$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" --devices cpu 2> "$WORK/w.log"
wait $PSD
grep -E "model |checkpoint |step interval|peak RSS" "$WORK/psd.log" | sed 's/^[^ ]* //'
