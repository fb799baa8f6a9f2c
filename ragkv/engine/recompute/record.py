"""What one selective recompute did, as a typed record: which block tokens it recomputed, the work, and the signals
read on the way. Modes, fidelity estimates, the eval and the server read its fields (RequestStats.recompute)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Recompute:
    select: str                     # the selection that chose (recompute/<select>.py)
    block_tokens: int               # the block tokens it chose from (the shared prefix is always exact)
    selected: int = 0               # block tokens recomputed (at the last layer, for CacheBlend's deviation)
    selected_per_block: list[int] = field(default_factory=list)
    # each stage-2 answer's risk signals (engine/measure/risk.py), the cheap one first (it decided escalation);
    # empty where no stage 1 answered first (CacheBlend's deviation)
    risks: list[dict] = field(default_factory=list)
    signal: str | None = None       # the risk signal the model's calibration chose
    check_layers: list[int] = field(default_factory=list)  # CacheBlend: where the deviation was read
    projected_rows: int = 0         # CacheBlend: candidate rows projected at check layers to compare
    draft: list[int] = field(default_factory=list)  # ProphetKV with draft_tokens: the draft whose attention scored
    draft_ms: float = 0.0
    # `auto`'s bound: the threshold and where it came from, the escalation budget and whether it was spent
    max_risk: float | None = None
    calibration: str | None = None
    escalation_budget: float | None = None
    budget_spent: bool = False

    @property
    def exact(self) -> bool:
        """Every block token recomputed: `full`'s answer (invariant 6)."""
        return self.selected == self.block_tokens

    @property
    def share(self) -> float:
        """The share of the block tokens recomputed."""
        return self.selected / self.block_tokens if self.block_tokens else 0.0

    @property
    def risk(self) -> dict | None:
        return self.risks[0] if self.risks else None

    @property
    def escalations(self) -> int:
        return max(0, len(self.risks) - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(exact=self.exact, share=round(self.share, 6), risk=self.risk, escalations=self.escalations)
        return d
