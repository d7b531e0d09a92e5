#!/bin/bash
# Benchmark (issue 43): bench/bench_mlp.sh's task through psd's Python path.
# psd + 2 torch workers (bench/torch_mlp_worker.py: the MLP as a torch
# nn.Module, psd's model.kind from_worker) against PyTorch DDP (gloo,
# bench/torch_ddp_mlp.py) and against psd + 2 C pworkers, on this machine.
#
#   bash bench/torch_mlp.sh [EPOCHS] [ROUNDS] [--no-ddp]     (defaults 5 and 1)
#
# --no-ddp: psd's two arms only, alternated (bench/torch_step.sh)
#
# Task (all three): MLP 784-256-128-10, Fashion-MNIST (all 60000 training
# samples), batch 64 per worker, SGD lr 0.05 momentum 0.9 (no Nesterov, no
# weight decay) constant, 2 processes with 1 thread each
# (OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1). psd's config is bench_mlp.sh's
# (its model.kind from_worker for the torch workers). Test accuracy: the last
# epoch's val_acc, on all 10000 test samples (no held-out split) / DDP's test
# of its final weights.
# OpenBLAS kernels as in bench_mlp.sh: pworker picks kernels for the CPU
# (worker/cpu/psw_blas_tune.c) and logs them; the torch workers and DDP get
# the same ones (OPENBLAS_CORETYPE), as bench_mlp.sh's
# "pytorch-ddp-same-kernels" run. An OPENBLAS_CORETYPE already in the
# environment is kept by all three.
# samples/s = training samples / training wall time, start-up and validation
# excluded: psd's metrics samples_per_s (samples trained / the sum of the
# epochs' training times, each from psd handing out the epoch's samples to
# the last sample's gradient applied), DDP's rank 0 between barriers around
# each epoch's loop (torch_ddp_mlp.py uses DDP's join() every epoch).
# Round 1 runs pworkers, torch workers, DDP in that order (the pworkers' log
# gives the kernels); even rounds the reverse. Medians at the end.
# Not a test: nothing here passes or fails on speed.
set -euo pipefail
EPOCHS=${1:-5}
ROUNDS=${2:-1}
DDP=1
[ "${3:-}" = --no-ddp ] && DDP=0
. "$(dirname "$0")/lib.sh"
bench_setup --bench
bench_torch_setup
for kind in pworker torch; do
    cat >"$WORK/$kind.yaml" <<YAML
run: {seed: 42, epochs: $EPOCHS}
model: $([ $kind = torch ] && echo '{kind: from_worker}' || echo '{layers: [784, 256, 128, 10]}')
train: {batch_size: 64}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9, nesterov: false, weight_decay: 0}
schedule: {name: constant}
server: {save: ""}
checkpoint: {dir: ""}
YAML
done
CORE=${OPENBLAS_CORETYPE:-}

psd_run() { # KIND ROUND: psd + 2 workers of KIND (pworker, torch); appends a line to $WORK/results
    local kind=$1 d="$WORK/$1-$2" k
    mkdir -p "$d"
    (cd "$d" && exec "$ROOT/build/psd" --config "$WORK/$kind.yaml" --listen "$EP" --workers 2 \
        --metrics "$d/metrics.jsonl") 2>"$d/psd.log" &
    local psd=$!
    PIDS+=("$psd")
    local ws=()
    for k in 0 1; do
        if [ "$kind" = pworker ]; then
            (cd "$d" && exec "$ROOT/build/pworker" --connect "$EP" --threads 1 --verbose) >"$d/w$k.out" 2>"$d/w$k.log" &
        else
            (cd "$d" && exec env ${CORE:+OPENBLAS_CORETYPE=$CORE} "$PY" "$ROOT/bench/torch_mlp_worker.py" "$EP" \
                --threads 1) >"$d/w$k.out" 2>"$d/w$k.log" &
        fi
        ws+=($!)
        PIDS+=($!)
    done
    bench_wait_all "$kind round $2" "$d" "$psd" "${ws[@]}"
    if [ "$kind" = pworker ] && [ -z "$CORE" ]; then
        CORE=$(sed -n 's/.*OpenBLAS \([A-Za-z0-9]*\) kernels.*/\1/p' "$d/w0.log" | head -n 1)
        [ -n "$CORE" ] || { echo "pworker's log names no OpenBLAS kernels:" >&2; tail -n 5 "$d/w0.log" >&2; exit 1; }
    fi
    python3 - "$kind" "$2" "$d" "$WORK/results" "$CORE" <<'PY'
import json, sys
kind, rnd, d, out, core = sys.argv[1:6]
lines = [json.loads(l) for l in open(d + "/metrics.jsonl")]
last = lines[-1]
samples = sum(l["train_samples"] for l in lines)
if last["val_set"] != "test" or last["val_samples"] != 10000:
    sys.exit("%s round %s: the last epoch validated %s (%d samples), not the whole test set"
             % (kind, rnd, last["val_set"], last["val_samples"]))
extra, share = "", float("nan")
if kind == "torch":
    tim = [json.loads(l[7:]) for k in (0, 1) for l in open("%s/w%d.out" % (d, k)) if l.startswith("TIMING ")]
    if len(tim) != 2:
        sys.exit("torch round %s: %d workers printed TIMING, not 2" % (rnd, len(tim)))
    have = all(t["wait_s"] is not None and t["train_s"] for t in tim)
    if have:
        share = sum(t["wait_s"] / t["train_s"] for t in tim) / 2
    own = sum(t["own_wait_s"] / t["loop_s"] for t in tim) / 2
    extra = ("; waiting share of a step %s (Worker wait_s/train_s), %.1f%% (wrapper's clocks), step %s ms, "
             "compute %s ms (workers 0 / 1), OpenBLAS %s"
             % ("%.1f%%" % (100 * share) if have else "n/a", 100 * own,
                " / ".join("%.2f" % (1e3 * t["loop_s"] / max(t["own_steps"], 1)) for t in tim),
                " / ".join("%.2f" % (1e3 * t["compute_s"] / max(t["own_steps"], 1)) for t in tim),
                "/".join(str(t["openblas_core"]) for t in tim)))
label = "psd + 2 pworkers (OpenBLAS %s kernels)" % core if kind == "pworker" else "psd + 2 torch workers"
print("round %s %s: %.0f samples/s (%d samples in %.1f s of training), test accuracy %.4f, "
      "psd's worker_wait_frac %.1f%%%s" % (rnd, label, last["samples_per_s"], samples, last["train_s"],
      last["val_acc"], 100 * sum(l["worker_wait_frac"] for l in lines) / len(lines), extra))
with open(out, "a") as f:
    f.write("%s %s %r %r %r\n" % (kind, rnd, last["samples_per_s"], last["val_acc"], share))
PY
}

