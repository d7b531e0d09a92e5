#!/bin/bash
# Benchmark (issue 43): examples/torch/fashion_cnn.py trained by psd + 2 torch
# workers against PyTorch DDP (gloo) with the same model, on this machine.
#
#   bash bench/torch_cnn.sh [EPOCHS] [ROUNDS]      (defaults 10 and 2)
#   TRAIN_LIMIT=2048 bash bench/torch_cnn.sh 1 1   (a quick check: the first 2048 samples only)
#   SCHEDULE=constant bash bench/torch_cnn.sh      (lr 0.05 throughout on both sides)
#
# Both sides: the example's CNN (its Net, initial weights from seed 0), its
# normalisation, batch 64 per process (a global batch of 128), 2 processes x
# 1 thread (OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1, torch.set_num_threads(1);
# an OPENBLAS_CORETYPE in the environment goes to both), SGD lr 0.05 momentum
# 0.9 weight decay 5e-4 Nesterov (psd's default, which the example's config
# keeps), psd's onecycle schedule (bench/torch_ddp_cnn.py computes psd's
# formula, server/psd_optim.c, step by step), EPOCHS epochs over all 60000
# training samples. psd runs examples/torch/fashion_cnn.yaml with --set:
# data.val_fraction=0 (no held-out split, so both train on all 60000 samples and
# every epoch validates on the whole test set: the last epoch's val_acc is the
# final weights' accuracy on all 10000 test samples), keep_best off (its file
# would go to the work directory), no weights file, no checkpoints, the metrics
# file in the work directory. The torch workers are bench/torch_cnn_worker.py:
# the example's loop with clocks around it.
#
# samples/s, the same measure on both sides: training samples / training wall
# time, start-up, validation and the test excluded. psd: its metrics line's
# samples_per_s = all samples trained / the sum of the epochs' training times,
# each from psd handing out the epoch's samples (start_epoch) to every sample's
# gradient applied (psd_valid_start): the epoch's first weights to the workers
# included. DDP: rank 0 times each epoch from a dist.barrier() before its loop
# to one after it.
# Waiting share of a torch worker's step: psd.torch.Worker's wait_s / train_s
# (blocked on psd: push, next weights, barrier / time inside batches()); the
# wrapper's own clocks (time outside the loop bodies' compute / loop time); and
# psd's metrics worker_wait_frac (waiting for the weights as the worker library
# times a step, without the barrier). ROUNDS alternations (psd first in odd
# rounds, DDP first in even ones); medians at the end.
# Not a test: nothing here passes or fails on speed.
set -euo pipefail
EPOCHS=${1:-10}
ROUNDS=${2:-2}
TRAIN_LIMIT=${TRAIN_LIMIT:-0}
SCHEDULE=${SCHEDULE:-onecycle}
case "$SCHEDULE" in onecycle | constant) ;; *) echo "SCHEDULE: onecycle or constant" >&2; exit 2 ;; esac
. "$(dirname "$0")/lib.sh"
bench_setup --bench
bench_torch_setup

