"""The soak's memory watch: the server's RSS sampled over the whole run (Linux /proc VmRSS: what the system sees,
not an allocator's count), and the abuse phase's verdict. RSS may rise over its pre-phase level by at most the
budget (the store's memory tier + the server's KV limit + a slack), and must come back within `rss_return_pct` of
the pre-phase level within `rss_return_s` of the phase's end."""

from __future__ import annotations

import threading
import time

from ragkv.bench.soak.config import SoakConfig
from ragkv.settings import SERVE
from ragkv.store.sizes import parse_size

MiB = 1 << 20


def rss_budget(cfg: SoakConfig) -> dict:
    """What the abuse phase may add to the server's RSS, by part."""
    kv = parse_size(cfg.kv_memory) if cfg.kv_memory else SERVE.kv_memory_bytes
    parts = {"memory_tier": parse_size(cfg.memory), "kv_limit": kv, "slack": parse_size(cfg.rss_slack)}
    return {**parts, "total": sum(parts.values())}


class RssWatch:
    """Samples (seconds since the soak began, phase, RSS bytes) of whichever server runs, every `every_s`."""

    def __init__(self, run, every_s: float = 0.5):
        self.run, self.every_s = run, every_s
        self.samples: list[tuple[float, str, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="soak-rss")

    def now(self) -> int | None:
        server = self.run.sup.server if self.run.sup else None
        return server.rss_bytes() if server is not None else None

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            rss = self.now()
            if rss is not None:
                self.samples.append((self.run.elapsed(), self.run.phase, rss))

    def __enter__(self) -> "RssWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)

    def series(self, points: int = 600) -> list[list]:
        """The samples for soak.json, thinned to about `points` (MiB, one decimal)."""
        step = max(1, len(self.samples) // points)
        return [[t, phase, round(rss / MiB, 1)] for t, phase, rss in self.samples[::step]]


def settle(watch: RssWatch, seconds: float = 3.0) -> int | None:
    """The server's RSS once it has been idle a moment (the lowest of a few samples)."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        rss = watch.now()
        if rss is not None:
            seen.append(rss)
        time.sleep(0.25)
    return min(seen) if seen else None


def wait_return(watch: RssWatch, target: int, limit_s: float) -> float | None:
    """Seconds until RSS is at or under `target`, or None if it is not within `limit_s`."""
    t0 = time.monotonic()
    while True:
        rss = watch.now()
        if rss is not None and rss <= target:
            return round(time.monotonic() - t0, 1)
        if time.monotonic() - t0 > limit_s:
            return None
        time.sleep(0.25)


def rss_verdict(samples: list[tuple[float, str, int]], pre: int, budget: dict, cfg: SoakConfig,
                returned_s: float | None, end_rss: int | None) -> dict:
    """Peak RSS during the phase against pre + budget; the return within rss_return_pct in rss_return_s."""
    during = [rss for _, phase, rss in samples if phase == "abuse"]
    peak = max(during + [pre])
    return {"pre_phase_mib": round(pre / MiB, 1), "peak_mib": round(peak / MiB, 1),
            "allowed_peak_mib": round((pre + budget["total"]) / MiB, 1),
            "budget_mib": {k: round(v / MiB, 1) for k, v in budget.items()},
            "after_phase_mib": None if end_rss is None else round(end_rss / MiB, 1),
            "return_target_mib": round(pre * (1 + cfg.rss_return_pct / 100) / MiB, 1),
            "returned_after_s": returned_s, "return_limit_s": cfg.rss_return_s,
            "over_budget": peak > pre + budget["total"], "not_returned": returned_s is None}
