#!/bin/bash
# issue 29, session 26: nq-long (the NQ gold passage among 149 others, ~19K tokens, 2.3x smollm2's window) with the
# gold passage spread over the positions: of the first 150 examples (gold at i % 150) every 15th, i.e. gold at
# 0, 15, ..., 135 (--shard 1/15). `ape` over the whole prompt against `full` on the prompt truncated to the window
# (the passages farthest from the question dropped). Resumes. From the repo root:
#   setsid nohup bash docs/results/blocks_beyond_rag/long-spread-smollm2.sh > runs/long-spread.log 2>&1 &
source .venv/bin/activate
ragkv eval --model smollm2 --dtype float32 --dataset nq-long --limit 150 --shard 1/15 --modes full \
  --truncate --max-new-tokens 12 --output runs/long-spread-trunc-smollm2.jsonl || exit 1
cp runs/long-spread-trunc-smollm2.jsonl docs/results/blocks_beyond_rag/
ragkv eval --model smollm2 --dtype float32 --dataset nq-long --limit 150 --shard 1/15 --modes ape \
  --max-new-tokens 12 --output runs/long-spread-ape-smollm2.jsonl || exit 1
cp runs/long-spread-ape-smollm2.jsonl docs/results/blocks_beyond_rag/
