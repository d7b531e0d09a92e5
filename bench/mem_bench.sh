#!/bin/bash
# psd's memory against its floor, at several worker counts, over tcp and
# through shared memory. psbench drives psd (W simulated workers, no math:
# steps come as fast as psd and the wire allow; Adam, no checkpoints). psd's
# VmRSS is sampled every 0.2 s; per run it prints the steady RSS (median of
# the second half), the peak (VmHWM), psd's base (its RSS with a model of a
# few parameters, measured first: code, libraries, the data set) and the
# floor: base + weights + Adam's two moments (3 x 4P). "extra" is peak less
# floor in gradient messages (4P bytes each): the issue's goal is at most 2.
# Through shared memory psd maps the workers' gradient regions (W x 4P, the
# workers' memory, counted in psd's RSS as shared pages): less those.
#   bash bench/mem_bench.sh [STEPS] [CASES...]
# CASES: "LAYERS:W:tcp|shm" (default: the 20M MLP at 2 and 8 workers and a
# 1M one at 2, 8 and 64, each over tcp and shared memory). Not a test.
set -euo pipefail
STEPS=${1:-60}
shift || true
BIG='[784,4096,4096,10]'   # P = 19.9M (80 MB a message)
SMALL='[784,1250,10]'      # P = 0.99M (4 MB a message)
CASES=("$@")
if [ ${#CASES[@]} -eq 0 ]; then
    CASES=("$BIG:2:tcp" "$BIG:2:shm" "$BIG:8:tcp" "$BIG:8:shm"
        "$SMALL:2:tcp" "$SMALL:2:shm" "$SMALL:8:tcp" "$SMALL:8:shm" "$SMALL:64:tcp" "$SMALL:64:shm")
fi
. "$(dirname "$0")/lib.sh"
bench_setup
machine_line
echo "commit $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- server worker common || echo +changes), $(date -u +%F)"

# run LAYERS W FLAGS: one run; its RSS samples to $WORK/rss.txt, peak to $WORK/hwm.txt,
# psd's log to $WORK/psd.log
run() {
    local layers=$1 w=$2 flags=$3 psd pb
    "$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers "$w" --epochs 1 \
        --set "model.layers=$layers" --set optimizer.name=adam --set optimizer.lr=0.001 \
        --set schedule.name=constant --set "data.train_limit=$((STEPS * 64 * w))" --set checkpoint.dir= \
        --set server.worker_timeout=60 --metrics "" --save "" 2>"$WORK/psd.log" &
    psd=$!
    # shellcheck disable=SC2086
    "$ROOT/build/psbench" --connect "tcp://127.0.0.1:$PORT" --workers "$w" $flags >"$WORK/psbench.txt" 2>&1 &
    pb=$!
    : >"$WORK/rss.txt"
    while kill -0 $psd 2>/dev/null; do
        awk '/^VmRSS/ {r=$2} /^RssAnon/ {a=$2} /^RssShmem/ {s=$2} END {if (r) print r, a, s}' \
            /proc/$psd/status 2>/dev/null >>"$WORK/rss.txt" || true
        awk '/^VmHWM/ {print $2}' /proc/$psd/status 2>/dev/null >"$WORK/hwm.txt" || true
        sleep 0.2
    done
    wait $psd || { echo "psd failed:" >&2; tail -n 5 "$WORK/psd.log" >&2; exit 1; }
    wait $pb || { echo "psbench failed:" >&2; tail -n 5 "$WORK/psbench.txt" >&2; exit 1; }
}

# psd's base: a model of 7,850 parameters, 2 workers over tcp
run '[784,10]' 2 --no-shm
BASE=$(cat "$WORK/hwm.txt")
echo "psd's base (model [784,10], 2 workers, tcp): peak $((BASE / 1024)) MiB"
printf '%-20s %3s %-4s %9s %9s %9s %9s %9s\n' model W wire "floor" steady peak extra "extra/msg"
for c in "${CASES[@]}"; do
    IFS=: read -r layers w wire <<<"$c"
    flags=""
    [ "$wire" = tcp ] && flags=--no-shm
    run "$layers" "$w" "$flags"
    P=$(grep -o 'model [0-9]* parameters' "$WORK/psd.log" | awk '{print $2}')
    SHM=$(grep -c 'through shared memory' "$WORK/psd.log" || true)
    python3 - "$WORK/rss.txt" "$(cat "$WORK/hwm.txt")" "$P" "$SHM" "$BASE" "$layers" "$w" "$wire" <<'EOF'
import statistics, sys
rows = [[int(v) for v in x.split()] for x in open(sys.argv[1]) if x.strip()]
hwm, P, shm, base = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
half = rows[len(rows) // 2:]
steady = statistics.median(r[0] for r in half) if half else 0
regions = shm * 4 * P / 1024          # KiB of worker gradient regions psd maps
msg = 4 * P / 1024                     # KiB of one gradient message
floor = base + 3 * msg                 # weights + Adam's two moments
extra = (hwm - regions) - floor
mib = lambda k: "%.1f" % (k / 1024)
print("%-20s %3s %-4s %9s %9s %9s %9s %9.2f" % (sys.argv[6], sys.argv[7], sys.argv[8], mib(floor),
      mib(steady - regions), mib(hwm - regions), mib(extra), extra / msg))
EOF
done
echo "(MiB; steady and peak less the workers' shared regions; extra = peak - floor; msg = 4P bytes)"
