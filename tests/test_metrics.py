"""`/metrics` through prometheus-client: a registry per server, process metrics, hits and misses as counters, and a
real `ragkv serve` whose counters move with the requests it answers."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny import make_tiny_served

from ragkv.bench.serve import ServerProcess
from ragkv.bench.soak.checks import parse_metrics
from ragkv.engine.measure.stats import RequestStats
from ragkv.serve.metrics import Metrics

DOCS = ["Lintwick Tower was built in 1893 from red sandstone by Ada Morrow.",
        "The Alpaca Farm in Lintwick keeps forty-two alpacas named after rivers."]
SCHED = {"queue_depth": 3, "batch_size": 2, "decode_steps": 40, "prefill_stall_ms_max": 12.5}
STORE = {"tiers": [{"tier": "memory", "describe": "memory:1MiB", "bytes": 1024, "namespaces": {"x": {"bytes": 1}},
                    "up": True},
                   {"tier": "redis", "describe": "redis://127.0.0.1:1/0", "up": False}],  # down: no bytes counted
         "faults": {"redis://127.0.0.1:1/0": 5, "memory:1MiB": 0}}


def samples(text: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample in a Prometheus exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def rendered(m: Metrics) -> dict:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    return samples(body.decode())


def test_each_server_counts_in_a_registry_of_its_own():
    a, b = Metrics(), Metrics()  # two servers in one process: no duplicate-registration error, no shared counts
    a.observe_request("chat", 200)
    a.observe_stats(RequestStats(mode="reuse", cache_hits=2, cache_misses=1, reused_tokens=30, ttft_ms=40.0,
                                 completion_tokens=4, decode_ms=80.0))
    sa, sb = rendered(a), rendered(b)
    assert value(sa, "ragkv_requests_total", endpoint="chat", status="200") == 1
    assert value(sb, "ragkv_requests_total", endpoint="chat", status="200") == 0
    assert value(sa, "ragkv_block_cache_hits_total") == 2 and value(sa, "ragkv_block_cache_misses_total") == 1
    assert value(sb, "ragkv_block_cache_hits_total") == 0
    assert value(sa, "ragkv_ttft_seconds_count", mode="reuse") == 1
    assert value(sa, "ragkv_ttft_seconds_bucket", mode="reuse", le="0.05") == 1  # 40 ms
    assert value(sa, "ragkv_ttft_seconds_bucket", mode="reuse", le="0.025") == 0
    assert value(sa, "ragkv_request_latency_seconds_sum", mode="reuse") == pytest.approx(0.12)
    assert value(sa, "ragkv_time_per_output_token_seconds_sum") == pytest.approx(0.02)
    assert value(sa, "ragkv_completion_tokens_total") == 4
    # n = 3 choices of one prompt: one prefill (hits, prompt tokens) but every choice's tokens
    b.observe_stats(RequestStats(mode="reuse", cache_hits=2, prompt_tokens=50, completion_tokens=4), 11)
    sb = rendered(b)
    assert value(sb, "ragkv_completion_tokens_total") == 11 and value(sb, "ragkv_prompt_tokens_total") == 50
    assert value(sb, "ragkv_block_cache_hits_total") == 2
    for found in (sa, sb):  # process and platform collectors in each registry
        assert value(found, "process_resident_memory_bytes") > 0
        assert value(found, "process_cpu_seconds_total") > 0
        assert any(name == "python_info" for name, _ in found)


def test_scheduler_and_store_figures_are_read_at_scrape_time():
    m = Metrics()
    sched = dict(SCHED)
    m.watch(lambda: sched, lambda: STORE)
    found = rendered(m)
    assert value(found, "ragkv_queue_depth") == 3 and value(found, "ragkv_batch_size") == 2
    assert value(found, "ragkv_decode_steps_total") == 40
    assert value(found, "ragkv_prefill_stall_seconds_max") == 0.0125
    # a tier that could not count (down) reads 0 bytes: its series stays, beside a tier_up of 0
    assert sorted((dict(labels)["tier"], v) for (name, labels), v in found.items() if name == "ragkv_store_bytes") == \
        [("memory:1MiB", 1024), ("redis://127.0.0.1:1/0", 0)]
    assert value(found, "ragkv_store_tier_up", tier="memory:1MiB") == 1
    assert value(found, "ragkv_store_tier_up", tier="redis://127.0.0.1:1/0") == 0
    assert value(found, "ragkv_store_tier_faults_total", tier="redis://127.0.0.1:1/0") == 5
    sched["queue_depth"] = 7  # a later scrape reads the new figure
    assert value(rendered(m), "ragkv_queue_depth") == 7
    # the soak benchmark's reader understands the exposition
    parsed = parse_metrics(m.render()[0].decode())
    assert parsed["tier_faults"] == {"redis://127.0.0.1:1/0": 5, "memory:1MiB": 0}
    assert parsed["fault_requests"] == 0 and parsed["uncached_blocks"] == 0


def test_openmetrics_when_the_scraper_asks_for_it():
    m = Metrics()
    body, content_type = m.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.decode().rstrip().endswith("# EOF")


def test_a_real_server_counts_hits_after_a_repeated_request(tmp_path):
    """A real server (a tiny random model: the counters are under test) and Prometheus's text format."""
    body = {"messages": [{"role": "user", "content": "Who built Lintwick Tower?"}], "max_tokens": 2,
            "ragkv": {"mode": "reuse", "documents": DOCS}}
    with ServerProcess(model=str(make_tiny_served(tmp_path)), dtype="float32", device="cpu", store="memory:256MiB",
                       startup_s=180,
                       cache_dir=tmp_path, extra=("--block-pool", "64MiB")) as s:
        def scrape() -> dict:
            r = httpx.get(s.url + "/metrics", timeout=30)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            return samples(r.text)

        before = scrape()
        assert value(before, "process_resident_memory_bytes") > 0
        assert ("ragkv_queue_depth", frozenset()) in before and ("ragkv_batch_size", frozenset()) in before
        first = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=600)
        assert first.status_code == 200, first.text
        after_first = scrape()
        second = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=600)
        assert second.status_code == 200, second.text
        after_second = scrape()
        bad = httpx.post(s.url + "/v1/chat/completions", json={"messages": []}, timeout=30)
        assert bad.status_code == 400
        shared = httpx.post(s.url + "/v1/chat/completions", timeout=600,
                            json={**body, "ragkv": {**body["ragkv"], "kv_layout": "shared"}})
        assert shared.status_code == 200, shared.text
        end = scrape()
        blends = [httpx.post(s.url + "/v1/chat/completions", timeout=600,
                             json={**body, "max_tokens": 6, "ragkv": {**body["ragkv"], "mode": "blend", "kv_layout": kv}})
                  for kv in ("copied", "shared")]
    # blocks read in place from the pool: the same greedy answer (fp32), the pool's bytes on /metrics
    assert shared.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    assert shared.json()["usage"]["fidelity"]["kv_layout"] == "shared"
    # blend's recomputed rows kept over the pooled blocks: its answer as over its copy
    assert [b.status_code for b in blends] == [200, 200], blends[1].text
    assert blends[1].json()["choices"][0]["message"] == blends[0].json()["choices"][0]["message"]
    assert value(before, "ragkv_block_pool_bytes") == 0 and value(end, "ragkv_block_pool_bytes") > 0
    assert value(end, "ragkv_block_pool_limit_bytes") == 64 << 20  # --block-pool

    hits = [value(x, "ragkv_block_cache_hits_total") for x in (before, after_first, after_second)]
    misses = [value(x, "ragkv_block_cache_misses_total") for x in (before, after_first, after_second)]
    # the first request computes both documents' blocks; the same request again finds them
    assert misses[1] - misses[0] >= len(DOCS) and misses[2] == misses[1]
    assert hits[2] - hits[1] >= len(DOCS)
    assert value(after_second, "ragkv_reused_tokens_total") > value(after_first, "ragkv_reused_tokens_total")
    assert value(after_second, "ragkv_ttft_seconds_count", mode="reuse") == 2
    assert value(after_second, "ragkv_completion_tokens_total") == \
        first.json()["usage"]["completion_tokens"] + second.json()["usage"]["completion_tokens"]
    assert value(end, "ragkv_requests_total", endpoint="chat", status="200") == 3
    assert value(end, "ragkv_requests_total", endpoint="chat", status="400") == 1
    assert value(end, "ragkv_decode_steps_total") > 0
    assert value(before, "ragkv_store_bytes", tier="memory:256MiB") == 0
    assert value(end, "ragkv_store_bytes", tier="memory:256MiB") > 0  # the two documents' blocks
