#!/usr/bin/env bash
# Install the comparison peer for `ragkv bench serve --peer llama-cpp`: llama.cpp's OpenAI server from
# llama-cpp-python[server]==0.3.36, into its own virtualenv (.venv-peer) so the project's .venv stays clean.
# llama-cpp-python builds llama.cpp from source with cmake: expect 10+ minutes on 2 cores.
# Idempotent: re-running it only checks that the peer imports.
#
#   bash scripts/install_peer.sh              # into .venv-peer
#   PEER_VENV=/some/where bash scripts/install_peer.sh
#   NICE=19 bash scripts/install_peer.sh       # build at low CPU priority
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
VENV=${PEER_VENV:-.venv-peer}
PY=${PYTHON:-python3}
NICE=${NICE:-0}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server, uvicorn, sse_starlette; assert llama_cpp.__version__ == '$VERSION'" 2>/dev/null; then
    echo "llama-cpp-python[server]==$VERSION already installed in $VENV"
    exit 0
fi

command -v cmake >/dev/null 2>&1 || { echo "error: cmake is needed to build llama.cpp (apt-get install cmake)" >&2; exit 1; }
command -v c++ >/dev/null 2>&1 || { echo "error: a C++ compiler is needed to build llama.cpp (apt-get install g++)" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
    echo "== creating $VENV"
    "$PY" -m venv "$VENV"
fi

# Build flags:
# - GGML_NATIVE=ON: tune for this CPU (the peer runs where it was built).
# - AMX off: on Intel CPUs with AMX the source build crashed inside the AMX matmul. The GGML_AMX_* options
#   only matter without GGML_NATIVE; with -march=native the compiler itself defines __AMX_INT8__ on an AMX
#   CPU, so there we also pass -mno-amx-* to the compiler.
# - LLAVA_BUILD=OFF: the multimodal library is not needed by a text chat server (it is imported lazily).
ARGS="-DGGML_NATIVE=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DLLAVA_BUILD=OFF"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    ARGS="$ARGS -DCMAKE_C_FLAGS='$NOAMX' -DCMAKE_CXX_FLAGS='$NOAMX'"
fi
export CMAKE_ARGS="${CMAKE_ARGS:-} $ARGS"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}

echo "== building llama-cpp-python[server]==$VERSION into $VENV (CMAKE_ARGS=$CMAKE_ARGS)"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
nice -n "$NICE" "$VENV/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
    "llama-cpp-python[server]==$VERSION"

"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server; print('installed: llama-cpp-python', llama_cpp.__version__)"
