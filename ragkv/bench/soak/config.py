"""What `ragkv bench soak` runs: clients, minutes, faults, the server and its store."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.errors import InvalidRequestError


@dataclass(frozen=True)
class SoakConfig:
    clients: int = 4
    minutes: float = 3.0               # of faults, after the calm period
    seed: int = 0
    fault_interval_s: float = 10.0     # mean seconds between two faults (each drawn uniformly in [0.5x, 1.5x])
    redis_down_s: tuple[float, float] = (2.0, 15.0)  # a killed Redis comes back after this long (uniform); other
                                                     # faults and the traffic go on meanwhile
    calm_s: float = 20.0               # load without faults first: the probes' noise floor under batching
    model: str = "smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    modes: tuple[str, ...] = ("reuse", "blend", "full")
    max_tokens: int = 16
    probe_fraction: float = 0.25       # of client requests that re-send a probe
    retrieval_fraction: float = 0.35   # of the other client requests that retrieve instead of inline documents
    stream_fraction: float = 0.25
    top_k: int = 3
    initial_documents: int = 3         # per tenant, before the clients start
    memory: str = "48MiB"              # small: blocks fall through to the disk and Redis tiers
    disk_size: str = "512MiB"
    redis_maxmemory: str = "256mb"
    request_timeout_s: float = 180.0   # client side, per request
    startup_s: float = 300.0
    max_requests: int = 20_000         # all clients together
    max_server_restarts: int = 2       # after crashes; then the soak ends early
    work_dir: str | None = None        # default: OUTPUT_DIR/soak-work (logs and index kept, KV files removed)

    def __post_init__(self):
        from ragkv.engine.modes import MODES

        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise InvalidRequestError(f"unknown or no mode(s) {bad}; choose from {', '.join(MODES)}")
        if self.clients < 1 or self.max_tokens < 1 or self.max_requests < 1 or self.initial_documents < 1:
            raise InvalidRequestError("--clients, --max-tokens, --max-requests and --initial-documents must be >= 1")
        if not (self.minutes > 0 and self.fault_interval_s > 0 and self.calm_s >= 0 and self.request_timeout_s > 0):
            raise InvalidRequestError("--minutes, --fault-interval and --request-timeout must be > 0, --calm >= 0")
        if not 0 <= self.redis_down_s[0] <= self.redis_down_s[1]:
            raise InvalidRequestError(f"redis_down_s must be (min, max) with 0 <= min <= max, got {self.redis_down_s}")
        for name in ("probe_fraction", "retrieval_fraction", "stream_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise InvalidRequestError(f"--{name.replace('_', '-')} must be in [0, 1]")
