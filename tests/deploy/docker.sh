#!/bin/bash
# Deploy test, Docker: a real engine, the real Dockerfile and compose file.
#
#   bash tests/deploy/docker.sh BUILD_DIR        (meson test --suite deploy runs it)
#
# 1. starts a private dockerd (own socket, data and exec roots under a temp dir);
# 2. makes the base image without pulling: debootstrap of bookworm from the
#    machine's Debian mirror, `docker import` as debian:bookworm-slim;
# 3. builds the project image from deploy/docker/Dockerfile, unchanged (its build
#    stage runs deploy/setup.sh on that bare Debian: the README's install);
# 4. `docker-compose up --scale pworker=2` from deploy/compose/docker-compose.yml
#    (authentication on, as by default) for 2 epochs, and asserts the metrics,
#    the key files' modes, and that the final correct count equals that of the same
#    run by hand (BUILD_DIR/psd + 2 BUILD_DIR/pworker on 127.0.0.1);
# 5. the user's script as the workers: the image built again with TORCH=1, compose with
#    PSD_WORKER_CMD="python3 fashion_cnn.py" (examples/torch, mounted as PSD_WORKER_DIR)
#    and examples/torch/fashion_cnn.yaml for one epoch: exact sample counts, CURVE, the
#    best weights kept by psd in the volume; then examples/ignite's autoencoder_psd.py
#    (psd.ignite, Ignite from the image's environment) for one epoch on 6000 images:
#    exact counts, both workers' validation loss psd's; then examples/lightning/fit.py
#    --model weather (the graph weather forecaster, psd.lightning) for 2 epochs: exact
#    counts, Lightning's val_mae psd's;
# 6. removes every container, network, volume and image, stops dockerd by PID and
#    restores iptables, the docker0 bridge and ip_forward as they were.
# Without root or the tools it skips (exit 77) with a message; with CI=true a skip
# is a failure.  PSD_TEST_KEEP=1 keeps the temp dir (logs).
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:-$SRC/build}" && pwd)
EPOCHS=2
SEED=7

skip() {
    if [ "${CI:-}" = true ]; then
        echo "FAIL: deploy/docker cannot run under CI=true: $*" >&2
        exit 1
    fi
    echo "SKIP: deploy/docker: $*"
    exit 77
}
[ "$(id -u)" -eq 0 ] || skip "needs root (it starts its own dockerd)"
for t in dockerd docker docker-compose debootstrap iptables-save iptables-restore ip; do
    command -v "$t" >/dev/null 2>&1 ||
        skip "$t not found (sh deploy/setup.sh --deploy installs docker.io docker-compose debootstrap iptables)"
done
if pgrep -x dockerd >/dev/null 2>&1; then
    skip "a dockerd already runs on this machine; this test starts and removes its own engine"
fi
if [ ! -x "$BUILD/psd" ] || [ ! -x "$BUILD/pworker" ]; then
    echo "no psd/pworker in $BUILD" >&2
    exit 1
fi

T=$(mktemp -d /tmp/psd-docker.XXXXXX)
PROJECT=psdtest$$
IMAGE=psd-test:$$
IMAGE_TORCH=psd-test-torch:$$
export DOCKER_HOST=unix://$T/docker.sock
DOCKERD_PID=""
HAND_PIDS=()

log() { echo "[$(date +%T)] $*"; }

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# -- state to restore ---------------------------------------------------------
iptables-save >"$T/iptables.before"
ip6tables-save >"$T/ip6tables.before" 2>/dev/null || true
FWD_BEFORE=$(cat /proc/sys/net/ipv4/ip_forward)
DOCKER0_BEFORE=0
ip link show docker0 >/dev/null 2>&1 && DOCKER0_BEFORE=1

restore_tables() { # $1 = iptables|ip6tables, $2 = saved dump
    local cmd=$1 dump=$2 t
    [ -s "$dump" ] || return 0
    "$cmd-restore" <"$dump" || echo "warning: $cmd-restore failed" >&2
    # tables that had no rules before (absent from the dump): empty them again
    for t in filter nat mangle raw; do
        grep -q "^\*$t" "$dump" && continue
        "$cmd" -t "$t" -F 2>/dev/null || true
        "$cmd" -t "$t" -X 2>/dev/null || true
        "$cmd" -t "$t" -S 2>/dev/null | awk '$1 == "-P" {print $2}' | while read -r c; do
            "$cmd" -t "$t" -P "$c" ACCEPT
        done
    done
}

