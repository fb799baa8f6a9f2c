#!/bin/bash
# issue 27: the NQ-10 grid on Qwen 0.5B fp32 (gold at 0/4/9), grown in steps; resumes. Run from the repo root:
#   for g in 0 4 9; do cp docs/results/quality_selection/grid-nq10-g$g-qwen05.jsonl runs/; done
#   setsid nohup bash docs/results/quality_selection/grid-qwen05.sh > runs/grid.log 2>&1 &
source .venv/bin/activate
# auto's calibration (session 19, NQ held out) is this folder's json; the cache that held it is lost between machines
python -c "import shutil; from ragkv.engine.calibration import auto_calibration_path as p; d = p('7ba31b0607f00862a409e8a1'); d.parent.mkdir(parents=True, exist_ok=True); shutil.copy('docs/results/quality_selection/calibration-auto-nq-distractors-heldout-qwen2.5-coder-0.5b.json', d)" || exit 1
M="full,reuse,ape,blend:r=0.15,blend:sel=query,r=0.15,blend:sel=sinks,sink=20,auto:r=0.15,blend:sel=query,r=0.3"
for step in "9 30" "9 40" "4 50" "0 50" "9 50" "4 60" "0 60" "9 60"; do
  set -- $step
  ragkv eval --model qwen2.5-coder-0.5b --dtype float32 --dataset nq-distractors --gold-position $1 --limit $2 \
    --modes "$M" --max-new-tokens 32 --output runs/grid-nq10-g$1-qwen05.jsonl || exit 1
done
