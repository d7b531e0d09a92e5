#!/bin/bash
# The 'lightning' and 'ignite' suites: psd.lightning's tests (python/tests/test_lightning.py and
# the example's, examples/lightning/) or, given test_ignite.py, psd.ignite's (and
# examples/ignite/), with the virtual environment deploy/setup.sh --lightning makes (PyTorch
# Lightning and Ignite from deploy/requirements.txt over Debian's torch). Fails, naming the
# command, where that environment is missing: a skip would hide the suite.
#   bash tests/lightning.sh [test_ignite.py] [pytest args]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="${PSD_LIGHTNING_PY:-$root/.venv/bin/python}"  # another stack: PSD_LIGHTNING_PY=/path/venv/bin/python
tests=test_lightning.py
case "${1:-}" in test_*.py) tests=$1; shift ;; esac
if ! "$py" -c "import lightning, ignite" 2>/dev/null; then
    echo "${tests%.py} suite: no $root/.venv with Lightning and Ignite: run sh deploy/setup.sh --lightning" >&2
    exit 1
fi
export PYTHONPATH="$root/python" PYTHONDONTWRITEBYTECODE=1
exec "$py" -m pytest -q -p no:cacheprovider "$root/python/tests/$tests" "$@"