psd_run() { # ROUND: psd + 2 torch workers; appends a "psd ..." line to $WORK/results
    local d="$WORK/psd-$1"
    mkdir -p "$d"
    (cd "$d" && exec "$ROOT/build/psd" --config "$ROOT/examples/torch/fashion_cnn.yaml" --listen "$EP" \
        --workers 2 --epochs "$EPOCHS" --metrics "$d/metrics.jsonl" --set server.save= --set checkpoint.dir= \
        --set data.val_fraction=0 --set data.train_limit="$TRAIN_LIMIT" --set train.keep_best.metric= \
        --set train.keep_best.path="$d/best.safetensors" --set schedule.name="$SCHEDULE" \
        --set optimizer.lr=0.05 --set optimizer.momentum=0.9 --set optimizer.weight_decay=5e-4 \
        --set optimizer.nesterov=true --set train.batch_size=64) 2>"$d/psd.log" &
    local psd=$!
    PIDS+=("$psd")
    (cd "$d" && exec "$PY" "$ROOT/bench/torch_cnn_worker.py" "$EP" --threads 1) >"$d/w0.out" 2>"$d/w0.log" &
    local w0=$!
    PIDS+=("$w0")
    (cd "$d" && exec "$PY" "$ROOT/bench/torch_cnn_worker.py" "$EP" --threads 1) >"$d/w1.out" 2>"$d/w1.log" &
    local w1=$!
    PIDS+=("$w1")
    bench_wait_all "psd round $1" "$d" "$psd" "$w0" "$w1"
    [ -z "$(ls "$d"/*.safetensors "$d"/*.bin 2>/dev/null)" ] || echo "note: psd left weights files in $d" >&2
    python3 - "$1" "$d" "$WORK/results" <<'PY'
import json, sys
rnd, d, out = sys.argv[1:4]
lines = [json.loads(l) for l in open(d + "/metrics.jsonl")]
last = lines[-1]
samples = sum(l["train_samples"] for l in lines)
sps = last["samples_per_s"]  # psd's own: samples trained / training seconds, the whole run
check = samples / last["train_s"] if last["train_s"] > 0 else 0.0
if last["val_set"] != "test" or last["val_samples"] != 10000:
    sys.exit("psd round %s: the last epoch validated %s (%d samples), not the whole test set"
             % (rnd, last["val_set"], last["val_samples"]))
tim = []
for k in (0, 1):
    for l in open("%s/w%d.out" % (d, k)):
        if l.startswith("TIMING "):
            tim.append(json.loads(l[7:]))
if len(tim) != 2:
    sys.exit("psd round %s: %d workers printed TIMING, not 2" % (rnd, len(tim)))
have = all(t["wait_s"] is not None and t["train_s"] for t in tim)
share = sum(t["wait_s"] / t["train_s"] for t in tim) / 2 if have else float("nan")
own = sum(t["own_wait_s"] / t["loop_s"] for t in tim) / 2
wf = sum(l["worker_wait_frac"] for l in lines) / len(lines)
comp = " / ".join("%.1f" % (1e3 * t["compute_s"] / max(t["own_steps"], 1)) for t in tim)
step = " / ".join("%.1f" % (1e3 * t["loop_s"] / max(t["own_steps"], 1)) for t in tim)
print("round %s psd + 2 torch workers: %.0f samples/s (%d samples in %.1f s of training; samples/train_s %.0f), "
      "test accuracy %.4f (%d/%d), lr of the last step %.3g" % (rnd, sps, samples, last["train_s"], check,
      last["val_acc"], last["val_correct"], last["val_samples"], last["lr"]))
print("round %s torch workers' waiting share of a step: %s (psd.torch Worker wait_s/train_s, steps %s), "
      "%.1f%% (this wrapper's clocks: outside the compute / batches() loop time), psd's worker_wait_frac %.1f%%; "
      "a step %s ms of which compute %s ms (workers 0 / 1)"
      % (rnd, "%.1f%%" % (100 * share) if have else "n/a (this psd.torch has no wait_s/train_s yet)",
         "/".join(str(t["steps"]) for t in tim), 100 * own, 100 * wf, step, comp))
with open(out, "a") as f:
    f.write("psd %s %r %r %r %r %r %d %s\n" % (rnd, sps, last["val_acc"], share, own, wf, samples,
            json.dumps([l["lr"] for l in lines], separators=(",", ":"))))
PY
}

