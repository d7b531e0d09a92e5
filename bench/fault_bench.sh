#!/bin/bash
# Time from a worker's death (kill -9) to psd going on without it, at the
# default settings (server.worker_timeout 5 s): psd + 3 pworkers on the
# default model, one killed in the middle of epoch 2. Prints the kill time,
# psd's "lost" line and the delay. Not a test.
#   bash bench/fault_bench.sh
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
cd "$WORK"
"$ROOT/build/psd" --listen "tcp://127.0.0.1:$PORT" --workers 3 --epochs 3 --set checkpoint.dir= 2> psd.log &
PSD=$!
W=()
for i in 0 1 2; do "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" --devices cpu 2> "w$i.log" & W+=($!); done
until [ -s psd-metrics.jsonl ]; do sleep 0.05; done
sleep 1
KILLED=$(date +%s.%N)
kill -9 "${W[2]}"
wait $PSD
LOST=$(grep -m1 "lost: nothing from it" psd.log)
AT=$(echo "$LOST" | cut -d' ' -f1)
python3 - "$KILLED" "$AT" <<'PY'
import sys, datetime
k = float(sys.argv[1])
t = datetime.datetime.strptime(sys.argv[2], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.timezone.utc).timestamp()
print("worker killed -> psd declares it lost and gives its samples to the others: %.2f s" % (t - k))
PY
echo "$LOST" | cut -c1-200
grep -E "remaining samples|run finished" psd.log | cut -c1-160
tail -1 psd-metrics.jsonl
