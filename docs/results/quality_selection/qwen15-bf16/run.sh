#!/usr/bin/env bash
# Issue 27's target on Qwen2.5-Coder-1.5B in bf16 (an AVX-512 BF16 or AMX CPU): NQ-10, the first 20 questions at
# gold 0 / 4 / 9, two shards of one thread each. Resumes (the eval appends; rerun the same script).
# ~65 minutes on 2 Zen 4 cores. Then: bash docs/results/quality_selection/qwen15-bf16/report.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
MODES="full,blend:sel=query,r=0.15,blend:sel=query,r=0.25,blend:sel=query,r=0.3"
for g in 0 4 9; do
  for s in 1 2; do
    OMP_NUM_THREADS=1 .venv/bin/ragkv eval --model qwen2.5-coder-1.5b --dtype bfloat16 --dataset nq-distractors \
      --gold-position "$g" --limit 20 --shard "$s/2" --modes "$MODES" --max-new-tokens 32 --no-progress \
      --output "runs/qwen15-g$g.s$s.jsonl" > "runs/qwen15-g$g.s$s.log" 2>&1 &
  done
  wait
  cp "runs/qwen15-g$g.s1.jsonl" "runs/qwen15-g$g.s2.jsonl" docs/results/quality_selection/qwen15-bf16/
done
