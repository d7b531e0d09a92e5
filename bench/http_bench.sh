#!/bin/bash
# What scraping psd's /metrics every second costs training: the default
# training (MLP 784-512-256-10, 2 pworkers, shared memory) for EPOCHS epochs,
# alternately without and with a scraper (curl of /metrics and /status every
# second), ROUNDS times each; prints samples/s of every run and the ratio of
# the medians. Not a test.
#   bash bench/http_bench.sh [EPOCHS] [ROUNDS]      (default 3 epochs, 3 rounds)
set -euo pipefail
EPOCHS=${1:-3}
ROUNDS=${2:-3}
. "$(dirname "$0")/lib.sh"
bench_setup
one() { # $1: scrape (0/1); prints samples/s
    local hp
    hp=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$ROOT/build/psd" --config deploy/configs/fashion-mnist.yaml --listen "tcp://127.0.0.1:$PORT" \
        --http "127.0.0.1:$hp" --epochs "$EPOCHS" --set checkpoint.dir= --metrics "$WORK/m.jsonl" \
        --save "" 2>"$WORK/psd.log" &
    local psd=$! scr=""
    for i in 1 2; do "$ROOT/build/pworker" --connect "tcp://127.0.0.1:$PORT" 2>"$WORK/w$i.log" & done
    if [ "$1" = 1 ]; then
        (while kill -0 $psd 2>/dev/null; do
             curl -s "http://127.0.0.1:$hp/metrics" >/dev/null || true
             curl -s "http://127.0.0.1:$hp/status" >/dev/null || true
             sleep 1
         done) &
        scr=$!
    fi
    wait $psd
    [ -n "$scr" ] && wait $scr
    wait
    python3 -c "import json; print(json.loads(open('$WORK/m.jsonl').read().splitlines()[-1])['samples_per_s'])"
    rm -f "$WORK/m.jsonl"
}
off=() on=()
for r in $(seq "$ROUNDS"); do
    off+=("$(one 0)")
    on+=("$(one 1)")
    echo "round $r: without scraping ${off[-1]} samples/s, scraping every second ${on[-1]} samples/s"
done
python3 - "${off[*]}" "${on[*]}" <<'PY'
import statistics, sys
off = [float(x) for x in sys.argv[1].split()]
on = [float(x) for x in sys.argv[2].split()]
a, b = statistics.median(off), statistics.median(on)
print(f"median without {a:.0f}, with /metrics + /status every second {b:.0f} samples/s: ratio {b / a:.3f}")
PY
