"""FusionOptions: how cached blocks become the KV the query attends to, a plain record of declared fields (its
values checked on their own). Which modes and selections exist is known above it: engine/options.validate_fusion
checks those where options enter (the CLI, the HTTP builder, the eval's mode keys, the engine's entry points)."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.engine.measure.risk import SIGNALS
from ragkv.engine.request.option_spec import check_option, option, option_specs
from ragkv.errors import OptionError


@dataclass(frozen=True)
class FusionOptions:
    """How cached blocks become the KV the query attends to (ragkv/engine/modes: one module per mode)."""
    mode: str = option("reuse", "fusion mode (ragkv/engine/modes)")
    ratio: float = option(0.15, "blend: fraction of block tokens recomputed, in [0, 1] (r_min with auto_ratio)",
                          ge=0.0, le=1.0, key="r", word=("auto", "auto_ratio"))
    auto_ratio: bool = option(False, "blend: the loading controller raises r to what loading hides")
    select: str = option("deviation", "blend: how the recomputed tokens are chosen: deviation (CacheBlend), query "
                         "(ProphetKV: the query's attention over the reused cache), sinks (EPIC: each block's first "
                         "sink_tokens only), recent (the last r of the block tokens, nearest the query)",
                         key="sel")
    signal: str | None = option(None, "auto: the risk signal it escalates on: shift (how far the recompute moved the "
                                "first token's distribution), entropy or margin (1 - top-1 minus top-2 "
                                "probability) of the answer's first token, uncovered (the query's attention left "
                                "on reused tokens) or expected_kl (the reply's fidelity estimate; max_risk is then "
                                "a KL) (default: calibrated, else shift)",
                                choices=SIGNALS, key="sig")
    max_risk: float | None = option(None, "auto: recompute everything when the risk signal exceeds this (default: "
                                    "calibrated by `ragkv calibrate --target auto`, else 0.05)",
                                    ge=0.0, le=100.0, key="risk")
    escalation_budget: float = option(1.0, "auto: escalate at most this share of the engine's last 100 auto answers "
                                      "(1: no limit); an answer over the threshold beyond it keeps its cheap "
                                      "recompute and says so", ge=0.0, le=1.0, key="budget")
    check_layers: tuple[int, ...] = option((1,), "blend: increasing layers where deviation selects tokens "
                                           "(gradual filtering if several)", ge=1, key="check", max_items=64)
    deviation: str = option("v", "blend: deviation on V (CacheBlend's code) or post-RoPE K (LMCache)",
                            choices=("v", "k"), key="dev")
    gradual: bool = option(False, "blend: shrink the selection at each check layer (CacheBlend 4.3)", key="gradual")
    sink_tokens: int = option(0, "blend: always recompute each block's first N tokens", ge=0, le=1 << 20,
                              key="sink")
    check_rows: str = option("selected", "blend: rows the check layer itself recomputes (all: every row, as "
                             "CacheBlend's code)", choices=("selected", "all"), key="rows")
    select_per_block: bool = option(False, "blend: keep the top r of each block, not of all blocks",
                                    key="perblock")
    draft_tokens: int = option(0, "blend select=query: also choose by the attention of a greedy draft of N tokens "
                               "decoded over the reused cache (what the answer reads, not only the question)",
                               ge=0, le=256, key="draft")
    score_layers: tuple[int, ...] = option((), "blend select=query: the layers whose query attention ranks the "
                                           "tokens (QCFuse's critical layers), '+'-joined; empty: every layer "
                                           "(ProphetKV's uniform fusion)", ge=0, key="slayers", max_items=256)
    score_from: float = option(0.0, "blend select=query: only the layers from this share of the model's depth on "
                               "rank the tokens (0.5: the second half; 0: every layer; 1: the last)", ge=0.0, le=1.0,
                               key="sfrom")
    whole_blocks: int = option(0, "blend select=query: the N blocks the query attends to most are recomputed "
                               "whole, inside the ratio's budget (the rest of it by token)", ge=0, le=1 << 16,
                               key="whole")
    ape_temperature: float | None = option(None, "ape: temperature T (default: calibrated or 0.9)", gt=0, le=100,
                                           key="T")
    ape_scale: float | None = option(None, "ape: scale S (default: calibrated or 0.9)", gt=0, le=100, key="S")
    prefix_chunk: int = option(32, "prefix: tokens per hash-chained chunk", ge=1, le=1 << 16, key="chunk")
    positions: str = option("reencoded", "reuse: reencoded (each block re-rotated to its place) or local (each "
                            "block keeps positions 0..n-1, an ablation)", choices=("reencoded", "local"), key="pos")
    conditioning: str = option("none", "reuse, blend, auto: what each block attended to when encoded: none (itself "
                               "alone, Block-Attention) or prefix (the prompt's system prefix first, as APE's blocks: "
                               "no block starts a sequence of its own, and the first block is computed as in full)",
                               choices=("none", "prefix"), key="cond")
    kv_layout: str = option("copied", "reuse, ape, blend: copied (each block's K re-rotated into the request's own "
                            "cache) or shared (blocks read in place from the engine's device-resident block pool, the "
                            "query rotated per block: the same attention, no per-request copy; blend prefills as "
                            "copied, then keeps only the rows it recomputed and decodes over the blocks in place)",
                            choices=("copied", "shared"), key="kv")

    def __post_init__(self):
        # the values alone (bounds, types, fixed choices); what depends on the registered modes and selections is
        # checked where options enter: engine/options.validate_fusion
        for spec in option_specs(FusionOptions)[1:]:
            check_option(spec, getattr(self, spec.name))
        # layer 0 has nothing to compare yet (every deviation is zero there): the first check layer is 1
        if not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers)):
            raise OptionError("check_layers", f"check_layers must be increasing layer numbers >= 1, got "
                              f"{self.check_layers}")
        if self.score_layers and self.score_from:
            raise OptionError("score_from", "score_from and score_layers both choose the scoring layers: set one")
        if list(self.score_layers) != sorted(set(self.score_layers)):
            raise OptionError("score_layers", f"score_layers must be increasing layer numbers, got "
                              f"{self.score_layers}")
