#!/bin/bash
# partition.sh [BUILD_DIR]: network partitions across hosts. psd and two pworkers in three network
# namespaces ("hosts"), psd's joined to each worker's by a veth link (10.57.1.0/24 to worker a,
# 10.57.2.0/24 to worker b), with CurveZMQ keys as across real hosts; a link is cut with iptables
# DROP rules (INPUT and OUTPUT, so both ways) in a namespace and healed by deleting them.
#  a. worker a's link cut for twice psd's --worker-timeout (2 s), then healed: psd declares a lost
#     while cut and hands the rest of its part of the epoch to b; a registers again (rejoining) and
#     trains in the last epoch; psd exits 0 and both workers 0; every epoch trains exactly the
#     training samples (3600) and validates exactly the held-out ones (400), the closing test
#     covers the 10000 test samples once, one worker counted lost, none failed or refused
#     (a lost worker's push applied as well as its samples handed out would show as more than
#     3600).
#  b. psd cut from both workers until it gives up: the workers lost after 2 s, nobody comes back
#     within --start-timeout (5 s): psd exits 4 ("no worker came back within 5 s") leaving a
#     checkpoint (checkpoint.every_steps=5, and the one it writes as it gives up); the links
#     healed, `psd --resume DIR` with the same, still running, workers finishes the run: exit 0
#     for psd and the workers, each epoch's line once with exact counts.
# Prints how long after the cut psd declared the worker(s) lost and how long after the heal the
# worker(s) were back.
#
#   bash tests/partition.sh build        (meson test -C build partition, suite long)
# Needs root, ip (iproute2), iptables (sh deploy/setup.sh --deploy installs it), python3 and
# Fashion-MNIST (package dataset-fashion-mnist); without them, or where network namespaces cannot
# be made, it prints SKIP and exits 77 (1 when CI=true). PSD_TEST_KEEP=1 keeps the temp dir.
# Every process it starts is ended by PID; the namespaces (their links and rules with them) are
# deleted: the host's own network and iptables are never touched.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
B=$(cd "${1:-$ROOT/build}" && pwd)
DATA=/usr/share/datasets/fashion-mnist
T0=$(date +%s.%N)
WT=2      # psd's --worker-timeout
SLOW=150  # pworker --x-slow-ms: about 4 s an epoch of 28 steps
PORT=5557 # inside psd's namespace: nothing else listens there

say() { printf '[partition %5.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN { print a - b }')" "$*"; }
skip() {
    if [ "${CI:-}" = true ]; then
        echo "FAIL: would skip under CI=true: $*" >&2
        exit 1
    fi
    echo "SKIP: $*"
    exit 77
}
die() {
    echo "FAIL: $*" >&2
    exit 1
}

[ "$(id -u)" -eq 0 ] || skip "needs root (network namespaces, iptables)"
for b in ip iptables python3; do
    command -v "$b" >/dev/null 2>&1 || skip "$b not found (sh deploy/setup.sh --deploy installs iproute2 and iptables)"
done
{ [ -x "$B/psd" ] && [ -x "$B/pworker" ]; } || die "no $B/psd or $B/pworker: build first (ninja -C build)"
[ -r "$DATA/train-images-idx3-ubyte.gz" ] || skip "no Fashion-MNIST in $DATA (package dataset-fashion-mnist)"

T=$(mktemp -d /tmp/psd-partition.XXXXXX)
NS_S=psdpart-$$-psd # psd's "host"
NS_A=psdpart-$$-a   # worker a's
NS_B=psdpart-$$-b   # worker b's
NSS=()              # the namespaces made
RULES=()            # "NS CHAIN ARGS..." of every DROP rule in place
PIDS=()             # every process started
W_a='' W_b=''       # the workers' pids

dump_logs() {
    local f
    echo "==================== logs ($T) ====================" >&2
    for f in "$T"/*/*.log; do
        [ -f "$f" ] || continue
        echo "---------- $f (last 40 lines)" >&2
        tail -n 40 "$f" >&2
    done
    for f in "$T"/*/psd-metrics.jsonl; do
        [ -f "$f" ] && { echo "---------- $f" >&2; cat "$f" >&2; }
    done
}

stop_pids() { # PIDS...: TERM, up to 5 s, then KILL
    local p i alive
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    for ((i = 0; i < 20; i++)); do
        alive=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.25
    done
    kill -KILL "$@" 2>/dev/null || true
}

heal_all() {
    local r
    for r in "${RULES[@]}"; do
        # shellcheck disable=SC2086 # NS CHAIN ARGS...: words
        set -- $r
        ip netns exec "$1" iptables -D "${@:2}" 2>/dev/null || true
    done
    RULES=()
}

