"""`ragkv bench lookahead|ceiling|profile|weights`: the engine's own timings probed in one process (the draft's
lookahead, the compute ceiling, one mode's prefill profile, decode weights against each other); registered under
`ragkv bench` by ragkv/cli/bench.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ragkv.cli.common import add_model_args, add_output_args, engine_from_args, finish_bench, say
from ragkv.cli.config_args import add_config_args, config_from_args
from ragkv.errors import InvalidRequestError


def register(bsub) -> None:
    from ragkv.bench.ceiling import CeilingBenchConfig
    from ragkv.bench.lookahead import LookaheadBenchConfig
    from ragkv.bench.prefill_profile import ProfileBenchConfig

    la = bsub.add_parser("lookahead", help="time to the whole answer of blend:sel=query,draft=N with the draft's "
                                           "rows taken as the answer's start and without, alternated per question")
    la.add_argument("--dataset", default="nq-distractors", help="an NQ set with distractors")
    la.add_argument("--gold-position", type=int, default=0, help="index of the gold passage among the 10")
    la.add_argument("--first", type=int, default=0, help="first question (0-based)")
    la.add_argument("--limit", type=int, default=8, help="questions up to this index (exclusive)")
    add_config_args(la, LookaheadBenchConfig, help={"ratio": "the selection's r", "draft_tokens": "the draft's "
                    "length N", "max_new_tokens": "tokens of each answer"})
    add_output_args(la)
    add_model_args(la)
    la.set_defaults(func=run_lookahead)

    ce = bsub.add_parser("ceiling", help="a full prefill under torch's profiler against this machine's sgemm "
                                         "peak, and batched decode steps' GFLOP/s and weight GB/s")
    add_config_args(ce, CeilingBenchConfig, help={
        "tokens": "the full prompt's length", "batch_sizes": "batched decode sizes",
        "sgemm_sizes": "square products timed for the peak", "rounds": "timed runs of each (the best counts)"})
    add_output_args(ce)
    add_model_args(ce)
    ce.set_defaults(func=run_ceiling)

    pr = bsub.add_parser("profile", help="where one mode's warm prefill spends its time (statistics and torch's "
                                         "profile), a question over MuSiQue passages")
    add_config_args(pr, ProfileBenchConfig, help={
        "mode": "a mode key, e.g. reuse:kv=shared or blend:sel=query,r=0.15", "repeats": "warm prefills timed",
        "top": "ops listed"})
    pr.add_argument("--passages", type=int, default=4, help="blocks of the prompt")
    pr.add_argument("--passage-words", type=int, default=0,
                    help="passages cut to this many words (bench serve: 210; default 0: whole, ~415 words)")
    add_output_args(pr)
    add_model_args(pr)
    pr.set_defaults(func=run_profile)

    w = bsub.add_parser("weights", help="prefills and decode steps on engines that differ only in "
                                        "--decode-weights, alternated in one process")
    from ragkv.bench.weights import WeightsBenchConfig

    w.add_argument("--modes", default=",".join(WeightsBenchConfig.modes),
                   help="mode keys timed warm (their blocks stored first)")
    add_config_args(w, WeightsBenchConfig, skip=("modes",), help={
        "weights": "decode weights compared (the first is the base)",
        "cold": "also a `reuse` whose blocks are encoded in the timed run", "batch_sizes": "decode batch sizes",
        "rounds": "timed rounds, after one that warms every path",
        "greedy_steps": "fidelity against the first weights: greedy tokens compared per prompt (`full`, every "
                        "prompt)"})
    w.add_argument("--passages", type=int, default=4, help="blocks per prompt")
    add_output_args(w)
    add_model_args(w, decode_weights=False)
    w.set_defaults(func=run_weights)


def run_lookahead(args) -> int:
    from ragkv.bench.lookahead import LookaheadBenchConfig, run_lookahead_bench
    from ragkv.eval.datasets import load_dataset

    if not 0 <= args.first < args.limit:
        raise InvalidRequestError(f"--first {args.first} must be below --limit {args.limit}")
    engine = engine_from_args(args)
    examples = load_dataset(args.dataset, limit=args.limit, num_passages=10,
                            gold_position=args.gold_position)[args.first:]
    questions = [(ex.id, engine.segments(ex.question, ex.passages)) for ex in examples]
    cfg = config_from_args(LookaheadBenchConfig, args)
    return finish_bench(args, run_lookahead_bench(engine, cfg, questions, Path(args.output_dir), say), "lookahead.md")


def _musique(engine, passages: int, prompts: int, words: int | None = None) -> list:
    """`prompts` prompts of `passages` MuSiQue passages each (cut to `words`), each its own question."""

    from ragkv.bench.common import real_passages

    pool, questions = real_passages(passages + prompts)
    if words:
        pool = [replace(p, text=" ".join(p.text.split()[:words])) for p in pool]
    return [engine.segments(questions[i % len(questions)], pool[i % len(pool):][:passages]) for i in range(prompts)]


def run_ceiling(args) -> int:
    from ragkv.bench.ceiling import CeilingBenchConfig, run_ceiling_bench

    cfg = config_from_args(CeilingBenchConfig, args, rounds=max(1, args.rounds))
    engine = engine_from_args(args)
    n, long = 4, _musique(engine, 4, 1)[0]
    while long.num_tokens < cfg.tokens and n < 64:  # passages enough for --tokens
        n *= 2
        long = _musique(engine, n, 1)[0]
    return finish_bench(args, run_ceiling_bench(engine, cfg, long.all_ids(),
                                           _musique(engine, 4, max(cfg.batch_sizes)), Path(args.output_dir), say),
                   "ceiling.md")


def run_profile(args) -> int:
    from ragkv.bench.prefill_profile import ProfileBenchConfig, run_profile_bench
    from ragkv.eval.modes import parse_mode_key

    parse_mode_key(args.mode)  # a bad key fails before the model loads
    cfg = config_from_args(ProfileBenchConfig, args, repeats=max(1, args.repeats))
    engine = engine_from_args(args)
    segs = _musique(engine, args.passages, 1, args.passage_words)[0]
    return finish_bench(args, run_profile_bench(engine, cfg, segs, Path(args.output_dir), say), "profile.md")


def run_weights(args) -> int:
    from ragkv.bench.weights import WeightsBenchConfig, run_weights_bench
    from ragkv.engine.engine import Engine
    from ragkv.eval.modes import parse_mode_key, split_mode_list

    modes = tuple(split_mode_list(args.modes))
    for k in modes:
        parse_mode_key(k)
    cfg = config_from_args(WeightsBenchConfig, args, modes=modes)
    cfg = replace(cfg, rounds=max(1, cfg.rounds), greedy_steps=max(0, cfg.greedy_steps))
    weights = cfg.weights
    if len(weights) < 2 or len(set(weights)) != len(weights):
        raise InvalidRequestError(f"--weights wants two or more different kinds, got {args.weights!r}")
    # one model per weights: oneDNN joins q/k/v and gate/up of the weights it runs on
    engines = {w: Engine.load(args.model, dtype=args.dtype, device=args.device, decode_weights=w) for w in weights}
    segs = _musique(engines[weights[0]], args.passages, max(cfg.batch_sizes))
    return finish_bench(args, run_weights_bench(engines, cfg, segs, Path(args.output_dir), say), "weights.md")
