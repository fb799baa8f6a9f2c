#!/bin/bash
# issue 27, session 28: passage order, best-last (the default) against best-first, for every fast mode the target
# names (reuse, CacheBlend's blend, the query-aware blend, ape), added to the files of the first order runs (same
# questions, 12 new tokens, paired with their `full`); resumes. From the repo root:
#   cp docs/results/quality_selection/nq10-best{first,last}-qwen05.jsonl runs/
#   setsid nohup bash docs/results/quality_selection/order-qwen05.sh > runs/order.log 2>&1 &
source .venv/bin/activate
M="full,reuse,blend:r=0.15,blend:sel=query,r=0.15,ape"
for step in "first 40" "last 48" "first 60" "last 60"; do
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset nq-distractors --passage-order best-$1 \
    --limit $2 --modes "$M" --max-new-tokens 12 --output runs/nq10-best$1-qwen05.jsonl || exit 1
  cp runs/nq10-best$1-qwen05.jsonl docs/results/quality_selection/
done
