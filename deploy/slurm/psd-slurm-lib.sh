# shellcheck shell=bash disable=SC2034  # (the globals set here are used by the batch scripts)
# Shared code of deploy/slurm/psd-het.sbatch and deploy/slurm/psd-nodes.sbatch: sourced by
# them, not run. See deploy/slurm/README.md. Every variable a user may set is documented at
# the top of the two batch scripts; this file only reads them.
#
# Functions set these globals: PSD_BIN PWORKER_BIN PSD_CONFIG PSD_PORT PSD_KEYS PSD_CKPT
# PSD_WORKDIR PSD_AUTH_ARGS PWORKER_AUTH_ARGS PSD_RESUME_ARGS PSD_EXTRA PWORKER_EXTRA
# PSD_PID PSD_RC WORKERS_PID PSD_PREEMPTED PSD_STOPPING.

PSD_PREEMPTED=0
PSD_STOPPING=0
PSD_PID=
WORKERS_PID=
PSD_RESUME_ARGS=()

psd_log() { printf '%s psd-slurm: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$*" >&2; }
psd_die() { psd_log "error: $*"; exit 2; }

# An absolute path: relative ones are taken from the submit directory.
psd_abs() {
    case $1 in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s/%s\n' "$SLURM_SUBMIT_DIR" "$1" ;;
    esac
}

# psd_find_bin NAME OVERRIDE: OVERRIDE if set, else PSD_HOME/build/NAME, PSD_HOME/bin/NAME,
# else NAME on PATH.
psd_find_bin() {
    local name=$1 override=$2 c
    if [ -n "$override" ]; then
        [ -x "$override" ] || psd_die "$name: $override is not an executable file"
        printf '%s\n' "$override"
        return
    fi
    for c in "$PSD_HOME/build/$name" "$PSD_HOME/bin/$name"; do
        if [ -x "$c" ]; then printf '%s\n' "$c"; return; fi
    done
    c=$(command -v "$name" 2>/dev/null) ||
        psd_die "$name not found in $PSD_HOME/build, $PSD_HOME/bin or PATH (set PSD_HOME or ${name^^}_BIN)"
    printf '%s\n' "$c"
}

# Defaults, binaries, directories; called first by both scripts.
psd_setup() {
    : "${SLURM_JOB_ID:?not inside a SLURM job (submit with sbatch)}"
    PSD_HOME=$(psd_abs "${PSD_HOME:-$SLURM_SUBMIT_DIR}")
    PSD_BIN=$(psd_find_bin psd "${PSD_BIN:-}") || exit 2
    if [ -z "${PSD_WORKER_CMD:-}" ]; then
        PWORKER_BIN=$(psd_find_bin pworker "${PWORKER_BIN:-}") || exit 2
    else
        PWORKER_BIN="(PSD_WORKER_CMD: $PSD_WORKER_CMD)"
    fi
    PSD_CONFIG=$(psd_abs "${PSD_CONFIG:-$PSD_HOME/deploy/configs/fashion-mnist.yaml}")
    [ -r "$PSD_CONFIG" ] || psd_die "PSD_CONFIG: cannot read $PSD_CONFIG"
    PSD_PORT=${PSD_PORT:-5555}
    case $PSD_PORT in '' | *[!0-9]*) psd_die "PSD_PORT must be a number, not '$PSD_PORT'" ;; esac
    PSD_WORKDIR=$(psd_abs "${PSD_WORKDIR:-psd-run-$SLURM_JOB_ID}")
    PSD_CKPT=$(psd_abs "${PSD_CKPT:-$PSD_WORKDIR/checkpoints}")
    PSD_KEYS=$(psd_abs "${PSD_KEYS:-psd-keys}")
    PSD_INSECURE=${PSD_INSECURE:-0}
    # PSD_ARGS / PWORKER_ARGS: split at white space (no quoting).
    read -r -a PSD_EXTRA <<<"${PSD_ARGS:-}"
    read -r -a PWORKER_EXTRA <<<"${PWORKER_ARGS:-}"
    mkdir -p "$PSD_WORKDIR" "$PSD_CKPT" || psd_die "cannot create $PSD_WORKDIR or $PSD_CKPT"
    psd_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname): psd $PSD_BIN, pworker $PWORKER_BIN"
    psd_log "config $PSD_CONFIG, work dir $PSD_WORKDIR, checkpoints $PSD_CKPT"
}

