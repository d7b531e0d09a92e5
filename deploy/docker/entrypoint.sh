#!/bin/sh
# Entrypoint of the psd image.  One image, three roles:
#   psd [FLAGS...]       the parameter server; makes the CurveZMQ keys on first start
#   pworker [FLAGS...]   a worker; waits for psd's keys, then connects with them; with
#                        PSD_WORKER_CMD set, runs that command instead (your training
#                        script, e.g. a psd.torch worker); FLAGS are pworker's and are
#                        not passed to it (put your script's flags in the command)
#   health psd|pworker   the compose healthchecks
#   anything else        run as a command (e.g. `psd eval ...` goes through role psd)
#
# Environment (all optional):
#   PSD_HOME      state directory: keys, metrics, weights, checkpoints (/var/lib/psd,
#                 the named volume shared by psd and the workers)
#   PSD_CONFIG    run description (/etc/psd/config.yaml, mounted read-only by compose)
#   PSD_PORT      port psd listens on and workers connect to (5555)
#   PSD_SERVER    host name of psd for the workers (psd: the compose service name)
#   PSD_WORKERS   workers psd waits for (2); keep equal to --scale pworker=N
#   PSD_INSECURE  1: no keys, plain TCP (psd --insecure); only on a trusted network
#   PSD_KEY_WAIT  seconds a worker waits for psd's keys to appear (300)
#   PSD_WORKER_CMD  the worker is this command (sh -c) instead of pworker, run in
#                 PSD_WORKDIR with PSD_ENDPOINT, PSD_KEY_FILE and PSD_SERVER_KEY in its
#                 environment (a psd.torch.Worker given no endpoint reads all three)
#   PSD_WORKDIR   working directory of PSD_WORKER_CMD (compose mounts your code there)
#   PSD_HTTP_PORT psd's HTTP endpoint (/metrics, /status, /healthz) on the
#                 container's loopback (9100); the healthcheck asks /healthz
set -eu

PSD_HOME=${PSD_HOME:-/var/lib/psd}
PSD_CONFIG=${PSD_CONFIG:-/etc/psd/config.yaml}
PSD_PORT=${PSD_PORT:-5555}
PSD_SERVER=${PSD_SERVER:-psd}
PSD_WORKERS=${PSD_WORKERS:-2}
PSD_INSECURE=${PSD_INSECURE:-0}
PSD_HTTP_PORT=${PSD_HTTP_PORT:-9100}
KEYS=$PSD_HOME/keys

die() { echo "psd-entrypoint: $*" >&2; exit 2; }

# Keys: psd.{key,pub} for psd, worker.{key,pub} shared by the workers of this
# deployment (all containers run as the same uid and share the volume), and
# allow/worker.pub, psd's allow-list.  Made once, in a scratch directory, and
# renamed into place psd.pub last: a worker that sees psd.pub sees everything.
make_keys() {
    [ -f "$KEYS/psd.pub" ] && [ -f "$KEYS/worker.key" ] && [ -f "$KEYS/allow/worker.pub" ] && return 0
    umask 077
    mkdir -p "$KEYS/allow"
    chmod 0700 "$KEYS"
    tmp=$(mktemp -d "$KEYS/.new.XXXXXX")
    psd keygen "$tmp/worker" >/dev/null
    psd keygen "$tmp/psd" >/dev/null
    cp "$tmp/worker.pub" "$tmp/allow.pub"
    chmod 0644 "$tmp/allow.pub"
    mv -f "$tmp/worker.key" "$KEYS/worker.key"
    mv -f "$tmp/worker.pub" "$KEYS/worker.pub"
    mv -f "$tmp/allow.pub" "$KEYS/allow/worker.pub"
    mv -f "$tmp/psd.key" "$KEYS/psd.key"
    mv -f "$tmp/psd.pub" "$KEYS/psd.pub"
    rmdir "$tmp"
    echo "psd-entrypoint: made CurveZMQ keys in $KEYS (psd.key, worker.key, allow/worker.pub)" >&2
}

role=${1:-psd}
[ $# -gt 0 ] && shift

case "$role" in
psd)
    case "${1:-}" in eval|keygen) exec psd "$@" ;; esac
    mkdir -p "$PSD_HOME/checkpoints"
    if [ "$PSD_INSECURE" = 1 ]; then
        echo "psd-entrypoint: PSD_INSECURE=1: no authentication, anyone who reaches port $PSD_PORT can read or change the model" >&2
        set -- --insecure "$@"
    else
        make_keys
        set -- --key "$KEYS/psd.key" --allow "$KEYS/allow" "$@"
    fi
    exec psd --config "$PSD_CONFIG" --listen "tcp://0.0.0.0:$PSD_PORT" --workers "$PSD_WORKERS" \
        --metrics "$PSD_HOME/psd-metrics.jsonl" --save "$PSD_HOME/psd-weights.bin" \
        --set "checkpoint.dir=$PSD_HOME/checkpoints" --http "127.0.0.1:$PSD_HTTP_PORT" "$@"
    ;;
pworker)
    if [ "$PSD_INSECURE" != 1 ]; then
        wait=${PSD_KEY_WAIT:-300}
        i=0
        while [ ! -f "$KEYS/psd.pub" ]; do
            [ "$i" -ge "$wait" ] && die "no $KEYS/psd.pub after ${wait}s: is psd running with the same volume?"
            sleep 1
            i=$((i + 1))
        done
    fi
    if [ -n "${PSD_WORKER_CMD:-}" ]; then
        # the user's worker: where to connect and the keys through the environment
        export PSD_ENDPOINT="tcp://$PSD_SERVER:$PSD_PORT"
        if [ "$PSD_INSECURE" != 1 ]; then
            export PSD_KEY_FILE="$KEYS/worker.key" PSD_SERVER_KEY="$KEYS/psd.pub"
        fi
        if [ -n "${PSD_WORKDIR:-}" ]; then
            cd "$PSD_WORKDIR" || die "PSD_WORKDIR $PSD_WORKDIR: no such directory (is your code mounted there?)"
        fi
        # pworker's flags (PWORKER_ARGS) are not the script's: as under SLURM, dropped
        exec sh -c "$PSD_WORKER_CMD"
    fi
    [ "$PSD_INSECURE" = 1 ] || set -- --key "$KEYS/worker.key" --server-key "$KEYS/psd.pub" "$@"
    exec pworker --connect "tcp://$PSD_SERVER:$PSD_PORT" "$@"
    ;;
health)
    case "${1:-}" in
    psd)
        # psd is up when /healthz answers 200 and, with keys, they exist
        [ "$PSD_INSECURE" = 1 ] || [ -f "$KEYS/psd.pub" ] || exit 1
        exec bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1" && printf "GET /healthz HTTP/1.0\r\n\r\n" >&3 &&
                      head -n 1 <&3 | grep -q "^HTTP/1.1 200 "' health "$PSD_HTTP_PORT"
        ;;
    pworker)
        # the worker (pid 1 after exec) is alive and not a zombie
        state=$(awk '{print $3}' /proc/1/stat)
        [ "$state" != Z ]
        ;;
    *) die "health: psd or pworker" ;;
    esac
    ;;
*)
    exec "$role" "$@"
    ;;
esac
