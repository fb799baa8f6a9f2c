#!/bin/bash
# issue 27, session 22: MuSiQue (CacheBlend's set: 10 passages of ~415 words, ~5.5K-token prompts, token F1) on
# Qwen 0.5B fp32, grown 10 questions at a time; resumes from runs/musique-qwen05.jsonl. Run from the repo root:
#   cp docs/results/quality_selection/musique-qwen05.jsonl runs/ 2>/dev/null
#   setsid nohup bash docs/results/quality_selection/musique-qwen05.sh > runs/musique.log 2>&1 &
source .venv/bin/activate
M="full,reuse,blend:r=0.15,blend:sel=query,r=0.15,blend:sel=sinks,sink=20,blend:sel=query,r=0.3"
for N in 10 20 30 40 50; do
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset musique --limit $N \
    --modes "$M" --max-new-tokens 32 --output runs/musique-qwen05.jsonl || exit 1
done
