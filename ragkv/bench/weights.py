"""`ragkv bench weights`: the same prefills and batched decode steps on engines that differ only in
`--decode-weights` (exact MKL linears against oneDNN on the model's own weights, say), alternated in one process
so that the machine's drift hits both alike. Per mode key a warm prefill (its blocks stored first), a cold `reuse`
(the blocks forgotten before each run: block encoding, then the question), and decode steps over `reuse` prompts
at each batch size; each case's median against the first weights', and how far its first-token logits are from
theirs (the exact copies compute the same products in another order)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ragkv.bench.common import markdown_table, save_json, sync_device
from ragkv.engine.kv.state import decode_batch
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
              "weights": {w: e.decode_weights for w, e in engines.items()}, "rows": rows}
    save_json(out_dir / "weights.json", result)
    (out_dir / "weights.md").write_text(markdown(result, list(engines)))
    return result


def markdown(res: dict, weights: list[str]) -> str:
    e, base = res["engine"], weights[0]
    head = ["case"] + [f"{w} ms" for w in weights] + [f"{w} / {base}" for w in weights[1:]] + \
        [f"{w}: max logit diff" for w in weights[1:]]
    rows = [[r["case"]] + [r["ms"][w] for w in weights] + [f"{r['ratio'][w]:.2f}x" for w in weights[1:]] +
            [r.get("max_logit_diff", {}).get(w, "-") for w in weights[1:]] for r in res["rows"]]
    return "\n".join([f"# ragkv bench weights: {e['model']} {e['dtype']}, {' vs '.join(weights)}", "",
                      f"{res['prompt_tokens']} prompt tokens; medians of {res['config']['rounds']} alternated "
                      "rounds.", "", markdown_table(head, rows), ""])
