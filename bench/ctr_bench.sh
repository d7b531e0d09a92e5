#!/bin/bash
# The click-through task (model.kind ctr) with the embedding table's
# gradient pushed as rows (train.sparse_threshold's default) and whole
# (train.sparse_threshold=0), psd + 2 pworkers over tcp loopback (--no-shm:
# the wire), on the shipped config (65 536 x 8 table, 5 epochs) and on a
# 1 048 576 x 32 table (50 000 examples, 1 epoch), there also with the
# table on psd (ctr.worker_table_mb=0). Prints, for the last
# epoch: bytes psd received and sent, table rows received, samples/s, psd's
# peak RSS, validation log-loss and AUC against the planted optimum, and
# whether both ways gave the same weights (they must). With `shards`, the
# 1 048 576 x 32 table over 2 psd shards instead (psd --shard 0/2 and 1/2,
# rows and whole), with what shard 1 received and sent. Not a test.
#
#   bash bench/ctr_bench.sh          (about 5 minutes on a 2-core VM)
#   bash bench/ctr_bench.sh shards   (about 3 minutes)
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
CFG="$ROOT/deploy/configs/ctr.yaml"

one() { # TAG ARGS...: one run; prints its line (SHARDS=2: psd as 2 shards, shard 0's figures)
    local tag=$1
    shift
    local sh=()
    [ "${SHARDS:-1}" = 2 ] && sh=(--shard 0/2)
    /usr/bin/time -f "%M" -o "$WORK/rss-$tag" "$ROOT/build/psd" --config "$CFG" --listen "tcp://127.0.0.1:$PORT" \
        --workers 2 --metrics "$WORK/m-$tag.jsonl" --save "$WORK/w-$tag.bin" --set checkpoint.dir= "${sh[@]}" "$@" \
        2>"$WORK/psd-$tag.log" &
    if [ "${SHARDS:-1}" = 2 ]; then
        local p1
        p1=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
        /usr/bin/time -f "%M" -o "$WORK/rss1-$tag" "$ROOT/build/psd" --config "$CFG" --listen "tcp://127.0.0.1:$p1" \
            --shard 1/2 --leader "tcp://127.0.0.1:$PORT" --set checkpoint.dir= "$@" 2>"$WORK/psd1-$tag.log" &
    fi
    "$ROOT/build/pworker" --no-shm --connect "tcp://127.0.0.1:$PORT" 2>/dev/null &
    "$ROOT/build/pworker" --no-shm --connect "tcp://127.0.0.1:$PORT" 2>/dev/null
    wait
    if [ "${SHARDS:-1}" = 2 ]; then
        echo "  shard 1 (max RSS $(($(cat "$WORK/rss1-$tag") / 1024)) MiB), the whole run:" \
            "$(grep -o 'received: .*' "$WORK/psd1-$tag.log")"
    fi
    python3 - "$tag" "$WORK/m-$tag.jsonl" "$(cat "$WORK/rss-$tag")" <<'PY'
import json, sys
tag, path, rss = sys.argv[1], sys.argv[2], int(sys.argv[3])
d = json.loads(open(path).readlines()[-1])
n = d["table_row_pushes"]
print(f"{tag:10s} epoch {d['epoch']}: psd received {d['wire_bytes_in'] / 1e6:.1f} MB"
      f" (rows: {n} pushes, {d['table_rows_in'] / max(n, 1):.0f} rows each), sent {d['wire_bytes_out'] / 1e6:.1f} MB,"
      f" {d['samples_per_s']:.0f} samples/s, psd max RSS {rss / 1024:.0f} MiB,"
      f" val log-loss {d['val_loss']:.4f} (planted {d['optimum_loss']:.4f}), AUC {d['val_auc']:.4f}")
PY
}
date -u +%F
BIG=(--set ctr.rows=1048576 --set ctr.dim=32 --set 'model.layers=[256,64,2]' --set run.epochs=1
     --set ctr.train=50000 --set ctr.vocab=100000)
if [ "${1:-}" = shards ]; then
    export SHARDS=2
    one big-rows-2sh "${BIG[@]}"
    one big-whole-2sh "${BIG[@]}" --set train.sparse_threshold=0
    same big-rows-2sh big-whole-2sh
    exit 0
fi
one rows
one whole --set train.sparse_threshold=0
same rows whole
one big-rows "${BIG[@]}"
one big-whole "${BIG[@]}" --set train.sparse_threshold=0
same big-rows big-whole
one big-onpsd "${BIG[@]}" --set ctr.worker_table_mb=0
same big-rows big-onpsd
