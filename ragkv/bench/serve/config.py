"""What `ragkv bench serve` runs: modes, concurrency levels, requests per cell, the pool, the peer."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import InvalidRequestError

PEERS = ("llama-cpp", "llama-server", "vllm-cpu", "openvino")


@dataclass(frozen=True)
class ServeBenchConfig:
    modes: tuple[str, ...] = ("full", "prefix", "reuse", "blend")
    concurrency: tuple[int, ...] = (1, 4, 16)
    requests: int = 32                # per (mode, concurrency) cell
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
        if not 1 <= self.passages_per_request <= self.pool_size:
            raise InvalidRequestError(f"--passages-per-request must be in [1, --pool-size={self.pool_size}]")


@dataclass(frozen=True)
class BenchRequest:
    question: str
    documents: tuple[dict, ...]
