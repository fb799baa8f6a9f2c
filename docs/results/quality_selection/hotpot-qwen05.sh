#!/bin/bash
# issue 27, session 19: HotpotQA dev on Qwen 0.5B fp32 with the new selections (target: within 2 points of full at r <= 0.2)
source .venv/bin/activate
# auto's calibration (session 19, NQ held out) is this folder's json; the cache that held it is lost between machines
python -c "import shutil; from ragkv.engine.calibration import auto_calibration_path as p; d = p('7ba31b0607f00862a409e8a1'); d.parent.mkdir(parents=True, exist_ok=True); shutil.copy('docs/results/quality_selection/calibration-auto-nq-distractors-heldout-qwen2.5-coder-0.5b.json', d)" || exit 1
M="full,blend:r=0.15,blend:sel=query,r=0.15,auto:r=0.15"
for N in 25 50 75 100; do
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset hotpotqa --limit $N \
    --modes "$M" --max-new-tokens 32 --output runs/hotpot-qwen05.jsonl || exit 1
done
