#!/bin/bash
# verdicts.sh BUILD_DIR: `psd --check-config` and the start give one verdict
# on every bad input of the suite: each case's arguments are run both ways,
# and the check's exit code (0 or 2) must say what the start does (2 at
# once: refused; listening: accepted, then ended by its PID). The cases:
# endpoints (host names, missing interfaces, a port taken), every file of
# the fuzz corpora as the input it stands for (configs, IDX data files,
# safetensors and weights files as model.init, checkpoints to --resume),
# the model against the data's shape, outputs that cannot be written. A
# case whose verdicts differ fails the test; nothing a refused psd was
# pointed at may be left behind (the checkpoint and metrics paths).
set -u
B=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/.." && pwd)
T=$(mktemp -d /tmp/psd-verdicts-XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
    [ -n "${KEEP:-}" ] && echo "kept $T" >&2 || rm -rf "$T"
}
trap cleanup EXIT
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PSD=$B/psd
CORPUS=$SRC/tests/fuzz/corpus
n=0
bad=0
refused=0

# verdict NAME ARGS...: run both ways in a fresh directory; the start waits
# for 1 worker (never comes) and is ended once it listens
verdict() {
    local name=$1
    shift
    local d=$T/case$n
    n=$((n + 1))
    mkdir -p "$d"
    local base=(--workers 1 --start-timeout 30 --metrics "$d/out/m.jsonl" --save "$d/out/w.bin"
        --set "checkpoint.dir=$d/out/ck")
    mkdir -p "$d/out"
    (cd "$d" && "$PSD" "${base[@]}" "$@" --check-config >"$d/check.log" 2>&1)
    local c=$?
    (cd "$d" && exec "$PSD" "${base[@]}" "$@" >"$d/start.log" 2>&1) &
    local p=$!
    pids+=("$p")
    local s=
    for _ in $(seq 1 300); do
        if ! kill -0 "$p" 2>/dev/null; then
            wait "$p"
            s=$?
            break
        fi
        if grep -q "listening on" "$d/start.log" 2>/dev/null; then
            kill -9 "$p" 2>/dev/null
            wait "$p" 2>/dev/null
            s=listening
            break
        fi
        sleep 0.05
    done
    [ -z "$s" ] && { kill -9 "$p"; wait "$p" 2>/dev/null; s=hung; }
    local ok=1
    case "$c/$s" in
    0/listening) ;;
    2/2)
        refused=$((refused + 1))
        # a refused start leaves nothing where it was told to write
        if [ -n "$(ls -A "$d/out" 2>/dev/null)" ]; then
            echo "verdicts: $name: the refused start left $(cd "$d/out" && find . -mindepth 1 | tr '\n' ' ')" >&2
            ok=0
        fi
        ;;
    *) ok=0 ;;
    esac
    if [ $ok -eq 0 ]; then
        bad=$((bad + 1))
        echo "verdicts: $name: --check-config exit $c, the start: $s" >&2
        echo "  check: $(tail -c 400 "$d/check.log" | tr '\n' ' ')" >&2
        echo "  start: $(grep -E "ERROR|psd:" "$d/start.log" 2>/dev/null | tail -n 2 | cut -c1-300 | tr '\n' ' ')" >&2
    fi
}

