"""What one request did: tokens reused and recomputed, the work behind them, and where its time went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the recompute record sits above the counters
    from ragkv.engine.recompute.record import Recompute


@dataclass
class RequestStats:
    mode: str
    prompt_tokens: int = 0
    reused_tokens: int = 0         # prompt tokens whose KV came from the cache (at the last layer, for blend)
    recomputed_tokens: int = 0     # prompt tokens whose KV this request computed at the last layer
    # the work behind them: rows through each layer's attention and MLP, summed over layers, and the same for a
    # `full` prefill of this prompt (blend also runs every token through the layers up to its first check layer)
    recomputed_token_layers: int = 0
    full_token_layers: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cached_tokens: int = 0         # prompt tokens of the blocks (or prefix chunks) found in the store: what the
    #                                cache saved this request (reused_tokens also counts blocks it encoded itself)
    ttft_ms: float = 0.0
    encode_ms: float = 0.0         # encoding missed blocks (not reuse: first-time cost)
    fetch_ms: float = 0.0
    rerotate_ms: float = 0.0
    recompute_ms: float = 0.0
    query_prefill_ms: float = 0.0
    completion_tokens: int = 0
    decode_ms: float = 0.0
    # how it was computed and how close to exact it is believed to be (each mode's `fidelity`): exact or not,
    # what was reused and recomputed, and the request's own fidelity signal where the mode has one
    fidelity: dict = field(default_factory=dict)
    recompute: "Recompute | None" = None  # what a selective recompute chose and read (blend, auto)
    extra: dict = field(default_factory=dict)  # what a mode or the store adds that no field names

    def absorb_exact_prefix(self, part: "RequestStats", num_layers: int) -> None:
        """Fold in the exact prefix a fused prefill was handed (`part`: its own prefill's figures): the fused path
        counted it as reused context, but its prefilled rows were computed, each through every layer."""
        self.reused_tokens -= part.recomputed_tokens
        self.recomputed_tokens += part.recomputed_tokens
        self.recomputed_token_layers += part.recomputed_tokens * num_layers
        self.cache_hits += part.cache_hits
        self.cache_misses += part.cache_misses
        self.cached_tokens += part.cached_tokens
        self.fetch_ms += part.fetch_ms
        self.query_prefill_ms += part.query_prefill_ms

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.completion_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["recompute"] = self.recompute.to_dict() if self.recompute is not None else None
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        d["recompute_vs_full"] = round(self.recomputed_token_layers / self.full_token_layers, 4) \
            if self.full_token_layers else None
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 3)
        return d