# Make the CurveZMQ keys once (kept, and reused by a requeued or later job):
#   PSD_KEYS/psd.key psd.pub        psd's key pair
#   PSD_KEYS/worker.key worker.pub  the workers' key pair (one for all of them)
#   PSD_KEYS/allow/worker.pub       psd's allow-list (add more *.pub there; psd reloads on SIGHUP)
# PSD_KEYS must be on a file system every node of the job sees (the submit dir usually is).
psd_keys() {
    if [ "$PSD_INSECURE" = 1 ]; then
        psd_log "PSD_INSECURE=1: no authentication, no encryption (trusted networks only)"
        PSD_AUTH_ARGS=(--insecure)
        PWORKER_AUTH_ARGS=()
        return
    fi
    local k=$PSD_KEYS tmp
    if [ ! -e "$k" ]; then
        mkdir -p "$(dirname "$k")" || psd_die "cannot create the directory of $k"
        # Build the directory aside and rename it into place: two jobs starting at once
        # cannot mix their keys (the loser uses the winner's).
        tmp=$(mktemp -d "$k.tmp.XXXXXX") || psd_die "cannot create a directory next to $k"
        chmod 0700 "$tmp"
        (umask 077 && mkdir "$tmp/allow" &&
            "$PSD_BIN" keygen "$tmp/psd" >/dev/null &&
            "$PSD_BIN" keygen "$tmp/worker" >/dev/null &&
            cp "$tmp/worker.pub" "$tmp/allow/worker.pub") || {
            rm -rf "$tmp"
            psd_die "psd keygen failed in $tmp"
        }
        if mv -T "$tmp" "$k" 2>/dev/null; then
            psd_log "made the CurveZMQ keys in $k"
        else
            rm -rf "$tmp"
        fi
    fi
    [ -d "$k" ] || psd_die "PSD_KEYS=$k is not a directory"
    case $(stat -c %a "$k" 2>/dev/null) in
    700 | 500) ;;
    *) psd_log "warning: $k can be read by others than its owner (chmod 700 it)" ;;
    esac
    (
        umask 077
        if [ ! -s "$k/psd.key" ] || [ ! -s "$k/psd.pub" ]; then
            rm -f "$k/psd.key" "$k/psd.pub" # keygen does not overwrite
            "$PSD_BIN" keygen "$k/psd" >/dev/null || exit 1
            psd_log "made psd's key pair in $k"
        fi
        if [ ! -s "$k/worker.key" ] || [ ! -s "$k/worker.pub" ]; then
            rm -f "$k/worker.key" "$k/worker.pub"
            "$PSD_BIN" keygen "$k/worker" >/dev/null || exit 1
            mkdir -p "$k/allow" && cp "$k/worker.pub" "$k/allow/worker.pub" || exit 1
            psd_log "made the workers' key pair in $k"
        fi
        if [ ! -s "$k/allow/worker.pub" ]; then
            mkdir -p "$k/allow" && cp "$k/worker.pub" "$k/allow/worker.pub" || exit 1
        fi
    ) || psd_die "cannot make the keys in $k"
    PSD_AUTH_ARGS=(--key "$k/psd.key" --allow "$k/allow")
    PWORKER_AUTH_ARGS=(--key "$k/worker.key" --server-key "$k/psd.pub")
}

