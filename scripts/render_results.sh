#!/bin/bash
# How docs/results was rendered: copy benchmark outputs into docs/results and render the fine-tuning table + curve and the report page.
set -e
cd "$(dirname "$0")/.."
D=docs/results
cp bench_out/ttft-fp32/ttft.json bench_out/ttft-fp32/ttft.md bench_out/ttft-fp32/ttft.png $D/
cp bench_out/engine/engine_vs_hf.json bench_out/engine/engine_vs_hf.md $D/
cp bench_out/engine-bf16-4k/engine_vs_hf.md $D/engine_vs_hf_bf16_4k.md; cp bench_out/engine-bf16-4k/engine_vs_hf.json $D/engine_vs_hf_bf16_4k.json
cp bench_out/store/store_bench.json bench_out/store/store_bench.md bench_out/store/store_bench.png $D/
cp bench_out/serve/serve_bench.json bench_out/serve/serve_bench.md bench_out/serve/serve_bench.png $D/
[ -f bench_out/ttft-4k-after/ttft.md ] && cp bench_out/ttft-4k-after/ttft.md $D/ttft_4k_after.md && cp bench_out/ttft-4k-after/ttft.json $D/ttft_4k_after.json
[ -f bench_out/store-after/store_bench.md ] && cp bench_out/store-after/store_bench.md $D/store_bench_after.md && cp bench_out/store-after/store_bench.json $D/store_bench_after.json
[ -f bench_out/serve-after/serve_bench.md ] && cp bench_out/serve-after/serve_bench.md $D/serve_bench_after.md && cp bench_out/serve-after/serve_bench.json $D/serve_bench_after.json
CURVE=""
for m in vanilla block; do
  CURVE="$CURVE --curve $m-ft:0=checkpoints/eval/base.jsonl"
  for s in 25 50 75 150; do CURVE="$CURVE --curve $m-ft:$s=checkpoints/eval/$m-$s.jsonl"; done
done
{
  cat docs/results/finetune_intro.md
  echo
  echo '### HotpotQA dev, first 50 examples, fp32, greedy 32 tokens'
  echo
  .venv/bin/ragkv finetune-report --row base=runs/eval-hotpotqa-smollm2.jsonl \
    --row vanilla-ft=runs/ft/vanilla-hotpotqa.jsonl --row block-ft=runs/ft/block-hotpotqa.jsonl --limit 50
  echo
  echo '### Accuracy vs steps (bf16, first 30 HotpotQA dev examples; step 0 = the base model)'
  echo
  .venv/bin/ragkv finetune-report $CURVE --curve-limit 30 --plot $D/finetune_curve.png \
    --title "HotpotQA dev accuracy vs steps (SmolLM2-135M, n=30, bf16)" | sed 's#^plot: .*#![accuracy vs steps](finetune_curve.png)#'
} > $D/finetune.md
EVALS=$(ls runs/eval-hotpotqa-smollm2.jsonl runs/eval-musique-smollm2.jsonl runs/eval-multi_news-smollm2.jsonl 2>/dev/null)
.venv/bin/ragkv report --bench $D/ttft.json --output-dir $D $EVALS
