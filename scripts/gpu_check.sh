#!/bin/bash
# The engine's CUDA check, for a machine with an NVIDIA GPU (never CI): the tiny-model equivalence tests on the GPU,
# then `ragkv bench ttft` on a random-weight model shaped like MODEL_DIR's config (no weights travel; timings only).
# Usage: scripts/gpu_check.sh OUT_DIR MODEL_DIR   (MODEL_DIR: config.json + tokenizer files of a converted model)
# The lent machine has torch and transformers but not every dependency, and no internet: carry wheels downloaded
# here (pip download --python-version 3.12 --only-binary=:all: pydantic zlib-ng ...) in WHEELS_DIR, and the data
# files the benches read in RAGKV_DATA_DIR (cacheblend/musique_s.json).
set -uo pipefail
out=${1:?OUT_DIR}; model=${2:?MODEL_DIR}
mkdir -p "$out"
nvidia-smi -L
if [ -n "${WHEELS_DIR:-}" ]; then python3 -m pip install -q --no-index --no-deps "$WHEELS_DIR"/*.whl; fi
TESTS=${TESTS:-tests/test_fusion_invariants.py tests/test_history.py tests/test_batched_decode.py \
    tests/test_runner_equivalence.py tests/test_generation.py tests/test_layers.py tests/test_scheduler.py \
    tests/test_kv_memory.py tests/test_risk.py tests/test_quant.py tests/test_sampling.py tests/test_modes.py \
    tests/test_store_compress.py tests/test_train.py tests/test_shared_blocks.py}
RAGKV_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 120 -rfE $TESTS \
    2>&1 | tee "$out/tests.log" | tail -40
python3 - "$model" <<'PY'
import sys, torch, transformers
cfg = transformers.AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
print("random weights saved:", sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY
common=(--model "$model" --dtype bfloat16 --device cuda)
timeout 150 python3 -m ragkv.cli bench ttft "${common[@]}" --contexts 1024,4096,8192 --modes full,prefix,reuse,ape,blend \
    --repeats 5 --output-dir "$out" 2>&1 | tail -20
# reuse with the blocks read in place, then its batched decode against the copied layout
timeout 60 python3 -m ragkv.cli bench ttft "${common[@]}" --contexts 1024,4096,8192 --modes reuse --kv-layout shared \
    --repeats 5 --output-dir "$out/shared_ttft" 2>&1 | tail -6
timeout 90 python3 -m ragkv.cli bench shared "${common[@]}" --output-dir "$out" 2>&1 | tail -6
rm -f "$out"/*.png "$out"/*/*.png  # at most 8 files come back from the device