# psd_worker_argv ENDPOINT: WORKER_ARGV, what each worker task runs: pworker, or the
# user's PSD_WORKER_CMD (their training script, such as a psd.torch worker) through sh -c,
# with PSD_ENDPOINT and, with keys, PSD_KEY_FILE and PSD_SERVER_KEY in its environment
# (psd.torch.Worker reads all three).
psd_worker_argv() {
    if [ -n "${PSD_WORKER_CMD:-}" ]; then
        export PSD_ENDPOINT=$1
        if [ ${#PWORKER_AUTH_ARGS[@]} -eq 4 ]; then
            export PSD_KEY_FILE=${PWORKER_AUTH_ARGS[1]} PSD_SERVER_KEY=${PWORKER_AUTH_ARGS[3]}
        fi
        WORKER_ARGV=(sh -c "$PSD_WORKER_CMD")
    else
        WORKER_ARGV=("$PWORKER_BIN" --connect "$1" --devices auto "${PWORKER_AUTH_ARGS[@]}" "${PWORKER_EXTRA[@]}")
    fi
}

# psd_node_addr NODELIST: an address of the first node of NODELIST that the workers can
# connect to: its name if it resolves, else its NodeAddr from scontrol.
psd_node_addr() {
    local node addr
    node=$(scontrol show hostnames "$1" | head -n 1)
    [ -n "$node" ] || psd_die "cannot expand the node list '$1'"
    if getent hosts "$node" >/dev/null 2>&1; then
        printf '%s\n' "$node"
        return
    fi
    addr=$(scontrol show node "$node" | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
    [ -n "$addr" ] || psd_die "node $node does not resolve and scontrol shows no NodeAddr for it"
    printf '%s\n' "$addr"
}

# psd's command line (without --resume) for N workers, in PSD_CMD.
psd_command() {
    PSD_CMD=("$PSD_BIN" --config "$PSD_CONFIG" --listen "tcp://0.0.0.0:$PSD_PORT"
        --workers "$1" --set "checkpoint.dir=$PSD_CKPT" "${PSD_AUTH_ARGS[@]}" "${PSD_EXTRA[@]}")
}

# Resume if PSD_CKPT holds a checkpoint; then it must be usable (else exit 2: a run must not
# silently start over, e.g. after a config change; pass --force-resume in PSD_ARGS or choose
# another PSD_CKPT).
psd_resume_args() {
    PSD_RESUME_ARGS=()
    if [ -z "$(find "$PSD_CKPT" -name '*.psdc' -print -quit 2>/dev/null)" ]; then
        psd_log "no checkpoint in $PSD_CKPT: a new run"
        return
    fi
    local out
    if out=$(cd "$PSD_WORKDIR" && "${PSD_CMD[@]}" --check-config --resume "$PSD_CKPT" 2>&1); then
        psd_log "$out"
        PSD_RESUME_ARGS=(--resume "$PSD_CKPT")
    else
        psd_log "$out"
        psd_die "$PSD_CKPT has checkpoints but psd cannot resume from them (see above)"
    fi
}

psd_on_usr1() {
    if [ -n "$PSD_PID" ] && ! kill -TERM "$PSD_PID" 2>/dev/null; then
        psd_log "SIGUSR1: psd has already ended; nothing to requeue"
        return 0
    fi
    psd_log "SIGUSR1: preempted (time limit near): checkpoint, stop, requeue"
    PSD_PREEMPTED=1
    return 0
}

# scancel, the time limit or preemption by another job: SLURM sends SIGTERM to every process
# of the job, psd included (it writes a checkpoint and exits 0). Not passed on: a second
# SIGTERM would make psd exit at once, without its checkpoint. The shell only stays to wait
# for psd, and does not requeue (SLURM requeues a preempted job itself).
psd_on_term() {
    psd_log "SIGTERM: the job is ending; psd writes a checkpoint and exits"
    PSD_STOPPING=1
    return 0
}

psd_traps() {
    trap psd_on_usr1 USR1
    trap psd_on_term TERM INT
}

# psd_wait PID: wait for PID to exit, across the signals the traps handle (a trapped signal
# makes `wait` return early); sets PSD_WAIT_RC to its exit status.
psd_wait() {
    local pid=$1 rc rc2
    while :; do
        rc=0
        wait "$pid" || rc=$?
        if [ "$rc" -gt 128 ]; then
            if kill -0 "$pid" 2>/dev/null; then continue; fi
            # It ended while a trap interrupted wait: fetch its own status (127: none left,
            # rc was already its own).
            rc2=0
            wait "$pid" 2>/dev/null || rc2=$?
            [ "$rc2" -ne 127 ] && rc=$rc2
        fi
        break
    done
    PSD_WAIT_RC=$rc
}

# Start psd in the background (in PSD_WORKDIR: relative paths of the config, e.g. the metrics
# file and the weights, land there).
psd_start() {
    if [ "$PSD_PREEMPTED" = 1 ] || [ "$PSD_STOPPING" = 1 ]; then return; fi
    psd_log "starting: ${PSD_CMD[*]} ${PSD_RESUME_ARGS[*]}"
    (cd "$PSD_WORKDIR" && exec "${PSD_CMD[@]}" "${PSD_RESUME_ARGS[@]}") </dev/null &
    PSD_PID=$!
    # A USR1 that came before PSD_PID was set.
    if [ "$PSD_PREEMPTED" = 1 ]; then kill -TERM "$PSD_PID"; fi
}

# After psd has ended: give the workers (psd tells them to leave) GRACE seconds, then stop
# the worker step.
psd_stop_workers() {
    local grace=${1:-60} i
    [ -n "$WORKERS_PID" ] || return 0
    for ((i = 0; i < grace * 2; i++)); do
        kill -0 "$WORKERS_PID" 2>/dev/null || break
        sleep 0.5
    done
    if kill -0 "$WORKERS_PID" 2>/dev/null; then
        psd_log "workers still running ${grace}s after psd: stopping the step"
        kill -TERM "$WORKERS_PID" 2>/dev/null # srun passes it on to the tasks
    fi
    psd_wait "$WORKERS_PID"
    psd_log "worker step ended with $PSD_WAIT_RC"
}

# Wait for psd, then the workers; requeue the job if it was preempted. Exits with psd's status.
psd_supervise() {
    if [ -z "$PSD_PID" ]; then
        PSD_RC=0
    else
        psd_wait "$PSD_PID"
        PSD_RC=$PSD_WAIT_RC
        psd_log "psd exited with $PSD_RC"
    fi
    # After a normal end psd has told the workers to leave; after a failure they would wait
    # for psd to come back (pworker --retry-for).
    if [ "$PSD_RC" -eq 0 ]; then psd_stop_workers 60; else psd_stop_workers 5; fi
    if [ "$PSD_PREEMPTED" = 1 ] && [ "$PSD_STOPPING" = 0 ]; then
        psd_log "requeueing job $SLURM_JOB_ID (the next start resumes from $PSD_CKPT)"
        if scontrol requeue "$SLURM_JOB_ID"; then
            exit 0
        fi
        psd_log "scontrol requeue failed: resubmit with PSD_CKPT=$PSD_CKPT PSD_WORKDIR=$PSD_WORKDIR"
        exit 1
    fi
    exit "$PSD_RC"
}
