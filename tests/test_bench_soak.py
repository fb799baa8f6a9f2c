"""The pure parts of `ragkv bench soak` (no server): workload, ledger, probe comparison, counts, report."""

import random

import pytest

from ragkv.bench.soak import SoakConfig
from ragkv.bench.soak.checks import DocLedger, compare_probes, leaked_marker, parse_metrics, summarize_requests
from ragkv.bench.soak.injector import corrupt_disk
from ragkv.bench.soak.report import render_markdown
from ragkv.bench.soak.workload import MARKERS, TENANTS, document_id, make_passage, make_probes
from ragkv.errors import InvalidRequestError, RagkvError


def test_workload_is_seeded_and_each_tenant_holds_only_its_marker():
    assert make_probes(3, ("reuse", "full")) == make_probes(3, ("reuse", "full"))
    assert make_probes(3, ("reuse",)) != make_probes(4, ("reuse",))
    probes = make_probes(0, ("reuse", "blend", "full"))
    assert len(probes) == 12 and len({p["id"] for p in probes}) == 12
    for p in probes:
        text = " ".join(d["text"] + d["title"] for d in p["documents"]) + p["question"]
        assert leaked_marker(p["tenant"], text) is None
        assert MARKERS[p["tenant"]] in text
    for t in TENANTS:
        doc, questions = make_passage(0, t, 5, "library")
        assert MARKERS[t] in doc["text"] and MARKERS[t] in doc["title"] and questions
        assert MARKERS[t].lower() in document_id(t, 5)
    assert leaked_marker("tenantB", f"... {MARKERS['tenantA'].lower()}-doc-001 ...") == MARKERS["tenantA"]


def test_ledger_counts_acknowledged_documents_missing_and_deleted_ones_back():
    led = DocLedger()
    led.added("tenantA", "a1", 200)
    led.added("tenantA", "a2", 200)
    led.added("tenantA", "a3", 500)      # uncertain: not counted either way
    led.added("tenantB", "b1", 200)
    led.added("tenantB", "b2", 400)      # refused: not expected
    led.deleted("tenantA", "a2", 200)
    led.deleted("tenantB", "b1", "timeout")  # uncertain
    assert led.live("tenantA") == ["a1"] and led.live("tenantB") == []
    out = led.check({"tenantA": {"a2", "a3"}, "tenantB": set()})
    assert out["lost"] == ["tenantA/a1"] and out["resurrected"] == ["tenantA/a2"]
    assert out["ledger"] == {"acked": 1, "deleted": 1, "uncertain": 2, "failed": 1}
    led.deleted("tenantA", "a1", 404)    # stays acknowledged: lost unless listed
    assert led.notes and led.check({"tenantA": {"a1"}, "tenantB": set()})["lost"] == []


def test_probe_comparison_per_phase():
    base = {"p1": "Paris", "p2": "1893", "p3": None}
    answers = [{"probe": "p1", "phase": "faults", "text": "Paris"},
               {"probe": "p2", "phase": "faults", "text": "1894", "store_fault": True},
               {"probe": "p2", "phase": "after", "text": "1893"},
               {"probe": "p3", "phase": "after", "text": "x"},        # no baseline answer: left out
               {"probe": "p1", "phase": "after", "text": None}]        # failed request: left out
    out = compare_probes(base, answers)
    assert out["phases"] == {"faults": {"sent": 2, "differ": 1}, "after": {"sent": 1, "differ": 0}}
    assert out["examples"][0]["got"] == "1894" and out["examples"][0]["store_fault"]


def test_metrics_parsing():
    text = """# TYPE ragkv_requests_total counter
ragkv_requests_total{endpoint="chat",status="200"} 10
ragkv_requests_total{endpoint="documents",status="200"} 2
ragkv_requests_total{endpoint="chat",status="500"} 1
ragkv_uncached_blocks_total 3
ragkv_store_fault_requests_total 0
ragkv_store_tier_faults_total{tier="redis://127.0.0.1:1234/0"} 7
ragkv_store_tier_faults_total{tier="disk:/x"} 0
"""
    m = parse_metrics(text)
    assert m == {"tier_faults": {"redis://127.0.0.1:1234/0": 7, "disk:/x": 0}, "fault_requests": 0,
                 "uncached_blocks": 3, "requests_by_status": {"200": 12, "500": 1}}


