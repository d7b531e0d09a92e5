#!/bin/bash
# psd's memory against its floor, at several worker counts, over tcp and
# through shared memory. psbench drives psd (W simulated workers, no math:
# steps come as fast as psd and the wire allow; Adam, no checkpoints). psd's
# VmRSS is sampled every 0.2 s. Per run: steady (the median of the second
# half of the samples) and peak (their largest: psd keeps freed memory for
# the next message, so the heap stays at its high-water mark once training
# runs; VmHWM would also count the start's data decoding, given back before
# training), psd's base (the steady RSS of a run of a model of 7,850
# parameters, measured first: code, libraries, the data set) and the floor:
# base + weights + Adam's two moments (3 x 4P). "extra" is peak less floor,
# also in gradient messages (4P bytes each): issue 63's goal is at most 2.
# "conns" is what as many connections cost psd by themselves: the extra of
# the base model (messages of 31 KB) with as many workers, over the same
# wire; "less/msg" the extra less that, in messages.
# Through shared memory psd maps the workers' gradient regions (the workers'
# memory, counted in psd's RSS as shared pages): their resident pages are
# taken out (/proc/PID/smaps, the memfds named psw-grad).
#   bash bench/mem_bench.sh [STEPS] [CASES...]      (PSD_BUILD=DIR: psd and psbench from DIR)
# CASES: "LAYERS:W:tcp|shm[:STEPS]" (default: the 20M MLP at 2 and 8 workers
# and a 1M one at 2, 8 and 64, each over tcp and shared memory, the 1M one for
# 10 x STEPS steps: its runs are short); PSD_ARGS: more psd flags (e.g.
# "--set server.grad_room=0"). Not a test.
set -euo pipefail
STEPS=${1:-60}
shift || true
BIG='[784,4096,4096,10]'   # P = 19.9M (80 MB a message)
SMALL='[784,1250,10]'      # P = 0.99M (4 MB a message)
CASES=("$@")
if [ ${#CASES[@]} -eq 0 ]; then
    S=$((STEPS * 10))
    CASES=("$BIG:2:tcp" "$BIG:2:shm" "$BIG:8:tcp" "$BIG:8:shm"
        "$SMALL:2:tcp:$S" "$SMALL:2:shm:$S" "$SMALL:8:tcp:$S" "$SMALL:8:shm:$S" "$SMALL:64:tcp:$S" "$SMALL:64:shm:$S")
fi
. "$(dirname "$0")/lib.sh"
bench_setup
B=${PSD_BUILD:-$ROOT/build}
machine_line
echo "build $B: commit $(git -C "$B/.." rev-parse --short HEAD 2>/dev/null)$(git -C "$B/.." diff --quiet HEAD -- server worker common 2>/dev/null || echo +changes), $(date -u +%F); psd args: ${PSD_ARGS:-none}"

# run LAYERS W FLAGS: one run; its RSS samples to $WORK/rss.txt, psd's log to $WORK/psd.log
run() {
    local layers=$1 w=$2 flags=$3 steps=${4:-$STEPS} psd pb
    # shellcheck disable=SC2086
    "$B/psd" --listen "tcp://127.0.0.1:$PORT" --workers "$w" --epochs 1 \
        --set "model.layers=$layers" --set optimizer.name=adam --set optimizer.lr=0.001 \
        --set schedule.name=constant --set "data.train_limit=$((steps * 64 * w))" --set checkpoint.dir= \
        --set server.worker_timeout=60 --metrics "" --save "" ${PSD_ARGS:-} 2>"$WORK/psd.log" &
    psd=$!
    # shellcheck disable=SC2086
    "$B/psbench" --connect "tcp://127.0.0.1:$PORT" --workers "$w" $flags >"$WORK/psbench.txt" 2>&1 &
    pb=$!
    : >"$WORK/rss.txt"
    while kill -0 $psd 2>/dev/null; do # VmRSS less the workers' gradient regions psd maps (memfd psw-grad)
        awk '/^[0-9a-f]+-[0-9a-f]+ / {g = /psw-grad/} /^Rss:/ {t += $2; if (g) w += $2} END {if (t) print t - w}' \
            /proc/$psd/smaps 2>/dev/null >>"$WORK/rss.txt" || true
        sleep 0.2
    done
    wait $psd || { echo "psd failed:" >&2; tail -n 5 "$WORK/psd.log" >&2; exit 1; }
    wait $pb || { echo "psbench failed:" >&2; tail -n 5 "$WORK/psbench.txt" >&2; exit 1; }
}

# psd's base: a model of 7,850 parameters, 2 workers over tcp
run '[784,10]' 2 --no-shm $((STEPS * 10))
BASE=$(python3 -c 'import statistics, sys; r = [int(x) for x in open(sys.argv[1]) if x.strip()]; print(int(statistics.median(r[len(r) // 2:])))' "$WORK/rss.txt")
echo "psd's base (model [784,10], 2 workers, tcp): steady $((BASE / 1024)) MiB"
# conns W WIRE: the extra of the base model with W workers (MiB x 1024:
# KiB): what W connections cost psd (ZeroMQ's per-connection buffers and
# pipes, psd's per-worker state) with messages of 31 KB; once per W and wire
declare -A CONNS
conns() {
    local key="$1:$2" flags=""
    [ "$2" = tcp ] && flags=--no-shm
    if [ -z "${CONNS[$key]:-}" ]; then
        run '[784,10]' "$1" "$flags" $((STEPS * 10))
        CONNS[$key]=$(python3 -c 'import sys; r = [int(x) for x in open(sys.argv[1]) if x.strip()]; print(max(r[len(r) // 2:]) - int(sys.argv[2]) - 3 * 31)' "$WORK/rss.txt" "$BASE")
    fi
}
printf '%-20s %3s %-4s %9s %9s %9s %9s %9s %9s %9s\n' model W wire "floor" steady peak extra "extra/msg" conns "less/msg"
for c in "${CASES[@]}"; do
    IFS=: read -r layers w wire steps <<<"$c"
    conns "$w" "$wire"
    flags=""
    [ "$wire" = tcp ] && flags=--no-shm
    run "$layers" "$w" "$flags" "${steps:-$STEPS}"
    P=$(grep -o 'model [0-9]* parameters' "$WORK/psd.log" | awk '{print $2}')
    SHM=$(grep -c 'through shared memory' "$WORK/psd.log" || true)
    [ "$wire" = shm ] && [ "$SHM" != "$w" ] && { echo "$c: $SHM of $w workers on shared memory" >&2; exit 1; }
    python3 - "$WORK/rss.txt" "$P" "$BASE" "$layers" "$w" "$wire" "${CONNS[$w:$wire]}" <<'PY'
import statistics, sys
rows = [int(x) for x in open(sys.argv[1]) if x.strip()]
P, base, conns = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[7])
half = rows[len(rows) // 2:]
steady, peak = statistics.median(half), max(half)
msg = 4 * P / 1024                     # KiB of one gradient message
floor = base + 3 * msg                 # weights + Adam's two moments
extra = peak - floor
mib = lambda k: "%.1f" % (k / 1024)
print("%-20s %3s %-4s %9s %9s %9s %9s %9.2f %9s %9.2f" % (sys.argv[4], sys.argv[5], sys.argv[6], mib(floor),
      mib(steady), mib(peak), mib(extra), extra / msg, mib(conns), (extra - max(conns, 0)) / msg))
PY
done
echo "(MiB; psd's RSS less the workers' gradient regions it maps; extra = peak - floor; msg = 4P bytes;"
echo " conns: the base model's extra with as many workers; less/msg: (extra - conns) / msg)"
