#!/bin/bash
# Many small tensors against one of the same bytes: psd's push+pull round
# (psbench, 1 worker, plain SGD) for tables of 4 MiB in all, alternated in
# rounds of back-to-back runs (this VM's loopback has slow and fast spells):
#   one      one tensor [1048576]
#   fast     [1048576] and a small [1338] (the built-in MLP's shape: the fast case)
#   t300     300 tensors: 299 small ones of assorted shapes (scalars, vectors,
#            matrices up to [64, 128], [3, 3, 16, 16]) and a last one that makes
#            1048576 floats in all (~414K floats): packed into units (ps_model.h)
# Prints each run and the medians, and t300's median over one's and fast's.
#   t300a    t300 with each tensor's gradient in a buffer of its own (psbench
#            --apart: the small ones are copied together each push)
#   bash bench/tables.sh [BUILD_DIR] [RUNS]      (default build, 5; tcp: NOSHM=--no-shm, the default)
# Not a test: nothing here passes or fails on speed.
set -euo pipefail
B=${1:-build}
RUNS=${2:-5}
FLAGS=${NOSHM---no-shm}
WORK=$(mktemp -d /tmp/psd-tb-XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
cd "$(dirname "$0")/.."
. bench/lib.sh
machine_line
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
head() { printf 'model:\n  kind: tensors\n  tensors:\n'; }
tail_cfg() { printf 'data: {train_size: 51200, test_size: 64}\noptimizer: {name: sgd, lr: 0.0001, momentum: 0, weight_decay: 0}\nschedule: {name: constant}\n'; }
{ head; echo '    - {name: w, shape: [1048576], init: zeros}'; tail_cfg; } >"$WORK/one.yaml"
{ head; echo '    - {name: w, shape: [1048576], init: zeros}'; echo '    - {name: b, shape: [1338], init: zeros}'; tail_cfg; } >"$WORK/fast.yaml"
python3 - "$WORK/t300.yaml" <<'PY'
import sys
shapes, total, k = [], 0, 0
while len(shapes) < 299:
    s = [[32, 64], [64], [1], [64, 128], [128], [3, 3, 16, 16]][k % 6]
    shapes.append(s); k += 1
for s in shapes:
    m = 1
    for d in s: m *= d
    total += m
shapes.append([1048576 - total])
with open(sys.argv[1], "w") as f:
    f.write("model:\n  kind: tensors\n  tensors:\n")
    for i, s in enumerate(shapes):
        f.write(f"    - {{name: t{i}, shape: {s}, init: zeros}}\n")
    f.write("data: {train_size: 51200, test_size: 64}\noptimizer: {name: sgd, lr: 0.0001, momentum: 0, weight_decay: 0}\nschedule: {name: constant}\n")
assert shapes[-1][0] > 0 and sum(eval('*'.join(map(str, s))) for s in shapes) == 1048576
PY
run() { # $1 table (t300a: t300, psbench --apart); prints psbench's aggregate GB/s
    local ep="tcp://127.0.0.1:$(free_port)" cfg=${1%a} more=
    [ "$1" = t300a ] && more=--apart
    "$B/psd" --config "$WORK/$cfg.yaml" --listen "$ep" --workers 1 --epochs 1 --set checkpoint.dir= --metrics "" \
        --save "" 2>"$WORK/psd.log" &
    local psd=$!
    "$B/psbench" --connect "$ep" --workers 1 --data 51200,64 $FLAGS $more >"$WORK/psbench.txt" ||
        { cat "$WORK/psd.log" >&2; exit 1; }
    wait $psd
    grep -m1 -o "in [0-9]* tensors ([0-9]* units" "$WORK/psd.log" >"$WORK/$1.units" || true
    awk '/^aggregate/ {print $3; exit}' "$WORK/psbench.txt"
}
declare -A got
for ((i = 1; i <= RUNS; i++)); do
    for t in one fast t300 t300a; do
        g=$(run $t)
        got[$t]="${got[$t]:-} $g"
        echo "  run $i $t: $g GB/s ($(cat "$WORK/$t.units"))"
    done
done
python3 - "${got[one]}" "${got[fast]}" "${got[t300]}" "${got[t300a]}" <<'PY'
import statistics, sys
one, fast, t300, t300a = ([float(x) for x in a.split()] for a in sys.argv[1:5])
m1, mf, mt, ma = (statistics.median(x) for x in (one, fast, t300, t300a))
print(f"medians: one tensor {m1:.3f}, fast case {mf:.3f}, 300 tensors {mt:.3f}, 300 apart {ma:.3f} GB/s; "
      f"300/one {mt / m1:.3f}, 300/fast {mt / mf:.3f}, 300 apart/one {ma / m1:.3f}, 300 apart/fast {ma / mf:.3f}")
PY
