#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: tiny random models plus the real default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
