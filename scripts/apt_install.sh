#!/usr/bin/env bash
# Install Debian packages, non-interactively, when the commands they provide are not on PATH:
#   apt_install.sh required|optional "WHAT NEEDS THEM" COMMAND... -- PACKAGE...
# Runs apt-get as root directly, through sudo otherwise. `required`: fail when they cannot be installed;
# `optional`: warn and go on (what needs them skips).
set -euo pipefail

strictness=$1 needed_by=$2
shift 2
commands=()
while [ "$1" != "--" ]; do commands+=("$1"); shift; done
shift
packages=("$@")

missing() { for c in "${commands[@]}"; do command -v "$c" >/dev/null 2>&1 || return 0; done; return 1; }
give_up() {  # message: an error for required packages, a warning for optional ones
    if [ "$strictness" = required ]; then echo "error: $1" >&2; exit 1; fi
    echo "warning: $1; $needed_by will skip" >&2
    exit 0
}

if ! missing; then
    echo "${packages[*]} already installed: $(command -v "${commands[0]}")"
    exit 0
fi
command -v apt-get >/dev/null 2>&1 ||
    give_up "${commands[*]} not on PATH and apt-get is unavailable; install ${packages[*]} with your package manager"
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
else
    give_up "installing ${packages[*]} needs root; run this script as root or install sudo"
fi

export DEBIAN_FRONTEND=noninteractive
APT=(${SUDO[@]+"${SUDO[@]}"} apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
# Refresh the package lists only when a candidate is unknown (fresh containers ship without lists).
if ! apt-cache policy "${packages[-1]}" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    ${SUDO[@]+"${SUDO[@]}"} apt-get update -q
fi
"${APT[@]}" install --no-install-recommends "${packages[@]}"

if missing; then echo "error: apt-get finished but ${commands[*]} are still not all on PATH" >&2; exit 1; fi
echo "installed: ${packages[*]}"
