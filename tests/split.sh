#!/bin/bash
# split.sh BUILD_DIR: the user's data, the held-out validation split, named
# sums, the best epoch and early stopping, end to end with real binaries on
# loopback (tests/table_worker through the public worker API, and pworker):
#  - psd takes the data's sizes and fingerprint from the first worker and
#    refuses a worker whose fingerprint or sizes differ, naming both;
#  - with data.val_fraction every epoch trains exactly the training samples
#    not held out and validates exactly the held-out ones, for 1, 2 and 3
#    workers and with a worker killed mid-epoch; the closing test covers
#    the test set once;
#  - a named sum's mean is exact (the single-process figure) for 1, 2, 3
#    workers, and the same on the held-out set for any number of workers;
#  - early stopping ends the run at the epoch its rule names (a scripted
#    loss), keep_best keeps that epoch's weights, and both go on where they
#    were after a stop and --resume;
#  - optimizer groups: each tensor of a run with groups (one unit, cut by
#    them) is the one a run with its group's settings for every tensor
#    gives, bit for bit (table_worker's gradient of a tensor reads only it);
#  - pworker on Fashion-MNIST: keep_best's file holds the epoch the metrics
#    file shows as best, and its closing test figures are psd eval's.
set -u
B=$1
T=$(mktemp -d /tmp/psd-split-XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
    [ -n "${KEEP:-}" ] && echo "kept $T" >&2 || rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "split: $*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PY=/usr/bin/python3
get() { $PY -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1" 2>/dev/null; }

# a model of 3 small tensors (packed into one unit); each run sets the rest (--set)
"$B/tests/table_worker" --yaml 3 small >"$T/model.yaml"
{
    cat "$T/model.yaml"
    printf 'optimizer: {name: sgd, lr: 0.1}\nschedule: {name: constant}\n'
} >"$T/base.yaml"

# start NAME CONFIG WORKERS PSD-ARGS... : psd in the background ($psd, $ep)
start() {
    local name=$1 cfg=$2 nw=$3
    shift 3
    ep="tcp://127.0.0.1:$(free_port)"
    "$B/psd" --config "$cfg" --workers "$nw" --start-timeout 60 --listen "$ep" --metrics "$T/$name.jsonl" \
        --save "" --set checkpoint.dir= --set run.epochs=3 --set train.batch_size=50 "$@" >"$T/$name.log" 2>&1 &
    psd=$!
    pids+=("$psd")
}
# worker NAME I TRAIN TEST ARGS...: table_worker i of run NAME in the background ($wpid)
worker() {
    local name=$1 i=$2
    shift 2
    "$B/tests/table_worker" "$ep" "$@" >"$T/$name-w$i.log" 2>&1 &
    wpid=$!
    pids+=("$wpid")
}
# finish NAME: psd's exit code 0
finish() {
    wait "$psd" || { tail -n 20 "$T/$1.log" >&2; fail "run $1: psd failed"; }
}
# check NAME PY-EXPR...: assertions on the metrics lines L (a list of dicts)
check() {
    local name=$1
    shift
    $PY - "$T/$name.jsonl" "$@" <<'PY' || fail "run $name: $(tail -n 3 "$T/$name.log")"
import json, sys
L = [json.loads(x) for x in open(sys.argv[1])]
for expr in sys.argv[2:]:
    if not eval(expr):
        sys.exit("failed: %s\n%s" % (expr, "\n".join(json.dumps(x) for x in L)))
PY
}

# -- the data: the first worker's; another fingerprint or size is refused with both named
start data "$T/base.yaml" 2 --set run.epochs=8 # waits for 2 workers with the same data
worker data 0 4000 100 id=fmnist-v1
w0=$wpid
for _ in $(seq 100); do grep -q "the run's data is rank 0's" "$T/data.log" && break; sleep 0.1; done
worker data 1 4000 100 id=fmnist-v2
wait "$wpid" && fail "a worker with another data fingerprint was not refused"
grep -q "'fmnist-v2'.*'fmnist-v1'" "$T/data.log" || fail "psd did not name both fingerprints: $(grep refused "$T/data.log")"
grep -q "fmnist-v2.*fmnist-v1" "$T/data-w1.log" || fail "the refused worker was not told both: $(cat "$T/data-w1.log")"
worker data 2 3999 100 id=fmnist-v1
wait "$wpid" && fail "a worker with another training set size was not refused"
grep -q "'fmnist-v1': 3999 training" "$T/data.log" || fail "psd did not name the other size: $(grep refused "$T/data.log")"
worker data 3 4000 100 id=fmnist-v1
wait "$wpid" || fail "a worker with the run's data failed: $(cat "$T/data-w3.log")"
wait "$w0" || fail "the first worker failed"
finish data
check data "len(L) == 8" "all(x['train_samples'] == 4000 and x['val_samples'] == 100 and x['val_set'] == 'test' for x in L)"
grep -q "no held-out validation set" "$T/data.log" || fail "no line says there is no held-out validation set"
echo "split: the data's sizes and fingerprint are the first worker's; another fingerprint or size is refused, both named"

# -- named sums on the test set: exact for 1, 2, 3 workers (a single process's figure)
sev=$($PY -c 'print(repr(sum(0.25 * (i % 7) for i in range(100)) / 100))')
acc=$($PY -c 'print(repr(sum(1 for i in range(100) if i % 3 == 0) / 100))')
for n in 1 2 3; do
    start sums$n "$T/base.yaml" $n
    for ((i = 0; i < n; i++)); do worker sums$n $i 1000 100 sums; done
    finish sums$n
    check sums$n "len(L) == 3" "all(x['val_sev'] == $sev and x['val_acc'] == $acc and x['val_samples'] == 100 for x in L)"
done
# and as psd serves it while the run goes on: /status, /metrics
hp=$(free_port)
start http "$T/base.yaml" 1 --set run.epochs=4 --http "127.0.0.1:$hp"
worker http 0 1000 100 sums slow=20 # 20 pushes of 50 an epoch, 0.4 s
for _ in $(seq 200); do
    st=$(get "http://127.0.0.1:$hp/status" || true)
    case $st in *'"val_means":{"sev":'*) break ;; esac
    sleep 0.05
done
$PY -c 'import json,sys; s=json.loads(sys.argv[1]); assert s["val_means"]["sev"] == float(sys.argv[2]), s["val_means"]' \
    "$st" "$sev" || fail "/status does not show the named sum's mean: $st"
get "http://127.0.0.1:$hp/metrics" | grep -q "^psd_val_mean{name=\"sev\"} $sev" ||
    fail "/metrics does not show the named sum's mean: $(get "http://127.0.0.1:$hp/metrics" | grep val_mean)"
finish http
echo "split: a named sum's mean is exact for 1, 2 and 3 workers (val_sev $sev), and so in /status and /metrics"

# -- the held-out split: exact counts every epoch for 1, 2, 3 workers and with one killed mid-epoch
for n in 1 2 3 k; do
    nw=$n
    [ "$n" = k ] && nw=3
    start held$n "$T/base.yaml" $nw --set data.val_fraction=0.1
    for ((i = 0; i < nw; i++)); do
        extra=()
        [ "$n" = k ] && [ $i = 2 ] && extra=(die=3) # 6 pushes of 50 an epoch: killed in the first
        worker held$n $i 1000 100 sums "${extra[@]}"
        [ "$n" = k ] && [ $i = 2 ] && killed=$wpid
    done
    if [ "$n" = k ]; then
        wait "$killed" 2>/dev/null
        [ $? = 137 ] || fail "the worker meant to be killed mid-epoch was not"
    fi
    finish held$n
    check held$n "len(L) == 3" \
        "all(x['train_samples'] == 900 and x['val_samples'] == 100 and x['val_set'] == 'held_out' for x in L)" \
        "L[-1]['test_samples'] == 100 and L[-1]['test_sev'] == $sev and L[-1]['test_acc'] == $acc" \
        "'test_loss' not in L[0]"
done
v1=$($PY -c 'import json,sys; print([json.loads(x)["val_sev"] for x in open(sys.argv[1])])' "$T/held1.jsonl")
for n in 2 3 k; do
    v=$($PY -c 'import json,sys; print([json.loads(x)["val_sev"] for x in open(sys.argv[1])])' "$T/held$n.jsonl")
    [ "$v" = "$v1" ] || fail "the held-out set's named sum differs between 1 and $n workers: $v1 / $v"
done
echo "split: 900 trained, 100 held out, 100 tested, every epoch, 1, 2, 3 workers and one killed mid-epoch"

# -- early stopping on a scripted loss, keep_best, and both across a stop and --resume
{
    cat "$T/base.yaml"
    printf 'data: {val_fraction: 0.1}\ncheckpoint: {every_epochs: 1}\n'
    printf 'train: {keep_best: {metric: val_loss, path: %s/best.safetensors},\n' "$T"
    printf '        early_stop: {metric: val_loss, patience: 2, min_delta: 0.01}}\n'
} >"$T/stop.yaml"
script=script=0.5,0.4,0.45,0.3,0.295,0.36,0.2,0.1,0.1,0.1
start stop "$T/stop.yaml" 2 --set checkpoint.dir="$T/ck" --set run.epochs=10
worker stop 0 1000 100 "$script"
worker stop 1 1000 100 "$script"
finish stop
# 0.295 is better than 0.3 (kept) but not by min_delta 0.01 (early_stop): stops after epoch 6
check stop "len(L) == 6" "L[-1].get('stopped_early') is True" "L[-1]['best_epoch'] == 5" \
    "all('stopped_early' not in x for x in L[:-1])" "L[-1]['best_test_samples'] == 100"
grep -q "stopping early after epoch 6: val_loss has not improved" "$T/stop.log" || fail "no line says why it stopped"
$PY - "$T/best.safetensors" "$T/stop.jsonl" <<'PY' || fail "keep_best did not keep epoch 5's weights"
import json, struct, sys
n = struct.unpack("<Q", open(sys.argv[1], "rb").read(8))[0]
meta = json.loads(open(sys.argv[1], "rb").read(8 + n)[8:])["__metadata__"]
L = [json.loads(x) for x in open(sys.argv[2])]
assert int(meta["epoch"]) == 5 and int(meta["step"]) == L[4]["step"], (meta, L[4]["step"])
PY
# the same with weights over the wire in bfloat16: the best epoch's test too
start stopw "$T/stop.yaml" 2 --set checkpoint.dir= --set run.epochs=10 --set train.wire_weights=bf16 \
    --set train.keep_best.path="$T/bestw.safetensors"
worker stopw 0 1000 100 "$script" wire
worker stopw 1 1000 100 "$script" # on psd's host: f32 in shared memory
finish stopw
check stopw "len(L) == 6" "L[-1]['best_epoch'] == 5" "L[-1]['best_test_samples'] == 100 and L[-1]['test_samples'] == 100"
# the same stopped after epoch 5 and resumed: it still stops after 6, with epoch 5 the best
rm -f "$T/best.safetensors"
start stopa "$T/stop.yaml" 2 --set checkpoint.dir="$T/ck2" --set run.epochs=10 --stop-after-epoch 5
worker stopa 0 1000 100 "$script"
worker stopa 1 1000 100 "$script"
finish stopa
start stopa "$T/stop.yaml" 2 --set checkpoint.dir="$T/ck2" --set run.epochs=10 --resume "$T/ck2"
worker stopa 2 1000 100 "$script"
worker stopa 3 1000 100 "$script"
finish stopa
check stopa "len(L) == 6" "L[-1].get('stopped_early') is True" "L[-1]['best_epoch'] == 5" \
    "L[-1]['best_test_loss'] == $($PY -c 'import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])["best_test_loss"])' "$T/stop.jsonl")"
grep -q "keep_best: the best epoch so far is 5" "$T/stopa.log" || fail "the resumed run did not take up the best epoch"
echo "split: early stopping ends a scripted run after epoch 6; keep_best keeps epoch 5; both go on after --resume"

# -- optimizer groups against runs with one setting for every tensor, sgd (momentum) and adamw
for opt in "sgd, momentum: 0.9" "adamw"; do
    for g in A B C D; do
        case $g in
        A) o='lr: 0.1, weight_decay: 0.1, groups: [{match: "*.bias", weight_decay: 0}, {match: "*.norm", lr_scale: 2}]' ;;
        B) o='lr: 0.1, weight_decay: 0.1' ;;
        C) o='lr: 0.1, weight_decay: 0' ;;
        D) o='lr: 0.2, weight_decay: 0.1' ;;
        esac
        { cat "$T/model.yaml"; printf 'optimizer: {name: %s, %s}\nschedule: {name: constant}\n' "$opt" "$o"; } >"$T/g$g.yaml"
        start g$g "$T/g$g.yaml" 1 --save "$T/g$g.safetensors"
        worker g$g 0 1000 100
        finish g$g
    done
    grep -q 'optimizer.groups\[0\] (\*.bias): 1 tensor' "$T/gA.log" || fail "psd did not say what groups[0] got: $(grep groups "$T/gA.log")"
    $PY - "$T" <<'PY' || fail "$opt: a tensor of the run with groups is not its group's settings' run's"