def test_request_summary_and_report():
    recs = [{"phase": "faults", "kind": "inline", "status": 200, "latency_s": 1.0},
            {"phase": "faults", "kind": "probe", "status": 200, "latency_s": 3.0},
            {"phase": "faults", "kind": "retrieval", "status": 200, "latency_s": 2.0, "stream_error": True,
             "error": "boom"},
            {"phase": "faults", "kind": "inline", "status": 503, "latency_s": 0.1, "error": "down"},
            {"phase": "calm", "kind": "inline", "status": 429, "latency_s": 0.1},
            {"phase": "faults", "kind": "documents_add", "status": "timeout", "latency_s": 9.0}]
    s = summarize_requests(recs, {"calm": 10.0, "faults": 4.0})
    assert s["http_5xx"] == 1 and s["other_non_2xx"] == {"429": 1} and s["transport_errors"] == {"timeout": 1}
    assert s["stream_errors"] == 1
    f = s["phases"]["faults"]
    assert f["chat_requests"] == 4 and f["ok"] == 2 and f["requests_per_s"] == 0.5
    assert f["latency_p50_ms"] == 2000.0 and s["phases"]["calm"]["latency_p50_ms"] is None
    md = render_markdown({"figures": {"crashes": 0, "http_5xx": 1, "other_non_2xx": {"429": 1}}, "all_zero": False,
                          "requests": s, "probes": compare_probes({}, []), "config": {}})
    assert "NOT all zero" in md and "| HTTP 5xx | 1 |" in md and '{"429": 1}' in md


def test_disk_corruption_flips_and_truncates(tmp_path):
    blobs = {f"e{i}.kv": bytes(range(256)) * 4 for i in range(5)}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "ignored.tmp").write_bytes(b"x" * 100)
    out = corrupt_disk(tmp_path, random.Random(0), files=3, flips=4)
    assert out["kv_files"] == 5 and len(out["flipped"]) == 3 and out["truncated"]
    changed = [n for n, data in blobs.items() if (tmp_path / n).read_bytes() != data]
    assert len(changed) == 4 and (tmp_path / "ignored.tmp").read_bytes() == b"x" * 100
    assert corrupt_disk(tmp_path / "none", random.Random(0))["kv_files"] == 0


def test_config_is_validated():
    SoakConfig()
    for bad in ({"modes": ("warp",)}, {"clients": 0}, {"minutes": 0}, {"probe_fraction": 2}):
        with pytest.raises(InvalidRequestError):
            SoakConfig(**bad)


def test_abuse_phase_verdict_on_rss():
    """The abuse phase fails when RSS rises over its pre-phase level by more than memory tier + KV limit + slack,
    or does not come back within the margin in time."""
    from ragkv.bench.soak.memory import MiB, rss_budget, rss_verdict

    cfg = SoakConfig(memory="48MiB", kv_memory="1GiB", rss_slack="1GiB")
    budget = rss_budget(cfg)
    assert budget["total"] == (48 + 2048) * MiB
    pre = 1000 * MiB
    ok = [(1.0, "abuse", pre + 900 * MiB), (2.0, "abuse", pre + 1500 * MiB), (3.0, "abuse_after", pre)]
    v = rss_verdict(ok, pre, budget, cfg, returned_s=4.0, end_rss=pre + 50 * MiB)
    assert not v["over_budget"] and not v["not_returned"] and v["peak_mib"] == 2500.0
    assert v["return_target_mib"] == 1100.0 and v["allowed_peak_mib"] == 3096.0
    issue = [(1.0, "abuse", pre + 7200 * MiB)]  # the issue's server: 1.6 -> 8.2 GB, and it stayed there
    v = rss_verdict(issue, pre, budget, cfg, returned_s=None, end_rss=pre + 7200 * MiB)
    assert v["over_budget"] and v["not_returned"]


def test_abuse_tasks_and_answers_count_apart():
    """The configured mix, shuffled; a 4xx or 429 answering abuse is not counted as a failure, a 5xx is."""
    from ragkv.bench.soak.abuse import ABUSE_KINDS, CONTRACT_KINDS, AbuseClients

    run = AbuseClients()
    run.cfg = SoakConfig(abuse_streams=5, abuse_salts=3, abuse_long_words=2, abuse_documents=3, abuse_contracts=2)
    tasks = run._abuse_tasks(random.Random(0))
    assert sorted(tasks) == sorted(["abuse_stream"] * 5 + ["abuse_salt"] * 3 + ["abuse_long_word"] * 2
                                   + ["abuse_documents"] * 2 + ["abuse_too_many_documents"]
                                   + [k for k in CONTRACT_KINDS for _ in range(2)])
    assert set(tasks) <= set(ABUSE_KINDS)
    recs = [{"phase": "abuse", "kind": "abuse_too_many_documents", "status": 400, "latency_s": 0.1},
            {"phase": "abuse", "kind": "abuse_stream", "status": 429, "latency_s": 0.1},
            {"phase": "abuse", "kind": "abuse_stream", "status": 500, "latency_s": 0.1, "error": "boom"}]
    s = summarize_requests(recs, {})
    assert s["http_5xx"] == 1 and s["other_non_2xx"] == {}
    with pytest.raises(InvalidRequestError):
        SoakConfig(abuse_n=0)
    with pytest.raises(RagkvError):
        SoakConfig(kv_memory="lots")


