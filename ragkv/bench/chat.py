"""`ragkv bench chat`: a long conversation replayed statelessly (the whole `messages` list every turn, as OpenAI
clients send it), as it is, after a mid-history compaction, and after a dropped exchange. Per turn: TTFT of `full`,
of `prefix` (exact prefix caching, what vLLM, SGLang and llama.cpp do) and of each block path (chat turns as blocks,
engine/blocks/history.py), with each block path's first-token KL to `full` and whether its greedy first token agrees.

Each path has its own store, filled only by the conversation itself; after each block-path reply the work the
server does in the background while idle (`Engine.settle_history_steps`) runs and is timed apart. User turns are
real MuSiQue passages ("remember this note"), assistant turns short fixed acknowledgements, so every path answers the
same prompts whatever it generates. Engine level (no HTTP): the server adds the same constant to every path.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, real_passages, save_json
from ragkv.engine.kv.stepwise import drain
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions
from ragkv.eval.modes import parse_mode_key
from ragkv.ops.divergence import first_token_kl
from ragkv.store.memory import MemoryStore

SCENARIOS = ("unedited", "compacted", "dropped")


@dataclass(frozen=True)
class ChatBenchConfig:
    turns: int = 20                  # user turns; the last one is measured against the targets
    edit_at: int = 12                # the turn at which the compacted and dropped scenarios edit the history
    words: int = 80                  # words of each user turn's note
    paths: tuple[str, ...] = ("prefix", "auto", "blend:sel=query,r=0.3")  # beside `full`, the reference
    scenarios: tuple[str, ...] = SCENARIOS
    repeats: int = 3                 # the measured turns (the edit, the last) run this often, each from the same
                                     # cache state; their median TTFT is reported
    system: str = "You are a helpful assistant. Keep the user's notes in mind and answer briefly."


def notes(n: int, words: int) -> list[str]:
    passages, _ = real_passages(limit=n + 5)
    out = []
    for p in passages:
        text = " ".join(p.text.split()[:words])
        if len(text.split()) >= words // 2:
            out.append(f"Please remember this note about {p.title}: {text}")
        if len(out) == n:
            return out
    raise ValueError(f"only {len(out)} usable passages for {n} turns")


def conversation(cfg: ChatBenchConfig, scenario: str, turn: int, texts: list[str]) -> list[dict]:
    """The messages a stateless client sends at `turn` (1-based) of `scenario`: every earlier exchange (as edited
    from cfg.edit_at on), then the turn's user message."""
    exchanges = [[{"role": "user", "content": texts[i]},
                  {"role": "assistant", "content": f"Noted: the note about item {i + 1} is saved."}]
                 for i in range(turn - 1)]
    if turn >= cfg.edit_at and scenario == "compacted":  # the first half of the history becomes one summary
        half = (cfg.edit_at - 1) // 2
        summary = [{"role": "user", "content": "Summary of our conversation so far: I shared notes on "
                                               + ", ".join(f"item {i + 1}" for i in range(half)) + "."},
                   {"role": "assistant", "content": "Understood."}]
        exchanges = [summary] + exchanges[half:]
    elif turn >= cfg.edit_at and scenario == "dropped":  # one exchange in the middle is removed
        del exchanges[(cfg.edit_at - 1) // 2]
    msgs = [m for ex in exchanges for m in ex]
    return msgs + [{"role": "user", "content": texts[turn - 1]}]


def run_chat_bench(engine, cfg: ChatBenchConfig, out_dir: Path, say=print) -> dict:
    texts = notes(cfg.turns, cfg.words)
    fusions = {key: parse_mode_key(key) for key in cfg.paths}
    rows, result = [], {"config": cfg.__dict__, "engine": engine.info(), "scenarios": {}}
    for scenario in cfg.scenarios:
        engines = {key: engine.with_store(MemoryStore()) for key in cfg.paths}  # each path its own, empty store
        turns = []
        for t in range(1, cfg.turns + 1):
            segs = engine.history_segments(conversation(cfg, scenario, t, texts), cfg.system)
            repeats = cfg.repeats if t in measured_turns(cfg, scenario) else 1
            full_runs, path_runs = [], {key: [] for key in fusions}
            for r in range(repeats):  # interleaved, so that a drift of the machine's speed hits every column alike
                full_runs.append(engine.prefill(segs, FusionOptions(mode="full")))
                for key, fusion in fusions.items():  # each run from the cache state the turn found
                    eng = engines[key]
                    snap = eng.store.snapshot() if r < repeats - 1 else None
                    path_runs[key].append(eng.prefill(segs, fusion))
                    if snap is not None:
                        eng.store.restore(snap)
            full_logits = full_runs[-1][0].logits.float()
            rec = {"turn": t, "prompt_tokens": segs.num_tokens, "full_ms": median_ttft(full_runs), "paths": {}}
            if repeats > 1:
                rec["full_runs_ms"] = [round(st.ttft_ms, 1) for _, st in full_runs]
            for key, fusion in fusions.items():
                eng, runs = engines[key], path_runs[key]
                state, stats = runs[-1]
                logits = state.logits.float()
                row = {"ttft_ms": median_ttft(runs), "exact": stats.fidelity.get("exact"),
                       "kl": round(first_token_kl(full_logits, logits), 5),
                       "top1_agrees": bool(torch.argmax(logits) == torch.argmax(full_logits)),
                       "recompute_vs_full": stats.to_dict().get("recompute_vs_full"),
                       "history": stats.extra.get("history")}
                if repeats > 1:
                    row["runs_ms"] = [round(st.ttft_ms, 1) for _, st in runs]
                if segs.blocks and get_mode(fusion.mode).reads_blocks:
                    t0 = time.perf_counter()  # the server's idle-time work after this reply
                    with eng.lock:
                        settled = drain(eng.settle_history_steps(segs, prefix_chunk=fusion.prefix_chunk))
                    row.update(background_ms=round((time.perf_counter() - t0) * 1000, 1), **settled)
                rec["paths"][key] = row
            turns.append(rec)
            say(f"[chat] {scenario} turn {t}: {segs.num_tokens} tokens, full {rec['full_ms']:.0f} ms, "
                + ", ".join(f"{k} {r['ttft_ms']:.0f} ms kl {r['kl']:.3f}" for k, r in rec["paths"].items()))
            rows.append([scenario, t, segs.num_tokens, rec["full_ms"]]
                        + [f"{r['ttft_ms']:.0f} / {r['kl']:.3f}{'' if r['top1_agrees'] else ' x'}"
                           for r in rec["paths"].values()])
        result["scenarios"][scenario] = turns
    result["summary"] = summarize(cfg, result["scenarios"])
    save_json(out_dir / "chat.json", result)
    write_markdown(cfg, result, rows, out_dir)
    return result


def measured_turns(cfg: ChatBenchConfig, scenario: str) -> set[int]:
    """The turns `summarize` reads: the last one unedited, the edit turn otherwise."""
    return {cfg.turns} if scenario == "unedited" else {cfg.edit_at}


def median_ttft(runs: list) -> float:
    return round(statistics.median(st.ttft_ms for _, st in runs), 1)


def summarize(cfg: ChatBenchConfig, scenarios: dict) -> dict:
    """The issue's ratios: the last turn unedited against `prefix`, and the edit turn against `full` and `prefix`."""
    out = {}
    for name, turns in scenarios.items():
        at = turns[-1] if name == "unedited" else turns[cfg.edit_at - 1]
        prefix = at["paths"].get("prefix", {}).get("ttft_ms")
        out[name] = {"turn": at["turn"], "prompt_tokens": at["prompt_tokens"], "full_ms": at["full_ms"],
                     "paths": {k: {"ttft_ms": r["ttft_ms"], "vs_full": round(r["ttft_ms"] / at["full_ms"], 3),
                                   "vs_prefix": round(r["ttft_ms"] / prefix, 3) if prefix else None,
                                   "kl": r["kl"], "top1_agrees": r["top1_agrees"], "exact": r["exact"]}
                               for k, r in at["paths"].items()},
                     "mean_kl_after_edit": {k: round(sum(t["paths"][k]["kl"] for t in turns[cfg.edit_at - 1:])
                                                     / len(turns[cfg.edit_at - 1:]), 5) for k in at["paths"]}}
    return out


def write_markdown(cfg: ChatBenchConfig, result: dict, rows: list, out_dir: Path) -> None:
    m, e = result["machine"], result["engine"]
    lines = [f"# ragkv bench chat: {cfg.turns} turns, edits at turn {cfg.edit_at}", "",
             f"{m.get('cpu')} ({m.get('cpus')} CPUs, {e['threads']} threads), {e['model']} {e['dtype']}; command: "
             f"`ragkv bench chat --turns {cfg.turns} --edit-at {cfg.edit_at} --words {cfg.words} --paths "
             f"{','.join(cfg.paths)} --scenarios {','.join(cfg.scenarios)} --repeats {cfg.repeats} --model "
             f"{e['model']} --dtype {e['dtype']} --decode-weights {e.get('decode_weights', 'exact')}`", "",
             "## Against the targets", ""]
    head = ["scenario (turn)", "tokens", "full ms"] + [f"{k}: ms, x full, x prefix, KL, top-1" for k in cfg.paths]
    table = []
    for name, s in result["summary"].items():
        table.append([f"{name} ({s['turn']})", s["prompt_tokens"], s["full_ms"]]
                     + [f"{p['ttft_ms']}, {p['vs_full']}, {p['vs_prefix']}, {p['kl']}, "
                        f"{'=' if p['top1_agrees'] else 'differs'}" for p in s["paths"].values()])
    lines += [markdown_table(head, table), "",
              "## Every turn (TTFT ms / first-token KL to full; x: greedy first token differs)", "",
              markdown_table(["scenario", "turn", "tokens", "full ms"] + list(cfg.paths), rows), ""]
    (out_dir / "chat.md").write_text("\n".join(lines))
