# Shared set-up of the bench scripts (sourced): install what is missing,
# build, make a work directory removed on exit, pick a free loopback port.
# Sets ROOT, WORK, PORT.
# One line naming this machine (CPU, cores, kernel, the kernel's congestion
# control), so that figures from different machines can be told apart.
machine_line() {
    local cpu
    cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1)
    echo "machine: ${cpu:-unknown CPU}, $(nproc) cores usable ($(grep -c ^processor /proc/cpuinfo) online)," \
        "kernel $(uname -r), tcp congestion control $(cat /proc/sys/net/ipv4/tcp_congestion_control 2>/dev/null ||
        echo unknown) (psd: server.tcp_congestion auto = reno on loopback)"
    # the CPU as the VM shows it, and page-table isolation (every system call pays for it)
    echo "cpu: family $(sed -n 's/^cpu family[[:space:]]*: //p' /proc/cpuinfo | head -n 1)" \
        "model $(sed -n 's/^model[[:space:]]*: //p' /proc/cpuinfo | head -n 1)," \
        "meltdown: $(cat /sys/devices/system/cpu/vulnerabilities/meltdown 2>/dev/null || echo unknown)," \
        "clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null || echo unknown)"
    # which host: tables from two hosts are told apart by these
    echo "host: machine-id $(cut -c1-12 /etc/machine-id 2>/dev/null || echo unknown)," \
        "DMI product uuid $(cat /sys/class/dmi/id/product_uuid 2>/dev/null || echo unreadable)," \
        "boot id $(cut -c1-8 /proc/sys/kernel/random/boot_id 2>/dev/null || echo unknown)"
    # what the kernel's entries cost (a deprivileged guest kernel pays several times bare metal's)
    local kp
    kp=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/kernel_probe
    [ ! -x "$kp" ] || "$kp"
    # whether the kernel copies a send slowly from a page's last bytes (psd pads around it)
    [ ! -x "${kp%/*}/frame_probe" ] || "${kp%/*}/frame_probe" 0.2
}

bench_setup() { # [--bench]
    cd "$(dirname "${BASH_SOURCE[1]}")/.."
    ROOT=$(pwd)
    sh deploy/setup.sh "$@"
    [ -f build/build.ninja ] || meson setup build >/dev/null
    ninja -C build >/dev/null
    WORK=$(mktemp -d /tmp/psd-bench-XXXXXX)
    trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
    PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
}

# TAG1 TAG2: the weights files $WORK/w-TAG.bin hold the same model, the run id
# aside (build/tests/weights_cmp: the tests' comparison, ps_weights_same)
same() {
    if "$ROOT/build/tests/weights_cmp" "$WORK/w-$1.bin" "$WORK/w-$2.bin" >/dev/null 2>&1; then
        echo "$1 = $2: same weights"
    else
        echo "$1 != $2: the weights differ (a bug)"
    fi
}

# After bench_setup, for the scripts that run torch workers and DDP
# (torch_cnn.sh, torch_mlp.sh): PY, PIDS (what the script started: ended by
# PID on exit, with the children of each, DDP's ranks), the machine line,
# one thread each, the package from the tree, EP.
bench_torch_setup() {
    PY=/usr/bin/python3
    PIDS=()
    trap bench_torch_cleanup EXIT
    trap 'exit 130' INT # a trapped signal ends `wait` at once; the exit runs the cleanup
    trap 'exit 143' TERM
    machine_line # before OMP_NUM_THREADS=1: nproc reads it
    export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
    export PYTHONPATH="$ROOT/python" PSD_WORKER_LIB="$ROOT/build/libpsworker.so.3"
    EP="tcp://127.0.0.1:$PORT"
}

bench_torch_cleanup() {
    local p
    for p in "${PIDS[@]}"; do
        pkill -TERM -P "$p" 2>/dev/null || true
        kill "$p" 2>/dev/null || true
    done
    rm -rf "$WORK"
}

# bench_wait_all LABEL DIR PID...: wait for a run's psd and workers (PIDS emptied: nothing of
# theirs to kill later, a PID may be reused); on a failure the ends of DIR's logs, exit 1
bench_wait_all() {
    local label=$1 d=$2 rc=0 p
    shift 2
    for p in "$@"; do wait "$p" || rc=$?; done
    PIDS=()
    if [ $rc != 0 ]; then
        echo "$label: a process failed (exit $rc); the logs' ends:" >&2
        tail -n 5 "$d/psd.log" "$d/w0.log" "$d/w1.log" >&2
        exit 1
    fi
}

# psd + psbench on the 784-1338 model (one 4 MiB tensor + 5 KiB of bias), ROUNDS
# training rounds a worker (default 800): $1 workers, $2 endpoint, $3 psbench flags,
# $4 psd optimizer flags (default PLAIN: plain SGD, one read of the weights and the
# gradient, one write). Prints the aggregate GB/s; psbench's lines go to stderr, psd's
# metrics to $WORK/metrics-$1.jsonl. Needs ROOT and WORK (bench_setup).
PLAIN="--set optimizer.momentum=0 --set optimizer.weight_decay=0"
psbench_run() {
    local w=$1 ep=$2 flags=${3:-} opt=${4:-$PLAIN} limit=$((${ROUNDS:-800} * 64 * $1))
    # shellcheck disable=SC2086
    "$ROOT/build/psd" --listen "$ep" --workers "$w" --epochs 1 --set 'model.layers=[784,1338]' $opt \
        --set "data.train_limit=$limit" --set schedule.name=constant --set checkpoint.dir= \
        --metrics "$WORK/metrics-$w.jsonl" --save "" 2>"$WORK/psd-$w.log" &
    local psd=$!
    # shellcheck disable=SC2086
    "$ROOT/build/psbench" --connect "$ep" --workers "$w" $flags >"$WORK/psbench-$w.txt"
    wait $psd
    sed 's/^/    /' "$WORK/psbench-$w.txt" >&2
    awk '/^aggregate/ {print $3}' "$WORK/psbench-$w.txt"
}
# psd's own step (psd_step_ms) in the last psbench_run with $1 workers
step_ms() { python3 -c "import json, sys; print(f\"{json.loads(open(sys.argv[1]).readlines()[-1])['psd_step_ms']:.2f}\")" \
    "$WORK/metrics-$1.jsonl"; }
