"""The evaluation loop: every example x every mode, greedy, scored on the task and against `full`.

Per example, `full` runs first and is the reference for fidelity (first-token KL, top-1 agreement, greedy
agreement over the first 32 tokens). Records are appended one by one to a `ResultsFile`, so an interrupted
run resumes. What fidelity needs of the reference (the exact first-token distribution and the greedy tokens) is
kept beside the results file (eval/references.py), so adding modes to an old run does not re-run `full`; where
that copy is missing or cannot be trusted, `full` re-runs (it is deterministic).

TTFT of the reuse modes is measured with the blocks already cached, as a serving system has them; the one-time
cost of encoding the example's blocks is recorded beside it as `encode_ms`. `prefix` is not warmed: only what
earlier examples left in the cache (the shared system prompt) can hit, as in serving.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from typing import Iterable

from ragkv.config import cpu_name
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.errors import RagkvError
from ragkv.eval.datasets import Example
from ragkv.ops.divergence import confidence
from ragkv.eval.metrics import (first_token_kl, greedy_agreement, parse_generation, prefix_agreement, score,
                                top1_agreement)
from ragkv.eval.modes import ModeSpec, without_later_defaults
from ragkv.eval.references import Reference, ReferenceStore
from ragkv.eval.results import ResultsFile

HARNESS_VERSION = 1
FIDELITY_TOKENS = 32  # greedy agreement is judged on the first 32 generated tokens
STEP_TOKENS = 8  # answer_steps: the top-2 log-probabilities of an answer's first 8 tokens
FULL = FusionOptions(mode="full")

# metrics reported per task on top of the example's own metric; F1 and EM score the first line only
TASK_METRICS = {"qa": ("accuracy", "f1"), "kv": ("accuracy", "exact_match"), "summary": ("rouge_l",)}
FIRST_LINE_METRICS = ("f1", "exact_match")


def task_scores(ex: Example, text: str) -> dict[str, float]:
    """Accuracy: a gold answer inside the whole output (Lost in the Middle); F1/EM on its first line (CacheBlend's
    parse_generation); Rouge-L on the whole output."""
    names = dict.fromkeys(TASK_METRICS.get(ex.task, ()) + (ex.metric,))
    return {n: score(n, parse_generation(text) if n in FIRST_LINE_METRICS else text, ex.answers) for n in names}


def fidelity(ref, ans, n: int = FIDELITY_TOKENS) -> dict:
    """Distance of an Answer to the `full` reference Answer on the same example ({} without one: an example
    longer than `full` can take)."""
    if ref is None:
        return {}
    out = {"first_token_kl": first_token_kl(ref.first_logits, ans.first_logits),
           "top1_agreement": top1_agreement(ref.first_logits, ans.first_logits)}
    if ref.token_ids or ans.token_ids:
        out["greedy_agreement"] = greedy_agreement(ref.token_ids, ans.token_ids, n)
        out["prefix_agreement"] = prefix_agreement(ref.token_ids, ans.token_ids, n)
    return out


def results_config(engine, dataset: dict, max_new_tokens: int, prompt_format=None, stop=()) -> dict:
    """What every record of one results file shares (modes and limit excluded: they may grow on resume)."""
    import torch

    return {**({"stop": list(stop)} if stop else {}),  # only when set: files written before it still resume
            "harness": HARNESS_VERSION, **dataset, "model": engine.model_name,
            "fingerprint": engine.fingerprint, "dtype": engine.dtype_name,
            "device": engine.device.type, "threads": torch.get_num_threads(),
            "max_new_tokens": max_new_tokens,
            "prompt_format": asdict(prompt_format or engine.prompt_format)}


def check_mode_params(records: Iterable[dict], modes: list[ModeSpec]) -> None:
    """A mode key already in the file must have been run with the same options."""
    want = {m.key: m.params for m in modes}
    for r in records:
        key = r.get("mode_key")
        if key in want and without_later_defaults(r.get("params")) != want[key]:
            raise RagkvError(f"mode {key!r} was run with {r.get('params')} in this results file but now resolves "
                             f"to {want[key]} (changed flags or APE calibration); name the parameters in the key "
                             "(e.g. ape:T=0.9,S=0.9), pass another --output, or --overwrite")


def _answer(engine, segs, fusion: FusionOptions, max_new_tokens: int, stop=()):
    if max_new_tokens:
        return engine.generate(segs, fusion, GenerationOptions(max_new_tokens=max_new_tokens, stop=tuple(stop),
                                                               logprobs=2))  # the top 2 at each step: answer_steps
    from ragkv.engine.decode.answer import Answer  # first-token fidelity only: no decoding

    state, stats = engine.prefill(segs, fusion)
    return Answer("", [], "length", stats, state.logits)


def _reference(engine, example_id, segs, pending, full_record, refs, max_new_tokens, stop):
    """`full`'s Answer on the example, or only its stored Reference where `full`'s own row is not pending."""
    if refs is not None and not any(get_mode(m.mode).is_reference for m in pending):
        stored = refs.load(example_id, full_record)
        if stored is not None:
            return stored
    ref = _answer(engine, segs, FULL, max_new_tokens, stop)
    if refs is not None:
        refs.save(example_id, ref)
    return ref


def _warm_group(engine, segs, fusion) -> tuple | None:
    """Modes that read the same blocks (reuse and blend) share one encoding: its cost is counted once."""
    return tuple(engine.cache_keys(segs, fusion)) if get_mode(fusion.mode).reads_blocks else None


def truncate_to_window(engine, examples: list[Example], max_new_tokens: int, prompt_format=None) -> list[Example]:
    """Each example with its passages farthest from the question (the first ones) dropped until the prompt and the
    answer fit the model's window: the baseline a longer-than-window set is compared with. `meta` says how many
    were dropped; `gold_index` follows the gold passage, -1 where it was dropped."""
    out = []
    for ex in examples:
        segs = engine.segments(ex.question, ex.passages, prompt_format=prompt_format)
        over = segs.num_tokens + max_new_tokens - engine.max_positions
        drop = 0
        while over > 0 and drop < len(segs.blocks):
            over -= len(segs.blocks[drop])
            drop += 1
        meta = {**ex.meta, "truncated_passages": drop}
        if "gold_index" in meta:
            meta["gold_index"] = meta["gold_index"] - drop if meta["gold_index"] >= drop else -1
        out.append(replace(ex, passages=ex.passages[drop:], meta=meta))
    return out


def forget_example(engine, segs, chunk: int = FusionOptions().prefix_chunk) -> None:
    """Drop the example's blocks and prefix-cache chunks from the store (keeping the shared system prompt's), so
    memory stays flat over hundreds of examples."""
    engine.forget(segs, prefix_chunk=chunk)


def make_record(ex: Example, spec: ModeSpec, ans, ref, segs, encode_ms: float, n_fid: int) -> dict:
    s = ans.stats
    rec = {"example_id": ex.id, "mode_key": spec.key, "mode": spec.mode, "params": spec.params,
           "task": ex.task, "metric": ex.metric, "prediction": ans.text, "token_ids": list(ans.token_ids),
           "finish_reason": ans.finish_reason, "scores": task_scores(ex, ans.text) if n_fid else {},
           "fidelity": fidelity(ref, ans, n_fid), "ttft_ms": round(s.ttft_ms, 3), "encode_ms": round(encode_ms, 3),
           "reused_tokens": s.reused_tokens, "recomputed_tokens": s.recomputed_tokens,
           # the prompt's work as token-layers, and as a fraction of a full prefill's
           "recomputed_token_layers": s.recomputed_token_layers, "full_token_layers": s.full_token_layers,
           "recompute_vs_full": s.to_dict()["recompute_vs_full"],
           "prompt_tokens": s.prompt_tokens, "num_passages": len(segs.blocks), "cache_hits": s.cache_hits,
           "completion_tokens": s.completion_tokens, "decode_ms": round(s.decode_ms, 3), "stats_extra": s.extra,
           "recompute": s.recompute.to_dict() if s.recompute is not None else None,  # what blend's selection chose
           "mode_fidelity": s.fidelity,  # how the mode says it computed the answer (exact or not, signal)
           # the answer's own first-token entropy and margin: features a per-reply estimate reads (engine/estimates)
           "answer_confidence": {k: round(v, 6) for k, v in confidence(ans.first_logits).items()},
           # and at each of its first STEP_TOKENS tokens, the top two log-probabilities: what a signal read a few
           # decoded tokens in (rather than at the first) would see
           "answer_steps": [[round(lp, 5) for _, lp in t.top[:2]] for t in ans.logprobs[:STEP_TOKENS]],
           "cpu": cpu_name()}  # per record: a resumed run may go on on another machine
    for k in ("gold_index", "retrieved_gold_rank", "truncated_passages"):  # where the gold passage sat, and the retriever's rank of it
        if k in ex.meta:
            rec[k] = ex.meta[k]
    if ex.task != "summary":
        rec["answers"] = ex.answers
    return rec


def run_eval(engine, examples: list[Example], modes: list[ModeSpec], results: ResultsFile | None = None, *,
             max_new_tokens: int = 32, progress: bool = True, desc: str = "eval", keep_cache: bool = False,
             prompt_format=None, stop=(), reference=None) -> dict:
    """Evaluate `modes` on `examples`, skipping (example, mode) pairs already in `results`.

    `prompt_format`: the data set's own prompt (datasets.dataset_prompt), else the engine's; `stop`: strings that
    end an answer (datasets.dataset_stop); `reference`: another run's `full` answers (references.ExternalReferences)
    to judge every mode against, `full` included, instead of this engine's own.
    Returns {"records": this run's records of these examples and modes, old and new, "skipped": ids of examples
    too long for the model, "recomputed_references": examples whose `full` reference was re-run on resume (its
    stored copy missing or not trusted)}.
    """
    from tqdm import tqdm

    if max_new_tokens < 0:
        raise RagkvError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    old = results.records() if results is not None else []
    check_mode_params(old, modes)
    done = {(r["example_id"], r["mode_key"]) for r in old}
    ref_keys = {m.key for m in modes if get_mode(m.mode).is_reference}
    old_full = {r["example_id"]: r for r in old if r["mode_key"] in ref_keys}  # checks a stored reference's tokens
    refs = ReferenceStore(results.path, results.config) if results is not None else None
    n_fid = min(FIDELITY_TOKENS, max_new_tokens)
    todo = [(ex, [m for m in modes if (ex.id, m.key) not in done]) for ex in examples]
    skipped, rerun = [], 0
    bar = tqdm(total=sum(len(p) for _, p in todo), desc=desc, unit="run", file=sys.stderr,
               disable=not progress, dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
    new = []
    for ex, pending in todo:
        if not pending:
            continue
        segs = engine.segments(ex.question, ex.passages, prompt_format=prompt_format)
        # each mode's layout: with blocks sharing positions (ape), a prompt longer than the window may still fit
        laid = {m.key: engine.fit_to_window(segs, m.fusion, max_new_tokens) for m in pending}
        fits = {m.key for m in pending
                if engine.positions_needed(laid[m.key], m.fusion) + max_new_tokens <= engine.max_positions}
        if not fits:
            skipped.append(ex.id)
            bar.update(len(pending))
            continue
        bar.set_postfix_str(f"{ex.id[:12]} full")
        # the reference where `full` fits; beyond the window, the other modes run without one (no fidelity)
        fits_full = segs.num_tokens + max_new_tokens <= engine.max_positions
        if reference is not None:
            ref = reference.get(ex.id) if fits_full else None
        else:
            ref = _reference(engine, ex.id, segs, pending, old_full.get(ex.id), refs, max_new_tokens, stop) \
                if fits_full else None
        rerun += ex.id in old_full and ref is not None and not isinstance(ref, Reference)
        encode: dict[tuple, float] = {}  # blocks read (cache keys) -> their encoding time
        for spec in pending:
            if spec.key not in fits:
                bar.update(1)
                continue
            bar.set_postfix_str(f"{ex.id[:12]} {spec.key}")
            mode_segs = laid[spec.key]
            group = _warm_group(engine, mode_segs, spec.fusion)
            if get_mode(spec.mode).is_reference and reference is None:
                ans = ref  # the reference run is the `full` row: fidelity exactly zero by construction
            else:
                if group and group not in encode:
                    encode[group] = engine.warm(mode_segs, spec.fusion).encode_ms
                ans = _answer(engine, mode_segs, spec.fusion, max_new_tokens, stop)
            rec = make_record(ex, spec, ans, ref, mode_segs, encode.get(group, 0.0), n_fid)
            if results is not None:
                results.append(rec)
            new.append(rec)
            bar.update(1)
        if not keep_cache:
            for laid_segs in {id(s): s for s in [segs, *laid.values()]}.values():
                forget_example(engine, laid_segs)
    bar.close()
    ids = {ex.id for ex in examples}
    keys = {m.key for m in modes}
    mine = [r for r in old if r["example_id"] in ids and r["mode_key"] in keys] + new
    return {"records": mine, "skipped": skipped, "recomputed_references": rerun}