cleanup() {
    local rc=$? ns p
    trap - EXIT INT TERM
    set +e
    [ $rc -ne 0 ] && dump_logs
    stop_pids "${PIDS[@]}"
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
    heal_all
    for ns in "${NSS[@]}"; do ip netns del "$ns" 2>/dev/null || echo "could not delete namespace $ns" >&2; done
    if [ "${PSD_TEST_KEEP:-0}" = 1 ]; then
        echo "kept $T" >&2
    else
        rm -rf "$T"
    fi
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ---------------------------------------------------------------- the hosts
for ns in "$NS_S" "$NS_A" "$NS_B"; do
    ip netns add "$ns" 2>"$T/netns.err" || skip "cannot make network namespaces here: $(cat "$T/netns.err")"
    NSS+=("$ns")
    ip -n "$ns" link set lo up
done
# psd's side of each link: s-a, s-b; the worker's side: w
ip link add s-a netns "$NS_S" type veth peer name w netns "$NS_A"
ip link add s-b netns "$NS_S" type veth peer name w netns "$NS_B"
ip -n "$NS_S" addr add 10.57.1.1/24 dev s-a
ip -n "$NS_S" addr add 10.57.2.1/24 dev s-b
ip -n "$NS_A" addr add 10.57.1.2/24 dev w
ip -n "$NS_B" addr add 10.57.2.2/24 dev w
for l in "$NS_S s-a" "$NS_S s-b" "$NS_A w" "$NS_B w"; do
    # shellcheck disable=SC2086
    set -- $l
    ip -n "$1" link set "$2" up
done
ip netns exec "$NS_S" iptables -S >/dev/null 2>"$T/ipt.err" ||
    skip "iptables does not work in a network namespace here: $(cat "$T/ipt.err")"
for l in "$NS_S s-a" "$NS_S s-b" "$NS_A w" "$NS_B w"; do # both ends up: the link is
    # shellcheck disable=SC2086
    set -- $l
    for ((i = 0; ; i++)); do
        ip -n "$1" -o link show dev "$2" | grep -q "state UP" && break
        [ $i -lt 50 ] || die "link $2 in $1 not up: $(ip -n "$1" -o link show dev "$2")"
        sleep 0.1
    done
done
say "hosts: psd in $NS_S (10.57.1.1, 10.57.2.1), worker a in $NS_A (10.57.1.2), worker b in $NS_B (10.57.2.2)"

# ---------------------------------------------------------------- keys (as across hosts)
mkdir -p "$T/keys/allow"
(cd "$T/keys" && "$B/psd" keygen server >/dev/null && "$B/psd" keygen worker-a >/dev/null &&
    "$B/psd" keygen worker-b >/dev/null) || die "psd keygen failed"
cp "$T/keys/worker-a.pub" "$T/keys/worker-b.pub" "$T/keys/allow/"

# cut NAME NS [IFACE]: DROP everything in and out of NS (on IFACE, else on all but lo)
cut() {
    local ns=$2 in out
    if [ $# -ge 3 ]; then
        in="INPUT -i $3 -j DROP" out="OUTPUT -o $3 -j DROP"
    else
        in="INPUT ! -i lo -j DROP" out="OUTPUT ! -o lo -j DROP"
    fi
    # shellcheck disable=SC2086
    ip netns exec "$ns" iptables -A $in && RULES+=("$ns $in")
    # shellcheck disable=SC2086
    ip netns exec "$ns" iptables -A $out && RULES+=("$ns $out")
}

# psd_start DIR PSD-ARGS...: psd in its namespace, its log DIR/psd.log ($PSD)
PSD_ARGS=(--listen "tcp://0.0.0.0:$PORT" --key "$T/keys/server.key" --allow "$T/keys/allow" --workers 2
    --worker-timeout "$WT" --seed 7 --save "" --metrics psd-metrics.jsonl --set data.train_limit=4000
    --set data.val_fraction=0.1 --set 'model.layers=[784,64,10]' --set server.progress_every=0)
psd_start() {
    local dir=$1
    shift
    (cd "$dir" && exec ip netns exec "$NS_S" "$B/psd" "${PSD_ARGS[@]}" "$@" >>psd.log 2>&1) &
    PSD=$!
    PIDS+=("$PSD")
}
# worker_start DIR X: pworker X (a or b) in its namespace ($W_a, $W_b)
worker_start() {
    local dir=$1 x=$2 ns addr
    if [ "$x" = a ]; then ns=$NS_A addr=10.57.1.1; else ns=$NS_B addr=10.57.2.1; fi
    (cd "$dir" && exec ip netns exec "$ns" "$B/pworker" --connect "tcp://$addr:$PORT" --key "$T/keys/worker-$x.key" \
        --server-key "$T/keys/server.pub" --devices cpu --threads 1 --x-slow-ms "$SLOW" --retry-for 120 \
        >"w$x.log" 2>&1) &
    PIDS+=($!)
    printf -v "W_$x" %s $!
}
# wait_log FILE PATTERN LIMIT PID: until FILE has a line with PATTERN (grep -E); die when PID ends first
wait_log() {
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        grep -qE "$2" "$1" 2>/dev/null && return 0
        kill -0 "$4" 2>/dev/null || die "$(basename "$(dirname "$1")"): pid $4 ended before '$2' in $1"
        sleep 0.1
    done
    die "no '$2' in $1 after $3 s"
}
# wait_rc WHAT PID LIMIT: its exit code ($RC), or die after LIMIT s
wait_rc() {
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        kill -0 "$2" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$2" 2>/dev/null && die "$1 (pid $2) still running after $3 s"
    RC=0
    wait "$2" || RC=$?
}
now() { date +%s.%N; }

# check DIR PY-ARGS...: the log and metrics checks of a scenario (python below), figures to stdout
check() {
    python3 - "$@" <<'PY'
import datetime, json, re, sys

def ts(line):
    t = datetime.datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f")
    return t.replace(tzinfo=datetime.timezone.utc).timestamp()

def msg(line):  # a log line without its time, role and level
    return re.sub(r"^\S+ \S+ \S+\s+", "", line)

def fail(why):
    sys.exit("FAIL: %s" % why)

scen, d = sys.argv[1], sys.argv[2]
args = dict(a.split("=", 1) for a in sys.argv[3:])
log = [l.rstrip("\n") for l in open(d + "/psd.log") if re.match(r"\d{4}-\d\d-\d\dT", l)]
L = [json.loads(x) for x in open(d + "/psd-metrics.jsonl")]
epochs = int(args["epochs"])

# every epoch once, in order, with exact counts; the closing test on every test sample
if [x["epoch"] for x in L] != list(range(1, epochs + 1)):
    fail("%s: epochs in the metrics file: %s" % (scen, [x["epoch"] for x in L]))
for x in L:
    if x["train_samples"] != 3600 or x["val_samples"] != 400 or x["val_set"] != "held_out":
        fail("%s: epoch %d trained %d (not 3600), validated %d (not 400)" %
             (scen, x["epoch"], x["train_samples"], x["val_samples"]))
    if x["workers_failed"] or x["workers_refused"] or x["workers_left"]:
        fail("%s: epoch %d: workers failed/refused/left %d/%d/%d" % (scen, x["epoch"], x["workers_failed"],
             x["workers_refused"], x["workers_left"]))
if L[-1].get("test_samples") != 10000:
    fail("%s: the closing test covered %s samples, not 10000" % (scen, L[-1].get("test_samples")))
if L[-1]["workers"] != 2:
    fail("%s: %d workers in the last epoch, not 2 (the cut worker(s) did not come back)" % (scen, L[-1]["workers"]))

# the workers: pid -> ranks, in order of registration
reg = []
for l in log:
    m = re.search(r"worker registered: rank (\d+), \S+ pid (\d+), .*", l)
    if m:
        reg.append((ts(l), int(m.group(1)), int(m.group(2)), "rejoining" in l, l))

def ranks_of(pid):
    return [r for t, r, p, rej, _ in reg if p == pid]

def first(pattern, after=0.0):
    for l in log:
        if re.search(pattern, l) and ts(l) >= after:
            return l
    return None

t_cut, t_heal = float(args["cut"]), float(args["heal"])
if scen == "a":
    pid_a, pid_b = int(args["pid_a"]), int(args["pid_b"])
    ra, rb = ranks_of(pid_a), ranks_of(pid_b)
    if not ra or not rb:
        fail("a: the workers' pids %d, %d not among the registered: %s" % (pid_a, pid_b, [x[4] for x in reg]))
    if len(rb) != 1:
        fail("a: worker b (never cut) registered %d times" % len(rb))
    lost = first(r"rank %d \(\S+ pid %d\) lost: " % (ra[0], pid_a))
    if not lost:
        fail("a: psd never declared worker a (rank %d) lost" % ra[0])
    t_lost = ts(lost)
    if not t_cut < t_lost < t_heal:
        fail("a: worker a declared lost %.2f s after the cut, not while cut (%.2f s)" % (t_lost - t_cut, t_heal - t_cut))
    if first(r"rank %d \(\S+ pid %d\) lost: " % (rb[0], pid_b)):
        fail("a: worker b (never cut) declared lost: %s" % first(r"rank %d \(" % rb[0]))
    moved = first(r"its remaining \d+ samples of epoch \d+ go to 1 other worker", t_lost)
    if not moved:
        fail("a: worker a's samples were not handed to worker b")
    back = [(t, r, l) for t, r, p, rej, l in reg if p == pid_a and t > t_lost]
    if not back or "rejoining" not in back[0][2]:
        fail("a: worker a did not register again (rejoining) after it was lost")
    t_back = back[0][0]
    if t_back < t_heal:
        fail("a: worker a registered again %.2f s before the heal" % (t_heal - t_back))
    ignored = [l for l in log if re.search(r"rank %d \(\S+ pid %d\) was declared gone" % (ra[0], pid_a), l)]
    cut_epoch = int(re.search(r"of epoch (\d+)", moved).group(1))
    for x in L:
        want = 0 if x["epoch"] < cut_epoch else 1
        if x["workers_lost"] != want:
            fail("a: epoch %d counts %d workers lost, not %d" % (x["epoch"], x["workers_lost"], want))
    print("a: cut at %.2f s; worker a (rank %d) declared lost %.2f s after the cut: %s"
          % (t_cut - float(args["t0"]), ra[0], t_lost - t_cut, msg(lost)))
    print("a: %s" % msg(moved))
    print("a: healed %.2f s after the cut; worker a back (registered again as rank %d, rejoining) %.2f s after the heal"
          % (t_heal - t_cut, back[0][1], t_back - t_heal))
    for l in ignored:
        print("a: %s" % msg(l))
    print("a: epochs %s, train_samples %s, val_samples %s, test_samples %d, workers_lost %s, "
          "workers in the last epoch %d"
          % ([x["epoch"] for x in L], [x["train_samples"] for x in L], [x["val_samples"] for x in L],
             L[-1]["test_samples"], [x["workers_lost"] for x in L], L[-1]["workers"]))
else:
    gone = first(r"no worker came back within 5 s to finish epoch \d+")
    if not gone:
        fail("b: no 'no worker came back within 5 s' in the first psd's log")
    lost = [l for l in log if re.search(r"rank \d+ \(\S+ pid \d+\) lost: ", l) and t_cut < ts(l) < ts(gone)]
    if len(lost) != 2:
        fail("b: %d workers declared lost while psd was cut, not 2" % len(lost))
    resume = first(r"resuming run", t_heal)
    if not resume:
        fail("b: the second psd did not resume")
    back = [(t, r, l) for t, r, p, rej, l in reg if t > t_heal]
    if len(back) != 2 or not all("rejoining" in l for _, _, l in back):
        fail("b: after the resume %d workers registered again (rejoining), not 2: %s" % (len(back), [l for _, _, l in back]))
    pids_back = sorted(int(re.search(r"pid (\d+)", l).group(1)) for _, _, l in back)
    if pids_back != sorted([int(args["pid_a"]), int(args["pid_b"])]):
        fail("b: the workers back are not the ones cut: %s" % pids_back)
    gone_epoch = int(re.search(r"finish epoch (\d+)", gone).group(1))
    if [("resumed_from_step" in x) for x in L] != [x["epoch"] >= gone_epoch for x in L]:
        fail("b: resumed_from_step on the lines: %s (psd gave up in epoch %d)"
             % ([x.get("resumed_from_step") for x in L], gone_epoch))
    print("b: cut at %.2f s; workers declared lost %s s after the cut"
          % (t_cut - float(args["t0"]), ", ".join("%.2f" % (ts(l) - t_cut) for l in lost)))
    print("b: %.2f s after the cut: %s; psd exit %s" % (ts(gone) - t_cut, msg(gone), args["rc1"]))
    print("b: healed %.2f s after the cut; %s" % (t_heal - t_cut, msg(resume)))
    print("b: the workers back (registered again, rejoining) %s s after the heal"
          % ", ".join("%.2f" % (t - t_heal) for t, _, _ in back))
    print("b: epochs %s, train_samples %s, val_samples %s, test_samples %d, resumed_from_step %s, workers_lost %s"
          % ([x["epoch"] for x in L], [x["train_samples"] for x in L], [x["val_samples"] for x in L],
             L[-1]["test_samples"], [x.get("resumed_from_step") for x in L], [x["workers_lost"] for x in L]))
    # workers_lost is "the run's workers so far whose run ended that way" (docs/usage.md, Metrics
    # file): the resumed run lost both workers before its checkpoint, as a run that goes on counts a
    # worker that came back (a.)
    want = [0 if x["epoch"] < gone_epoch else 2 for x in L]
    if [x["workers_lost"] for x in L] != want:
        fail("b: workers_lost %s, not %s: the run lost both workers in epoch %d, before the checkpoint it "
             "resumed from; the resumed psd counts from 0 (its ending counts are not in the checkpoint)"
             % ([x["workers_lost"] for x in L], want, gone_epoch))
PY
}

# ---------------------------------------------------------------- a. one worker cut, healed
D=$T/a
mkdir -p "$D"
say "a: psd + 2 workers, 4 epochs; worker a's link cut for $((2 * WT)) s mid-epoch 1"
psd_start "$D" --epochs 4 --start-timeout 60 --set checkpoint.dir=
worker_start "$D" a
worker_start "$D" b
wait_log "$D/psd.log" "2 workers ready; training" 60 "$PSD"
grep -q "authentication: CURVE" "$D/psd.log" || die "a: psd does not use CURVE"
sleep 1.5
CUT=$(now)
cut a "$NS_A" w
say "a: worker a cut (iptables DROP in and out on its link)"
sleep $((2 * WT))
HEAL=$(now)
heal_all
say "a: healed"
wait_rc "a: psd" "$PSD" 180
[ "$RC" -eq 0 ] || die "a: psd exited $RC, not 0"
PSD_RC_A=$RC
for x in a b; do
    eval "p=\$W_$x"
    wait_rc "a: worker $x" "$p" 60
    [ "$RC" -eq 0 ] || die "a: worker $x exited $RC, not 0"
done
grep -q "rejoined run" "$D/wa.log" || die "a: worker a's log does not say it rejoined"
check a "$D" epochs=4 cut="$CUT" heal="$HEAL" t0="$T0" pid_a="$W_a" pid_b="$W_b" || exit 1
say "a: psd exit $PSD_RC_A, workers a and b exit 0"

# ---------------------------------------------------------------- b. psd cut from every worker
D=$T/b
mkdir -p "$D"
say "b: psd + 2 workers, 3 epochs, --start-timeout 5, a checkpoint every 5 steps; psd cut from both in epoch 2"
psd_start "$D" --epochs 3 --start-timeout 5 --set checkpoint.dir="$D/ckpt" --set checkpoint.every_steps=5
worker_start "$D" a
worker_start "$D" b
wait_log "$D/psd.log" "epoch 1/3 step" 60 "$PSD"
sleep 1
CUT=$(now)
cut psd "$NS_S"
say "b: psd cut from both workers"
wait_rc "b: psd, cut" "$PSD" 60
PSD_RC_B1=$RC
say "b: psd exited $RC"
[ "$RC" -eq 4 ] || die "b: psd exited $RC, not 4 (no worker came back)"
ls "$D"/ckpt/run-*/ckpt-*.psdc >/dev/null 2>&1 || die "b: no checkpoint in $D/ckpt"
say "b: checkpoints left: $(cd "$D/ckpt" && echo run-*/ckpt-*.psdc)"
for x in a b; do
    eval "p=\$W_$x"
    kill -0 "$p" 2>/dev/null || die "b: worker $x did not wait for psd (--retry-for 120)"
done
HEAL=$(now)
heal_all
say "b: healed; psd --resume $D/ckpt"
# the same config (server.* is not part of its hash); a longer wait for the workers, which
# register again with back-off
psd_start "$D" --epochs 3 --start-timeout 60 --set checkpoint.dir="$D/ckpt" --set checkpoint.every_steps=5 \
    --resume "$D/ckpt"
wait_rc "b: the resumed psd" "$PSD" 180
[ "$RC" -eq 0 ] || die "b: the resumed psd exited $RC, not 0"
PSD_RC_B2=$RC
for x in a b; do
    eval "p=\$W_$x"
    wait_rc "b: worker $x" "$p" 60
    [ "$RC" -eq 0 ] || die "b: worker $x exited $RC, not 0"
done
check b "$D" epochs=3 cut="$CUT" heal="$HEAL" t0="$T0" pid_a="$W_a" pid_b="$W_b" rc1="$PSD_RC_B1" || exit 1
say "b: psd exit $PSD_RC_B1, then resumed: exit $PSD_RC_B2; workers a and b exit 0"
say "PASS"
