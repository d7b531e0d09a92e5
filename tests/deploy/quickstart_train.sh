#!/bin/bash
# The README's first command as written, for one epoch on a free port:
#   PSD_PORT=<free> sh deploy/quickstart.sh train --epochs 1
# (installs what is missing: root, or every package there already; builds
# build/ if needed, a no-op after `quickstart.sh test` built it; trains psd
# + 2 pworkers on 127.0.0.1 in run/; evaluates the saved weights). Passes
# when the run ends 0 and `psd eval` prints its line for the 10 000 test
# samples.
set -euo pipefail
cd "$(dirname "$0")/../.."
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
log=$(mktemp /tmp/psd-quickstart-XXXXXX)
trap 'rm -f "$log"' EXIT
if ! PSD_PORT=$port timeout 600 sh deploy/quickstart.sh train --epochs 1 >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "quickstart_train: sh deploy/quickstart.sh train failed" >&2
    exit 1
fi
grep -E "^eval psd-weights\.bin: 10000 samples, loss [0-9.]+, accuracy 0\.[0-9]+" "$log" ||
    { tail -n 40 "$log"; echo "quickstart_train: no evaluation line" >&2; exit 1; }
grep -q "run finished: 1 epochs" "$log" || { tail -n 40 "$log"; echo "quickstart_train: psd did not finish its epoch" >&2; exit 1; }
echo "quickstart_train: ok"
