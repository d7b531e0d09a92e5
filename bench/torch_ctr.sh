#!/bin/bash
# The click-through task two ways (issue 44): psd + 2 C pworkers on deploy/configs/ctr.yaml
# (model.kind ctr) and psd + 2 torch workers of examples/torch/embedding_bag.py (the same
# examples, model, optimizer, batch and epochs, EmbeddingBag(sparse=True), model.kind
# from_worker): each epoch's test log-loss side by side, and the torch workers' pushes.
#
#   bash bench/torch_ctr.sh [EPOCHS]
#
# Not a test: it reports, a person reads.
set -euo pipefail
EPOCHS=${1:-5}
. "$(dirname "$0")/lib.sh"
bench_setup --bench
bench_torch_setup
for kind in pworker torch; do
    if [ $kind = pworker ]; then cfg=deploy/configs/ctr.yaml; else cfg=examples/torch/embedding_bag.yaml; fi
    "$ROOT/build/psd" --config "$cfg" --listen "$EP" --workers 2 --epochs "$EPOCHS" --metrics "$WORK/$kind.jsonl" \
        --save "" --set checkpoint.dir= 2> "$WORK/$kind-psd.log" &
    PIDS=($!)
    for i in 0 1; do
        if [ $kind = pworker ]; then
            "$ROOT/build/pworker" --connect "$EP" --threads 1 2> "$WORK/$kind-w$i.log" &
        else
            "$PY" examples/torch/embedding_bag.py "$EP" --threads 1 > "$WORK/$kind-w$i.out" 2> "$WORK/$kind-w$i.log" &
        fi
        PIDS+=($!)
    done
    for p in "${PIDS[@]}"; do wait "$p"; done
    PIDS=()
done
grep "epoch $EPOCHS done" "$WORK"/torch-w*.out | sed 's/^[^:]*: */torch rank 0: /'
python3 - "$WORK/pworker.jsonl" "$WORK/torch.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
for x, y in zip(a, b):
    print("epoch %d: test log-loss pworker %.4f, torch %.4f (%+.4f); val_samples %d / %d; samples/s %.0f / %.0f" % (
        x["epoch"], x["val_loss"], y["val_loss"], y["val_loss"] - x["val_loss"], x["val_samples"], y["val_samples"],
        x["samples_per_s"], y["samples_per_s"]))
PY
