"""Per-request options (fusion mode and its parameters, decoding) and per-request statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ragkv.errors import InvalidRequestError

MODES = ("full", "prefix", "reuse", "ape", "blend")


@dataclass(frozen=True)
class FusionOptions:
    """How cached blocks become the KV the query attends to (README "How a request flows")."""
    mode: str = "reuse"
    ratio: float = 0.15                   # blend: fraction of block tokens recomputed (r_min when auto_ratio)
    auto_ratio: bool = False              # blend: the loading controller raises r to what loading hides
    check_layers: tuple[int, ...] = (1,)  # blend: layers where deviation selects tokens (gradual filtering if >1)
    deviation: str = "v"                  # blend: "v" (CacheBlend code) or "k" (post-RoPE K, LMCache)
    gradual: bool = False                 # blend: shrink the selection at each check layer (CacheBlend 4.3)
    sink_tokens: int = 0                  # blend: always recompute each block's first tokens
    check_rows: str = "selected"          # blend: "all" recomputes every row through the check layer itself and
    #                                       writes all its fresh KV there (the original code), "selected" only the kept
    select_per_block: bool = False        # blend: keep the top r of each block, not the top r of all blocks
    ape_temperature: float | None = None  # ape: None -> calibrated value or 0.9
    ape_scale: float | None = None
    prefix_chunk: int = 32                # prefix: tokens per hash-chained chunk
    positions: str = "reencoded"          # reuse: "reencoded" (each block re-rotated to its place in the prompt)
    #                                       or "local" (no re-encoding: each block keeps positions 0..n-1, an ablation)

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidRequestError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise InvalidRequestError(f"blend ratio must be in [0, 1], got {self.ratio}")
        if self.check_rows not in ("selected", "all"):
            raise InvalidRequestError(f"blend check_rows must be 'selected' or 'all', got {self.check_rows!r}")
        if self.deviation not in ("k", "v"):
            raise InvalidRequestError(f"blend deviation must be 'k' or 'v', got {self.deviation!r}")
        # layer 0 has nothing to compare yet (every deviation is zero there): the first check layer is 1
        if not self.check_layers or any(c < 1 for c in self.check_layers) or list(self.check_layers) != sorted(
                set(self.check_layers)):
            raise InvalidRequestError(f"check_layers must be increasing layer numbers >= 1, got {self.check_layers}")
        for name in ("ape_temperature", "ape_scale"):
            val = getattr(self, name)
            if val is not None and val <= 0:
                raise InvalidRequestError(f"{name} must be > 0, got {val}")
        if self.positions not in ("reencoded", "local"):
            raise InvalidRequestError(f"positions must be 'reencoded' or 'local', got {self.positions!r}")
        if self.positions == "local" and self.mode != "reuse":
            raise InvalidRequestError(f"positions='local' applies to mode 'reuse' only, not {self.mode!r}")
        if self.prefix_chunk < 1:
            raise InvalidRequestError("prefix_chunk must be >= 1")


@dataclass(frozen=True)
class GenerationOptions:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0                  # <= 0: off
    min_p: float = 0.0              # 0: off
    presence_penalty: float = 0.0   # OpenAI's, on generated tokens
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # CTRL's, on prompt and generated tokens; 1: off
    logprobs: int | None = None     # None: none; k: each chosen token's log-probability and the k most likely

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise InvalidRequestError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty must be > 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise InvalidRequestError("logprobs must be >= 0")

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


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
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.completion_tokens / self.decode_ms if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_s"] = round(self.tokens_per_s, 2)
        d["recompute_vs_full"] = round(self.recomputed_token_layers / self.full_token_layers, 4) \
            if self.full_token_layers else None
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 3)
        return d
