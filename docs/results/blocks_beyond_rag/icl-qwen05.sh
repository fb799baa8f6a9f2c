#!/bin/bash
# issue 29, session 25: in-context examples as blocks on Qwen 0.5B (smollm2 cannot answer closed-book NQ), 8 and 32
# examples, 60 questions each, grown in steps; resumes. From the repo root:
#   for k in 8 32; do cp docs/results/blocks_beyond_rag/icl-$k-qwen05.jsonl runs/ 2>/dev/null; done
#   setsid nohup bash docs/results/blocks_beyond_rag/icl-qwen05.sh > runs/icl.log 2>&1 &
source .venv/bin/activate
for step in "8 30" "32 30" "8 60" "32 60"; do
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset nq-icl-$1 --limit $2 \
    --modes "full,reuse,ape,blend:sel=query,r=0.15" --max-new-tokens 12 --output runs/icl-$1-qwen05.jsonl || exit 1
done
