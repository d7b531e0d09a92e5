#!/bin/bash
# Benchmark (issue 59): what a psd.torch step costs beyond the user's compute.
#
#   bash bench/torch_step.sh [PAIRS] [EPOCHS] [--gru]     (defaults 9 and 3; --gru: part 1 only)
#
# 1. The GRU of bench/torch_gru_step.py (4,164 parameters, batch 32, Adam, 1
#    thread): psd + 1 torch worker against one plain PyTorch process stepping
#    torch.optim.Adam itself over the same batches (the sample ids psd handed
#    out, in the same order), PAIRS alternated pairs (odd pairs psd first);
#    ms a step = the wall time of the training loops / steps (start-up and
#    validation excluded); the ratio psd / plain of each pair, and their median
#    (as bench/ab_speed.sh reports).
# 2. The MLP of bench/torch_mlp.sh (psd + 2 torch workers against psd + 2 C
#    pworkers, samples/s, and the torch workers' waiting share): that script,
#    without DDP, PAIRS rounds of EPOCHS epochs.
# Not a test: nothing here passes or fails on speed.
set -euo pipefail
PAIRS=${1:-9}
EPOCHS=${2:-3}
. "$(dirname "$0")/lib.sh"
bench_setup --bench
bench_torch_setup
cat >"$WORK/gru.yaml" <<YAML
run: {seed: 42, epochs: $EPOCHS}
model: {kind: from_worker}
train: {batch_size: 32, val_batch_size: 256}
server: {save: ""}
checkpoint: {dir: ""}
YAML

gru_psd() { # PAIR: psd + 1 torch worker; its RESULT line into $WORK/psd-PAIR.json, its batches into ids-PAIR
    local d="$WORK/gru-$1"
    mkdir -p "$d"
    (cd "$d" && exec "$ROOT/build/psd" --config "$WORK/gru.yaml" --listen "$EP" --workers 1 \
        --metrics "$d/metrics.jsonl") 2>"$d/psd.log" &
    local psd=$!
    PIDS+=("$psd")
    "$PY" "$ROOT/bench/torch_gru_step.py" psd "$EP" "$WORK/ids-$1" >"$d/w0.out" 2>"$d/w0.log" &
    local w=$!
    PIDS+=("$w")
    bench_wait_all "gru psd pair $1" "$d" "$psd" "$w"
    grep '^RESULT ' "$d/w0.out" | cut -c8- >"$WORK/psd-$1.json"
}

gru_plain() { # PAIR: the plain process over pair PAIR's batches
    "$PY" "$ROOT/bench/torch_gru_step.py" plain "$WORK/ids-$1" | grep '^RESULT ' | cut -c8- >"$WORK/plain-$1.json"
}

echo "$(date -u '+%F %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- \
    python worker server common bench 2>/dev/null || echo '*'): GRU 8-32 x 20 steps + head (4,164 parameters)," \
    "batch 32, Adam lr 1e-3, 1 thread, $EPOCHS epochs of 4096 samples, $PAIRS alternated pairs"
for p in $(seq 1 "$PAIRS"); do
    # the plain run needs psd's batches: a pair's first psd run makes them; odd pairs then run plain
    # second, even pairs run plain first over the previous pair's batches and psd second
    if [ $((p % 2)) = 1 ]; then
        gru_psd "$p"
        gru_plain "$p"
    else
        cp "$WORK/ids-$((p - 1))" "$WORK/ids-$p"
        gru_plain "$p"
        gru_psd "$p"
    fi
done
python3 - "$WORK" "$PAIRS" <<'PY'
import json, statistics, sys
work, pairs = sys.argv[1], int(sys.argv[2])
ratios = []
for p in range(1, pairs + 1):
    a = json.load(open("%s/psd-%d.json" % (work, p)))
    b = json.load(open("%s/plain-%d.json" % (work, p)))
    ratios.append(a["ms"] / b["ms"])
    print("pair %d: psd + 1 torch worker %.3f ms a step (%d steps, waiting %.1f%% of train_s), plain PyTorch %.3f ms "
          "(%d steps): ratio %.3f" % (p, a["ms"], a["steps"], 100 * a["wait_s"] / a["train_s"], b["ms"], b["steps"],
                                      ratios[-1]))
print("GRU: median of the pairs' ratios (psd / plain, ms a step) %.3f (min %.3f, max %.3f)"
      % (statistics.median(ratios), min(ratios), max(ratios)))
PY
[ "${3:-}" = --gru ] && exit 0
echo
bash "$ROOT/bench/torch_mlp.sh" "$EPOCHS" "$PAIRS" --no-ddp
