#!/bin/sh
# One command each for the README:
#   sh deploy/quickstart.sh train   install what is missing, build, train the
#                                   Fashion-MNIST MLP with psd + 2 pworkers on
#                                   localhost, then evaluate the saved weights
#   sh deploy/quickstart.sh test    install what is missing, build, run all tests
#                                   (deploy tests: root, Docker engine, SLURM)
#   sh deploy/quickstart.sh torch   install what is missing (PyTorch too), build,
#                                   train examples/torch/fashion_cnn.py with psd +
#                                   2 torch workers (1 thread each) on localhost
#   sh deploy/quickstart.sh lightning  install what is missing (.venv with Lightning
#                                   too), build, train examples/lightning/fit.py's
#                                   DCRNN with psd + 2 Lightning workers (PsdStrategy)
#   sh deploy/quickstart.sh weather the same for fit.py --model weather (weather.py's
#                                   mesh forecaster): psd + 2 Lightning workers
#   sh deploy/quickstart.sh ignite  the same for examples/ignite/autoencoder_psd.py:
#                                   psd + 2 Ignite workers (psd.ignite)
# Extra arguments after `train`, `torch` or `lightning` go to psd (e.g. --epochs 3); after
# `weather` or `ignite`, to the workers (e.g. --epochs 3: the workers' --epochs, which their
# cosine schedule spans, is psd's run.epochs too).
set -eu
cd "$(dirname "$0")/.."
ROOT=$(pwd)
what=${1:-train}
[ $# -gt 0 ] && shift

case "$what" in
test) sh deploy/setup.sh --deploy ;;
torch) sh deploy/setup.sh --bench ;;
lightning|weather|ignite) sh deploy/setup.sh --lightning ;;
*) sh deploy/setup.sh ;;
esac
if [ ! -f build/build.ninja ]; then
    meson setup build -Dwerror=true >/dev/null
fi
ninja -C build >/dev/null

# wait_run PSD W0 W1: psd's exit code (the workers' are theirs); all three killed on INT/TERM
wait_run() {
    trap "kill $1 $2 $3 2>/dev/null || true" INT TERM EXIT
    rc=0
    wait "$1" || rc=$?
    wait "$2" || true
    wait "$3" || true
    trap - INT TERM EXIT
    [ $rc -ne 0 ] && { echo "psd exited $rc" >&2; exit $rc; }
    return 0
}

case "$what" in
train|torch)
    mkdir -p run
    cd run
    EP="tcp://127.0.0.1:${PSD_PORT:-5555}"
    if [ "$what" = train ]; then
        "$ROOT/build/psd" --listen "$EP" --workers 2 "$@" &
        PSD=$!
        "$ROOT/build/pworker" --connect "$EP" &
        W0=$!
        "$ROOT/build/pworker" --connect "$EP" &
        W1=$!
        wait_run $PSD $W0 $W1
        echo "metrics: $ROOT/run/psd-metrics.jsonl   weights: $ROOT/run/psd-weights.bin"
        "$ROOT/build/psd" eval psd-weights.bin
    else
        export PYTHONPATH="$ROOT/python" PSD_WORKER_LIB="$ROOT/build/libpsworker.so.3"
        "$ROOT/build/psd" --config "$ROOT/examples/torch/fashion_cnn.yaml" --listen "$EP" "$@" &
        PSD=$!
        /usr/bin/python3 "$ROOT/examples/torch/fashion_cnn.py" "$EP" --threads 1 &
        W0=$!
        /usr/bin/python3 "$ROOT/examples/torch/fashion_cnn.py" "$EP" --threads 1 &
        W1=$!
        wait_run $PSD $W0 $W1
        echo "metrics: $ROOT/run/psd-metrics.jsonl   best epoch's weights: $ROOT/run/fashion_cnn.safetensors"
    fi
    ;;
lightning)
    mkdir -p run/lightning
    cd run/lightning
    EP="tcp://127.0.0.1:${PSD_PORT:-5555}"
    export PYTHONPATH="$ROOT/python" PSD_WORKER_LIB="$ROOT/build/libpsworker.so.3"
    "$ROOT/build/psd" --config "$ROOT/examples/lightning/psd.yaml" --listen "$EP" "$@" &
    PSD=$!
    # psd's run.epochs ends the run; Lightning's max_epochs is only a bound here
    PY=${PSD_PY:-$ROOT/.venv/bin/python} # (another Python with Lightning: PSD_PY)
    "$PY" "$ROOT/examples/lightning/fit.py" --epochs 1000 --psd "$EP" --out w0 &
    W0=$!
    "$PY" "$ROOT/examples/lightning/fit.py" --epochs 1000 --psd "$EP" --out w1 &
    W1=$!
    wait_run $PSD $W0 $W1
    echo "metrics: $ROOT/run/lightning/dcrnn-metrics.jsonl   Lightning's logs and checkpoints: $ROOT/run/lightning/w0"
    ;;
weather|ignite)
    mkdir -p "run/$what"
    cd "run/$what"
    EP="tcp://127.0.0.1:${PSD_PORT:-5555}"
    export PYTHONPATH="$ROOT/python" PSD_WORKER_LIB="$ROOT/build/libpsworker.so.3" PSD_ENDPOINT="$EP"
    E=16 prev=  # the workers' --epochs (their cosine schedule spans it) is psd's run.epochs
    [ "$what" = ignite ] && E=5
    for a in "$@"; do [ "$prev" = --epochs ] && E=$a; prev=$a; done
    PY=${PSD_PY:-$ROOT/.venv/bin/python} # (another Python with Lightning and Ignite: PSD_PY)
    if [ "$what" = weather ]; then
        cfg=examples/lightning/weather.yaml out=weather-metrics.jsonl
        set -- "$ROOT/examples/lightning/fit.py" --model weather --psd "" "$@"
    else
        cfg=examples/ignite/psd.yaml out=autoencoder-metrics.jsonl
        set -- "$ROOT/examples/ignite/autoencoder_psd.py" "$@"
    fi
    "$ROOT/build/psd" --config "$ROOT/$cfg" --listen "$EP" --set run.epochs="$E" &
    PSD=$!
    "$PY" "$@" --out w0 &
    W0=$!
    "$PY" "$@" --out w1 &
    W1=$!
    wait_run $PSD $W0 $W1
    echo "metrics: $ROOT/run/$what/$out   rank 0's logs and best checkpoint: $ROOT/run/$what/w0"
    ;;
test)
    meson test -C build --print-errorlogs --suite unit --suite integration --suite long --suite gpu --suite emu \
        --suite python --suite lightning --suite ignite --suite deploy
    ;;
*)
    echo "usage: sh deploy/quickstart.sh train|torch|lightning|weather|ignite|test" >&2
    exit 2
    ;;
esac
