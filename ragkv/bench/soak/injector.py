"""The soak's faults: at seeded random intervals, flipped and truncated disk-tier files, a killed Redis that
comes back empty after a while, and documents added and deleted in both tenants."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

from ragkv.bench.soak.processes import RedisProcess
from ragkv.bench.soak.workload import TENANTS

FAULT_KINDS = ("disk", "redis", "documents")


def corrupt_disk(disk_dir: Path, rng: random.Random, files: int = 3, flips: int = 8) -> dict:
    """Flip `flips` random bytes in each of up to `files` random `*.kv` files; truncate one more."""
    paths = sorted(Path(disk_dir).rglob("*.kv"))
    chosen = rng.sample(paths, min(files + 1, len(paths)))
    out = {"kv_files": len(paths), "flipped": [], "truncated": None}
    for i, p in enumerate(chosen):
        try:
            size = p.stat().st_size
            if size == 0:
                continue
            if i == len(chosen) - 1 and len(chosen) > 1:
                keep = rng.randrange(size)
                with open(p, "r+b") as f:
                    f.truncate(keep)
                out["truncated"] = f"{p.name} {size} -> {keep} bytes"
                continue
            with open(p, "r+b") as f:
                for off in sorted(rng.randrange(size) for _ in range(flips)):
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0xFF]))
            out["flipped"].append(p.name)
        except OSError as e:  # replaced or evicted meanwhile: part of the game
            out.setdefault("skipped", []).append(f"{p.name}: {e}")
    return out


class FaultInjector:
    """The injector thread of a SoakRun (its state: cfg, stop, faults, redis_back, lock; its document calls)."""

    def injector(self, deadline: float, disk_dir: Path, redis: RedisProcess) -> None:
        import httpx

        rng = random.Random(self.cfg.seed)
        kinds: list[str] = []
        with httpx.Client(timeout=self.cfg.request_timeout_s, trust_env=False) as http:
            while True:
                wait = rng.uniform(0.5, 1.5) * self.cfg.fault_interval_s
                if self.stop.wait(min(wait, max(0.0, deadline - time.monotonic()))) or time.monotonic() >= deadline:
                    return
                if not kinds:  # every kind once per round, in a seeded order
                    kinds = rng.sample(FAULT_KINDS, len(FAULT_KINDS))
                kind = kinds.pop()
                event = {"t": self.elapsed(), "kind": kind}
                try:
                    if kind == "disk":
                        event.update(corrupt_disk(disk_dir, rng))
                    elif kind == "redis":
                        if self.redis_back is not None and self.redis_back.is_alive():
                            event["skipped"] = "Redis is still down"
                        else:
                            event.update(before=redis.stats())
                            redis.kill()
                            down = rng.uniform(*self.cfg.redis_down_s)
                            self.redis_back = threading.Thread(target=self._restart_redis, args=(redis, down),
                                                               daemon=True, name="soak-redis-restart")
                            self.redis_back.start()
                            event.update(down_s=round(down, 2))
                    else:
                        event["documents"] = []
                        for t in TENANTS:
                            event["documents"].append(self.add_document(http, t))
                            if rng.random() < 0.5:
                                event["documents"].append(self.delete_document(http, t, rng))
                            self.call(http, "GET", "/v1/documents", t, "documents_list")  # checked for leaks
                except Exception as e:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
                    event["error"] = f"{type(e).__name__}: {e}"
                with self.lock:
                    self.faults.append(event)
                self.progress(f"[soak] {event['t']:.0f} s: fault {kind}: "
                              f"{json.dumps({k: v for k, v in event.items() if k not in ('t', 'kind')})[:240]}")

    def _restart_redis(self, redis: RedisProcess, down: float) -> None:
        self.stop.wait(down)  # the end of the soak brings it back at once
        try:
            redis.start()
        except Exception as e:  # noqa: BLE001 - the end of the soak tries again
            with self.lock:
                self.faults.append({"t": self.elapsed(), "kind": "redis_restart_failed", "error": str(e)})
