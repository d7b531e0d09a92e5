#!/bin/bash
# examples/c/fm_worker.c as a user builds it: against the installed library
# (`meson install` into a scratch root, `pkg-config --cflags --libs
# psworker` and nothing else), then two of them train examples/c/fm.yaml
# with a real psd on loopback (a free port, psd ended by its pid). Checks
# that the run ends well, that the test loss falls below what a constant
# guess gives, and that psd's weights (.safetensors) hold the table's
# tensors, read back with numpy (/usr/bin/python3) when it is installed, bit
# for bit, and that psd reads files numpy writes in F32, F16 and BF16 bit
# for bit.
# Then model.kind from_worker: the first worker offers the model, a worker
# whose factors have another shape is refused with that tensor named; psd
# killed (-9) after a checkpoint resumes with the model from it, and the
# workers of the resumed run are not asked for theirs; its last checkpoint
# exported (psd export) holds the weights it saved, bit for bit. Last, the
# config's table trained by 3 workers with 2 psd shards gives the weights 3
# workers with one psd give, bit for bit; and so does from_worker (shard 1
# takes the model and its part of the first worker's values from shard 0).
#   bash tests/example_c.sh BUILD_DIR SOURCE_ROOT
set -euo pipefail
B=$(cd "${1:?usage: tests/example_c.sh BUILD_DIR SOURCE_ROOT}" && pwd)
S=$(cd "${2:?usage: tests/example_c.sh BUILD_DIR SOURCE_ROOT}" && pwd)
T=$(mktemp -d /tmp/psd-exc-XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; [ -n "${KEEP:-}" ] || rm -rf "$T"; }
trap cleanup EXIT
KEEP=${KEEP:-}
fail() { echo "example_c: $*" >&2; exit 1; }

DESTDIR=$T/root meson install -C "$B" --no-rebuild --quiet >"$T/install.log" 2>&1 ||
    { cat "$T/install.log" >&2; fail "meson install failed"; }
pc=$(find "$T/root" -name psworker.pc | head -n 1)
so=$(find "$T/root" -name 'libpsworker.so.3' | head -n 1)
export PKG_CONFIG_PATH=$(dirname "$pc") PKG_CONFIG_SYSROOT_DIR=$T/root
flags=$(pkg-config --cflags --libs psworker) || fail "pkg-config --cflags --libs psworker failed"
# shellcheck disable=SC2086  # the flags are words
cc -std=c17 -O2 -Wall -Wextra -Werror "$S/examples/c/fm_worker.c" -o "$T/fm_worker" $flags -lm ||
    fail "cannot build the example against the installed library ($flags)"
lines=$(wc -l <"$S/examples/c/fm_worker.c")
[ "$lines" -lt 200 ] || fail "the example has $lines lines (under 200, the issue says)"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$B/psd" --config "$S/examples/c/fm.yaml" --listen "tcp://127.0.0.1:$port" --set checkpoint.dir= \
    --metrics "$T/m.jsonl" --save "$T/fm.safetensors" --start-timeout 60 >"$T/psd.log" 2>&1 &
pids+=($!)
psd_pid=$!
for w in 0 1; do
    LD_LIBRARY_PATH=$(dirname "$so") "$T/fm_worker" "tcp://127.0.0.1:$port" >"$T/w$w.log" 2>&1 &
    pids+=($!)
done
for _ in $(seq 1 300); do kill -0 "$psd_pid" 2>/dev/null || break; sleep 1; done
kill -0 "$psd_pid" 2>/dev/null && { cat "$T/psd.log" >&2; fail "psd did not end within 300 s"; }
wait "$psd_pid" || { cat "$T/psd.log" "$T/w0.log" "$T/w1.log" >&2; fail "psd exited non-zero"; }
[ -s "$T/fm.safetensors" ] || fail "psd wrote no weights"
rc=0
"$B/psd" eval "$T/fm.safetensors" >"$T/eval.log" 2>&1 || rc=$?
[ "$rc" = 2 ] && grep -q "not one of psd's built-in models" "$T/eval.log" ||
    { cat "$T/eval.log" >&2; fail "psd eval of another model: exit $rc"; }
