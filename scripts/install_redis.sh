#!/usr/bin/env bash
# Install redis-server (the Redis tier, its tests and benchmarks) from Debian's packages when it is not on PATH.
exec bash "$(dirname "$0")/apt_install.sh" required "the Redis tier" redis-server -- redis-server
