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
#                              Chromium (loads psd's live page headless)
set -eu

PKGS="build-essential pkg-config meson ninja-build protobuf-c-compiler
libzmq3-dev libprotobuf-c-dev libuv1-dev libyaml-dev libcriterion-dev
libopenblas-dev zlib1g-dev libhttp-parser-dev dataset-fashion-mnist iproute2
libnss-wrapper python3 python3-numpy"
for opt in "$@"; do
    case "$opt" in
    --bench) PKGS="$PKGS python3-torch python3-numpy" ;;
    --deploy)
        PKGS="$PKGS python3 python3-torch python3-pytest python3-venv python3-wheel debootstrap iptables iproute2 procps munge prometheus chromium"
        command -v dockerd >/dev/null 2>&1 || PKGS="$PKGS docker.io"
        command -v docker-compose >/dev/null 2>&1 || PKGS="$PKGS docker-compose"
        command -v slurmctld >/dev/null 2>&1 || PKGS="$PKGS slurm-wlm"
        ;;
    *) echo "setup: unknown option $opt (--bench, --deploy)" >&2; exit 2 ;;
    esac
done

missing=""
for p in $PKGS; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing="$missing $p"
    fi
done
[ -z "$missing" ] && exit 0

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