# the test loss of the last epoch against a constant guess at the click rate (about 0.69)
python3 - "$T/m.jsonl" <<'PY' || { cat "$T/psd.log" >&2; fail "the factorization machine did not learn"; }
import json, sys
ep = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
last = ep[-1]
print("example_c: %d epochs, val_loss %.4f, val_acc %.4f" % (len(ep), last["val_loss"], last["val_acc"]))
sys.exit(0 if last["val_loss"] < 0.60 and ep[0]["val_loss"] > last["val_loss"] else 1)
PY
if /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
    /usr/bin/python3 - "$T/fm.safetensors" <<'PY' || fail "numpy does not read psd's safetensors as the table"
import json, struct, sys
import numpy as np
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
want = {"bias": [1], "linear.weight": [4000], "factors.weight": [4000, 8]}
got = {k: v["shape"] for k, v in h.items() if k != "__metadata__"}
assert got == want, got
f = h["factors.weight"]
a = np.frombuffer(b[8 + n + f["data_offsets"][0]:8 + n + f["data_offsets"][1]], dtype="<f4").reshape(4000, 8)
assert np.isfinite(a).all() and a.std() > 0.005, a.std()
print("example_c: numpy reads", ", ".join("%s %s" % (k, got[k]) for k in want), "; run", h["__metadata__"]["run_id"])
PY
    # bit for bit: psd's own weights file (format 3) and its export, read by numpy; files numpy
    # writes in F32, F16 and BF16, read by psd (export) and compared with numpy's own conversion
    "$B/psd" export "$T/fm.safetensors" "$T/fm.bin.safetensors" >/dev/null || fail "psd export of a safetensors file"
    /usr/bin/python3 - "$T" "$B/psd" <<'PY' || fail "safetensors between psd and numpy are not bit-exact"
