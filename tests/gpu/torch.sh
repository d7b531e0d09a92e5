# Sourced by tests/gpu/run (mode "torch" or "all"): issue 64's measurements, psd.torch on
# the GPU. Uses run's L, BIN, LIBS, PY, note, ok. Each figure goes to the summary and to
# $L/torch-figures.jsonl (one JSON line each, what docs/benchmarks.md takes).
#   1. examples/torch/fashion_cnn.py --device cuda: 1 and 2 torch workers, 2 epochs, test
#      accuracy against the same script on the CPU (within 0.3 points); a worker killed
#      mid-epoch (exact counts); psd killed and resumed (the workers carry on)
#   2. the same CNN with torch.autocast(bfloat16), on shared memory and with bfloat16 on
#      the wire (train.wire_gradients/wire_weights: bf16, the worker over tcp)
#   3. ResNet-18 (CIFAR-style, 11.2M), batch 256, SGD momentum: plain PyTorch against 1
#      psd.torch worker, and 2 workers time-slicing the one GPU
#   4. C pworker, MLP 784-4096-4096-10 at batch 512 and 8192: the time psd adds to a step
#      against the transfer floor from the measured bandwidths
# TORCH_DEVICE=cpu (with TORCH_LIMIT) runs it all on the CPU, small: a dry run of the script.
TDEV=${TORCH_DEVICE:-cuda}
TLIM=${TORCH_LIMIT:-30000}        # data.train_limit for the CNN runs (0: the whole set)
TSTEPS=${TORCH_STEPS:-60}         # timed ResNet steps
TBATCH=${TORCH_BATCH:-256}
FIG=$L/torch-figures.jsonl
: > "$FIG"
export PYTHONPATH=$ROOT/python PSD_WORKER_LIB=${PSD_WORKER_LIB:-$BIN/libpsworker.so.3}
[ -n "${DATA:-}" ] && export PSD_FASHION_MNIST=$DATA
fig() { echo "$1" >> "$FIG"; }
killtree() { pkill -KILL -P "$1" 2>/dev/null; kill -KILL "$1" 2>/dev/null; } # timeout's child, then timeout
tport() { $PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
CNN_SET=(--set run.epochs=2 --set checkpoint.dir= --set "train.keep_best.path=$L/best.safetensors")
[ "$TLIM" -gt 0 ] && CNN_SET+=(--set "data.train_limit=$TLIM")
# cnn TAG WORKERS DEVICE [worker flags...] [-- psd flags...]: psd + torch workers; the metrics in $L/TAG-m.jsonl
cnn() {
    local tag=$1 n=$2 dev=$3; shift 3
    local wf=() pf=() port psd pids=() i rc=0
    while [ $# -gt 0 ] && [ "$1" != -- ]; do wf+=("$1"); shift; done
    [ "${1:-}" = -- ] && shift && pf=("$@")
    port=$(tport)
    rm -f "$L/$tag-m.jsonl"
    timeout 240 env LD_LIBRARY_PATH="$LIBS" "$BIN/psd" --config examples/torch/fashion_cnn.yaml \
        --listen "tcp://127.0.0.1:$port" --workers "$n" --metrics "$L/$tag-m.jsonl" --save "" \
        "${CNN_SET[@]}" "${pf[@]}" > "$L/$tag-psd.log" 2>&1 &
    psd=$!
    for ((i = 0; i < n; i++)); do
        timeout 240 env LD_LIBRARY_PATH="$LIBS" $PY examples/torch/fashion_cnn.py "tcp://127.0.0.1:$port" \
            --device "$dev" --threads "${TTHREADS:-4}" "${wf[@]}" > "$L/$tag-w$i.log" 2>&1 &
        pids+=($!)
    done
    CNN_PSD=$psd CNN_W=("${pids[@]}")
    [ -n "${CNN_NOWAIT:-}" ] && return 0
    wait $psd || rc=$?
    for p in "${pids[@]}"; do wait "$p" || true; done
    return $rc
}
last() { $PY -c 'import json,sys; r=json.loads(open(sys.argv[1]).readlines()[-1]); print(r.get(sys.argv[2], -1))' "$@" 2>/dev/null || echo -1; }
counts_ok() { $PY - "$1" <<'PY'
import json, sys
L = [json.loads(x) for x in open(sys.argv[1])]
t = [x["train_samples"] for x in L]
print("epochs %d, train_samples %s" % (len(L), t))
sys.exit(0 if len(L) == 2 and len(set(t)) == 1 else 1)
PY
}

# 1. correct: 1 and 2 workers on the GPU against as many on the CPU (the same global batch)
T0=$(date +%s)
cnn cnn-cpu1 1 cpu; rcc1=$?
cnn cnn-cpu2 2 cpu; rcc2=$?
cnn cnn-g1 1 "$TDEV"; rc1=$?
cnn cnn-g2 2 "$TDEV"; rc2=$?
AC1=$(last "$L/cnn-cpu1-m.jsonl" test_acc); AC2=$(last "$L/cnn-cpu2-m.jsonl" test_acc)
A1=$(last "$L/cnn-g1-m.jsonl" test_acc); A2=$(last "$L/cnn-g2-m.jsonl" test_acc)
S1=$(last "$L/cnn-g1-m.jsonl" samples_per_s); S2=$(last "$L/cnn-g2-m.jsonl" samples_per_s)
fig "{\"check\": \"cnn\", \"train_limit\": $TLIM, \"cpu1_test_acc\": $AC1, \"cpu2_test_acc\": $AC2, \"gpu1_test_acc\": $A1, \"gpu2_test_acc\": $A2, \"gpu1_samples_per_s\": $S1, \"gpu2_samples_per_s\": $S2}"
if [ $rcc1 -eq 0 ] && [ $rcc2 -eq 0 ] && [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && \
    $PY -c "import sys; sys.exit(0 if abs($A1 - $AC1) <= 0.003 and abs($A2 - $AC2) <= 0.003 else 1)"; then
    note "torch cnn $TDEV: PASS test_acc 1 worker $A1 (CPU $AC1, $S1 samples/s), 2 workers $A2 (CPU $AC2, $S2 samples/s)"
else note "torch cnn $TDEV: FAIL (rc $rcc1/$rcc2/$rc1/$rc2; test_acc 1 worker $A1 vs CPU $AC1, 2 workers $A2 vs $AC2; see cnn-*.log)"; ok=0; fi
echo "(cnn: $(( $(date +%s) - T0 )) s)"

# a worker killed mid-epoch: the other finishes, every epoch's counts exact
CNN_NOWAIT=1 cnn cnn-kill 2 "$TDEV"
until [ -s "$L/cnn-kill-m.jsonl" ] || ! kill -0 "$CNN_PSD" 2>/dev/null; do sleep 0.2; done
sleep 1
killtree "${CNN_W[1]}"
rck=0; wait "$CNN_PSD" || rck=$?; wait "${CNN_W[0]}" || true
CK=$(counts_ok "$L/cnn-kill-m.jsonl"); okk=$?
if [ $rck -eq 0 ] && [ $okk -eq 0 ]; then note "torch cnn $TDEV worker killed mid-epoch 2: PASS ($CK)"
else note "torch cnn $TDEV worker killed: FAIL (rc $rck; $CK; see cnn-kill-*.log)"; ok=0; fi

# psd killed (SIGKILL) in epoch 1 and resumed: the workers register again and carry on
CNN_NOWAIT=1 cnn cnn-res 2 "$TDEV" -- --set "checkpoint.dir=$L/ck" --set checkpoint.every_steps=50
until grep -q "epoch 1/2 step" "$L/cnn-res-psd.log" 2>/dev/null || ! kill -0 "$CNN_PSD" 2>/dev/null; do sleep 0.2; done
sleep 2
killtree "$CNN_PSD"; wait "$CNN_PSD" 2>/dev/null
PORT_RES=$(grep -o 'listening on tcp://127.0.0.1:[0-9]*' "$L/cnn-res-psd.log" | head -1 | sed 's/.*://')
timeout 240 env LD_LIBRARY_PATH="$LIBS" "$BIN/psd" --config examples/torch/fashion_cnn.yaml \
    --listen "tcp://127.0.0.1:$PORT_RES" --workers 2 --metrics "$L/cnn-res-m.jsonl" --save "" "${CNN_SET[@]}" \
    --set "checkpoint.dir=$L/ck" --set checkpoint.every_steps=50 --resume "$L/ck" >> "$L/cnn-res-psd.log" 2>&1
rcr=$?
for p in "${CNN_W[@]}"; do wait "$p" || true; done
CR=$(counts_ok "$L/cnn-res-m.jsonl"); okr=$?
if [ $rcr -eq 0 ] && [ $okr -eq 0 ] && grep -q "resuming run" "$L/cnn-res-psd.log"; then
    note "torch cnn $TDEV psd killed and resumed: PASS ($CR, test_acc $(last "$L/cnn-res-m.jsonl" test_acc))"
else note "torch cnn $TDEV psd killed and resumed: FAIL (rc $rcr; $CR; see cnn-res-*.log)"; ok=0; fi

# 2. mixed precision: autocast (shared memory), and autocast with bfloat16 on the wire (tcp)
cnn cnn-ac 1 "$TDEV" --autocast; rca=$?
cnn cnn-bf 1 "$TDEV" --autocast --no-shm -- --set train.wire_gradients=bf16 --set train.wire_weights=bf16; rcb=$?
AA=$(last "$L/cnn-ac-m.jsonl" test_acc); AB=$(last "$L/cnn-bf-m.jsonl" test_acc)
SA=$(last "$L/cnn-ac-m.jsonl" samples_per_s); SB=$(last "$L/cnn-bf-m.jsonl" samples_per_s)
fig "{\"check\": \"cnn_bf16\", \"autocast_test_acc\": $AA, \"autocast_samples_per_s\": $SA, \"wire_bf16_test_acc\": $AB, \"wire_bf16_samples_per_s\": $SB, \"f32_test_acc\": $A1}"
if [ $rca -eq 0 ] && [ $rcb -eq 0 ] && $PY -c "import sys; sys.exit(0 if $AA >= $A1 - 0.01 and $AB >= $A1 - 0.01 else 1)"; then
    note "torch cnn $TDEV bfloat16: PASS autocast test_acc $AA ($SA samples/s), + bf16 wire $AB ($SB samples/s), f32 $A1"
else note "torch cnn $TDEV bfloat16: FAIL (rc $rca/$rcb; test_acc $AA, $AB against f32 $A1; see cnn-ac-*, cnn-bf-*)"; ok=0; fi

# 3. ResNet-18, batch 256: plain PyTorch, then psd + 1 worker, psd + 2 workers on the one GPU
resnet_psd() { # TAG WORKERS
    local tag=$1 n=$2 port psd pids=() i
    port=$(tport)
    timeout 200 env LD_LIBRARY_PATH="$LIBS" "$BIN/psd" --config bench/resnet.yaml --listen "tcp://127.0.0.1:$port" \
        --workers "$n" --set "train.batch_size=$TBATCH" --metrics "" --save "" > "$L/$tag-psd.log" 2>&1 &
    psd=$!
    for ((i = 0; i < n; i++)); do
        timeout 200 env LD_LIBRARY_PATH="$LIBS" $PY bench/torch_resnet.py worker "tcp://127.0.0.1:$port" \
            --device "$TDEV" --batch "$TBATCH" --steps "$TSTEPS" --workers "$n" > "$L/$tag-w$i.log" 2>&1 &
        pids+=($!)
    done
    wait $psd
    for p in "${pids[@]}"; do wait "$p" || true; done
}
timeout 200 $PY bench/torch_resnet.py plain --device "$TDEV" --batch "$TBATCH" --steps "$TSTEPS" > "$L/resnet-plain.log" 2>&1
resnet_psd resnet-1 1
resnet_psd resnet-2 2
RN=$($PY - "$L" <<'PY'
import glob, json, sys
L = sys.argv[1]
def rows(pat):
    out = []
    for f in sorted(glob.glob(L + "/" + pat)):
        out += [json.loads(x) for x in open(f) if x.startswith("{")]
    return out
try:
    p = rows("resnet-plain.log")[0]
    w1 = rows("resnet-1-w*.log")[0]
    w2 = rows("resnet-2-w*.log")
    s2 = sum(r["samples_per_s"] for r in w2)
    added = w1["ms_per_step"] - p["ms_per_step"]
    fig = {"check": "resnet18", "batch": p["batch"], "plain_samples_per_s": p["samples_per_s"],
           "plain_ms": p["ms_per_step"], "psd1_samples_per_s": w1["samples_per_s"], "psd1_ms": w1["ms_per_step"],
           "ratio": w1["samples_per_s"] / p["samples_per_s"], "added_ms": added,
           "added_share": added / p["ms_per_step"], "psd1_wait_share": w1["wait_share"],
           "psd2_samples_per_s": s2, "psd2_over_psd1": s2 / w1["samples_per_s"]}
    open(L + "/torch-figures.jsonl", "a").write(json.dumps(fig) + "\n")
    print("%s plain %.0f samples/s (%.1f ms), psd + 1 worker %.0f (%.1f ms): %.2fx, psd adds %.1f ms (%.0f%% of "
          "the plain step), waits %.0f%%; 2 workers %.0f samples/s (%.2fx of 1)" % (
              "PASS" if fig["ratio"] >= 0.9 else "BELOW 0.9x:", p["samples_per_s"], p["ms_per_step"],
              w1["samples_per_s"], w1["ms_per_step"], fig["ratio"], added, 100 * fig["added_share"],
              100 * w1["wait_share"], s2, fig["psd2_over_psd1"]))
except Exception as e:
    print("FAIL not measured (%s)" % e)
PY
)
note "torch resnet-18 b$TBATCH $TDEV: $RN"
case "$RN" in FAIL*) ok=0 ;; esac

# 4. C pworker, MLP 784-4096-4096-10: the time psd adds against the transfer floor
if [ "$TDEV" = cuda ]; then
    timeout 60 $PY bench/torch_bw.py --device cuda > "$L/bw.log" 2>&1
    for B in 512 8192; do
        port=$(tport)
        LIM=(--epochs 1 --set "data.train_limit=$((B * 40))")
        [ $((B * 40)) -gt 60000 ] && LIM=(--epochs 3) # 7 steps an epoch
        timeout 200 env LD_LIBRARY_PATH="$LIBS" "$BIN/psd" --listen "tcp://127.0.0.1:$port" --workers 1 \
            "${DATA_FLAGS[@]}" "${LIM[@]}" --set model.layers=784,4096,4096,10 --set "train.batch_size=$B" --set optimizer.weight_decay=0 --set schedule.name=constant \
            --set checkpoint.dir= --metrics "$L/mlp$B-m.jsonl" --save "" > "$L/mlp$B-psd.log" 2>&1 &
        psd=$!
        timeout 200 env LD_LIBRARY_PATH="$LIBS" "$BIN/pworker" --connect "tcp://127.0.0.1:$port" --devices 0 \
            > "$L/mlp$B-w.log" 2>&1
        wait $psd
        timeout 120 env LD_LIBRARY_PATH="$LIBS" "$BIN/gpu_step" --batch "$B" > "$L/gpu_step$B.log" 2>&1
        timeout 120 $PY bench/torch_gpu_step.py --batch "$B" > "$L/torch_step$B.log" 2>&1
        MLP=$($PY - "$L" "$B" <<'PY'
import json, sys
L, B = sys.argv[1], int(sys.argv[2])
def tagged(path, tag):
    for line in open(path):
        if line.startswith(tag): return json.loads(line[len(tag):])
try:
    bw = [json.loads(x) for x in open(L + "/bw.log") if x.startswith("{")][0]
    m = json.loads(open(L + "/mlp%d-m.jsonl" % B).readlines()[-1])
    g = tagged(L + "/gpu_step%d.log" % B, "GPU_STEP ")
    t = tagged(L + "/torch_step%d.log" % B, "TORCH_STEP ")
    P = 784 * 4096 + 4096 + 4096 * 4096 + 4096 + 4096 * 10 + 10
    step_ms = 1000 * B / m["samples_per_s"]
    ours = g.get("ms_per_step_resident", g["ms_per_step"])
    added = step_ms - ours
    # the floor: the gradient down and the weights up (pinned copies), psd's pass over the
    # gradient, the weights and momentum (read 3 arrays, write 2) at memcpy speed
    floor = 1000 * 4 * P * (1 / (bw["d2h_GBps"] * 1e9) + 1 / (bw["h2d_GBps"] * 1e9) + 2.5 / (bw["memcpy_GBps"] * 1e9))
    fig = {"check": "pworker_mlp", "batch": B, "step_ms": step_ms, "gpu_step_ms": ours, "added_ms": added,
           "floor_ms": floor, "added_over_floor": added / floor, "torch_step_ms": t["ms_per_step"],
           "ratio_to_torch": t["ms_per_step"] / step_ms, "bw": bw}
    open(L + "/torch-figures.jsonl", "a").write(json.dumps(fig) + "\n")
    print("%s step %.2f ms end to end (GPU step %.2f): psd adds %.2f ms, floor %.2f ms (%.2fx); PyTorch alone "
          "%.2f ms: %.2fx of its rate" % ("PASS" if added <= 1.5 * floor else "ABOVE 1.5x:", step_ms, ours, added,
                                          floor, added / floor, t["ms_per_step"], t["ms_per_step"] / step_ms))
except Exception as e:
    print("FAIL not measured (%s)" % e)
PY
)
        note "pworker MLP 784-4096-4096-10 b$B: $MLP"
        case "$MLP" in FAIL*) ok=0 ;; esac
    done
fi
