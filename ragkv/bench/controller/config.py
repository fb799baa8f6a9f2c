"""What `ragkv bench controller` runs: its settings, each timed configuration, and the spread placement."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragkv.engine.options import FusionOptions
from ragkv.errors import InvalidRequestError

NAMESPACE = "bench-controller"
TARGET = 1.10            # controller TTFT <= 1.10 x the best fixed choice's at equal or better KL
KL_REL_TOL = 0.01        # a fixed choice's KL within 1% of the controller's counts as equal
TIERS = ("memory", "disk", "redis", "throttled")
# the spread placement: block i lives in SPREAD[i % 6] (the throttled tier as the big slow tier holding half of
# them alone); blocks on disk are also in the throttled tier (two holders: the controller must read them from disk)
SPREAD = ("memory", "throttled", "disk", "throttled", "redis", "throttled")
ALSO = {"disk": "throttled"}


@dataclass(frozen=True)
class ControllerBenchConfig:
    model: str = "smollm2"
    dtype: str = "auto"  # as the CLI's --dtype
    device: str = "auto"
    context: int = 3072                              # context tokens of the request (prefix + blocks)
    query_tokens: int = 50
    ratios: tuple[float, ...] = (0.05, 0.15, 0.3, 0.5)  # the fixed choices' r
    r_min: float = 0.15                               # the controller's r_quality (auto_ratio's floor)
    repeats: int = 3                                  # round-robin rounds timed (after one untimed)
    throttle: str = "latency"                         # latency: a fixed delay per block and layer read;
    #                                                   bandwidth: nbytes / bytes_per_s per block and layer read
    throttle_ms: float | None = None                  # latency: the delay; None: auto (throttle_factor)
    throttle_mbps: float | None = None                # bandwidth: MB/s; None: auto (throttle_factor)
    throttle_factor: float = 2.0                      # auto: in the spread placement, the throttled blocks take
    #                                                   this x the recompute at r_min per layer to load
    target: float = TARGET
    refresh_profile: bool = True                      # re-measure the recompute cost under this run's threads
    fusion: FusionOptions = FusionOptions(mode="blend")  # blend's other parameters (check layers, deviation, ...)
    redis: str | None = None                          # a Redis URL; None: a private redis-server for the run
    disk_dir: str | None = None                       # None: temporary directories under $RAGKV_CACHE_DIR/bench

    def __post_init__(self):
        if self.throttle not in ("latency", "bandwidth"):
            raise InvalidRequestError(f"throttle {self.throttle!r}: choose latency or bandwidth")
        if not self.ratios or any(not 0 <= r <= 1 for r in self.ratios) or not 0 <= self.r_min <= 1:
            raise InvalidRequestError("ratios and r_min must be in [0, 1]")
        if self.repeats < 1 or self.context < 64 or self.throttle_factor <= 0:
            raise InvalidRequestError("repeats must be >= 1, context >= 64 and throttle_factor > 0")
        if (self.throttle_ms is not None and self.throttle_ms < 0) or (
                self.throttle_mbps is not None and self.throttle_mbps <= 0):
            raise InvalidRequestError("throttle_ms must be >= 0 and throttle_mbps > 0")


@dataclass
class Config:
    name: str                    # row label
    kind: str                    # full | controller | fixed | spread
    tier: str                    # memory | disk | redis | throttled | spread
    fusion: FusionOptions
    engine: object
    store: object
    runs: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    ratio: float | None = None   # r actually used (the controller's plan for the controller)
    plan: dict | None = None
    reads: dict = field(default_factory=dict)  # tier -> blocks opened there per request (hit counters)
    kl: float | None = None
    top1: bool | None = None
    logits: object = None


def spread_placement(n_blocks: int, tiers=TIERS) -> list[tuple[str, ...]]:
    """The tiers holding each block in the controller's placement (only among `tiers`, e.g. without Redis)."""
    order = [t for t in SPREAD if t in tiers]
    out = []
    for i in range(n_blocks):
        home = order[i % len(order)]
        out.append((home, ALSO[home]) if home in ALSO and ALSO[home] in tiers else (home,))
    return out
