#!/usr/bin/env bash
# Install redis-server from the distribution's packages when it is not already on PATH.
# Non-interactive; runs apt-get as root directly, through sudo otherwise.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server already installed: $(command -v redis-server)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: redis-server is not on PATH and apt-get is unavailable; install redis-server with your package manager" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
else
    echo "error: redis-server is missing and installing it needs root; run this script as root or install sudo" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
APT=(${SUDO[@]+"${SUDO[@]}"} apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# Refresh the package lists only when the candidate is unknown (fresh containers ship without lists).
if ! apt-cache policy redis-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    ${SUDO[@]+"${SUDO[@]}"} apt-get update -q
fi
"${APT[@]}" install --no-install-recommends redis-server

command -v redis-server >/dev/null 2>&1 || { echo "error: apt-get finished but redis-server is still not on PATH" >&2; exit 1; }
echo "installed: $(redis-server --version)"
