#!/bin/bash
# Same behaviour across a change: the weights saved after 2 epochs by two
# builds, for the default config, a 2-shard run, the click-through model
# with the table on psd, streamed steps with clipping, asynchronous training
# with one worker (deterministic so), and a user's table model
# (examples/c/fm.yaml, 2 examples/c/fm_worker.c built against each build's
# libpsworker), compared tensor by tensor, every byte (the run id aside:
# tests/weights_cmp, the tests' own comparison, ps_weights_same). Not a test:
# a check for a redesign.
#   bash bench/same_weights.sh OLD_REV [NEW_REV]
# NEW_REV defaults to the working tree. LIMIT=N trains N samples an epoch
# (default: all of them); CASES="default shards ctr stream async1 table"
# picks cases.
# Exit 0 when every case gives the same weights, 1 when one differs.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OLD=${1:?usage: bash bench/same_weights.sh OLD_REV [NEW_REV]}
NEW=${2:-}
CASES=${CASES:-default shards ctr stream async1 table}
WORK=$(mktemp -d /tmp/psd-same-XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
    for t in old new; do [ -d "$WORK/$t" ] && git -C "$ROOT" worktree remove --force "$WORK/$t" 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT

# build REV (or the working tree) into $WORK/build-<name>; for the table case
# its examples/c/fm_worker.c too, as a user builds it: the public header and
# libpsworker.so (no meson target builds it)
build() {
    local name=$1 rev=$2 src=$ROOT b=$WORK/build-$1
    if [ -n "$rev" ]; then
        git -C "$ROOT" worktree add --detach "$WORK/$name" "$rev" >/dev/null 2>&1
        src=$WORK/$name
    fi
    meson setup "$b" "$src" -Dcuda=disabled -Dbuildtype=release >/dev/null
    ninja -C "$b" psd pworker $([ "$name" = new ] && echo tests/weights_cmp) \
        $([[ " $CASES " = *" table "* ]] && echo libpsworker.so.3.0.0) >/dev/null
    if [[ " $CASES " = *" table "* ]]; then
        cc -std=c17 -O2 "$src/examples/c/fm_worker.c" -I"$src/worker/include" -L"$b" -Wl,-rpath,"$b" \
            -lpsworker -lm -o "$b/fm_worker"
    fi
    echo "built $name: $(cd "$src" && git rev-parse --short HEAD)$([ -z "$rev" ] && echo ' + working tree')"
}
build old "$OLD"
build new "$NEW"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run <name> <case>: psd (+ a shard) + its workers (2 pworkers; async1: one;
# table: 2 fm_workers) to the end; weights in $WORK/<case>-<name>.bin
run() {
    local name=$1 case=$2 bin=$WORK/build-$1 dir=$WORK/run-$2-$1
    mkdir -p "$dir"
    local port sport args=(--epochs 2 --seed 3 --set checkpoint.dir= --metrics "" --save "$WORK/$case-$name.bin")
    local nw=2 worker=("$bin/pworker" --connect)
    port=$(free_port)
    local limit=data.train_limit
    [ "$case" = ctr ] && limit=ctr.train
    [ -n "${LIMIT:-}" ] && args+=(--set "$limit=$LIMIT")
    case $case in
    default) ;;
    shards) args+=(--set optimizer.name=adam --set optimizer.lr=0.001 --set optimizer.clip_norm=1) ;;
    ctr) args+=(--config "$ROOT/deploy/configs/ctr.yaml" --set ctr.test=2000 --set ctr.worker_table_mb=0) ;;
    stream) args+=(--set train.stream=true --set server.chunk_bytes=65536 --set optimizer.clip_norm=0.5) ;;
    async1) args+=(--set train.sync=async) nw=1 ;;
    table) args+=(--config "$ROOT/examples/c/fm.yaml") worker=("$bin/fm_worker") ;;
    esac
    local p s i ws=()
    if [ "$case" = shards ]; then
        sport=$(free_port)
        (cd "$dir" && exec "$bin/psd" --listen "tcp://127.0.0.1:$port" --workers "$nw" "${args[@]}" --shard 0/2 \
            >psd.log 2>&1) &
        p=$!
        (cd "$dir" && exec "$bin/psd" --listen "tcp://127.0.0.1:$sport" --shard 1/2 \
            --leader "tcp://127.0.0.1:$port" "${args[@]}" >shard1.log 2>&1) &
        s=$!
        pids+=("$p" "$s")
    else
        (cd "$dir" && exec "$bin/psd" --listen "tcp://127.0.0.1:$port" --workers "$nw" "${args[@]}" >psd.log 2>&1) &
        p=$!
        pids+=("$p")
    fi
    for ((i = 0; i < nw; i++)); do
        (cd "$dir" && exec "${worker[@]}" "tcp://127.0.0.1:$port" >"w$i.log" 2>&1) &
        ws+=($!)
    done
    pids+=("${ws[@]}")
    local rc=0
    wait "$p" || rc=$?
    wait "${ws[@]}" || true
    [ "$case" = shards ] && { wait "$s" || true; }
    if [ "$rc" -ne 0 ]; then
        echo "$case ($name): psd exited $rc; its log ends:" >&2
        tail -n 15 "$dir/psd.log" >&2
        return 1
    fi
}

status=0
for c in $CASES; do
    run old "$c"
    run new "$c"
    if "$WORK/build-new/tests/weights_cmp" "$WORK/$c-old.bin" "$WORK/$c-new.bin" >/dev/null; then
        echo "$c: same weights ($(stat -c %s "$WORK/$c-new.bin") bytes)"
    else
        echo "$c: DIFFERENT weights" >&2
        "$WORK/build-new/tests/weights_cmp" "$WORK/$c-old.bin" "$WORK/$c-new.bin" || true
        status=1
    fi
done
exit $status
