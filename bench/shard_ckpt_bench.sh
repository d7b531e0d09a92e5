#!/bin/bash
# Checkpoints of psd shards: 2 shards train an Adam MLP 784-2048-2048-10
# (5.8M parameters) with 2 workers, stop after epoch 1 (a checkpoint of
# each shard's part), then resume and finish. Prints each shard's file size
# and the peak resident memory of both shards while resumed (sampled every
# 50 ms). Not a test.
#   bash bench/shard_ckpt_bench.sh
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
ARGS=(--epochs 2 --set data.train_limit=2048 --seed 3 --set optimizer.name=adam
    --set "model.layers=[784,2048,2048,10]" --set "checkpoint.dir=$WORK/ck" --metrics "" --save "")
run() { # extra psd flags; sets S0 S1 and starts the workers
    local p0 p1
    p0=$(free_port)
    p1=$(free_port)
    "$ROOT/build/psd" --listen "tcp://127.0.0.1:$p0" --workers 2 --shard 0/2 "${ARGS[@]}" "$@" 2>> "$WORK/s0.log" &
    S0=$!
    "$ROOT/build/psd" --listen "tcp://127.0.0.1:$p1" --shard 1/2 --leader "tcp://127.0.0.1:$p0" "${ARGS[@]}" "$@" \
        2>> "$WORK/s1.log" &
    S1=$!
    for i in 0 1; do "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$p0" --no-shm 2>> "$WORK/w$i.log" & done
}
run --stop-after-epoch 1
wait
for f in "$WORK"/ck/run-*/ckpt-*.psdc "$WORK"/ck/run-*/shard-1/ckpt-*.psdc; do
    echo "checkpoint file $(stat -c %s "$f") bytes: ${f#"$WORK"/ck/}"
done
run --resume "$WORK/ck"
peak0=0 peak1=0
while kill -0 "$S0" 2> /dev/null; do
    r0=$(awk '/VmRSS/ {print $2}' "/proc/$S0/status" 2> /dev/null || true)
    r1=$(awk '/VmRSS/ {print $2}' "/proc/$S1/status" 2> /dev/null || true)
    if [ -n "$r0" ] && [ "$r0" -gt "$peak0" ]; then peak0=$r0; fi
    if [ -n "$r1" ] && [ "$r1" -gt "$peak1" ]; then peak1=$r1; fi
    sleep 0.05
done
wait
grep -h "resumed its part\|resuming run" "$WORK/s0.log" "$WORK/s1.log" | sed 's/^[^ ]* //'
echo "resumed: peak RSS shard 0 $((peak0 / 1024)) MiB, shard 1 $((peak1 / 1024)) MiB"
