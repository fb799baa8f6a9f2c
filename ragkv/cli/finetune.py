"""`ragkv finetune`: block fine-tuning (Block-Attention, Ma et al., ICLR 2025, sec. 3.4) or vanilla SFT."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ragkv.errors import RagkvError
from ragkv.train.config import METHODS


# TrainConfig field -> argparse dest, for the options a resumed run may take from the saved run
CONFIG_FLAGS = {"steps": "steps", "lr": "lr", "warmup_steps": "warmup_steps", "schedule": "schedule",
                "weight_decay": "weight_decay", "max_grad_norm": "max_grad_norm", "batch_size": "batch",
                "grad_accum": "grad_accum", "seed": "seed", "bf16": "bf16", "max_length": "max_length",
                "save_every": "save_every", "keep_states": "keep_states"}


def register(sub) -> None:
    p = sub.add_parser(
        "finetune", help="fine-tune a model for Block-Attention (block mask) or plainly (causal mask)",
        description="Supervised fine-tuning on RAG examples built exactly like inference prompts (prefix, one "
                    "block per passage, question), loss on the gold answer + EOS. --method block trains under the "
                    "Block-Attention mask (each passage sees only itself; question and answer see everything), "
                    "so the result answers well in --mode reuse; --method vanilla trains under the causal mask; "
                    "--method block-local under the block mask with each passage at positions 0..n-1 (no position "
                    "re-encoding: Block-Attention's w/o-pos ablation, evaluated with --modes reuse:pos=local). "
                    "The output folder is an ordinary Hugging Face model folder for --model.")
    p.add_argument("--method", choices=METHODS, default="block")
    src = p.add_argument_group("data (default: --dataset hotpotqa-train)")
    src.add_argument("--data", default=None, metavar="FILE", help="a training file in an eval format (see --format)")
    src.add_argument("--format", default=None, help="format of --data: hotpotqa (default), cacheblend, nq, ...")
    src.add_argument("--dataset", default=None, help="named training sets, comma-separated: hotpotqa-train (500 "
                     "HotpotQA questions), nq-train (1,955 NQ-open questions with 9 distractors each)")
    src.add_argument("--limit", type=int, default=None, help="use the first N examples of each data set only")
    src.add_argument("--max-length", type=int, default=None,
                     help="tokens per example (default 2048); longer ones lose whole passages (distractors first)")
    src.add_argument("--max-passages", type=int, default=None,
                     help="keep at most N passages per example: the gold ones plus the first distractors")
    p.add_argument("--output", required=True, help="output folder (the final model; checkpoints/ inside)")
    p.add_argument("--model", default="smollm2", help="base model: known name or a local Hugging Face folder")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: torch's); 1 is much faster on a CPU shared with other jobs")
    opt = p.add_argument_group("optimization")
    opt.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    opt.add_argument("--lr", type=float, default=None, help="peak learning rate (default 5e-5)")
    opt.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --steps")
    opt.add_argument("--schedule", choices=("cosine", "linear", "constant"), default=None,
                     help="decay after warmup (default cosine)")
    opt.add_argument("--weight-decay", type=float, default=None, help="default 0")
    opt.add_argument("--max-grad-norm", type=float, default=None, help="default 1.0; 0 disables clipping")
    opt.add_argument("--batch", type=int, default=None, help="examples per micro-batch, padded (default 1)")
    opt.add_argument("--grad-accum", type=int, default=None, help="micro-batches per optimizer step (default 1)")
    opt.add_argument("--seed", type=int, default=None, help="default 0")
    opt.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                     help="bf16 autocast with fp32 weights (default: where the hardware runs bf16 fast)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--save-every", type=int, default=None,
                    help="save a checkpoint every N steps (default 0: final only)")
    ck.add_argument("--keep-states", type=int, default=None,
                    help="checkpoints keeping their optimizer state for --resume (default 1; weights are always kept)")
    ck.add_argument("--resume", action="store_true", help="continue the run in --output from its last checkpoint; "
                    "options not given are taken from that run")
    ck.add_argument("--until-step", type=int, default=None, metavar="N",
                    help="stop after step N with a checkpoint, the schedule still that of --steps (to stop runs at "
                         "equal steps; --resume goes on)")
    ck.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_finetune)

    r = sub.add_parser("finetune-report", help="Block-Attention table 1 and the accuracy-vs-steps curve from "
                                               "`ragkv eval` results of base and fine-tuned models")
    r.add_argument("--row", action="append", default=[], help="MODEL=results.jsonl (base, vanilla-ft, block-ft, block-local-ft); "
                   "several comma-separated files are the shards of one run; a MODEL given again with a run on "
                   "another data set is pooled with it")
    r.add_argument("--curve", action="append", default=[], help="MODEL:STEP=results.jsonl (shards and data sets "
                   "as for --row)")
    r.add_argument("--limit", type=int, default=None, help="table: first N examples of each file")
    r.add_argument("--curve-limit", type=int, default=None, help="curve: first N examples of each file")
    r.add_argument("--plot", default=None, help="PNG path of the accuracy-vs-steps curve")
    r.add_argument("--title", default="HotpotQA dev accuracy vs fine-tuning steps (SmolLM2-135M)")
    r.set_defaults(func=run_finetune_report)


def run_finetune(args) -> int:
    import torch

    from ragkv.config import resolve_autocast, resolve_device
    from ragkv.models.loader import load_model
    from ragkv.train.checkpoint import MARKER, check_output, prepare_output
    from ragkv.train.config import TrainConfig
    from ragkv.train.data import build_examples, load_training_examples
    from ragkv.train.loop import Trainer

    t_start = time.perf_counter()
    if args.data is None and args.dataset is None:
        args.dataset = "hotpotqa-train"
    if args.data is not None and args.dataset is not None:
        raise RagkvError("pass --data FILE or --dataset NAME, not both")
    if args.max_passages is not None and args.max_passages < 0:
        raise RagkvError(f"--max-passages must be >= 0, got {args.max_passages}")
    if args.threads is not None:
        if args.threads < 1:
            raise RagkvError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.until_step is not None and args.until_step < 1:
        raise RagkvError(f"--until-step must be >= 1, got {args.until_step}")
    device = resolve_device(args.device)
    output = Path(args.output).expanduser()
    check_output(output, args.resume, args.overwrite)
    given = {field: getattr(args, flag) for field, flag in CONFIG_FLAGS.items() if getattr(args, flag) is not None}
    if args.resume and (output / MARKER).is_file():  # options not given again come from the run being resumed
        saved = json.loads((output / MARKER).read_text()).get("config", {})
        given = {**{k: v for k, v in saved.items() if k in CONFIG_FLAGS}, **given}
    given["bf16"] = resolve_autocast(given.get("bf16"), device)
    cfg = TrainConfig(method=args.method, **given)

    raw = load_training_examples(args.dataset, args.data, args.format, args.limit)
    loaded = load_model(args.model, torch.float32, device)  # fp32 master weights; bf16 only in autocast
    examples, report = build_examples(raw, loaded.tokenizer, cfg.max_length, max_passages=args.max_passages)
    print(f"ragkv: {report.summary(cfg.max_length)}", file=sys.stderr)
    if not examples:
        raise RagkvError(f"no example fits --max-length {cfg.max_length}; raise it or lower --max-passages")

    resume_from = prepare_output(output, args.resume, args.overwrite)
    meta = {"base_model": args.model, "base_path": str(loaded.path), "method": cfg.method,
            "data": args.data or args.dataset, "format": args.format, "limit": args.limit,
            "max_passages": args.max_passages, "examples": report.examples, "truncated": report.truncated,
            "dropped_passages": report.dropped_passages, "skipped": report.skipped}
    if resume_from is None:
        (output / MARKER).write_text(json.dumps({**meta, "config": cfg.to_dict(), "step": 0}, indent=2) + "\n")
        (output / "train_log.jsonl").unlink(missing_ok=True)
    tok = loaded.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    trainer = Trainer(loaded.model, examples, cfg, output, loaded.path, pad_id=pad_id, meta=meta)
    if resume_from is not None:
        trainer.resume(resume_from)
        print(f"ragkv: resuming from {resume_from} (step {trainer.step} of {cfg.steps})", file=sys.stderr)
    print(f"ragkv: {cfg.method} fine-tuning of {args.model}: {cfg.steps} steps x {cfg.examples_per_step} "
          f"examples, lr {cfg.lr}, {'bf16 autocast' if cfg.bf16 else 'fp32'} on {device}", file=sys.stderr)
    if args.until_step is not None and args.until_step <= trainer.step:
        raise RagkvError(f"--until-step {args.until_step}: the run in {output} is already at step {trainer.step}")
    loss = trainer.run(progress=not args.no_progress, until=args.until_step)
    minutes = (time.perf_counter() - t_start) / 60
    last = f"last loss {loss if loss is None else round(loss, 4)}"
    if trainer.step < cfg.steps:  # --until-step reached, or stopped by SIGINT/SIGTERM: a checkpoint, not the model
        reached = trainer.step == args.until_step
        what = f"reached --until-step {trainer.step}" if reached else f"stopped at step {trainer.step}"
        print(f"ragkv: {what} of {cfg.steps} after {minutes:.1f} min, {last}; checkpoint saved in "
              f"{output / 'checkpoints'}; go on with: ragkv finetune --method {cfg.method} --output {output} --resume",
              file=sys.stderr)
        return 0 if reached else 130
    print(f"ragkv: done in {minutes:.1f} min, {last}; model saved to {output} (use --model {output})",
          file=sys.stderr)
    return 0


def _pairs(items: list[str], flag: str) -> list[tuple[str, list[Path]]]:
    """KEY=FILE[,FILE...] items: several files are the shards of one run."""
    out = []
    for item in items:
        key, sep, paths = item.partition("=")
        files = [Path(p) for p in paths.split(",") if p]
        if not sep or not files:
            raise RagkvError(f"{flag} wants KEY=FILE (or KEY=FILE,FILE,... for the shards of one run), got {item!r}")
        out.append((key, files))
    return out


def run_finetune_report(args) -> int:
    from ragkv.bench.finetune_report import curve, plot_curve, table

    rows = _pairs(args.row, "--row")
    if not rows and not args.curve:
        raise RagkvError("nothing to report: pass --row MODEL=FILE and/or --curve MODEL:STEP=FILE")
    if rows:
        print(table(rows, args.limit))
    if args.curve:
        points: dict[str, dict[int, list[list[Path]]]] = {}
        for key, path in _pairs(args.curve, "--curve"):
            model, _, step = key.partition(":")
            if not step.isdigit():
                raise RagkvError(f"--curve wants MODEL:STEP=FILE with an integer STEP, got {key!r}")
            points.setdefault(model, {}).setdefault(int(step), []).append(path)
        series = curve(points, args.curve_limit)
        print()
        steps = sorted({s for pts in series.values() for s in pts})
        print("| curve | " + " | ".join(str(s) for s in steps) + " |")
        print("|---|" + "---|" * len(steps))
        for name, pts in series.items():
            print(f"| {name} | " + " | ".join(f"{pts[s]:.1f}" if s in pts else "" for s in steps) + " |")
        if args.plot:
            print(f"\nplot: {plot_curve(series, Path(args.plot), args.title)}")
    return 0
