#!/bin/bash
# Same speed across a change: psd's push+pull (psbench, as bench/wire_bench.sh
# runs it: one 4 MiB tensor, plain SGD) with two builds' binaries
# alternated, PAIRS pairs (default 9), for the rows a redesign must keep:
# 1 worker over tcp, 2 workers over tcp, 1 worker through shared memory.
# Prints every pair, the medians old and new with their ratio, and the
# median of the pairs' ratios (this VM's loopback switches between a slow and
# a fast mode every few minutes: a pair, back to back, shares its mode).
#   bash bench/ab_speed.sh OLD_BUILD_DIR NEW_BUILD_DIR [ROUNDS]
# (a build dir holds psd and psbench: e.g. bench/same_weights.sh's, or
#  `git worktree add /tmp/old REV && meson setup /tmp/old/b /tmp/old && ninja -C /tmp/old/b psd psbench`)
# ROWS picks rows (default "tcp1 tcp2 shm1"); LAYERS another MLP (default
# [784,1338]; e.g. [784,4096,4096,10], 80 MB, with ROUNDS=50); MODEL_CONFIG a
# config file of a `model.kind: tensors` table instead (e.g.
# bench/one_tensor.yaml); PSD_SET more psd flags for both (e.g. "--set
# train.stream=true"). Not a test: nothing here passes or fails on speed.
set -euo pipefail
OLD=${1:?usage: bash bench/ab_speed.sh OLD_BUILD_DIR NEW_BUILD_DIR [ROUNDS]}
NEW=${2:?usage: bash bench/ab_speed.sh OLD_BUILD_DIR NEW_BUILD_DIR [ROUNDS]}
ROUNDS=${3:-800}
PAIRS=${PAIRS:-9}
WORK=$(mktemp -d /tmp/psd-ab-XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
cd "$(dirname "$0")/.."
. bench/lib.sh
machine_line
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# one run: $1 build dir, $2 workers, $3 endpoint, $4 psbench flags; prints the aggregate GB/s
run() {
    local bin=$1 w=$2 ep=$3 flags=${4:-} limit=$((ROUNDS * 64 * $2)) model
    model=(--set "model.layers=${LAYERS:-[784,1338]}")
    if [ -n "${MODEL_CONFIG:-}" ]; then # the workers give the data's sizes
        model=(--config "$MODEL_CONFIG")
        flags="$flags --data $limit,640"
    fi
    # shellcheck disable=SC2086
    "$bin/psd" --listen "$ep" --workers "$w" --epochs 1 "${model[@]}" ${PSD_SET:-} \
        --set optimizer.momentum=0 --set optimizer.weight_decay=0 --set "data.train_limit=$limit" \
        --set schedule.name=constant --set checkpoint.dir= --metrics "" --save "" 2>"$WORK/psd.log" &
    local psd=$!
    # shellcheck disable=SC2086
    "$bin/psbench" --connect "$ep" --workers "$w" $flags >"$WORK/psbench.txt"
    wait $psd
    awk '/^aggregate/ {print $3; exit}' "$WORK/psbench.txt"
}
row() { # $1 name, $2 workers, $3 kind (tcp|shm)
    local ep flags olds=() news=()
    for ((i = 1; i <= PAIRS; i++)); do
        if [ "$3" = tcp ]; then ep="tcp://127.0.0.1:$(free_port)"; flags=--no-shm; else ep="ipc://$WORK/psd.sock"; flags=; fi
        local o n
        o=$(run "$OLD" "$2" "$ep" "$flags")
        n=$(run "$NEW" "$2" "$ep" "$flags")
        olds+=("$o")
        news+=("$n")
        echo "  $1 pair $i: old $o new $n GB/s"
    done
    python3 - "$1" "${olds[*]}" "${news[*]}" <<'PY'
import statistics, sys
o = [float(x) for x in sys.argv[2].split()]; n = [float(x) for x in sys.argv[3].split()]
mo, mn = statistics.median(o), statistics.median(n)
mr = statistics.median(b / a for a, b in zip(o, n))
print(f"{sys.argv[1]}: median old {mo:.3f} new {mn:.3f} GB/s, new/old {mn / mo:.3f}; median of the pairs' new/old {mr:.3f}")
PY
}
for r in ${ROWS:-tcp1 tcp2 shm1}; do
    case $r in
    tcp1) row "1 worker tcp" 1 tcp ;;
    tcp2) row "2 workers tcp" 2 tcp ;;
    shm1) row "1 worker shm" 1 shm ;;
    *) echo "ab_speed: unknown row $r (tcp1 tcp2 shm1)" >&2; exit 2 ;;
    esac
done