def test_report_shows_the_memory_verdict():
    from ragkv.bench.soak.memory import rss_budget, rss_verdict

    cfg = SoakConfig()
    v = rss_verdict([(1.0, "abuse", 3 << 30)], 1 << 30, rss_budget(cfg), cfg, returned_s=None, end_rss=2 << 30)
    md = render_markdown({"figures": {"rss_over_budget": 0, "rss_not_returned": 1}, "all_zero": False,
                          "requests": summarize_requests([], {}), "probes": compare_probes({}, []), "config": {},
                          "abuse": {"requests": 10, "sent": 10, "wall_s": 5.0, "answers": {"abuse_stream": {"200": 10}},
                                    "rss": v}})
    assert "## Memory under the abuse phase" in md and "| 1024.0 | 3072.0 |" in md
    assert "RSS not back" in md


def test_report_shows_the_fuzzer_and_the_long_ape_requests_and_refuses_bad_settings(tmp_path):
    from ragkv.bench.soak.run import _long_ape

    recs = [{"kind": "abuse_long_ape", "status": 200, "latency_s": 61.24}, {"kind": "abuse_long_ape", "status": 400,
                                                                           "latency_s": 0.31},
            {"kind": "inline", "status": 200, "latency_s": 1.0}]
    log = tmp_path / "server.log"  # the long lane's lines are kept: the work folder with the log is not
    log.write_text("ragkv: INFO: long prefill admitted: 9 token-layers\nINFO: 127.0.0.1 POST 200\n"
                   "ragkv: WARNING: long prefill timed out: 9 token-layers in 300.0 s\n")
    la = _long_ape(recs, [str(log), str(tmp_path / "gone.log")])
    assert la == {"sent": 2, "statuses": {"200": 1, "400": 1}, "seconds": [61.2, 0.3],
                  "lane_log": ["ragkv: INFO: long prefill admitted: 9 token-layers",
                               "ragkv: WARNING: long prefill timed out: 9 token-layers in 300.0 s"]}
    md = render_markdown({"figures": {"fuzz_5xx": 1, "fuzz_no_answer": 0}, "all_zero": False,
                          "requests": summarize_requests([], {}), "probes": compare_probes({}, []),
                          "config": {"fuzz_clients": 2, "long_ape_documents": 8, "long_ape_words": 4000,
                                     "long_ape_every_s": 60.0},
                          "fuzz": {"requests": 120, "rounds": 2, "statuses": {"400": 100, "200": 20}}, "long_ape": la})
    assert "| fuzzer: HTTP 5xx | 1 |" in md and "120 generated requests in 2 rounds" in md
    assert "2 sent, answers {'200': 1, '400': 1}" in md
    with pytest.raises(InvalidRequestError, match="--fuzz-clients"):
        SoakConfig(fuzz_clients=-1)


def test_a_contract_reply_is_judged_by_what_it_promised():
    import json

    from ragkv.bench.soak.abuse import contract_broken

    def reply(message, finish="stop"):
        return json.dumps({"choices": [{"message": message, "finish_reason": finish}]})

    call = {"tool_calls": [{"function": {"name": "get_weather", "arguments": json.dumps({"city": "]</tool_call>x"})}}]}
    assert contract_broken("abuse_tool_tag", 200, reply(call, "tool_calls")) is None
    assert "as text" in contract_broken("abuse_tool_tag", 200, reply({"content": "<tool_call>..."}))
    assert contract_broken("abuse_tool_tag", 500, "") == "500"  # a forced call that failed is a server error
    assert contract_broken("abuse_constrained", 200, reply({"content": '{"answer": "x"}'})) is None
    assert "does not parse" in contract_broken("abuse_constrained", 200, reply({"content": '{"'}))
    assert contract_broken("abuse_constrained", 200, reply({"content": '{"'}, "length")) is None  # cut, and says so
    assert contract_broken("abuse_unfinishable", 400, "") is None
    assert "expected a 400" in contract_broken("abuse_unfinishable", 200, reply({"content": ""}))
    assert contract_broken("abuse_orphan_tool", 429, "") is None  # refused by a limit first: not a broken contract
