"""`ragkv bench weights`: the same prefills and batched decode steps on engines that differ only in
`--decode-weights` (exact MKL linears against oneDNN on the model's own weights, say), alternated in one process
so that the machine's drift hits both alike. Per mode key a warm prefill (its blocks stored first), a cold `reuse`
(the blocks forgotten before each run: block encoding, then the question), and decode steps over `reuse` prompts
at each batch size; each case's median against the first weights', and how far its first-token logits are from
theirs (the exact copies compute the same products in another order). Then fidelity against the first weights on
every prompt (`full`, exact on the first weights when they are exact): first-token KL, top-1 agreement and greedy
agreement over `greedy_steps` tokens, which an approximate copy (w8a8: int8 products in prefill) is judged by."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragkv.bench.common import markdown_table, save_json, sync_device
from ragkv.engine.kv.state import decode_batch, decode_step
from ragkv.engine.options import FusionOptions
from ragkv.eval.modes import parse_mode_key

COLD = "reuse (cold)"


@dataclass(frozen=True)
class WeightsBenchConfig:
    weights: tuple[str, ...] = ("exact", "onednn")
    modes: tuple[str, ...] = ("full", "reuse", "blend:r=0.15", "blend:sel=query,r=0.15")
    cold: bool = True                         # also a `reuse` whose blocks are encoded in the timed run
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    rounds: int = 3                           # timed rounds, after one that warms every path
    greedy_steps: int = 16                    # fidelity: greedy tokens compared per prompt (0: first token only)


def _ms(fn) -> tuple[float, object]:
    sync_device()
    t0 = time.perf_counter()
    out = fn()
    sync_device()
    return (time.perf_counter() - t0) * 1000, out


def run_weights_bench(engines: dict, cfg: WeightsBenchConfig, segs_list: list, out_dir: Path, say=print) -> dict:
    """`engines`: weights -> Engine (the same model); `segs_list`: the prompts, the first timed, max(batch) for
    decode."""
    cases = {k: parse_mode_key(k) for k in cfg.modes}
    if cfg.cold:
        cases[COLD] = FusionOptions(mode="reuse")
    segs = segs_list[0]
    ms = {(w, c): [] for w in engines for c in [*cases, *(f"step b={b}" for b in cfg.batch_sizes)]}
    first = {}  # (weights, case) -> first-token logits
    steps = len(cfg.batch_sizes) * (cfg.rounds + 1) + 2  # cache rows each decode state needs
    states = {w: [e.prefill(s, FusionOptions(mode="reuse"), steps)[0]
                  for s in segs_list[:max(cfg.batch_sizes)]] for w, e in engines.items()}
    for r in range(cfg.rounds + 1):
        for case, fusion in cases.items():
            for w, engine in engines.items():
                if case == COLD:
                    engine.forget(segs)
                else:
                    engine.warm(segs, fusion)
                t, (state, _) = _ms(lambda: engine.prefill(segs, fusion))
                first.setdefault((w, case), state.logits.float().cpu())
                state.release()
                if r:  # round 0 warms every path
                    ms[w, case].append(t)
        for b in cfg.batch_sizes:
            for w, engine in engines.items():
                t, _ = _ms(lambda: decode_batch(engine.decode_model, states[w][:b], [13] * b))
                if r:
                    ms[w, f"step b={b}"].append(t)
        say(f"[weights] round {r} of {cfg.rounds} done" + (" (warm-up)" if not r else ""))
    for ss in states.values():
        for s in ss:
            s.release()
    base = next(iter(engines))
    rows = []
    for case in dict.fromkeys(c for _, c in ms):
        med = {w: round(statistics.median(ms[w, case]), 3) for w in engines}
        row = {"case": case, "ms": med, "ratio": {w: round(med[w] / med[base], 4) for w in engines}}
        if (base, case) in first:
            row["max_logit_diff"] = {w: round(float((first[w, case] - first[base, case]).abs().max()), 6)
                                     for w in engines}
        rows.append(row)
    result = {"config": asdict(cfg), "engine": engines[base].info(), "prompt_tokens": segs.num_tokens,
              "weights": {w: e.decode_weights for w, e in engines.items()}, "rows": rows,
              "fidelity": _fidelity(engines, segs_list, cfg.greedy_steps, say)}
    save_json(out_dir / "weights.json", result)
    (out_dir / "weights.md").write_text(markdown(result, list(engines)))
    return result


def _greedy(engine, segs, steps: int) -> tuple[torch.Tensor, list[int]]:
    """`full`'s first-token log-probabilities and its greedy tokens (the first and `steps` more)."""
    state, _ = engine.prefill(segs, FusionOptions(mode="full"), steps + 1)
    first = state.logits.float().log_softmax(-1).cpu()
    toks = [int(state.logits.argmax())]
    for _ in range(steps):
        toks.append(int(decode_step(engine.decode_model, state, toks[-1]).argmax()))
    state.release()
    return first, toks


