#!/usr/bin/env bash
# Install Debian's chromium and chromedriver (for tests/test_playground.py) when they are not already on PATH.
# Non-interactive; runs apt-get as root directly, through sudo otherwise. Without apt-get it only warns: the
# playground test then skips.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    echo "chromium already installed: $(command -v chromium)"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "warning: chromium/chromedriver are missing and apt-get is unavailable; tests/test_playground.py will skip" >&2
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
else
    echo "warning: installing chromium needs root; tests/test_playground.py will skip" >&2
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
APT=(${SUDO[@]+"${SUDO[@]}"} apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# Refresh the package lists only when the candidate is unknown (fresh containers ship without lists).
if ! apt-cache policy chromium-driver 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    ${SUDO[@]+"${SUDO[@]}"} apt-get update -q
fi
"${APT[@]}" install --no-install-recommends chromium chromium-driver

command -v chromedriver >/dev/null 2>&1 || { echo "error: apt-get finished but chromedriver is still not on PATH" >&2; exit 1; }
echo "installed: $(chromium --version)"
