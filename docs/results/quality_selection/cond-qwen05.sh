#!/bin/bash
# issue 27, session 25: blocks encoded after the prompt's prefix (conditioning=prefix) under reuse and the query-aware
# blend, added to the NQ-10 grid's files (same questions, so paired with their `full`); resumes. From the repo root:
#   for g in 0 4 9; do cp docs/results/quality_selection/grid-nq10-g$g-qwen05.jsonl runs/; done
#   setsid nohup bash docs/results/quality_selection/cond-qwen05.sh > runs/cond.log 2>&1 &
source .venv/bin/activate
M="full,reuse:cond=prefix,blend:sel=query,r=0.15,cond=prefix,blend:sel=query,r=0.3,cond=prefix"
for step in "0 25" "9 25" "4 25" "0 50" "9 50" "4 60"; do
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset nq-distractors --gold-position $1 --limit $2 \
    --modes "$M" --max-new-tokens 32 --output runs/grid-nq10-g$1-qwen05.jsonl || exit 1
done