import json, struct, sys
def tensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items() if k != "__metadata__"}
A, B, C, D = (tensors("%s/g%s.safetensors" % (sys.argv[1], g)) for g in "ABCD")
assert A["layers.0.weight"] == B["layers.0.weight"], "weight: the default weight decay"
assert A["layers.0.bias"] == C["layers.0.bias"], "bias: weight decay 0"
assert A["layers.0.norm"] == D["layers.0.norm"], "norm: lr x 2"
assert A["layers.0.bias"] != B["layers.0.bias"] and A["layers.0.norm"] != B["layers.0.norm"], "groups changed nothing"
PY
done
echo "split: optimizer groups (sgd with momentum, adamw): every tensor of a run with groups is bit for bit its group's settings' run's"

# -- pworker, Fashion-MNIST: the best epoch's file, and its closing test figures are psd eval's
FM=/usr/share/datasets/fashion-mnist
if [ -r "$FM/train-images-idx3-ubyte.gz" ]; then
    printf 'model: {layers: [784, 64, 10]}\ndata: {train_limit: 6000, val_fraction: 0.2}\n' >"$T/mlp.yaml"
    printf 'train: {keep_best: {metric: val_acc, path: %s/mbest.safetensors}}\n' "$T" >>"$T/mlp.yaml"
    printf 'optimizer: {lr: 0.05}\n' >>"$T/mlp.yaml"
    start mlp "$T/mlp.yaml" 2 --set run.epochs=4 --set train.batch_size=64
    for i in 0 1; do
        "$B/pworker" --connect "$ep" --threads 1 >"$T/mlp-w$i.log" 2>&1 &
        pids+=($!)
    done
    finish mlp
    check mlp "len(L) == 4" "all(x['train_samples'] == 4800 and x['val_samples'] == 1200 for x in L)" \
        "L[-1]['best_epoch'] == max(range(4), key=lambda i: (L[i]['val_acc'], -i)) + 1" \
        "L[-1]['test_samples'] == 10000 and L[-1]['best_test_samples'] == 10000"
    "$B/psd" eval "$T/mbest.safetensors" --config "$T/mlp.yaml" --threads 1 >"$T/eval.txt" 2>&1 || fail "psd eval: $(cat "$T/eval.txt")"
    $PY - "$T/eval.txt" "$T/mlp.jsonl" <<'PY' || fail "the closing test of the best epoch is not psd eval's"
import json, re, sys
t = open(sys.argv[1]).read()
m = re.search(r"(\d+) samples, loss ([0-9.e+-]+), accuracy [0-9.]+ \((\d+) correct\).*epoch (\d+)", t)
L = [json.loads(x) for x in open(sys.argv[2])]
last = L[-1]
assert m, t
assert int(m.group(1)) == last["best_test_samples"] and int(m.group(3)) == last["best_test_correct"], (t, last)
assert abs(float(m.group(2)) - last["best_test_loss"]) <= 1e-6 * max(1, abs(last["best_test_loss"])), (t, last)
assert int(m.group(4)) == last["best_epoch"], (t, last)
print("split: pworker: best epoch %d (val_acc %.4f), its test: %d/%d correct, loss %.6f; psd eval agrees"
      % (last["best_epoch"], L[last["best_epoch"] - 1]["val_acc"], last["best_test_correct"],
         last["best_test_samples"], last["best_test_loss"]))
PY
else
    echo "split: no $FM: the pworker part is skipped"
fi
