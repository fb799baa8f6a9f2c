#!/bin/bash
# issue 29, session 26: few-shot SAMSum summarization with the solved dialogues as blocks, Qwen 0.5B fp32, answers
# end at their first newline (40 tokens at most), Rouge-L; grown in steps; resumes. From the repo root:
#   for k in 8 32; do cp docs/results/blocks_beyond_rag/samsum-icl-$k-qwen05.jsonl runs/ 2>/dev/null; done
#   setsid nohup bash docs/results/blocks_beyond_rag/samsum-icl-qwen05.sh > runs/samsum-icl.log 2>&1 &
source .venv/bin/activate
for step in "8 20" "32 20" "8 40" "32 40" "8 60"; do  # session 26 ran the first two
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset samsum-icl-$1 --limit $2 \
    --modes "full,reuse,ape,blend:sel=query,r=0.15" --max-new-tokens 40 --output runs/samsum-icl-$1-qwen05.jsonl \
    || exit 1
  cp runs/samsum-icl-$1-qwen05.jsonl docs/results/blocks_beyond_rag/
done