import json, os, struct, subprocess, sys
import numpy as np
T, psd = sys.argv[1], sys.argv[2]
def read_st(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    out = {}
    for k, v in h.items():
        if k == "__metadata__":
            continue
        raw = b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
        dt = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[v["dtype"]]
        out[k] = np.frombuffer(raw, dtype=dt).reshape(v["shape"])
    return out
def write_st(path, tensors, dtype):
    hdr, off, blobs = {}, 0, []
    for k, a in tensors.items():
        if dtype == "F32": raw = a.astype("<f4").tobytes()
        elif dtype == "F16": raw = a.astype("<f2").tobytes()
        else: raw = (a.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()  # bfloat16 by truncation
        hdr[k] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    j = json.dumps(hdr).encode()
    j += b" " * (-len(j) % 8)
    open(path, "wb").write(struct.pack("<Q", len(j)) + j + b"".join(blobs))
a = read_st(os.path.join(T, "fm.safetensors"))
b = read_st(os.path.join(T, "fm.bin.safetensors"))
assert all(a[k].tobytes() == b[k].tobytes() for k in a), "export changed bits"
for dtype in ("F32", "F16", "BF16"):
    src, dst = os.path.join(T, "np-%s.safetensors" % dtype), os.path.join(T, "np-%s-psd.safetensors" % dtype)
    write_st(src, a, dtype)
    subprocess.run([psd, "export", src, dst], check=True, stdout=subprocess.DEVNULL)
    got, raw = read_st(dst), read_st(src)
    for k in a:
        want = raw[k].astype("<f4") if dtype != "BF16" else (raw[k].astype("<u4") << 16).view("<f4")
        assert got[k].dtype == np.dtype("<f4") and got[k].tobytes() == want.tobytes(), (dtype, k)
    print("example_c: numpy wrote %s, psd read it bit-exact (%d values)" % (dtype, sum(v.size for v in a.values())))
PY
    # model.init: a run starts from numpy's F16 file (its values, f32 in psd), and a file whose
    # factors have another shape is refused before any worker comes, naming the tensor
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$B/psd" --config "$S/examples/c/fm.yaml" --listen "tcp://127.0.0.1:$port" --set checkpoint.dir= --epochs 1 \
        --set "model.init=$T/np-F16.safetensors" --metrics "" --save "" --start-timeout 60 >"$T/init.log" 2>&1 &
    psd_pid=$!
    pids+=("$psd_pid")
    for w in 0 1; do
        LD_LIBRARY_PATH=$(dirname "$so") "$T/fm_worker" "tcp://127.0.0.1:$port" >"$T/iw$w.log" 2>&1 &
        pids+=($!)
    done
    wait "$psd_pid" || { cat "$T/init.log" >&2; fail "a run from model.init failed"; }
    # from the trained values the first epoch's training loss is below 0.5 (from the inits: 0.61)
    grep -q "epoch 1/1 .* train_loss 0\.[0-4]" "$T/init.log" ||
        { cat "$T/init.log" >&2; fail "a run from trained values (model.init) did not start where they are"; }
    /usr/bin/python3 - "$T" <<'PY'
import json, struct, sys
T = sys.argv[1]
b = open(T + "/np-F16.safetensors", "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
h["factors.weight"]["shape"] = [8000, 4]  # the same bytes, another shape
j = json.dumps(h).encode()
j += b" " * (-len(j) % 8)
open(T + "/bad-init.safetensors", "wb").write(struct.pack("<Q", len(j)) + j + b[8 + n:])
PY
    rc=0
    "$B/psd" --config "$S/examples/c/fm.yaml" --listen "tcp://127.0.0.1:$port" --set checkpoint.dir= \
        --set "model.init=$T/bad-init.safetensors" --metrics "" --save "" >"$T/bad.log" 2>&1 || rc=$?
    [ "$rc" = 2 ] && grep -q "factors.weight has shape \[8000, 4\], the run's model \[4000, 8\]" "$T/bad.log" ||
        { cat "$T/bad.log" >&2; fail "a model.init file of another shape: exit $rc"; }
    echo "example_c: model.init from numpy's F16 file trains from its values; another shape is refused (exit 2)"
fi
# ---- model.kind from_worker
wait_for() { # FILE REGEX SECONDS
    for _ in $(seq 1 "$(($3 * 10))"); do grep -qE "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
    cat "$1" >&2
    fail "no '$2' in $1 within $3 s"
}
cat >"$T/fw.yaml" <<YAML
run: {epochs: 30}
model: {kind: from_worker}
data: {train_size: 200000, test_size: 10000}
train: {batch_size: 256}
optimizer: {name: adam, lr: 0.003, weight_decay: 0}
schedule: {name: constant}
server: {workers: 2, save: "$T/fw.safetensors", metrics: "$T/fw.jsonl"}
checkpoint: {dir: "$T/ck", every_steps: 100}
YAML
worker() { LD_LIBRARY_PATH=$(dirname "$so") "$T/fm_worker" "tcp://127.0.0.1:$port" offer "$@"; }
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$B/psd" --config "$T/fw.yaml" --listen "tcp://127.0.0.1:$port" --start-timeout 60 >"$T/fw1.log" 2>&1 &
psd_pid=$!
pids+=("$psd_pid")
worker >"$T/f0.log" 2>&1 &
pids+=($!)
wait_for "$T/fw1.log" "the model is the first worker.s: 3 tensors, 36001 parameters" 30
grep -q "psd asked for this worker's model" "$T/f0.log" || fail "the first worker was not asked for its model"
if worker 4 >"$T/fbad.log" 2>&1; then fail "a worker with another model was let in"; fi
grep -q "tensor 2 (factors.weight): shape \[4000, 4\] in this worker's, \[4000, 8\] in the run's" "$T/fbad.log" ||
    { cat "$T/fbad.log" >&2; fail "the refusal does not name the tensor"; }
worker >"$T/f1.log" 2>&1 &
pids+=($!)
wait_for "$T/fw1.log" "checkpoint .*ckpt-" 120
kill -9 "$psd_pid"
for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
wait 2>/dev/null || true
if grep -q "run finished" "$T/fw1.log"; then fail "the run finished before psd was killed"; fi
"$B/psd" --config "$T/fw.yaml" --listen "tcp://127.0.0.1:$port" --start-timeout 60 --resume "$T/ck" >"$T/fw2.log" 2>&1 &
psd_pid=$!
pids+=("$psd_pid")
for w in 2 3; do worker >"$T/f$w.log" 2>&1 & pids+=($!); done
for _ in $(seq 1 300); do kill -0 "$psd_pid" 2>/dev/null || break; sleep 1; done
wait "$psd_pid" || { cat "$T/fw2.log" >&2; fail "the resumed from_worker run failed"; }
grep -q "resum" "$T/fw2.log" || { cat "$T/fw2.log" >&2; fail "psd did not resume"; }
if grep -q "offers the model" "$T/fw2.log" || grep -q "psd asked for this worker's model" "$T/f2.log" "$T/f3.log"; then
    fail "the resumed run asked a worker for the model it has from its checkpoint"
fi
python3 - "$T/fw.jsonl" <<'PY' || fail "the resumed from_worker run did not learn"
import json, sys
ep = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("example_c: from_worker, resumed: %d epochs (the last %d), val_loss %.4f" % (len(ep), ep[-1]["epoch"], ep[-1]["val_loss"]))
sys.exit(0 if ep[-1]["epoch"] == 30 and ep[-1]["val_loss"] == ep[-1]["val_loss"] else 1)
PY
# the run's last checkpoint exported: the same tensors, bit for bit, as the weights it saved
last=$(ls "$T"/ck/run-*/ckpt-*.psdc | sort | tail -n 1)
"$B/psd" export "$last" "$T/ck.safetensors" >/dev/null || fail "psd export of a checkpoint ($last)"
python3 - "$T/ck.safetensors" "$T/fw.safetensors" <<'PY' || fail "the exported checkpoint is not the saved weights"
import json, struct, sys
def tensors(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items() if k != "__metadata__"}
a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
assert a == b, sorted(a)
print("example_c: the last checkpoint exported holds the saved weights bit for bit (%d tensors)" % len(a))
PY
# ---- the same table, 3 workers: one psd, then 2 psd shards; the same weights
run3() { # NAME SHARDS CONFIG [WORKER ARGS]: psd (and shard 1), 3 workers, 1 epoch, weights in $T/NAME.bin (format 3)
    local lep wep sh1= name=$1 shards=$2 cfg=$3
    shift 3
    set -- "$name" "$shards" "$@"
    lep=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    local set=(--config "$cfg" --epochs 1 --workers 3 --set checkpoint.dir= --start-timeout 60)
    if [ "$2" = 2 ]; then
        wep=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        "$B/psd" "${set[@]}" --listen "tcp://127.0.0.1:$wep" --shard 1/2 --leader "tcp://127.0.0.1:$lep" \
            --metrics "" --save "" >"$T/$1-s1.log" 2>&1 &
        sh1=$!
        pids+=("$sh1")
        set+=(--shard 0/2)
    fi
    "$B/psd" "${set[@]}" --listen "tcp://127.0.0.1:$lep" --metrics "" --save "$T/$1.bin" >"$T/$1.log" 2>&1 &
    local p0=$!
    pids+=("$p0")
    for w in 0 1 2; do
        LD_LIBRARY_PATH=$(dirname "$so") "$T/fm_worker" "tcp://127.0.0.1:$lep" "${@:3}" >"$T/$1-w$w.log" 2>&1 &
        pids+=($!)
    done
    wait "$p0" || { cat "$T/$1.log" >&2; fail "run $1 failed"; }
    [ -z "$sh1" ] || wait "$sh1" || { cat "$T/$1-s1.log" >&2; fail "shard 1 of run $1 failed"; }
}
run3 one 1 "$S/examples/c/fm.yaml"
run3 two 2 "$S/examples/c/fm.yaml"
grep -q "psd shard 0 of 2" "$T/two.log" || fail "the second run had no psd shards"
"$B/tests/weights_cmp" "$T/one.bin" "$T/two.bin" || fail "2 psd shards gave other weights than one psd"
echo "example_c: 3 workers, one psd or 2 psd shards: the same weights, bit for bit"
# model.kind from_worker: the first worker's model and values; with 2 shards shard 1 takes its part from shard 0
run3 fwone 1 "$T/fw.yaml" offer
run3 fwtwo 2 "$T/fw.yaml" offer
grep -q "the model is the first worker.s" "$T/fwtwo.log" || { cat "$T/fwtwo.log" >&2; fail "fwtwo: no offered model"; }
grep -q "has its part of the initial values from shard 0" "$T/fwtwo-s1.log" ||
    { cat "$T/fwtwo-s1.log" >&2; fail "shard 1 of the from_worker run did not take its values from shard 0"; }
"$B/tests/weights_cmp" "$T/fwone.bin" "$T/fwtwo.bin" || fail "from_worker: 2 psd shards gave other weights than one psd"
echo "example_c: from_worker, 3 workers, one psd or 2 psd shards: the same weights, bit for bit"
echo "example_c: ok"
