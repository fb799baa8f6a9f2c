"""A few Prometheus metrics in the text exposition format (no client library needed for this handful)."""

from __future__ import annotations

import threading
from collections import defaultdict

TTFT_BUCKETS_MS = (25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = defaultdict(int)  # (endpoint, status) -> count
        self.ttft_counts = [0] * (len(TTFT_BUCKETS_MS) + 1)
        self.ttft_sum = 0.0
        self.hits = self.misses = 0
        self.reused = self.recomputed = self.completion = 0
        self.uncached = self.store_faults = 0  # blocks computed but not kept; requests recomputed after a fault

    def observe_request(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def observe_stats(self, stats) -> None:
        with self.lock:
            i = next((i for i, b in enumerate(TTFT_BUCKETS_MS) if stats.ttft_ms <= b), len(TTFT_BUCKETS_MS))
            self.ttft_counts[i] += 1
            self.ttft_sum += stats.ttft_ms / 1000
            self.hits += stats.cache_hits
            self.misses += stats.cache_misses
            self.reused += stats.reused_tokens
            self.recomputed += stats.recomputed_tokens
            self.completion += stats.completion_tokens
            self.uncached += stats.extra.get("uncached_blocks", 0)
            self.store_faults += "store_fault" in stats.extra

    def render(self, store_stats: dict, sched: dict) -> str:
        out = ["# HELP ragkv_requests_total HTTP requests by endpoint and status.", "# TYPE ragkv_requests_total counter"]
        with self.lock:
            for (ep, status), n in sorted(self.requests.items()):
                out.append(f'ragkv_requests_total{{endpoint="{ep}",status="{status}"}} {n}')
            out += ["# HELP ragkv_ttft_seconds Time to first token.", "# TYPE ragkv_ttft_seconds histogram"]
            cum = 0
            for b, n in zip(TTFT_BUCKETS_MS, self.ttft_counts):
                cum += n
                out.append(f'ragkv_ttft_seconds_bucket{{le="{b / 1000}"}} {cum}')
            cum += self.ttft_counts[-1]
            out += [f'ragkv_ttft_seconds_bucket{{le="+Inf"}} {cum}', f"ragkv_ttft_seconds_sum {self.ttft_sum:.6f}",
                    f"ragkv_ttft_seconds_count {cum}"]
            total = self.hits + self.misses
            out += ["# TYPE ragkv_block_cache_hits_total counter", f"ragkv_block_cache_hits_total {self.hits}",
                    "# TYPE ragkv_block_cache_misses_total counter", f"ragkv_block_cache_misses_total {self.misses}",
                    "# HELP ragkv_block_cache_hit_ratio Block cache hits over lookups since start.",
                    "# TYPE ragkv_block_cache_hit_ratio gauge",
                    f"ragkv_block_cache_hit_ratio {self.hits / total if total else 0:.6f}",
                    "# TYPE ragkv_reused_tokens_total counter", f"ragkv_reused_tokens_total {self.reused}",
                    "# TYPE ragkv_recomputed_tokens_total counter", f"ragkv_recomputed_tokens_total {self.recomputed}",
                    "# TYPE ragkv_completion_tokens_total counter", f"ragkv_completion_tokens_total {self.completion}",
                    "# HELP ragkv_uncached_blocks_total Blocks computed and used but not kept by the store.",
                    "# TYPE ragkv_uncached_blocks_total counter", f"ragkv_uncached_blocks_total {self.uncached}",
                    "# HELP ragkv_store_fault_requests_total Requests answered without the cache after a store fault.",
                    "# TYPE ragkv_store_fault_requests_total counter",
                    f"ragkv_store_fault_requests_total {self.store_faults}"]
        out += ["# TYPE ragkv_queue_depth gauge", f"ragkv_queue_depth {sched['queue_depth']}",
                "# HELP ragkv_batch_size Generations decoding together now.", "# TYPE ragkv_batch_size gauge",
                f"ragkv_batch_size {sched['batch_size']}",
                "# TYPE ragkv_decode_steps_total counter", f"ragkv_decode_steps_total {sched['decode_steps']}",
                "# HELP ragkv_prefill_stall_seconds_max Longest pause a prefill imposed on running decodes.",
                "# TYPE ragkv_prefill_stall_seconds_max gauge",
                f"ragkv_prefill_stall_seconds_max {sched['prefill_stall_ms_max'] / 1000:.6f}",
                "# HELP ragkv_store_bytes Bytes held per KV store tier.", "# TYPE ragkv_store_bytes gauge"]
        for tier, val in flatten_store_bytes(store_stats).items():
            out.append(f'ragkv_store_bytes{{tier="{tier}"}} {val}')
        faults = store_stats.get("faults", {})
        if faults:
            out += ["# HELP ragkv_store_tier_faults_total Calls to a store tier that failed (then skipped with "
                    "backoff).", "# TYPE ragkv_store_tier_faults_total counter"]
            out += [f'ragkv_store_tier_faults_total{{tier="{t}"}} {n}' for t, n in sorted(faults.items())]
        return "\n".join(out) + "\n"


def flatten_store_bytes(stats: dict, prefix: str = "") -> dict[str, int]:
    """Find `bytes` figures in a (possibly nested) store stats dict, keyed by the tier path."""
    out = {}
    for k, v in stats.items():
        if k == "bytes" and isinstance(v, (int, float)):
            out[prefix or "store"] = int(v)
        elif isinstance(v, dict) and k not in ("namespaces",):
            out.update(flatten_store_bytes(v, f"{prefix}.{k}" if prefix else str(k)))
    return out
