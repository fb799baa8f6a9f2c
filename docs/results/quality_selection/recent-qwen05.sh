#!/bin/bash
# issue 27, session 26: the static recency selection (blend:sel=recent: the last r of the block tokens, nearest the
# query, or each block's last r with perblock), added to the NQ-10 grid's files (same questions, paired with their
# `full`); resumes. From the repo root:
#   for g in 0 4 9; do cp docs/results/quality_selection/grid-nq10-g$g-qwen05.jsonl runs/; done
#   setsid nohup bash docs/results/quality_selection/recent-qwen05.sh > runs/recent.log 2>&1 &
source .venv/bin/activate
M="full,blend:sel=recent,r=0.3,blend:sel=recent,r=0.15,blend:sel=recent,r=0.15,perblock=true"
for step in "0 25"; do  # session 26 stopped it at 12 questions (clearly behind query-aware); gold 4, 9 not run
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset nq-distractors --gold-position $1 --limit $2 \
    --modes "$M" --max-new-tokens 32 --output runs/grid-nq10-g$1-qwen05.jsonl || exit 1
  cp runs/grid-nq10-g$1-qwen05.jsonl docs/results/quality_selection/
done
