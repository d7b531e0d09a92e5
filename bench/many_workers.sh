#!/bin/bash
# psd with 64 pworkers on this host (issue 57; the test
# long/sixty_four_workers_train_and_survive_sixteen_killed_at_once in
# tests/it_many.c runs the same set-up): one BLAS thread a worker, a
# 784-16-10 model, batch 16. Two runs:
#   idle:  psd waits for N+1 workers while N are registered and ready; psd's
#          CPU a second (its threads' run time, /proc/PID/task/*/schedstat, over IDLE_S s)
#          and per worker a second (each: one HEARTBEAT from psd, and a ZeroMQ
#          PING each way with its PONG), its threads and open descriptors;
#   train: N workers, EPOCHS epochs of LIMIT samples (0: all 60 000); psd's
#          CPU per step over the first EPOCHS-1 epochs (validations
#          included), those epochs' wall time and samples/s, the time from
#          the last registration to the start and to the first step (psd's
#          /metrics polled: the step lies between the last poll that saw 0
#          and the first that saw 1), then KILL workers stopped (SIGSTOP:
#          the epoch stands still, its progress line says where) and killed
#          at once (SIGKILL) in the last epoch: from the kill to psd's "lost"
#          lines, and the last epoch's counts.
# Not a test.
#   bash bench/many_workers.sh
#   N=64 KILL=16 EPOCHS=4 LIMIT=40960 IDLE_S=20 WORKER_TIMEOUT=30 bash bench/many_workers.sh
set -euo pipefail
. "$(dirname "$0")/lib.sh"
bench_setup
# KEEP=1: leave the logs in $WORK
[ -z "${KEEP:-}" ] || trap 'kill $(jobs -p) 2>/dev/null || true; echo "kept $WORK"' EXIT
machine_line
N=${N:-64} KILL=${KILL:-16} EPOCHS=${EPOCHS:-4} LIMIT=${LIMIT:-40960} IDLE_S=${IDLE_S:-20}
WT=${WORKER_TIMEOUT:-30}
echo "commit $(git -C "$ROOT" rev-parse --short HEAD)$(git -C "$ROOT" diff --quiet HEAD -- server common worker || echo '+changes'), $N workers, kill $KILL, $EPOCHS epochs of ${LIMIT} samples, --worker-timeout $WT, load before: $(cut -d' ' -f1-3 /proc/loadavg)"
COMMON=(--set 'model.layers=[784,16,10]' --set train.batch_size=16 --set checkpoint.dir= --set "data.train_limit=$LIMIT"
    --worker-timeout "$WT" --start-timeout 300 --save "" --set server.progress_every=0.2)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# psd's CPU time in ns: its threads' run time (/proc/PID/task/*/schedstat; utime + stime of
# /proc/PID/stat count in 10 ms ticks, too coarse for an idle psd); psd's threads live to its end
cpu_ns() { cat /proc/"$1"/task/*/schedstat | awk '{s += $1} END {printf "%.0f\n", s}'; }
count() { grep -s -c -- "$1" "$2" || true; }
# wait until pattern $1 occurs $2 times in file $3 (at most $4 s)
wait_count() {
    local t=0
    until [ "$(count "$1" "$3")" -ge "$2" ]; do
        sleep 0.02
        t=$((t + 1))
        [ $t -lt $(($4 * 50)) ] || { echo "timed out waiting for $2 x '$1' in $3" >&2; tail -5 "$3" >&2; exit 1; }
    done
}

# ---- idle: N workers registered and ready, psd waiting for one more ----------
mkdir "$WORK/idle" "$WORK/train"
cd "$WORK/idle"
EP="tcp://127.0.0.1:$(free_port)"
"$ROOT/build/psd" --listen "$EP" --workers $((N + 1)) --epochs 1 --metrics "" "${COMMON[@]}" 2>psd.log &
PSD=$!
W=()
for i in $(seq 0 $((N - 1))); do
    "$ROOT/build/pworker" --connect "$EP" --threads 1 --wait 300 2>"w$i.log" &
    W+=($!)
done
wait_count "exchanges tensors with psd" "$N" psd.log 300
sleep 2
c0=$(cpu_ns $PSD) t0=$(date +%s.%N)
sleep "$IDLE_S"
c1=$(cpu_ns $PSD) t1=$(date +%s.%N)
FDS=$(find /proc/$PSD/fd -mindepth 1 | wc -l)
THREADS=$(find /proc/$PSD/task -mindepth 1 -maxdepth 1 | wc -l)
python3 - "$c0" "$c1" "$t0" "$t1" "$N" "$FDS" "$THREADS" <<'PY'
import sys
c0, c1, t0, t1, n = (float(x) for x in sys.argv[1:6])
ms = (c1 - c0) / 1e6 / (t1 - t0)
print(f"idle, {n:.0f} workers ready and waiting: psd CPU {ms:.2f} ms/s over {t1 - t0:.1f} s, "
      f"{ms / n * 1000:.1f} us per worker a second = per heartbeat psd receives (each worker's ZeroMQ PING, "
      f"1/s; psd sends each a HEARTBEAT message and a PING, 1/s, and PONGs both ways); "
      f"psd holds {sys.argv[6]} descriptors, {sys.argv[7]} threads")
PY
kill -TERM $PSD
wait $PSD || true
for p in "${W[@]}"; do wait "$p" || true; done

# ---- train: N workers, KILL of them killed in the last epoch -----------------
cd "$WORK/train"
EP="tcp://127.0.0.1:$(free_port)" HTTP="127.0.0.1:$(free_port)"
T_START=$(date +%s.%N)
"$ROOT/build/psd" --listen "$EP" --workers "$N" --epochs "$EPOCHS" --metrics m.jsonl --http "$HTTP" "${COMMON[@]}" \
    2>psd.log &
PSD=$!
# the first step: /metrics polled every 5 ms
python3 - "http://$HTTP/metrics" >first_step.txt <<'PY' &
import sys, time, urllib.request
last0, until = None, time.time() + 600
while time.time() < until:
    sent = time.time()
    try:
        body = urllib.request.urlopen(sys.argv[1], timeout=2).read().decode()
    except Exception:
        time.sleep(0.05)
        continue
    steps = [float(l.split()[1]) for l in body.splitlines() if l.startswith("psd_steps_total ")]
    if steps and steps[0] >= 1:
        print(last0, time.time())
        sys.exit(0)
    if steps:
        last0 = sent
    time.sleep(0.005)
print("nan nan")
PY
POLL=$!
W=()
for i in $(seq 0 $((N - 1))); do
    "$ROOT/build/pworker" --connect "$EP" --threads 1 --wait 300 2>"w$i.log" &
    W+=($!)
done
wait_count "workers ready; training" 1 psd.log 300
c_start=$(cpu_ns $PSD)
wait_count '"epoch"' $((EPOCHS - 1)) m.jsonl 300
c_end=$(cpu_ns $PSD)
wait $POLL || true
# the last epoch: stopped, then killed where it stands
before=$(count "epoch $EPOCHS/$EPOCHS step " psd.log)
VICTIMS=()
for i in $(seq 0 $((N / KILL)) $((N - 1))); do VICTIMS+=("${W[$i]}"); done
kill -STOP "${VICTIMS[@]}"
wait_count "epoch $EPOCHS/$EPOCHS step " $((before + 1)) psd.log 10
AT=$(grep "epoch $EPOCHS/$EPOCHS step " psd.log | tail -1 | sed 's/.*\(step [0-9]*\/[0-9]*\).*/\1/')
exec 3>&2 2>/dev/null # not the shell's "Killed" line for each victim
T_KILL=$(date +%s.%N)
kill -KILL "${VICTIMS[@]}"
rc=0
wait $PSD || rc=$?
for p in "${W[@]}"; do wait "$p" || true; done
exec 2>&3 3>&-
[ $rc = 0 ] || { echo "psd exit $rc" >&2; tail -20 psd.log >&2; exit 1; }
python3 - "$c_start" "$c_end" "$N" "$EPOCHS" "$T_KILL" "$AT" "$KILL" "$T_START" <<'PY'
import datetime, json, re, statistics, sys
cpu_s = (float(sys.argv[2]) - float(sys.argv[1])) / 1e9
n, epochs, t_kill, at, kill, t_start = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6], int(sys.argv[7]), float(sys.argv[8])
def ts(line):
    return datetime.datetime.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.timezone.utc).timestamp()
