#!/bin/bash
# The 'lightning' suite: psd.lightning's tests (python/tests/test_lightning.py and the
# example's, examples/lightning/) with the virtual environment deploy/setup.sh --lightning
# makes (PyTorch Lightning from deploy/requirements.txt over Debian's torch). Fails, naming
# the command, where that environment is missing: a skip would hide the suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py="${PSD_LIGHTNING_PY:-$root/.venv/bin/python}"  # another stack: PSD_LIGHTNING_PY=/path/venv/bin/python
if ! "$py" -c "import lightning" 2>/dev/null; then
    echo "lightning suite: no $root/.venv with Lightning: run sh deploy/setup.sh --lightning" >&2
    exit 1
fi
export PYTHONPATH="$root/python" PYTHONDONTWRITEBYTECODE=1
exec "$py" -m pytest -q -p no:cacheprovider "$root/python/tests/test_lightning.py" "$@"
