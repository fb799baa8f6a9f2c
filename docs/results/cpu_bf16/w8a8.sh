#!/usr/bin/env bash
# Session 37: w8a8 (int8 products in prefill) against the bf16 onednn copy on Qwen2.5-Coder-0.5B, alone on the
# machine (~10 minutes on 2 Zen 4 cores). Writes w8a8_weights/, engine_s37/ and w8a8_profile/ here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
R=docs/results/cpu_bf16
.venv/bin/ragkv bench weights --model qwen2.5-coder-0.5b --dtype bfloat16 --weights onednn,w8a8 \
  --modes full,reuse,blend:sel=query,r=0.15 --batch-sizes 1,16 --rounds 5 --greedy-steps 16 --output-dir $R/w8a8_weights
.venv/bin/ragkv bench engine --model qwen2.5-coder-0.5b --dtypes bfloat16 --lengths 1024,2048 --repeats 5 --weights auto,w8a8 \
  --output-dir $R/engine_s37
.venv/bin/ragkv bench profile --model qwen2.5-coder-0.5b --dtype bfloat16 --decode-weights w8a8 --mode full \
  --passages 4 --passage-words 210 --repeats 3 --top 15 --output-dir $R/w8a8_profile
