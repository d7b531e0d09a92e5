#!/bin/bash
# The click-through task with a 10 000 000 x 32 embedding table (1.28 GB of
# floats), psd + 2 pworkers over tcp loopback (--no-shm: the wire), Adagrad.
# The table stays on psd (over ctr.worker_table_mb): the workers hold one
# batch's rows, pull and push rows. Prints the final validation log-loss and
# AUC against the planted optimum, psd's and the workers' peak RSS,
# samples/s, and bytes on the wire per push and reply. Not a test.
# With DENSE=1 it then runs 10 steps of the same model with the table on
# the workers and forced whole (ctr.worker_table_mb=1000000,
# train.sparse_threshold=0, --worker-timeout 120): every push and reply is
# a 1.28 GB message (about 5 more minutes, 11 GiB of memory).
#
# With SHARDS=2 it runs the same training again with psd as 2 shards (psd
# --shard 0/2 and 1/2: each keeps half of the table, the workers still hold
# one batch's rows), with each shard's peak RSS, and checks that both runs
# gave the same weights (they must).
#
#   bash bench/ctr_big.sh            (about 1 minute on a 2-core VM; psd takes 2.5 GiB)
#   EPOCHS=2 TRAIN=400000 bash bench/ctr_big.sh
#   SHARDS=2 bash bench/ctr_big.sh   (about 3 minutes)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
CFG="$ROOT/deploy/configs/ctr.yaml"
EPOCHS=${EPOCHS:-1}
TRAIN=${TRAIN:-1000000}
BIG=(--set ctr.rows=10000000 --set ctr.dim=32 --set 'model.layers=[256,64,2]' --set ctr.vocab=2000000
     --set ctr.test=40000 --set train.val_batch_size=2000)

one() { # TAG ARGS...: one run; prints its line (SH=2: psd as 2 shards, shard 0's figures and shard 1's RSS)
    local tag=$1
    shift
    local sh=()
    [ "${SH:-1}" = 2 ] && sh=(--shard 0/2)
    /usr/bin/time -f "%M %e" -o "$WORK/rss-$tag" "$ROOT/build/psd" --config "$CFG" \
        --listen "tcp://127.0.0.1:$PORT" --workers 2 --metrics "$WORK/m-$tag.jsonl" --save "$WORK/w-$tag.bin" \
        --set checkpoint.dir= "${sh[@]}" \
        "${BIG[@]}" "$@" 2>"$WORK/psd-$tag.log" &
    if [ "${SH:-1}" = 2 ]; then
        local p1
        p1=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        /usr/bin/time -f "%M" -o "$WORK/rss1-$tag" "$ROOT/build/psd" --config "$CFG" --listen "tcp://127.0.0.1:$p1" \
            --shard 1/2 --leader "tcp://127.0.0.1:$PORT" --set checkpoint.dir= "${BIG[@]}" "$@" \
            2>"$WORK/psd1-$tag.log" &
    fi
    for i in 0 1; do
        /usr/bin/time -f "%M" -o "$WORK/rss-$tag-w$i" "$ROOT/build/pworker" --no-shm \
            --connect "tcp://127.0.0.1:$PORT" 2>/dev/null &
    done
    wait
    grep -m1 "ctr task" "$WORK/psd-$tag.log" | sed 's/.*ctr task/ctr task/' || true
    if [ "${SH:-1}" = 2 ]; then
        echo "  shard 1 (max RSS $(($(cat "$WORK/rss1-$tag") / 1024)) MiB), the whole run:" \
            "$(grep -o 'received: .*' "$WORK/psd1-$tag.log")"
    fi
    python3 - "$tag" "$WORK/m-$tag.jsonl" "$(cat "$WORK/rss-$tag")" "$(cat "$WORK/rss-$tag-w0")" \
        "$(cat "$WORK/rss-$tag-w1")" <<'PY'
import json, sys
tag, path = sys.argv[1], sys.argv[2]
rss, wall = sys.argv[3].split()
w0, w1 = int(sys.argv[4]), int(sys.argv[5])
lines = [json.loads(l) for l in open(path)]
d = lines[-1]
steps = d["step"] - (lines[-2]["step"] if len(lines) > 1 else 0)
pushes = max(2 * steps, 1)
print(f"{tag}: epoch {d['epoch']}, {steps} steps (2 pushes each), {d['samples_per_s']:.0f} samples/s, wall {float(wall):.0f} s")
print(f"  psd max RSS {int(rss) / 1024:.0f} MiB, workers {w0 / 1024:.0f} / {w1 / 1024:.0f} MiB")
print(f"  last epoch: psd received {d['wire_bytes_in'] / 1e6:.1f} MB ({d['wire_bytes_in'] / pushes / 1e3:.1f} kB a push),"
      f" sent {d['wire_bytes_out'] / 1e6:.1f} MB; table rows: {d['table_rows_in'] / max(d['table_row_pushes'], 1):.0f}"
      f" a push in {d['table_row_pushes']} pushes, {d['table_rows_out'] / max(d['table_row_replies'], 1):.0f}"
      f" a reply in {d['table_row_replies']} replies ({d['table_rows_out'] * 132 / max(d['table_row_replies'], 1) / 1e3:.1f} kB)")
print(f"  val log-loss {d['val_loss']:.4f} (planted optimum {d['optimum_loss']:.4f}, constant {d['constant_loss']:.4f}),"
      f" AUC {d['val_auc']:.4f} (planted {d['optimum_auc']:.4f}), psd step {d['psd_step_ms']:.3f} ms")
PY
}
date -u +%F
one rows --set run.epochs="$EPOCHS" --set ctr.train="$TRAIN"
if [ "${SHARDS:-1}" = 2 ]; then
    SH=2 one rows-2sh --set run.epochs="$EPOCHS" --set ctr.train="$TRAIN"
    same rows rows-2sh
fi
if [ "${DENSE:-0}" = 1 ]; then
    one whole --set run.epochs=1 --set ctr.train=5120 --set ctr.test=2000 --set train.sparse_threshold=0 \
        --set ctr.worker_table_mb=1000000 --worker-timeout 120
fi
