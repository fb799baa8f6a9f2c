"""The server's Prometheus metrics through prometheus-client, in a registry of its own: several servers may live in
one process (tests do that), and each must count only its own requests."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PER_TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Counters and histograms fed by the request handlers and the scheduler's finished jobs; gauges read from the
    scheduler and the store when scraped (`watch`)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)   # process_cpu_seconds_total, process_resident_memory_bytes, open fds, ...
        PlatformCollector(registry=r)  # python_info
        GCCollector(registry=r)        # python_gc_*
        self.requests = Counter("ragkv_requests", "HTTP requests by endpoint and status.", ["endpoint", "status"],
                                registry=r)
        self.ttft = Histogram("ragkv_ttft_seconds", "Time to first token (the prefill, as the engine measures it), "
                              "by fusion mode.", ["mode"], buckets=TTFT_BUCKETS_S, registry=r)
        self.latency = Histogram("ragkv_request_latency_seconds", "Time to the last token (prefill and decode), "
                                 "by fusion mode.", ["mode"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.per_token = Histogram("ragkv_time_per_output_token_seconds", "Decode time per generated token.",
                                   buckets=PER_TOKEN_BUCKETS_S, registry=r)
        # hits and misses, not their ratio: PromQL computes the ratio over any window from the two rates
        self.hits = Counter("ragkv_block_cache_hits", "Blocks whose KV came from the store.", registry=r)
        self.misses = Counter("ragkv_block_cache_misses", "Blocks whose KV had to be computed.", registry=r)
        self.prompt = Counter("ragkv_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.reused = Counter("ragkv_reused_tokens", "Prompt tokens whose KV came from the cache.", registry=r)
        self.recomputed = Counter("ragkv_recomputed_tokens", "Prompt tokens whose KV a request computed.",
                                  registry=r)
        self.completion = Counter("ragkv_completion_tokens", "Generated tokens.", registry=r)
        self.uncached = Counter("ragkv_uncached_blocks", "Blocks computed and used but not kept by the store.",
                                registry=r)
        self.store_faults = Counter("ragkv_store_fault_requests",
                                    "Requests answered without the cache after a store fault.", registry=r)
        self.escalations = Counter("ragkv_quality_escalations", "Recomputes a quality-bounded answer added because "
                                   "its fidelity signal exceeded the budget (mode auto).", ["mode"], registry=r)
        self.history_turns = Counter("ragkv_history_turns", "Earlier chat turns of history requests, by how their KV "
                                     "was had: exact (the prefix cache or an exact prefill) or fused (stored "
                                     "turns behind an edit, at new offsets).", ["kind"], registry=r)
        self.live = LiveStats()
        r.register(self.live)

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_stats(self, stats, completion_tokens: int | None = None) -> None:
        """One finished generation (the scheduler's worker thread calls this; prometheus-client locks): `stats`
        of its first choice, `completion_tokens` of all its choices when it has several (n > 1)."""
        self.ttft.labels(stats.mode).observe(stats.ttft_ms / 1000)
        self.latency.labels(stats.mode).observe((stats.ttft_ms + stats.decode_ms) / 1000)
        if stats.completion_tokens:
            self.per_token.observe(stats.decode_ms / 1000 / stats.completion_tokens)
        self.hits.inc(stats.cache_hits)
        self.misses.inc(stats.cache_misses)
        self.prompt.inc(stats.prompt_tokens)
        self.reused.inc(stats.reused_tokens)
        self.recomputed.inc(stats.recomputed_tokens)
        self.completion.inc(stats.completion_tokens if completion_tokens is None else completion_tokens)
        self.uncached.inc(stats.extra.get("uncached_blocks", 0))
        self.escalations.labels(stats.mode).inc(stats.fidelity.get("escalations", 0))
        history = stats.extra.get("history")
        if history:  # engine/blocks/history.py
            self.history_turns.labels("exact").inc(history.get("exact_turns", 0))
            self.history_turns.labels("fused").inc(history.get("fused_turns", 0))
        if "store_fault" in stats.extra:
            self.store_faults.inc()

    def watch(self, scheduler_stats: Callable[[], dict], store_stats: Callable[[], dict],
              pool_stats: Callable[[], dict] = dict) -> None:
        """Where the scheduler's, the store's and the block pool's figures are read at each scrape."""
        self.live.scheduler_stats, self.live.store_stats = scheduler_stats, store_stats
        self.live.pool_stats = pool_stats

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition and its content type: OpenMetrics when the scraper asks for it, else Prometheus text."""
        encode, content_type = choose_encoder(accept or "")
        return encode(self.registry), content_type


class LiveStats:
    """A collector of figures other objects own: queue and batch, decode steps, bytes and faults per store tier."""

    def __init__(self):
        self.scheduler_stats: Callable[[], dict] = dict
        self.store_stats: Callable[[], dict] = dict
        self.pool_stats: Callable[[], dict] = dict

    def collect(self):
        sched, store = self.scheduler_stats(), self.store_stats()
        if sched:
            yield GaugeMetricFamily("ragkv_queue_depth", "Requests waiting for the model.", sched["queue_depth"])
            yield GaugeMetricFamily("ragkv_batch_size", "Generations decoding together now.", sched["batch_size"])
            yield CounterMetricFamily("ragkv_decode_steps", "Batched decode steps run.", sched["decode_steps"])
            yield GaugeMetricFamily("ragkv_prefill_stall_seconds_max",
                                    "Longest pause a prefill imposed on running decodes.",
                                    sched["prefill_stall_ms_max"] / 1000)
            if "kv_bytes_reserved" in sched:  # the KV memory budget (engine/kv/kvbudget.py)
                yield GaugeMetricFamily("ragkv_kv_bytes_reserved", "KV bytes the admitted generations reserved "
                                        "(prompt + n x max_tokens rows each).", sched["kv_bytes_reserved"])
                yield GaugeMetricFamily("ragkv_kv_bytes_in_use", "KV bytes the live caches hold now.",
                                        sched["kv_bytes_in_use"])
                if sched.get("kv_bytes_limit") is not None:
                    yield GaugeMetricFamily("ragkv_kv_bytes_limit", "KV memory limit of the server (--kv-memory).",
                                            sched["kv_bytes_limit"])
        held = GaugeMetricFamily("ragkv_store_bytes", "Bytes held per KV store tier (0 while it is down).",
                                 labels=["tier"])
        for tier, n in tier_bytes(store).items():
            held.add_metric([tier], n)
        yield held
        up = tier_up(store)
        if up:
            family = GaugeMetricFamily("ragkv_store_tier_up", "1 while a KV store tier serves, 0 while it is "
                                       "skipped after a fault (or cannot be reached).", labels=["tier"])
            for tier, ok in up.items():
                family.add_metric([tier], 1 if ok else 0)
            yield family
        pool = self.pool_stats()
        if pool:  # blocks resident for kv_layout=shared (engine/blocks/pool.py), bounded apart from --kv-memory
            yield GaugeMetricFamily("ragkv_block_pool_bytes", "Bytes of blocks the pool keeps for in-place reads "
                                    "(kv_layout=shared).", pool["bytes"])
            yield GaugeMetricFamily("ragkv_block_pool_limit_bytes", "The pool's bound (--block-pool).",
                                    pool["max_bytes"])
            yield CounterMetricFamily("ragkv_block_pool_hits", "Blocks a request found in the pool.", pool["hits"])
        faults = store.get("faults") or {}
        if faults:
            family = CounterMetricFamily("ragkv_store_tier_faults",
                                         "Calls to a store tier that failed (then skipped with backoff).",
                                         labels=["tier"])
            for tier, n in sorted(faults.items()):
                family.add_metric([tier], n)
            yield family


def _tiers(stats: dict) -> list[dict]:
    tiers = stats.get("tiers") if isinstance(stats.get("tiers"), list) else [stats] if stats else []
    return [t for t in tiers if isinstance(t, dict)]


def tier_bytes(stats: dict) -> dict[str, int]:
    """Bytes held per tier of a store's stats (a tiered store's `tiers`, or one tier's own), each tier named by its
    `describe()` as the fault counters are. A tier that could not count (Redis down) reads 0: its series stays."""
    return {str(t.get("describe") or t.get("tier") or i):
            int(t["bytes"]) if isinstance(t.get("bytes"), (int, float)) else 0
            for i, t in enumerate(_tiers(stats))}


def tier_up(stats: dict) -> dict[str, bool]:
    """Whether each tier is in service (a tiered store's `up` per tier; tiers that do not say are left out)."""
    return {str(t.get("describe") or t.get("tier") or i): bool(t["up"])
            for i, t in enumerate(_tiers(stats)) if "up" in t}
