#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: tiny random models plus the real default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --for-tests
exec .venv/bin/python -m pytest -q "$@"
