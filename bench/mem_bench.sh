#!/bin/bash
# psd's memory in steady state for an Adam model of P = 20.0M parameters
# (MLP 784-4096-4096-10), driven by psbench (2 simulated workers, no math, so
# steps come as fast as psd and the wire allow; no checkpoints). Samples
# psd's VmRSS every 0.2 s; prints the median of the second half of the run
# (steady state), the peak (VmHWM) and the target of the fast-path issue:
# 1.15 x (5 x 4P bytes) + 40 MiB (weights, two Adam moments, the aggregation
# buffer and one older version still being sent). Not a test.
#
# psbench runs on psd's host, so by default tensors go through shared memory:
# psd then maps the workers' gradient regions (2 x 4P, the workers' memory,
# counted in psd's RSS as shared pages). The script also prints RssAnon and
# RssShmem, and psd's own memory: RSS less those regions. --no-shm measures
# the wire instead (pushed gradients are then psd's, held until the step).
#   bash bench/mem_bench.sh [STEPS] [--no-shm]          (default 300)
set -euo pipefail
STEPS=${1:-300}
FLAGS=${2:-}
. "$(dirname "$0")/lib.sh"
bench_setup
"$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers 2 --epochs 1 \
    --set 'model.layers=[784,4096,4096,10]' --set optimizer.name=adam --set optimizer.lr=0.001 \
    --set schedule.name=constant --set "data.train_limit=$((STEPS * 128))" --set checkpoint.dir= \
    --metrics "" --save "" 2>"$WORK/psd.log" &
PSD=$!
# shellcheck disable=SC2086
"$ROOT/build/psbench" --connect "tcp://127.0.0.1:$PORT" --workers 2 $FLAGS >"$WORK/psbench.txt" &
PB=$!
: >"$WORK/rss.txt"
while kill -0 $PSD 2>/dev/null; do
    awk '/^VmRSS/ {r=$2} /^RssAnon/ {a=$2} /^RssShmem/ {s=$2} END {if (r) print r, a, s}' \
        /proc/$PSD/status 2>/dev/null >>"$WORK/rss.txt" || true
    awk '/^VmHWM/ {print $2}' /proc/$PSD/status 2>/dev/null >"$WORK/hwm.txt" || true
    sleep 0.2
done
wait $PSD || true
wait $PB || true
P=$(grep -o 'model [0-9]* parameters' "$WORK/psd.log" | awk '{print $2}')
SHM=$(grep -c 'through shared memory' "$WORK/psd.log" || true)
python3 - "$WORK/rss.txt" "$(cat "$WORK/hwm.txt")" "$P" "$SHM" <<'EOF'
import statistics, sys
rows = [[int(v) for v in x.split()] for x in open(sys.argv[1]) if x.strip()]
hwm = int(sys.argv[2]); P = int(sys.argv[3]); shm = int(sys.argv[4])
half = rows[len(rows) // 2:]
med = lambda k: statistics.median(r[k] for r in half) if half else 0
steady, anon, shmem = med(0), med(1), med(2)
regions = shm * 4 * P / 1024  # KiB of worker gradient regions psd maps
own = steady - regions
target = 1.15 * 5 * 4 * P / 2**20 + 40
print(f"P = {P} parameters ({4 * P / 2**20:.1f} MiB per copy); {shm} of 2 workers on shared memory")
print(f"psd steady RSS {steady / 1024:.1f} MiB (anon {anon / 1024:.1f}, shmem {shmem / 1024:.1f}); "
      f"less the workers' regions: {own / 1024:.1f} MiB ({own * 1024 / (4 * P):.2f} x 4P); "
      f"peak {hwm / 1024:.1f} MiB ({hwm * 1024 / (4 * P):.2f} x 4P; regions included); target <= {target:.1f} MiB")
EOF
tail -n1 "$WORK/psbench.txt"