ddp_run() { # ROUND: PyTorch DDP with the pworkers' kernels; appends a line to $WORK/results
    local d="$WORK/ddp-$1" rc=0
    mkdir -p "$d"
    env ${CORE:+OPENBLAS_CORETYPE=$CORE} "$PY" "$ROOT/bench/torch_ddp_mlp.py" --procs 2 --epochs "$EPOCHS" \
        >"$d/ddp.log" 2>&1 &
    local p=$!
    PIDS+=("$p")
    wait "$p" || rc=$?
    PIDS=()
    if [ $rc != 0 ] || ! grep -q '^RESULT ' "$d/ddp.log"; then
        echo "ddp round $1: failed (exit $rc); its log's end:" >&2
        tail -n 8 "$d/ddp.log" >&2
        exit 1
    fi
    python3 - "$1" "$(grep '^RESULT ' "$d/ddp.log" | tail -n 1)" "$WORK/results" "$(grep -m 1 '^openblas:' "$d/ddp.log")" <<'PY'
import json, sys
rnd, line, out, ob = sys.argv[1:5]
r = json.loads(line[7:])
print("round %s pytorch DDP (gloo, 2 x 1 thread, %s): %.0f samples/s (%d samples in %.1f s of training), "
      "test accuracy %.4f" % (rnd, ob.split(" [")[0], r["samples_per_s"], 60000 * r["epochs"], r["train_s"],
                              r["test_acc"]))
with open(out, "a") as f:
    f.write("ddp %s %r %r nan\n" % (rnd, r["samples_per_s"], r["test_acc"]))
PY
}

echo "$(date -u '+%F %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- \
    python worker server common 2>/dev/null || echo '*'), MLP 784-256-128-10 (bench_mlp.sh's task):" \
    "$EPOCHS epochs, $ROUNDS rounds, batch 64 x 2, 2 processes x 1 thread, sgd lr 0.05 momentum 0.9 constant"
: >"$WORK/results"
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then
        psd_run pworker "$r"
        psd_run torch "$r"
        [ $DDP = 0 ] || ddp_run "$r"
    else
        [ $DDP = 0 ] || ddp_run "$r"
        psd_run torch "$r"
        psd_run pworker "$r"
    fi
done
python3 - "$WORK/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    side, rnd, sps, acc, share = line.split()
    rows.setdefault(side, {})[int(rnd)] = (float(sps), float(acc), float(share))
med = statistics.median
rounds = sorted(rows["torch"])
def ratio(a, b):
    return med(rows[a][r][0] / rows[b][r][0] for r in rounds)
def m(side, i):
    return med(rows[side][r][i] for r in rounds)
share = [rows["torch"][r][2] for r in rounds if rows["torch"][r][2] == rows["torch"][r][2]]
ddp = "ddp" in rows
print("median of %d round(s): psd + 2 torch workers %.0f samples/s (accuracy %.4f), %spsd + 2 pworkers %.0f (%.4f)"
      % (len(rounds), m("torch", 0), m("torch", 1),
         "pytorch DDP %.0f (%.4f), " % (m("ddp", 0), m("ddp", 1)) if ddp else "", m("pworker", 0), m("pworker", 1)))
if ddp:
    print("ratio psd-torch / DDP: %.2fx samples/s" % ratio("torch", "ddp"))
print("ratio psd-torch / psd-pworker: %.2fx samples/s (what the Python binding and torch's kernels cost: %.0f%%)"
      % (ratio("torch", "pworker"), 100 * (1 - ratio("torch", "pworker"))))
if ddp:
    print("ratio psd-pworker / DDP: %.2fx samples/s (bench_mlp.sh's figure)" % ratio("pworker", "ddp"))
print("torch workers' waiting share of a step: %s (Worker wait_s/train_s, median)"
      % ("%.1f%%" % (100 * med(share)) if share else "n/a"))
PY