cleanup() {
    local rc=$?
    set +e
    for p in "${HAND_PIDS[@]}"; do kill "$p" 2>/dev/null; done
    [ -n "${TORCH_BUILD_PID:-}" ] && kill "$TORCH_BUILD_PID" 2>/dev/null
    if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
        for p in "$PROJECT" "${PROJECT}t" "${PROJECT}i" "${PROJECT}l"; do
            docker-compose -p "$p" -f "$SRC/deploy/compose/docker-compose.yml" down -v --rmi all \
                --remove-orphans >>"$T/down.log" 2>&1
        done
        docker ps -aq | xargs -r docker rm -f >/dev/null 2>&1
        docker images -q | sort -u | xargs -r docker rmi -f >/dev/null 2>&1
        docker network prune -f >/dev/null 2>&1
        docker volume prune -f >/dev/null 2>&1
        kill -TERM "$DOCKERD_PID"
        for _ in $(seq 1 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$DOCKERD_PID" 2>/dev/null && kill -KILL "$DOCKERD_PID"
    fi
    # containerd and shims started by our dockerd live under $T
    pkill -f -- "$T/" 2>/dev/null
    sleep 0.5
    pkill -KILL -f -- "$T/" 2>/dev/null
    grep -o " $T/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    restore_tables iptables "$T/iptables.before"
    restore_tables ip6tables "$T/ip6tables.before"
    [ "$DOCKER0_BEFORE" = 0 ] && ip link show docker0 >/dev/null 2>&1 && ip link del docker0
    echo "$FWD_BEFORE" >/proc/sys/net/ipv4/ip_forward
    if [ "$rc" -ne 0 ]; then
        for f in "$T"/*.log; do [ -f "$f" ] && { echo "---- $f (tail)"; tail -n 40 "$f"; }; done
    fi
    if [ -n "${PSD_TEST_KEEP:-}" ]; then echo "kept $T"; else rm -rf "$T"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- 1. the engine ------------------------------------------------------------
log "starting dockerd"
mkdir -p "$T/data" "$T/exec"
dockerd --data-root "$T/data" --exec-root "$T/exec" --pidfile "$T/dockerd.pid" \
    -H "$DOCKER_HOST" >"$T/dockerd.log" 2>&1 &
DOCKERD_PID=$!
for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
docker info >/dev/null 2>&1 || { echo "dockerd did not start" >&2; exit 1; }

# -- 2. base image, no pull ---------------------------------------------------
MIRROR=$(grep -rhoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.sources \
    /etc/apt/sources.list.d/*.list 2>/dev/null | grep -v security | head -n1 | tr -d ' ' || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
CACHE=$BUILD/deploy-cache/bookworm-minbase.tar
if [ ! -s "$CACHE" ]; then
    log "debootstrap bookworm from $MIRROR"
    debootstrap --variant=minbase bookworm "$T/rootfs" "$MIRROR" >"$T/debootstrap.log" 2>&1
    mkdir -p "$(dirname "$CACHE")"
    tar -C "$T/rootfs" -cf "$CACHE.tmp" . && mv "$CACHE.tmp" "$CACHE"
    rm -rf "$T/rootfs"
else
    log "base root file system from $CACHE (delete it to debootstrap again)"
fi
docker import "$CACHE" debian:bookworm-slim >/dev/null

# -- 3. the project image, from the unchanged Dockerfile ----------------------
log "docker build"
docker build -f "$SRC/deploy/docker/Dockerfile" -t "$IMAGE" "$SRC" >"$T/build.log" 2>&1
docker run --rm "$IMAGE" id -un | grep -qx psd || { echo "image does not run as user psd" >&2; exit 1; }

# the image with PyTorch (step 5) builds meanwhile: every layer above its own is cached now
TORCH_BUILD_PID=""
if [ "${PSD_TEST_TORCH:-1}" = 1 ]; then
    # the image's PyPI packages fetched here (the build's container may lack this host's proxy
    # and certificates): deploy/wheels, installed from there with their hashes checked
    "$SRC/.venv/bin/pip" download -q --disable-pip-version-check --no-deps --require-hashes \
        -r "$SRC/deploy/requirements.txt" -d "$SRC/deploy/wheels" >"$T/wheels.log" 2>&1 ||
        fail "pip download of deploy/requirements.txt failed (see wheels.log; sh deploy/setup.sh --deploy makes .venv)"
    log "docker build --build-arg TORCH=1 (in the background)"
    docker build -f "$SRC/deploy/docker/Dockerfile" --build-arg TORCH=1 -t "$IMAGE_TORCH" "$SRC" \
        >"$T/build-torch.log" 2>&1 &
    TORCH_BUILD_PID=$!
fi

# -- 4a. the same run by hand -------------------------------------------------
log "the run by hand"
PORT=$(free_port)
mkdir -p "$T/hand"
(cd "$T/hand" && exec "$BUILD/psd" --config "$SRC/deploy/configs/fashion-mnist.yaml" \
    --listen "tcp://127.0.0.1:$PORT" --workers 2 --epochs $EPOCHS --seed $SEED \
    --set checkpoint.dir= >psd.log 2>&1) &
HAND_PIDS+=($!)
for i in 0 1; do
    # the kernels OpenBLAS picks itself, as in the image (an OPENBLAS_CORETYPE
    # set here would give other kernels, and other bits, than the containers')
    env -u OPENBLAS_CORETYPE "$BUILD/pworker" --connect "tcp://127.0.0.1:$PORT" --threads 1 \
        >"$T/hand/w$i.log" 2>&1 &
    HAND_PIDS+=($!)
done
timeout 600 tail --pid="${HAND_PIDS[0]}" -f /dev/null
wait "${HAND_PIDS[0]}" || { echo "psd by hand failed" >&2; cat "$T/hand/psd.log"; exit 1; }
wait "${HAND_PIDS[1]}" "${HAND_PIDS[2]}" || true
HAND_PIDS=()

# -- 4b. docker-compose -------------------------------------------------------
log "docker-compose up, psd + 2 pworkers"
PUBLISH_PORT=$(free_port)
export PSD_IMAGE=$IMAGE PSD_WORKERS=2 PSD_PUBLISH=127.0.0.1:$PUBLISH_PORT
export PSD_ARGS="--epochs $EPOCHS --seed $SEED" PWORKER_ARGS="--threads 1"
COMPOSE=(docker-compose -p "$PROJECT" -f "$SRC/deploy/compose/docker-compose.yml")
rc=0
timeout 600 "${COMPOSE[@]}" up --no-build --scale pworker=2 --exit-code-from psd >"$T/compose.log" 2>&1 || rc=$?
[ "$rc" -eq 0 ] || { echo "docker-compose up exited $rc" >&2; exit 1; }
PSD_CID=$("${COMPOSE[@]}" ps -q psd)
docker cp "$PSD_CID:/var/lib/psd/psd-metrics.jsonl" "$T/compose-metrics.jsonl"
"${COMPOSE[@]}" run --rm --no-deps --entrypoint stat pworker -c '%a %U %n' \
    /var/lib/psd/keys /var/lib/psd/keys/psd.key /var/lib/psd/keys/worker.key >"$T/modes.txt"

# -- assertions ---------------------------------------------------------------
fail() { echo "FAIL: $*" >&2; exit 1; }
last() { tail -n1 "$1" | python3 -c "import json,sys; print(json.load(sys.stdin)['$2'])"; }
grep -q "authentication: CURVE" "$T/compose.log" || fail "psd did not run with CURVE authentication"
grep -q "worker registered: rank 1" "$T/compose.log" || fail "the second worker did not register"
[ "$(grep -c "through shared memory" "$T/compose.log")" = 2 ] || fail "the workers did not use shared memory"
[ "$(last "$T/compose-metrics.jsonl" epoch)" = $EPOCHS ] || fail "compose run did not reach epoch $EPOCHS"
[ "$(last "$T/compose-metrics.jsonl" val_samples)" = 10000 ] || fail "compose run: val_samples != 10000"
# equal bits need equal BLAS kernels
KH=$(grep -ho "OpenBLAS [A-Za-z0-9]* kernels" "$T"/hand/w*.log | sort -u)
KC=$(grep -o "OpenBLAS [A-Za-z0-9]* kernels" "$T/compose.log" | sort -u)
[ "$KH" = "$KC" ] || fail "the workers by hand ran $KH, under compose $KC"
HAND=$(last "$T/hand/psd-metrics.jsonl" val_correct)
COMP=$(last "$T/compose-metrics.jsonl" val_correct)
[ "$HAND" = "$COMP" ] || fail "val_correct by hand $HAND, under compose $COMP"
grep -qx "700 psd /var/lib/psd/keys" "$T/modes.txt" || fail "keys dir mode: $(cat "$T/modes.txt")"
grep -qx "600 psd /var/lib/psd/keys/psd.key" "$T/modes.txt" || fail "psd.key mode: $(cat "$T/modes.txt")"
grep -qx "600 psd /var/lib/psd/keys/worker.key" "$T/modes.txt" || fail "worker.key mode: $(cat "$T/modes.txt")"
log "compose val_correct $COMP/10000 = by hand $HAND/10000 after $EPOCHS epochs (seed $SEED), CURVE on, shared memory"
grep -E "run finished" "$T/compose.log" | sed 's/^/  /'

# -- 5. the user's script as the workers (PSD_WORKER_CMD, TORCH=1) --------------
# compose_workers NAME P: compose project PROJECT+P up with psd + 2 workers as exported
# (PSD_CONFIG_FILE, PSD_WORKER_DIR, PSD_WORKER_CMD, PSD_ARGS); psd exited 0, CURVE, both
# workers registered; its log T/compose-NAME.log, psd's metrics T/NAME-metrics.jsonl,
# psd's container PSD_CID
# expect_last NAME KEY=VALUE...: psd's last metrics line of the NAME run (T/NAME-metrics.jsonl)
expect_last() {
    local name=$1 kv
    shift
    for kv in "$@"; do
        [ "$(last "$T/$name-metrics.jsonl" "${kv%=*}")" = "${kv#*=}" ] ||
            fail "$name run: ${kv%=*} $(last "$T/$name-metrics.jsonl" "${kv%=*}"), not ${kv#*=}"
    done
}
compose_workers() {
    local name=$1 rc=0
    local compose=(docker-compose -p "$PROJECT$2" -f "$SRC/deploy/compose/docker-compose.yml")
    timeout 600 "${compose[@]}" up --no-build --scale pworker=2 --exit-code-from psd >"$T/compose-$name.log" 2>&1 ||
        rc=$?
    [ "$rc" -eq 0 ] || fail "docker-compose up ($name workers) exited $rc"
    PSD_CID=$("${compose[@]}" ps -q psd)
    docker cp "$PSD_CID:/var/lib/psd/psd-metrics.jsonl" "$T/$name-metrics.jsonl"
    grep -q "authentication: CURVE" "$T/compose-$name.log" || fail "$name run: psd did not run with CURVE authentication"
    [ "$(grep -c "worker registered: rank [01]" "$T/compose-$name.log")" = 2 ] || fail "$name run: 2 workers did not register"
}
if [ "${PSD_TEST_TORCH:-1}" = 1 ]; then
    wait "$TORCH_BUILD_PID" || fail "docker build --build-arg TORCH=1 failed (see build-torch.log)"
    TORCH_BUILD_PID=""
    log "docker build --build-arg TORCH=1 done"
    log "docker-compose up, psd + 2 workers running PSD_WORKER_CMD (examples/torch/fashion_cnn.py), 1 epoch"
    export PSD_IMAGE=$IMAGE_TORCH PSD_PUBLISH=127.0.0.1:$(free_port)
    export PSD_CONFIG_FILE=$SRC/examples/torch/fashion_cnn.yaml PSD_WORKER_DIR=$SRC/examples/torch
    # PWORKER_ARGS are pworker's: set to one the script does not take, to show they are not passed
    export PSD_ARGS="--epochs 1 --seed $SEED" PSD_WORKER_CMD="python3 fashion_cnn.py --threads 1" PWORKER_ARGS="--no-shm"
    compose_workers torch t
    docker cp "$PSD_CID:/var/lib/psd/fashion_cnn.safetensors" "$T/torch-best.safetensors" ||
        fail "psd kept no best weights (train.keep_best) in the volume"
    # w.log() prints on rank 0 only
    [ "$(grep -c "epoch 1 done" "$T/compose-torch.log")" = 1 ] || fail "torch run: 'epoch 1 done' not logged once"
    expect_last torch epoch=1 train_samples=54000 val_samples=6000 test_samples=10000
    TACC=$(last "$T/torch-metrics.jsonl" test_acc)
    python3 -c "import sys; sys.exit(0 if float('$TACC') >= 0.80 else 1)" || fail "torch run: test_acc $TACC < 0.80 after 1 epoch"
    log "torch workers: 54000 trained, 6000 validated, 10000 tested, test_acc $TACC, best weights kept"

    # -- 5b. an Ignite script as the workers (examples/ignite, psd.ignite) --------
    log "docker-compose up, psd + 2 workers running examples/ignite/autoencoder_psd.py (psd.ignite), 1 epoch"
    export PSD_PUBLISH=127.0.0.1:$(free_port)
    export PSD_CONFIG_FILE=$SRC/examples/ignite/psd.yaml PSD_WORKER_DIR=$SRC/examples/ignite
    # (its code directory is read-only in the container: the checkpoints go to /tmp)
    export PSD_ARGS="--epochs 1 --seed $SEED" \
        PSD_WORKER_CMD="python3 autoencoder_psd.py --epochs 1 --train-limit 6000 --val-limit 1000 --out /tmp/ckpt"
    compose_workers ignite i
    expect_last ignite epoch=1 train_samples=6000 val_samples=1000
    # both workers print psd's reduced validation loss (the evaluator's metrics are psd's)
    ILOSS=$(grep -o "RESULT val_loss=[0-9.]*" "$T/compose-ignite.log" | sort -u)
    [ "$(echo "$ILOSS" | wc -l)" = 1 ] && [ "$(grep -c "RESULT val_loss" "$T/compose-ignite.log")" = 2 ] ||
        fail "ignite run: the two workers' validation losses differ: $ILOSS"
    PLOSS=$(last "$T/ignite-metrics.jsonl" val_loss)
    python3 -c "import sys; a = float('${ILOSS#RESULT val_loss=}'); b = float('$PLOSS'); sys.exit(0 if abs(a - b) <= 1e-5 * b and b < 0.05 else 1)" ||
        fail "ignite run: workers' val_loss ${ILOSS#RESULT val_loss=}, psd's $PLOSS (or not below 0.05)"
    log "ignite workers: 6000 trained, 1000 validated, val_loss $PLOSS on both workers and psd"

    # -- 5c. a Lightning script as the workers (the graph weather forecaster) ----
    log "docker-compose up, psd + 2 workers running examples/lightning/fit.py --model weather (psd.lightning), 2 epochs"
    export PSD_PUBLISH=127.0.0.1:$(free_port)
    export PSD_CONFIG_FILE=$SRC/examples/lightning/weather.yaml PSD_WORKER_DIR=$SRC/examples/lightning
    export PSD_ARGS="--epochs 2 --seed $SEED" \
        PSD_WORKER_CMD="python3 fit.py --model weather --epochs 2 --psd '' --out /tmp/runs"
    compose_workers weather l
    expect_last weather epoch=2 train_samples=920 val_samples=184
    # rank 0 prints Lightning's logged val_mae: psd's (persistence scores 0.054)
    WMAE=$(last "$T/weather-metrics.jsonl" val_mae)
    LMAE=$(grep -o "RESULT mode=psd .*" "$T/compose-weather.log" | grep -o " val_mae=[0-9.]*" | sed 's/.*=//')
    python3 -c "import sys; a = float('$LMAE'); b = float('$WMAE'); sys.exit(0 if abs(a - b) <= 1e-4 and b < 0.04 else 1)" ||
        fail "weather run: Lightning's val_mae '$LMAE', psd's $WMAE (or not below 0.04)"
    log "weather workers: 2 epochs of 920 trained, 184 validated, val_mae $WMAE (Lightning's and psd's)"
fi
log "PASS: compose pworkers = by hand ($COMP/10000), compose torch workers test_acc ${TACC:-skipped}, ignite workers val_loss ${PLOSS:-skipped}, weather workers val_mae ${WMAE:-skipped}"
