#!/bin/bash
# Benchmark (issue 60): examples/lightning/fit.py, traffic.py's DCRNN trained three ways on this
# machine, with the same module, data and Trainer:
#   single  one process (strategy "auto"), batch 64
#   ddp     Lightning's own DDP on CPU (gloo), 2 processes it launches, batch 64 each
#   psd     psd (examples/lightning/psd.yaml) + 2 psd.lightning workers started here, batch 64 each
# every process 1 torch thread (OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1, fit.py --threads 1).
#
#   bash bench/lightning.sh [EPOCHS] [ROUNDS]       (defaults 3 and 2)
#   MODES="single ddp" bash bench/lightning.sh      (some of the three; psd is skipped anyway
#                                                    while psd.lightning does not import)
#   PY=/path/to/venv/bin/python bash bench/lightning.sh   (a Python with lightning 2.2.5;
#                                                    default .venv's, as deploy/setup.sh makes it)
#
# samples/s, the same measure in the three: training windows x epochs / training seconds, timed
# by rank 0's fit.py (its TrainClock: on_train_start to on_train_end, each epoch's validation
# left out; start-up, the sanity check and the data's generation not counted). psd's own
# samples_per_s (its metrics file) is printed beside it. ROUNDS alternations, the order of the
# three rotated each round; medians at the end. val_mae: the last epoch's validation MAE (mph)
# as Lightning logged it. Not a test: nothing here passes or fails on speed.
set -euo pipefail
EPOCHS=${1:-3}
ROUNDS=${2:-2}
MODES=${MODES:-single ddp psd}
LPY=${PY:-}
. "$(dirname "$0")/lib.sh"
bench_setup --bench
bench_torch_setup
PY=${LPY:-$ROOT/.venv/bin/python} # bench_torch_setup's PY is Debian's python3, without lightning
[ -x "$PY" ] || PY=python3
"$PY" -c 'import lightning' 2>/dev/null || { echo "$PY has no lightning: set PY (see the header)" >&2; exit 2; }
FIT="$ROOT/examples/lightning/fit.py"
HAVE_PSD=1
"$PY" -c 'import psd.lightning' 2>/dev/null || HAVE_PSD=0

# result MODE ROUND DIR LOG: the RESULT line of LOG onto $WORK/results, or the log's end and exit 1
result() {
    local line
    line=$(grep '^RESULT ' "$4" | tail -n 1) || true
    if [ -z "$line" ]; then
        echo "$1 round $2: no RESULT line; the end of $4:" >&2
        tail -n 8 "$4" >&2
        exit 1
    fi
    echo "round $2 $1: ${line#RESULT }"
    echo "$1 $2 ${line#RESULT }" >>"$WORK/results"
}

single_run() { # ROUND
    local d="$WORK/single-$1"
    mkdir -p "$d"
    "$PY" "$FIT" --epochs "$EPOCHS" --threads 1 --out "$d" >"$d/fit.log" 2>&1 &
    PIDS+=("$!")
    wait "${PIDS[-1]}" || true
    PIDS=()
    result single "$1" "$d" "$d/fit.log"
}

ddp_run() { # ROUND: Lightning starts rank 1 itself (a child of rank 0: ended with it on exit)
    local d="$WORK/ddp-$1"
    mkdir -p "$d"
    "$PY" "$FIT" --epochs "$EPOCHS" --threads 1 --ddp 2 --out "$d" >"$d/fit.log" 2>&1 &
    PIDS+=("$!")
    wait "${PIDS[-1]}" || true
    PIDS=()
    result ddp "$1" "$d" "$d/fit.log"
}

psd_run() { # ROUND: psd + 2 workers
    local d="$WORK/psd-$1"
    if [ "$HAVE_PSD" = 0 ]; then
        echo "round $1 psd: skipped (psd.lightning does not import with $PY)"
        return
    fi
    mkdir -p "$d"
    (cd "$d" && exec "$ROOT/build/psd" --config "$ROOT/examples/lightning/psd.yaml" --listen "$EP" --workers 2 \
        --epochs "$EPOCHS" --set train.batch_size=64 --metrics "$d/metrics.jsonl" --save "" --set checkpoint.dir=) \
        2>"$d/psd.log" &
    local psd=$!
    PIDS+=("$psd")
    local k pids=()
    for k in 0 1; do
        (cd "$d" && exec "$PY" "$FIT" --epochs "$EPOCHS" --threads 1 --psd "$EP" --out "$d/w$k") >"$d/w$k.out" \
            2>"$d/w$k.log" &
        pids+=("$!")
        PIDS+=("$!")
    done
    bench_wait_all "psd round $1" "$d" "$psd" "${pids[@]}"
    cat "$d/w0.out" "$d/w1.out" >"$d/fit.log"
    result psd "$1" "$d" "$d/fit.log"
    python3 - "$1" "$d/metrics.jsonl" <<'PY'
import json, sys
last = json.loads(open(sys.argv[2]).readlines()[-1])
print("round %s psd: psd's own samples_per_s %.1f (%.1f s of training)" % (sys.argv[1], last["samples_per_s"],
      last["train_s"]))
PY
}

echo "$(date -u '+%F %H:%M UTC'), $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- \
    python worker server common examples/lightning 2>/dev/null || echo '*'), Lightning DCRNN" \
    "(examples/lightning): $EPOCHS epochs, $ROUNDS rounds, batch 64 per process, 1 thread per process, $PY" \
    "(lightning $("$PY" -c 'import lightning; print(lightning.__version__)'), torch $("$PY" -c \
    'import torch; print(torch.__version__)')), load average $(cut -d' ' -f1-3 /proc/loadavg)"
: >"$WORK/results"
read -r -a modes <<<"$MODES"
for r in $(seq 1 "$ROUNDS"); do
    for i in $(seq 0 $((${#modes[@]} - 1))); do
        m=${modes[$(((i + r - 1) % ${#modes[@]}))]}
        case "$m" in
        single) single_run "$r" ;;
        ddp) ddp_run "$r" ;;
        psd) psd_run "$r" ;;
        *) echo "MODES: single, ddp, psd" >&2; exit 2 ;;
        esac
    done
done
python3 - "$WORK/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    mode, rnd, *kv = line.split()
    rows.setdefault(mode, []).append({k: float(v) for k, v in (x.split("=") for x in kv if x[:5] != "mode=")})
med = statistics.median
base = med(r["samples_per_s"] for r in rows["single"]) if "single" in rows else None
for mode, rs in rows.items():
    sps = med(r["samples_per_s"] for r in rs)
    print("median of %d: %-6s %7.1f samples/s%s, val_mae %.3f mph (historical average %.3f, last value %.3f)"
          % (len(rs), mode, sps, " (%.2fx single)" % (sps / base) if base else "", med(r["val_mae"] for r in rs),
             rs[0]["ha_mae"], rs[0]["last_mae"]))
PY