log = open("psd.log").read().splitlines()
lines = [json.loads(l) for l in open("m.jsonl")]
full = lines[:epochs - 1]
steps = full[-1]["step"]
print(f"train: psd CPU {cpu_s * 1000:.0f} ms over epochs 1-{epochs - 1} ({steps} steps, "
      f"{n} workers, validations included): {cpu_s * 1000 / steps:.2f} ms a step, "
      f"{cpu_s / full[-1]['wall_s'] * 100:.0f}% of one core over their {full[-1]['wall_s']:.2f} s; "
      f"psd_step_ms (its reduce + optimizer) {statistics.median(l['psd_step_ms'] for l in full):.3f}")
reg = [ts(l) for l in log if "worker registered" in l]
start = [ts(l) for l in log if "workers ready; training" in l][0]
lo, hi = (float(x) for x in open("first_step.txt").read().split())
print(f"start: psd started to the {n}th registration {reg[-1] - t_start:.1f} s (first {reg[0] - t_start:.1f} s); "
      f"the {n}th registration to the start (every worker's data read and checked: 'ready; training') "
      f"{start - reg[-1]:.2f} s; to the first step {lo - reg[-1]:.2f}-{hi - reg[-1]:.2f} s "
      f"(start to first step {max(0, lo - start) * 1000:.0f}-{(hi - start) * 1000:.0f} ms)")
prev = {"wall_s": 0, "train_s": 0}
for l in full:
    print(f"epoch {l['epoch']}: wall {l['wall_s'] - prev['wall_s']:.3f} s (training "
          f"{l['train_s'] - prev['train_s']:.3f} s), "
          f"{l['epoch_samples_per_s']:.0f} samples/s, {l['train_samples']} samples, {l['workers']} workers, "
          f"worker_step_ms {l['worker_step_ms']:.2f}, wire_bytes_in {l['wire_bytes_in']}")
    prev = l
lost = [l for l in log if "lost: its connection closed" in l]
silent = [l for l in log if "lost: nothing from it" in l]
after = [float(m.group(1)) for m in (re.search(r"closed, (-?[0-9.]+) s after", l) for l in lost) if m]
if lost:
    print(f"kill: {kill} stopped at {at} of epoch {epochs}, then killed: {len(lost)} lost for their closed "
          f"connections {(ts(lost[0]) - t_kill) * 1000:.0f}-{(ts(lost[-1]) - t_kill) * 1000:.0f} ms after the kill "
          f"(psd: {min(after):.1f} to {max(after):.1f} s after their last message, the stop included); "
          f"{len(silent)} lost for silence")
last = lines[-1]
print(f"epoch {last['epoch']} with the kill: wall {last['wall_s'] - lines[-2]['wall_s']:.3f} s, train_samples {last['train_samples']}, "
      f"val_samples {last['val_samples']}, workers {last['workers']}, workers_lost {last['workers_lost']}")
PY
