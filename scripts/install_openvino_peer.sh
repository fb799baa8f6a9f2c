#!/usr/bin/env bash
# Install OpenVINO GenAI (Intel's LLM stack for CPUs) as a comparison peer for `ragkv bench serve --peer openvino`:
# openvino-genai (the continuous-batching pipeline the peer server runs) and optimum-intel (which exports the model
# folder ragkv loads to OpenVINO IR, once), into their own virtualenv (.venv-ov) so the project's .venv stays clean.
# About 1.6 GB on disk; a few minutes. Idempotent: re-running it only checks that the peer imports.
#
#   bash scripts/install_openvino_peer.sh              # into .venv-ov
#   PEER_VENV=/some/where bash scripts/install_openvino_peer.sh
#
# The bench exports the model on first use (~1 minute for Qwen2.5-Coder-0.5B) beside ragkv's converted folder
# (<models>/<name>-openvino) and starts ragkv/bench/serve/openvino_server.py with this python.
set -euo pipefail
cd "$(dirname "$0")/.."

GENAI=2026.4.1.0
OPTIMUM_INTEL=2.2.0
TORCH=2.13.0
VENV=${PEER_VENV:-.venv-ov}
PY=${PYTHON:-python3}

check() {
    "$VENV/bin/python" - <<PYEOF
import importlib.metadata as md, torch, openvino_genai, optimum.intel
assert md.version("openvino-genai") == "$GENAI", md.version("openvino-genai")
assert torch.__version__.startswith("$TORCH") and torch.version.cuda is None, torch.__version__
PYEOF
}

if [ -x "$VENV/bin/python" ] && check >/dev/null 2>&1; then
    echo "openvino-genai==$GENAI already installed in $VENV"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip

# 1. torch first, CPU build (optimum-intel's exporter traces the model with it): installed first and pinned in
#    every later step, so that pip never resolves a (multi-GB) CUDA torch.
echo "== installing torch==$TORCH (CPU) into $VENV"
if ! "$VENV/bin/python" -m pip install --disable-pip-version-check "torch==$TORCH+cpu"; then
    "$VENV/bin/python" -m pip install --disable-pip-version-check "torch==$TORCH+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu
fi
PIN=$(mktemp)
echo "torch==$TORCH+cpu" > "$PIN"

# 2. openvino-genai (brings openvino and openvino-tokenizers of the same release) and optimum-intel, torch held
#    at the CPU build; then torchvision goes (an image package optimum-intel lists; a text export does not use it,
#    and a build for another torch breaks transformers' imports).
echo "== installing openvino-genai==$GENAI and optimum-intel[openvino]==$OPTIMUM_INTEL into $VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -c "$PIN" "openvino-genai==$GENAI" \
    "optimum-intel[openvino]==$OPTIMUM_INTEL"
"$VENV/bin/python" -m pip uninstall -y -q --disable-pip-version-check torchvision 2>/dev/null || true
rm -f "$PIN"
check
"$VENV/bin/python" -c "import importlib.metadata as md; print('installed: openvino-genai', md.version('openvino-genai'), '/ optimum-intel', md.version('optimum-intel'))"
