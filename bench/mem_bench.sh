#!/bin/bash
# psd's memory in steady state for an Adam model of P = 20.0M parameters
# (MLP 784-4096-4096-10), driven by psbench (2 simulated workers, no math, so
# steps come as fast as psd and the wire allow; no checkpoints). Samples
# psd's VmRSS every 0.2 s; prints the median of the second half of the run
# (steady state), the peak (VmHWM) and the target of the fast-path issue:
# 1.15 x (5 x 4P bytes) + 40 MiB (weights, two Adam moments, the aggregation
# buffer and one older version still being sent). Not a test.
#   bash bench/mem_bench.sh [STEPS]          (default 300)
set -euo pipefail
STEPS=${1:-300}
. "$(dirname "$0")/lib.sh"
bench_setup
"$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers 2 --epochs 1 \
    --set 'model.layers=[784,4096,4096,10]' --set optimizer.name=adam --set optimizer.lr=0.001 \
    --set schedule.name=constant --set "data.train_limit=$((STEPS * 128))" --set checkpoint.dir= \
    --metrics "" --save "" 2>"$WORK/psd.log" &
PSD=$!
"$ROOT/build/psbench" --connect "tcp://127.0.0.1:$PORT" --workers 2 >"$WORK/psbench.txt" &
PB=$!
: >"$WORK/rss.txt"
while kill -0 $PSD 2>/dev/null; do
    awk '/^VmRSS/ {print $2}' /proc/$PSD/status 2>/dev/null >>"$WORK/rss.txt" || true
    awk '/^VmHWM/ {print $2}' /proc/$PSD/status 2>/dev/null >"$WORK/hwm.txt" || true
    sleep 0.2
done
wait $PSD || true
wait $PB || true
P=$(grep -o 'model [0-9]* parameters' "$WORK/psd.log" | awk '{print $2}')
python3 - "$WORK/rss.txt" "$(cat "$WORK/hwm.txt")" "$P" <<'EOF'
import statistics, sys
rss = [int(x) for x in open(sys.argv[1]) if x.strip()]
hwm = int(sys.argv[2]); P = int(sys.argv[3])
steady = statistics.median(rss[len(rss) // 2:]) if rss else 0
target = 1.15 * 5 * 4 * P / 2**20 + 40
print(f"P = {P} parameters ({4 * P / 2**20:.1f} MiB per copy)")
print(f"psd steady RSS {steady / 1024:.1f} MiB ({steady * 1024 / (4 * P):.2f} x 4P), "
      f"peak {hwm / 1024:.1f} MiB ({hwm * 1024 / (4 * P):.2f} x 4P); target <= {target:.1f} MiB")
EOF
tail -n1 "$WORK/psbench.txt"
