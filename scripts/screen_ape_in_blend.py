"""Screen: APE's temperature T and scale S (engine/fusion/ape.py) on the query rows' attention to the passages inside
the default query-aware `blend` (r=0.14, `sfrom=0.5`), first token only, against `full`.

Not an engine option: the stage-2 row attention (ragkv.engine.recompute.rows.SelectedRowsPlan.attend) is wrapped
here so that the query rows attend through APE's merge (prefix, passages at T and S, query) instead of the causal
kernel; every variant, T = S = 1 included, runs that same explicit fp32 merge, so the paired differences against
T = S = 1 compare temperature and scale alone, not the two kernels' rounding. One JSON line a question, the
first-token KL of each variant (and of the unwrapped default).

    .venv/bin/python scripts/screen_ape_in_blend.py qwen2.5-coder-1.5b 30 runs/ape-in-blend.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys

from ragkv.engine.engine import Engine
from ragkv.engine.fusion.ape import ApeAttention
from ragkv.engine.options import FusionOptions
from ragkv.engine.recompute import rows
from ragkv.eval.datasets import dataset_prompt, load_dataset
from ragkv.eval.harness import forget_example
from ragkv.eval.metrics import first_token_kl
from ragkv.eval.summary import bootstrap_ci

FULL = FusionOptions(mode="full")
DEFAULT = FusionOptions(mode="blend", select="query", ratio=0.14, score_from=0.5)
VARIANTS = [("T=S=1", 1.0, 1.0), ("T=0.9,S=0.9", 0.9, 0.9), ("T=0.9,S=1", 0.9, 1.0), ("T=1,S=0.9", 1.0, 0.9)]
BASELINE = "T=S=1"


def wrap_row_attention(setting: dict) -> None:
    """While setting["on"], the query rows (cache index >= setting["N"]) attend through APE's merge."""
    plain = rows.SelectedRowsPlan.attend

    def attend(self, layer, q, kv):
        out = plain(self, layer, q, kv)
        if setting["on"]:
            nq = int((self.positions >= setting["N"]).sum())
            ape = ApeAttention(setting["P"], setting["N"] - setting["P"], setting["T"], setting["S"])
            out[:, :, -nq:] = ape(layer, q[:, :, -nq:], *kv).to(out.dtype)
        return out

    rows.SelectedRowsPlan.attend = attend


def first_logits(engine, segs, fusion: FusionOptions):
    return engine.prefill(segs, fusion)[0].logits


def main(model: str, limit: int, output: str) -> None:
    engine = Engine.load(model, dtype="bfloat16", device="cpu")
    setting = {"on": False, "T": 1.0, "S": 1.0, "P": 0, "N": 0}
    wrap_row_attention(setting)
    fmt = dataset_prompt("nq-distractors")
    records = []
    with open(output, "a") as out:
        for ex in load_dataset("nq-distractors", limit=limit):
            segs = engine.segments(ex.question, ex.passages, prompt_format=fmt)
            setting.update(on=False, P=len(segs.prefix), N=len(segs.prefix) + sum(len(b) for b in segs.blocks))
            ref = first_logits(engine, segs, FULL)
            engine.warm(segs, DEFAULT)
            rec = {"id": ex.id, "default": first_token_kl(ref, first_logits(engine, segs, DEFAULT))}
            for name, T, S in VARIANTS:
                setting.update(on=True, T=T, S=S)
                rec[name] = first_token_kl(ref, first_logits(engine, segs, DEFAULT))
            setting["on"] = False
            forget_example(engine, segs)
            out.write(json.dumps(rec) + "\n")
            out.flush()
            records.append(rec)
            print(ex.id, {k: round(v, 4) for k, v in rec.items() if k != "id"}, file=sys.stderr, flush=True)
    for key in ["default"] + [v[0] for v in VARIANTS]:  # each against BASELINE, paired by question
        kl, diff = [r[key] for r in records], [r[key] - r[BASELINE] for r in records]
        lo, hi = bootstrap_ci(diff)
        print(f"{key:12s} KL mean {statistics.mean(kl):.4f} median {statistics.median(kl):.4f}  "
              f"vs {BASELINE}: {statistics.mean(diff):+.4f} [{lo:+.4f}, {hi:+.4f}]")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