# endpoints
verdict "listen on 127.0.0.1:0" --listen tcp://127.0.0.1:0
verdict "listen on a host name" --listen tcp://localhost:6171
verdict "listen on no interface" --listen tcp://nosuchif0:6171
verdict "listen on an address not here" --listen tcp://192.0.2.1:6171
taken=$(free_port)
/usr/bin/python3 -c 'import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
time.sleep(600)' "$taken" &
pids+=("$!")
disown "$!"
sleep 0.3
verdict "listen on a port taken" --listen "tcp://127.0.0.1:$taken"
verdict "ipc in a missing directory" --listen "ipc://$T/no/such/dir/sock"
L=(--listen tcp://127.0.0.1:0)

# configs (the fuzz corpus: valid and hostile YAML)
for f in "$CORPUS"/fuzz_config/*; do
    verdict "config $(basename "$f")" "${L[@]}" --config "$f"
done
# data files: each IDX file of the corpus as the training images and as the labels
img=/usr/share/fashion-mnist
for f in "$CORPUS"/fuzz_idx/*; do
    verdict "train_images $(basename "$f")" "${L[@]}" --set "data.train_images=$f"
    verdict "train_labels $(basename "$f")" "${L[@]}" --set "data.train_labels=$f"
done
verdict "no such data file" "${L[@]}" --set data.test_images=/nonexistent/t10k-images-idx3-ubyte.gz
# the model against the data's shape
verdict "model.layers [100,10] for 784 pixels" "${L[@]}" --set "model.layers=[100,10]"
verdict "model.layers with 5 classes for 10 labels" "${L[@]}" --set "model.layers=[784,32,5]"
# model.init: every safetensors and weights file of the corpora
for f in "$CORPUS"/fuzz_safetensors/* "$CORPUS"/fuzz_weights/*; do
    verdict "model.init $(basename "$(dirname "$f")")/$(basename "$f")" "${L[@]}" --set model.kind=tensors \
        --set "model.init=$f"
done
# model.init: hostile safetensors files (each malformed one way), written here
mkdir -p "$T/st"
/usr/bin/python3 - "$T/st" <<'PY'
import json, struct, sys
d = sys.argv[1]
def t(shape, a, b, dtype="F32"):
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}
def put(name, header, data=b"\0" * 4, length=None):
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open("%s/%s.safetensors" % (d, name), "wb") as f:
        f.write(struct.pack("<Q", len(h) if length is None else length) + h + data)
put("header-length-0", b"", b"", 0)
put("header-length-past-the-file", b"{}", b"", 1000)
put("header-length-2-63", b"{}", b"", 1 << 63)
put("header-length-2-64-1", b"{}", b"", (1 << 64) - 1)
put("json-unterminated", b'{"x":' + json.dumps(t([1], 0, 4)).encode())
put("json-junk-after", json.dumps({"x": t([1], 0, 4)}).encode() + b"junk")
put("json-lone-surrogate", b'{"x\\ud800":' + json.dumps(t([1], 0, 4)).encode() + b"}")
put("dtype-f64", {"x": t([1], 0, 8, "F64")}, b"\0" * 8)
put("dtype-unknown", {"x": t([1], 0, 4, "Q9")})
put("shape-against-offsets", {"x": t([2], 0, 4)})
put("offsets-past-the-data", {"x": t([1], 0, 1 << 40)})
put("offsets-reversed", {"x": t([1], 4, 0)})
put("offsets-with-a-hole", {"x": t([1], 4, 8)}, b"\0" * 8)
put("offsets-overlapping", {"x": t([1], 0, 4), "y": t([1], 0, 4)})
put("a-byte-no-tensor-covers", {"x": t([1], 0, 4)}, b"\0" * 5)
put("data-truncated", {"x": t([4], 0, 16)}, b"\0" * 8)
put("shape-overflowing-2-64", {"x": t([1 << 32, 1 << 32, 1 << 32], 0, 4)})
put("shape-negative", {"x": t([-1], 0, 4)})
put("shape-of-9-dims", {"x": t([1] * 9, 0, 4)})
put("name-twice", b'{"x":' + json.dumps(t([1], 0, 4)).encode() + b',"x":' + json.dumps(t([0], 4, 4)).encode() + b"}")
put("name-of-400-bytes", {"n" * 400: t([1], 0, 4)})
put("field-unknown", {"x": dict(t([1], 0, 4), extra=1)})
put("metadata-not-strings", {"__metadata__": {"k": 1}, "x": t([1], 0, 4)})
put("tensors-16385", {"t%05d" % i: t([1], 4 * i, 4 * i + 4) for i in range(16385)}, b"\0" * (4 * 16385))
put("no-tensors", {}, b"")
put("not-an-object", b"[1, 2]", b"")
PY
for f in "$T"/st/*.safetensors; do
    verdict "model.init hostile/$(basename "$f")" "${L[@]}" --set model.kind=tensors --set "model.init=$f"
done
# checkpoints: each one of the corpus alone in a run directory to --resume
for f in "$CORPUS"/fuzz_ckpt/*; do
    r=$T/resume$n/run-00000000000000aa
    mkdir -p "$r"
    cp "$f" "$r/ckpt-000000000001.psdc"
    verdict "resume $(basename "$f")" "${L[@]}" --resume "$r"
done
# outputs
verdict "metrics in a missing directory" "${L[@]}" --metrics /nonexistent/dir/m.jsonl
verdict "checkpoint.dir a file" "${L[@]}" --set "checkpoint.dir=$SRC/README.md"

echo "verdicts: $n cases, $refused refused both ways, $bad differing"
[ $bad -eq 0 ]