def _fidelity(engines: dict, segs_list: list, steps: int, say=print) -> dict:
    """Per weights against the first: mean and max first-token KL(base || w), top-1 agreement, the share of prompts
    whose greedy tokens all agree, and the mean number of leading greedy tokens that agree, over every prompt."""
    base = next(iter(engines))
    runs = {w: [_greedy(e, s, steps) for s in segs_list] for w, e in engines.items()}
    out = {}
    for w in list(engines)[1:]:
        kls = [float((b.exp() * (b - a)).sum()) for (b, _), (a, _) in zip(runs[base], runs[w])]
        lead = [next((i for i, (x, y) in enumerate(zip(tb, ta)) if x != y), len(tb))
                for (_, tb), (_, ta) in zip(runs[base], runs[w])]
        out[w] = {"prompts": len(kls), "first_token_kl_mean": round(sum(kls) / len(kls), 6),
                  "first_token_kl_max": round(max(kls), 6), "top1_agreement": sum(n > 0 for n in lead) / len(lead),
                  "greedy_agreement": sum(n == steps + 1 for n in lead) / len(lead),
                  "agreeing_tokens_mean": round(sum(lead) / len(lead), 2), "greedy_tokens": steps + 1}
        say(f"[weights] fidelity of {w} against {base} (full, {len(kls)} prompts): {out[w]}")
    return out


def markdown(res: dict, weights: list[str]) -> str:
    e, base = res["engine"], weights[0]
    head = ["case"] + [f"{w} ms" for w in weights] + [f"{w} / {base}" for w in weights[1:]] + \
        [f"{w}: max logit diff" for w in weights[1:]]
    rows = [[r["case"]] + [r["ms"][w] for w in weights] + [f"{r['ratio'][w]:.2f}x" for w in weights[1:]] +
            [r.get("max_logit_diff", {}).get(w, "-") for w in weights[1:]] for r in res["rows"]]
    return "\n".join([f"# ragkv bench weights: {e['model']} {e['dtype']}, {' vs '.join(weights)}", "",
                      f"{res['prompt_tokens']} prompt tokens; medians of {res['config']['rounds']} alternated "
                      "rounds.", "", markdown_table(head, rows), "", _fidelity_table(res, weights), ""])


def _fidelity_table(res: dict, weights: list[str]) -> str:
    fid = res.get("fidelity", {})
    head = ["weights", "prompts", "first-token KL mean", "max", "top-1 agreement", "greedy agreement",
            "agreeing greedy tokens (mean)"]
    rows = [[w, f["prompts"], f["first_token_kl_mean"], f["first_token_kl_max"], f"{f['top1_agreement']:.2f}",
             f"{f['greedy_agreement']:.2f} (of {f['greedy_tokens']} tokens)", f["agreeing_tokens_mean"]]
            for w, f in fid.items()]
    return f"Fidelity against {weights[0]} (`full` on every prompt):\n\n" + markdown_table(head, rows)
