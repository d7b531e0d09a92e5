#!/bin/sh
# Install the Debian 12 packages psd needs to build, test and train.
# Idempotent: installs only what is missing. Runs as root, or through sudo.
#   deploy/setup.sh            build + test + train dependencies
#   deploy/setup.sh --bench    also python3-torch, for bench/
#   deploy/setup.sh --deploy   also what the tests start: PyTorch and pytest
#                              (the python suite), a Docker engine
#                              and docker-compose, debootstrap, SLURM and munge
#                              (each engine only when none is installed), and
#                              Prometheus' promtool (checks psd's /metrics) and
#                              Chromium (loads psd's live page headless);
#                              and --lightning's environment
#   deploy/setup.sh --lightning  also a virtual environment .venv (Debian's torch
#                              through its system site packages) with the PyPI
#                              packages of deploy/requirements.txt, pinned with
#                              hashes: PyTorch Lightning for psd.lightning
#   deploy/setup.sh --torch2   also .venv-torch2: Lightning 2.6 with torch 2.11 from
#                              PyPI (deploy/requirements-torch2.txt; CPU use, with the
#                              CUDA 13.0 toolkit's libraries of /usr/local/cuda): what
#                              CI tests psd.lightning on besides Debian's torch
set -eu
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=0
TORCH2=0

PKGS="build-essential pkg-config meson ninja-build protobuf-c-compiler
libzmq3-dev libprotobuf-c-dev libuv1-dev libyaml-dev libcriterion-dev
libopenblas-dev zlib1g-dev libhttp-parser-dev dataset-fashion-mnist iproute2
libnss-wrapper python3 python3-numpy"
for opt in "$@"; do
    case "$opt" in
    --bench) PKGS="$PKGS python3-torch python3-numpy" ;;
    --lightning) PKGS="$PKGS python3-torch python3-venv python3-pytest"; VENV=1 ;;
    --torch2) PKGS="$PKGS python3-venv python3-pytest"; TORCH2=1 ;;
    --deploy)
        VENV=1
        PKGS="$PKGS python3 python3-torch python3-pytest python3-venv python3-wheel debootstrap iptables iproute2 procps munge prometheus chromium"
        command -v dockerd >/dev/null 2>&1 || PKGS="$PKGS docker.io"
        command -v docker-compose >/dev/null 2>&1 || PKGS="$PKGS docker-compose"
        command -v slurmctld >/dev/null 2>&1 || PKGS="$PKGS slurm-wlm"
        ;;
    *) echo "setup: unknown option $opt (--bench, --deploy, --lightning, --torch2)" >&2; exit 2 ;;
    esac
done

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done

# A virtual environment of psd's Python side (as the user who runs this, not root through
# sudo), with Debian's packages through its system site packages and a requirements file's
# PyPI packages, pinned with hashes, over them; made again when the file changed.
#   venv DIR REQUIREMENTS
venv() {
    if [ -f "$1/requirements.txt" ] && cmp -s "$1/requirements.txt" "$2"; then
        return 0
    fi
    echo "setup: making $1 ($2)" >&2
    rm -rf "$1"
    /usr/bin/python3 -m venv --system-site-packages "$1"
    # --no-deps: every dependency is in the file (why: its head)
    "$1/bin/pip" install -q --disable-pip-version-check --no-deps --require-hashes -r "$2"
    cp "$2" "$1/requirements.txt"
}
venvs() {
    [ "$VENV" = 1 ] && venv "$ROOT/.venv" "$ROOT/deploy/requirements.txt"
    [ "$TORCH2" = 1 ] && venv "$ROOT/.venv-torch2" "$ROOT/deploy/requirements-torch2.txt"
    return 0
}

if [ -z "$missing" ]; then
    venvs
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup: need root or sudo to install:$missing" >&2; exit 1; }
    SUDO="sudo"
fi
echo "setup: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
venvs
