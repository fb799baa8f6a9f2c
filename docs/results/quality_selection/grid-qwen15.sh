#!/bin/bash
# issue 27, session 28: does the loss far from the question (gold 0) shrink with the model? Qwen2.5-Coder-1.5B
# (fp32, ~3.5 min per question for these four modes on a 2-core AMD EPYC, 32 new tokens); resumes. From the repo root:
#   cp docs/results/quality_selection/grid-nq10-g0-qwen15.jsonl runs/ 2>/dev/null
#   setsid nohup bash docs/results/quality_selection/grid-qwen15.sh > runs/grid15.log 2>&1 &
source .venv/bin/activate
M="full,reuse,blend:sel=query,r=0.15,blend:sel=query,r=0.3"
for step in "0 10" "0 20" "0 30" "0 60"; do
  set -- $step
  ragkv eval --model qwen2.5-coder-1.5b --dtype float32 --dataset nq-distractors --gold-position $1 --limit $2 \
    --modes "$M" --max-new-tokens 32 --output runs/grid-nq10-g$1-qwen15.jsonl || exit 1
  cp runs/grid-nq10-g$1-qwen15.jsonl docs/results/quality_selection/
done
