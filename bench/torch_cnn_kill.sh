#!/bin/bash
# examples/torch/fashion_cnn.py with psd and 3 torch workers (1 thread each), one of them
# killed with SIGKILL in the middle of epoch KILL_EPOCH: the run goes on with 2, and every
# epoch trains every sample once (psd's counts in its metrics file). Issue 43's acceptance.
#
#   bash bench/torch_cnn_kill.sh [EPOCHS] [KILL_EPOCH]
#
# Prints each epoch's metrics line (train_samples, val_samples, val_acc) and the closing test.
# Not a test: it reports, a person reads.
set -euo pipefail
EPOCHS=${1:-10}
KILL_EPOCH=${2:-2}
. "$(dirname "$0")/lib.sh"
bench_setup --bench
machine_line
export OMP_NUM_THREADS=1 PYTHONPATH="$ROOT/python" PSD_WORKER_LIB="$ROOT/build/libpsworker.so"
EP="tcp://127.0.0.1:$PORT"
"$ROOT/build/psd" --config examples/torch/fashion_cnn.yaml --listen "$EP" --workers 3 --epochs "$EPOCHS" \
    --metrics "$WORK/m.jsonl" --save "" --set checkpoint.dir= \
    --set train.keep_best.path="$WORK/best.safetensors" 2> "$WORK/psd.log" &
PSD=$!
for i in 0 1 2; do
    /usr/bin/python3 examples/torch/fashion_cnn.py "$EP" --threads 1 > "$WORK/w$i.out" 2> "$WORK/w$i.err" &
    eval "W$i=\$!"
done
# the middle of epoch KILL_EPOCH: the metrics line of the epoch before it, then a few seconds
PREV=$((KILL_EPOCH - 1))
until [ "$(cat "$WORK/m.jsonl" 2>/dev/null | wc -l)" -ge "$PREV" ] && grep -q "training $EPOCHS epochs" "$WORK/psd.log"
do sleep 0.5; done
sleep 6
kill -KILL "$W2"
echo "killed worker pid $W2 (SIGKILL) $PREV epochs and 6 s into the run; psd says:"
rc=0
wait "$PSD" || rc=$?
wait "$W0" "$W1" || true
wait "$W2" 2>/dev/null || true
grep -E "lost|samples of epoch" "$WORK/psd.log" | sed 's/^[^ ]* //' | head -n 5
python3 - "$WORK/m.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    x = json.loads(line)
    print("epoch %2d: train_samples %d val_samples %d val_acc %.4f%s" % (
        x["epoch"], x["train_samples"], x["val_samples"], x["val_acc"],
        "  test_samples %d test_acc %.4f (best epoch %s: %.4f)" % (
            x["test_samples"], x["test_acc"], x.get("best_epoch"), x.get("best_test_acc", float("nan")))
        if "test_samples" in x else ""))
PY
echo "psd exit $rc"
exit $rc
