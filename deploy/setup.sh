#!/bin/sh
# Install the Debian 12 packages psd needs to build, test and train.
# Idempotent: installs only what is missing. Runs as root, or through sudo.
#   deploy/setup.sh            build + test + train dependencies
#   deploy/setup.sh --bench    also python3-torch, for bench/
set -eu

PKGS="build-essential pkg-config meson ninja-build protobuf-c-compiler
libzmq3-dev libprotobuf-c-dev libuv1-dev libyaml-dev libcriterion-dev
libopenblas-dev zlib1g-dev dataset-fashion-mnist"
[ "${1:-}" = "--bench" ] && PKGS="$PKGS python3-torch python3-numpy"

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
