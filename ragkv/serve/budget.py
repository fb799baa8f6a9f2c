"""What a request may cost before it is queued (issue: one `ape` request over 32K tokens held the only model worker
for minutes). Cost is the engine's unit of work, token-layers: the most rows the request's prefill can run through a
layer, summed over layers, on a cold cache (FusionMode.worst_token_layers: every block encoded, blend's second
stage, auto's escalation, a draft). A request above the per-request limit is refused with a 400 that states its
cost and the limit; a tenant whose admitted requests over the last minute would exceed its budget gets a 429 with
the seconds until enough of that minute has passed."""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict, deque

from ragkv.serve.schemas import FieldError

WINDOW_S = 60.0


class TenantOverBudget(Exception):
    """A 429: the tenant's admitted cost over the window would exceed its budget; `retry_after_s` until it fits."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantBudget:
    """Token-layers admitted per tenant over a sliding window; thread-safe (handlers admit on worker threads)."""

    def __init__(self, per_window: int | None, window_s: float = WINDOW_S, clock=time.monotonic):
        self.per_window, self.window_s, self.clock = per_window, window_s, clock
        self.spent: dict[str, deque] = defaultdict(deque)  # tenant -> (time, cost) admitted within the window
        self._lock = threading.Lock()

    def charge(self, tenant: str, cost: int) -> None:
        """Admit `cost` for `tenant` now, or raise TenantOverBudget (nothing is charged then)."""
        if self.per_window is None:
            return
        with self._lock:
            now, spent = self.clock(), self.spent[tenant]
            while spent and spent[0][0] <= now - self.window_s:
                spent.popleft()
            used = sum(c for _, c in spent)
            if used + cost <= self.per_window or not spent:  # alone it always fits (the per-request limit is apart)
                spent.append((now, cost))
                return
            # the earliest time enough of the window's cost has expired for this request to fit
            need, freed = used + cost - self.per_window, 0
            for t, c in spent:
                freed += c
                if freed >= need:
                    wait = t + self.window_s - now
                    break
            raise TenantOverBudget(
                f"tenant {tenant!r} has used {used} of its {self.per_window} token-layers per "
                f"{self.window_s:.0f} s (--tenant-budget) and this request needs {cost}; retry in "
                f"{math.ceil(wait)} s", max(1, math.ceil(wait)))


class TenantInFlight:
    """Token-layers of each tenant's admitted, unfinished requests, against a limit (None: none); thread-safe. What
    one tenant may have queued or running at once: beyond it a 429, not a wait that ends in a timeout."""

    RETRY_AFTER_S = 10

    def __init__(self, limit: int | None):
        self.limit = limit
        self.cost: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def admit(self, tenant: str, cost: int):
        """Count `cost` for `tenant` until the returned release() is called (once), or raise TenantOverBudget.
        A tenant with nothing in flight is always admitted (the per-request limit is apart)."""
        with self._lock:
            used = self.cost[tenant]
            if self.limit is not None and used and used + cost > self.limit:
                raise TenantOverBudget(
                    f"tenant {tenant!r} has requests costing {used} token-layers queued or running, and this one "
                    f"needs {cost}: at most {self.limit} may be in flight at once (--tenant-in-flight-cost); retry "
                    "when one has finished", self.RETRY_AFTER_S)
            self.cost[tenant] = used + cost
        done = threading.Event()

        def release() -> None:
            if done.is_set():
                return
            done.set()
            with self._lock:
                self.cost[tenant] -= cost
                if self.cost[tenant] <= 0:
                    del self.cost[tenant]
        return release


def check_cost(cost: int, limit: int | None, tokens: int, layers: int, mode: str, field: str) -> None:
    """Refuse a request whose prefill may cost more than `limit` token-layers (None: no limit)."""
    if limit is not None and cost > limit:
        raise FieldError(field, f"this request's prefill may cost {cost} token-layers ({tokens} prompt tokens through "
                        f"{layers} layers in mode {mode!r}, cold cache); one request may cost at most {limit} "
                        f"(--max-request-cost): send fewer or shorter documents, or a cheaper mode", "request_too_costly")