ddp_run() { # ROUND: PyTorch DDP; appends a "ddp ..." line to $WORK/results
    local d="$WORK/ddp-$1" rc=0
    mkdir -p "$d"
    "$PY" "$ROOT/bench/torch_ddp_cnn.py" --procs 2 --epochs "$EPOCHS" --batch 64 --schedule "$SCHEDULE" \
        --lr 0.05 --train-limit "$TRAIN_LIMIT" >"$d/ddp.log" 2>&1 &
    local p=$!
    PIDS+=("$p")
    wait "$p" || rc=$?
    PIDS=()
    if [ $rc != 0 ] || ! grep -q '^RESULT ' "$d/ddp.log"; then
        echo "ddp round $1: failed (exit $rc); its log's end:" >&2
        tail -n 8 "$d/ddp.log" >&2
        exit 1
    fi
    grep -m 1 '^openblas:' "$d/ddp.log" | sed "s/^/round $1 DDP /"
    python3 - "$1" "$(grep '^RESULT ' "$d/ddp.log" | tail -n 1)" "$WORK/results" <<'PY'
import json, sys
rnd, line, out = sys.argv[1:4]
r = json.loads(line[7:])
print("round %s pytorch DDP (gloo, 2 x 1 thread): %.0f samples/s (%d samples in %.1f s of training), "
      "test accuracy %.4f, lr of the last step %.3g" % (rnd, r["samples_per_s"], r["train_samples"] * r["epochs"],
      r["train_s"], r["test_acc"], r["epoch_lr"][-1]))
with open(out, "a") as f:
    f.write("ddp %s %r %r 0 0 0 %d %s\n" % (rnd, r["samples_per_s"], r["test_acc"], r["train_samples"] * r["epochs"],
            json.dumps(r["epoch_lr"], separators=(",", ":"))))
PY
}

echo "$(date -u '+%F %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- \
    python worker server common 2>/dev/null || echo '*'), torch CNN (examples/torch/fashion_cnn.py):" \
    "$EPOCHS epochs, $ROUNDS rounds, batch 64 x 2, 2 processes x 1 thread, schedule $SCHEDULE," \
    "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}$([ "$TRAIN_LIMIT" = 0 ] || echo ", first $TRAIN_LIMIT samples only")"
: >"$WORK/results"
for r in $(seq 1 "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then
        psd_run "$r"
        ddp_run "$r"
    else
        ddp_run "$r"
        psd_run "$r"
    fi
done
python3 - "$WORK/results" <<'PY'
import json, statistics, sys
rows = {"psd": {}, "ddp": {}}
for line in open(sys.argv[1]):
    side, rnd, sps, acc, share, own, wf, samples, lrs = line.split()
    rows[side][int(rnd)] = dict(sps=float(sps), acc=float(acc), share=float(share), own=float(own), wf=float(wf),
                                samples=int(samples), lrs=json.loads(lrs))
med = statistics.median
ratios = []
for rnd in sorted(rows["psd"]):
    p, t = rows["psd"][rnd], rows["ddp"][rnd]
    ratios.append(p["sps"] / t["sps"])
    lr_diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(p["lrs"], t["lrs"]))
    note = "" if p["samples"] == t["samples"] else " (samples trained differ: psd %d, DDP %d)" % (p["samples"], t["samples"])
    print("round %d: psd/DDP %.2fx samples/s, accuracy %+.2f points; epochs' last lr psd vs DDP: max relative "
          "difference %.1e%s" % (rnd, ratios[-1], 100 * (p["acc"] - t["acc"]), lr_diff, note))
P, T = rows["psd"].values(), rows["ddp"].values()
share = [p["share"] for p in P if p["share"] == p["share"]]
print("median of %d rounds: psd + 2 torch workers %.0f samples/s, test accuracy %.4f; pytorch DDP %.0f samples/s, "
      "test accuracy %.4f; psd/DDP %.2fx (median of the rounds' ratios)"
      % (len(ratios), med(p["sps"] for p in P), med(p["acc"] for p in P), med(t["sps"] for t in T),
         med(t["acc"] for t in T), med(ratios)))
print("median torch workers' waiting share of a step: %s (Worker wait_s/train_s), %.1f%% (wrapper's clocks), "
      "psd's worker_wait_frac %.1f%%" % ("%.1f%%" % (100 * med(share)) if share else "n/a",
                                         100 * med(p["own"] for p in P), 100 * med(p["wf"] for p in P)))
PY
