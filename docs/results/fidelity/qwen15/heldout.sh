#!/usr/bin/env bash
# The fidelity fit's records for Qwen2.5-Coder-1.5B in bf16: 30 held-out NQ-10 questions (nq-distractors-heldout),
# prefill only, two shards of one thread each (~18 minutes on 2 Zen 4 cores). Resumes.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
MODES="full,reuse,ape,blend:r=0.15,blend:sel=query,r=0.15,blend:sel=query,r=0.3"
for s in 1 2; do
  OMP_NUM_THREADS=1 .venv/bin/ragkv eval --model qwen2.5-coder-1.5b --dtype bfloat16 \
    --dataset nq-distractors-heldout --limit 30 --modes "$MODES" --max-new-tokens 0 --shard "$s/2" --no-progress \
    --output "runs/fid-heldout-qwen15.s$s.jsonl" > "runs/fid-heldout-qwen15.s$s.log" 2>&1 &
done
wait
cp runs/fid-heldout-qwen15.s1.jsonl runs/fid-heldout-qwen15.s2.jsonl docs/results/fidelity/qwen15/
