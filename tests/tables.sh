#!/bin/bash
# tables.sh BUILD_DIR: models of many named tensors end to end, trained by
# tests/table_worker (the public worker API; each tensor pushed from its own
# buffer, or all from one buffer laid out as psd lays them out; the
# sparse one as rows over the wire): 300 tensors of assorted shapes (some of
# one element, some over 1M floats, one sparse), 3 workers, one psd and 2
# psd shards give the same weights bit for bit, with the config's table and
# with the first worker's (from_worker); a table of 4,100 tensors
# trains, stops, resumes from its checkpoint, and its weights hold every tensor.
set -u
B=$1
T=$(mktemp -d /tmp/psd-tab-XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
    rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "tables: $*" >&2; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run NAME CONFIG WORKERS SHARDS TRAIN TEST: a run to its end, weights in $T/NAME.bin
run() {
    local name=$1 cfg=$2 nw=$3 shards=$4 lep wep sh1=
    lep=$(free_port)
    local set=(--config "$cfg" --workers "$nw" --start-timeout 60 --metrics "")
    [ -n "${CKPT:-}" ] || set+=(--set checkpoint.dir=)
    # shellcheck disable=SC2206
    set+=(${EXTRA:-})
    if [ "$shards" = 2 ]; then
        wep=$(free_port)
        "$B/psd" "${set[@]}" --listen "tcp://127.0.0.1:$wep" --shard 1/2 --leader "tcp://127.0.0.1:$lep" \
            --save "" >"$T/$name-s1.log" 2>&1 &
        sh1=$!
        pids+=("$sh1")
        set+=(--shard 0/2)
    fi
    "$B/psd" "${set[@]}" --listen "tcp://127.0.0.1:$lep" --save "$T/$name.bin" >"$T/$name.log" 2>&1 &
    local p0=$!
    pids+=("$p0")
    local how=("${HOW0:-}" flat "wire") # worker 0 pushes each tensor from its own buffer, 1 from one flat buffer,
    for ((w = 0; w < nw; w++)); do # 2 over the wire (the sparse tensor as rows there with one psd)
        "$B/tests/table_worker" "tcp://127.0.0.1:$lep" "$5" "$6" ${how[$w]} ${OFFER:-} >"$T/$name-w$w.log" 2>&1 &
        pids+=($!)
    done
    wait "$p0" || { tail -n 20 "$T/$name.log" "$T/$name-w0.log" >&2; fail "run $name failed"; }
    [ -z "$sh1" ] || wait "$sh1" || { tail -n 20 "$T/$name-s1.log" >&2; fail "shard 1 of run $name failed"; }
}

{
    "$B/tests/table_worker" --yaml 300
    printf 'run: {epochs: 2}\ndata: {train_size: 960, test_size: 30}\ntrain: {batch_size: 64}\n'
    printf 'optimizer: {name: adam, lr: 0.01, weight_decay: 0.001, clip_norm: 0.5}\nschedule: {name: constant}\n'
} >"$T/m300.yaml"
run one "$T/m300.yaml" 3 1 960 30
grep -q "in 300 tensors" "$T/one.log" || fail "psd did not train 300 tensors: $(grep -m1 'model ' "$T/one.log")"
run two "$T/m300.yaml" 3 2 960 30
HOW0=parts run parts "$T/m300.yaml" 3 1 960 30
"$B/tests/weights_cmp" "$T/one.bin" "$T/parts.bin" || fail "pushes in two parts gave other weights than whole pushes"
grep -q "psd shard 0 of 2" "$T/two.log" || fail "the second run had no psd shards"
"$B/tests/weights_cmp" "$T/one.bin" "$T/two.bin" || fail "2 psd shards gave other weights than one psd"
units=$(grep -o "in 300 tensors ([0-9]* units" "$T/one.log" | grep -o "([0-9]*" | tr -d '(')
loss=$(grep -o "val_loss [0-9.e+-]*" "$T/one.log" | tail -1)
echo "tables: 300 tensors in $units units, 3 workers, 2 epochs ($loss): one psd and 2 psd shards, the same weights;"
echo "tables: the same with pushes in two parts (a tensor given twice refused)"

# optimizer groups: biases without weight decay, the norms and the sparse
# tensor (stepped by rows) at other rates, one group that fits nothing; the
# units pack tensors of different groups. 2 psd shards step their parts with
# the same groups: the same weights as one psd, and not those without groups.
{
    "$B/tests/table_worker" --yaml 300
    printf 'run: {epochs: 2}\ndata: {train_size: 960, test_size: 30}\ntrain: {batch_size: 64}\n'
    printf 'optimizer:\n  name: adam\n  lr: 0.01\n  weight_decay: 0.001\n  clip_norm: 0.5\n  groups:\n'
    printf '    - {match: "*.bias", weight_decay: 0}\n    - {match: "*.norm", lr_scale: 2}\n'
    printf '    - {match: "layers.1.scale", lr_scale: 0.5}\n    - {match: "nothing.*", lr_scale: 2}\n'
    printf 'schedule: {name: constant}\n'
} >"$T/m300g.yaml"
run g1 "$T/m300g.yaml" 3 1 960 30
run g2 "$T/m300g.yaml" 3 2 960 30
grep -q 'optimizer.groups\[0\] (\*.bias): 75 tensors: layers.0.bias, layers.1.bias, layers.2.bias, ...' "$T/g1.log" ||
    fail "psd did not log the biases' group: $(grep -m1 'groups\[0\]' "$T/g1.log")"
grep -q 'optimizer.groups\[3\] (nothing.\*) matches none' "$T/g1.log" || fail "psd did not warn of a group that fits nothing"
"$B/tests/weights_cmp" "$T/g1.bin" "$T/g2.bin" || fail "optimizer groups: 2 psd shards gave other weights than one psd"
if "$B/tests/weights_cmp" "$T/one.bin" "$T/g1.bin" >/dev/null 2>&1; then fail "optimizer groups changed no weight"; fi
echo "tables: optimizer groups (biases without weight decay, norms and the sparse tensor at other rates): one psd and"
echo "tables: 2 psd shards, the same weights, other than without groups"

{
    printf 'model: {kind: from_worker}\nrun: {epochs: 1}\ndata: {train_size: 960, test_size: 30}\n'
    printf 'train: {batch_size: 64}\noptimizer: {name: adam, lr: 0.01, groups: [{match: "*.norm", lr_scale: 2}]}\n'
    printf 'schedule: {name: constant}\n'
} >"$T/fw.yaml"
OFFER=offer=300 run fw1 "$T/fw.yaml" 3 1 960 30
grep -q "the model is the first worker.s: 300 tensors" "$T/fw1.log" || fail "psd did not take the 300 tensors offered"
# the groups are matched once the first worker has offered the tensors' names
grep -q 'optimizer.groups\[0\] (\*.norm): 75 tensors' "$T/fw1.log" || fail "from_worker: the group got no tensor"
OFFER=offer=300 run fw2 "$T/fw.yaml" 3 2 960 30
"$B/tests/weights_cmp" "$T/fw1.bin" "$T/fw2.bin" || fail "from_worker, 300 tensors: 2 psd shards gave other weights"
sed 's/name: adam, lr: 0.01/name: sgd, lr: 1e-30, momentum: 0, weight_decay: 0/' "$T/fw.yaml" >"$T/fw0.yaml"
OFFER=offer=300 run fw0 "$T/fw0.yaml" 1 1 960 30 # steps too small to change a float: the values offered
"$B/psd" export "$T/fw0.bin" "$T/fw0.safetensors" >/dev/null || fail "psd export"
if /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
/usr/bin/python3 - "$T/fw0.safetensors" <<'PY' || fail "psd did not train from the values the first worker offered"
import json, struct, sys
import numpy as np
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); data = f.read()
h.pop("__metadata__", None)
names = sorted(h, key=lambda k: h[k]["data_offsets"][0])
assert len(names) == 300, len(names)
for k, name in enumerate(names):
    a, b = h[name]["data_offsets"]
    v = np.frombuffer(data[a:b], dtype="<f4")
    want = (0.01 * np.cos(0.3 * k + 0.001 * np.arange(v.size))).astype(np.float32)
    assert np.allclose(v, want, rtol=0, atol=1e-9), (name, v[:3], want[:3])
