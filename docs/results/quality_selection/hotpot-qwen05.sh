#!/bin/bash
# issue 27, session 19: HotpotQA dev on Qwen 0.5B fp32 with the new selections (target: within 2 points of full at r <= 0.2)
source .venv/bin/activate
M="full,blend:r=0.15,blend:sel=query,r=0.15,auto:r=0.15"
for N in 25 50 75 100; do
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset hotpotqa --limit $N \
    --modes "$M" --max-new-tokens 32 --output runs/hotpot-qwen05.jsonl || exit 1
done
