#!/bin/bash
# issue 27, session 27: the query-aware selection scored with a greedy 16-token draft too (blend:...,draft=16),
# added to the NQ-10 grid's files (same questions, paired with their `full` and the plain query-aware rows);
# resumes. Gold 0 was first measured by the diagnostic in diag/draft_accuracy.py (60 questions, same selection).
# From the repo root:
#   for g in 0 4 9; do cp docs/results/quality_selection/grid-nq10-g$g-qwen05.jsonl runs/; done
#   setsid nohup bash docs/results/quality_selection/draft-qwen05.sh > runs/draft.log 2>&1 &
source .venv/bin/activate
M="full,blend:sel=query,r=0.15,draft=16,blend:sel=query,r=0.3,draft=16"
for step in "9 25" "4 25" "9 50" "4 60" "0 60"; do
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset nq-distractors --gold-position $1 --limit $2 \
    --modes "$M" --max-new-tokens 32 --output runs/grid-nq10-g$1-qwen05.jsonl || exit 1
  cp runs/grid-nq10-g$1-qwen05.jsonl docs/results/quality_selection/
done