PY
    echo "tables: from_worker, 300 tensors: psd trains from the values offered (read back with numpy)"
else
    echo "tables: no numpy for /usr/bin/python3: the values offered not read back"
fi
echo "tables: from_worker, 300 tensors offered (values in units): one psd and 2 psd shards, the same weights"

{
    "$B/tests/table_worker" --yaml 4100 small
    printf 'run: {epochs: 2}\ndata: {train_size: 128, test_size: 8}\ntrain: {batch_size: 64}\n'
    printf 'optimizer: {name: sgd, lr: 0.1}\nschedule: {name: constant}\ncheckpoint: {dir: %s}\n' "$T/ck"
} >"$T/m4100.yaml"
CKPT=1 EXTRA="--stop-after-epoch 1" run big "$T/m4100.yaml" 1 1 128 8
grep -q "in 4100 tensors" "$T/big.log" || fail "psd did not train 4100 tensors"
CKPT=1 EXTRA="--resume $T/ck" run again "$T/m4100.yaml" 1 1 128 8
grep -q "resuming run" "$T/again.log" || { tail -n 20 "$T/again.log" >&2; fail "the 4100 tensors' run did not resume"; }
grep -q "epoch 2/2" "$T/again.log" || fail "the resumed run did not train its second epoch"
"$B/psd" export "$T/again.bin" "$T/again.safetensors" >/dev/null || fail "psd export of 4100 tensors"
ck=$(ls "$T"/ck/run-*/ckpt-*.psdc | sort | tail -n 1)
"$B/psd" export "$ck" "$T/ck.safetensors" >/dev/null || fail "psd export of the 4100 tensors' checkpoint"
cmp -s "$T/again.safetensors" "$T/ck.safetensors" || fail "the last checkpoint's weights are not the saved ones"
n=$(python3 -c 'import json,struct,sys; f=open(sys.argv[1],"rb"); n=struct.unpack("<Q",f.read(8))[0]; h=json.loads(f.read(n)); h.pop("__metadata__",None); print(len(h))' "$T/again.safetensors")
[ "$n" = 4100 ] || fail "the exported weights hold $n tensors, not 4100"
echo "tables: 4100 tensors: stopped after epoch 1, resumed from its checkpoint to the end; the weights saved and the"
echo "tables: last checkpoint exported as safetensors hold all 4100 tensors, the same bytes"
echo "tables: ok"
