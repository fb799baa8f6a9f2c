"""Cost before admission (serve/budget.py): every mode's worst prefill cost in token-layers, a per-request limit
(400 stating the cost and the limit) and a per-tenant budget over a minute (429 with Retry-After) that ingestion's
precompute is charged to as well, against a real
`ragkv serve` on 127.0.0.1 with two tenants' keys."""

import httpx
import pytest
from tiny import default_model_available

from ragkv.bench.serve import ServerProcess
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Segments
from ragkv.serve.budget import TenantBudget, TenantInFlight, TenantOverBudget

KEY_A, KEY_B, KEY_C = "key-cost-tenant-a-01", "key-cost-tenant-b-02", "key-cost-tenant-c-03"
LIMIT, BUDGET = 20_000, 30_000  # token-layers; SmolLM2 has 30 layers: ~660 and ~1,000 prompt tokens


def test_each_modes_worst_cost_covers_what_it_can_run():
    segs = Segments(list(range(10)), [list(range(100)), list(range(200))], list(range(20)))
    L, N, Tq = 30, 330, 20
    cost = {m: get_mode(m).worst_token_layers(segs, FusionOptions(mode=m), L) for m in ("full", "prefix", "reuse",
                                                                                         "ape", "blend", "auto")}
    assert cost["full"] == cost["prefix"] == cost["reuse"] == cost["ape"] == N * L
    # blend: the blocks encoded, then stage 1's query, 15% of the block tokens and the query again
    assert cost["blend"] == (N + Tq + 45 + Tq) * L
    assert cost["auto"] == cost["blend"] + (N + Tq) * L  # and its escalation to a full recompute
    drafted = get_mode("blend").worst_token_layers(segs, FusionOptions(mode="blend", draft_tokens=8), L)
    assert drafted == cost["blend"] + 16 * L


def test_a_tenants_budget_refuses_over_its_window_and_recovers_as_it_passes():
    now = [0.0]
    budget = TenantBudget(100, window_s=60, clock=lambda: now[0])
    budget.charge("a", 60)
    now[0] = 10
    budget.charge("a", 40)  # 100: exactly the budget
    now[0] = 20
    with pytest.raises(TenantOverBudget) as e:
        budget.charge("a", 30)
    assert e.value.retry_after_s == 40  # the first 60 leave the window at t=60
    budget.charge("b", 100)  # another tenant's budget is its own
    now[0] = 60.5
    budget.charge("a", 30)  # 40 + 30 within the window
    assert TenantBudget(None).charge("a", 10 ** 12) is None
    alone = TenantBudget(10, clock=lambda: now[0])
    alone.charge("a", 50)  # more than the budget, but alone in the window: the per-request limit is apart


def test_a_tenants_requests_in_flight_are_bounded_and_released_as_they_end():
    flight = TenantInFlight(100)
    r1 = flight.admit("a", 70)
    with pytest.raises(TenantOverBudget, match="--tenant-in-flight-cost") as e:
        flight.admit("a", 40)  # 110 in flight: refused at once, not queued
    assert e.value.retry_after_s == TenantInFlight.RETRY_AFTER_S
    r2 = flight.admit("a", 30)  # 100: exactly the limit
    flight.admit("b", 100)  # another tenant's count is its own
    r1()
    r1()  # releasing twice counts once
    r3 = flight.admit("a", 70)
    r2()
    r3()
    assert "a" not in flight.cost
    assert TenantInFlight(10).admit("c", 500)  # alone it is always admitted (the per-request limit is apart)
    TenantInFlight(None).admit("a", 10 ** 12)


def test_an_ingestion_holds_its_precompute_in_flight_and_in_the_budget():
    from types import SimpleNamespace

    from ragkv.serve.ingest import IngestJobs

    budget, flight = TenantBudget(1000), TenantInFlight(100)
    jobs = IngestJobs(SimpleNamespace(requests=SimpleNamespace(budget=budget), in_flight=flight))
    library = SimpleNamespace(precompute_cost=lambda docs: 30 * len(docs))
    release = jobs.admit("a", library, [{}, {}])  # 60 token-layers
    assert flight.cost["a"] == 60 and sum(c for _, c in budget.spent["a"]) == 60
    with pytest.raises(TenantOverBudget, match="--tenant-in-flight-cost"):
        jobs.admit("a", library, [{}, {}])  # 120 in flight
    release()
    assert "a" not in flight.cost
    jobs.admit("a", SimpleNamespace(precompute_cost=lambda docs: 0), [{}])()  # nothing new: nothing charged
    assert sum(c for _, c in budget.spent["a"]) == 60
    over = IngestJobs(SimpleNamespace(requests=SimpleNamespace(budget=TenantBudget(50)), in_flight=flight))
    over.admit("b", library, [{}])  # 30
    with pytest.raises(TenantOverBudget, match="--tenant-budget"):
        over.admit("b", library, [{}])  # 60 of 50 this minute
    assert flight.cost["b"] == 30  # the refused one holds nothing in flight


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not default_model_available():
        pytest.skip("default model not converted")
    extra = ("--api-key", f"{KEY_A}:tenantA", "--api-key", f"{KEY_B}:tenantB", "--api-key", f"{KEY_C}:tenantC",
             "--max-request-cost", str(LIMIT),
             "--tenant-budget", str(BUDGET), "--no-startup-profile")
    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=180,
                       cache_dir=tmp_path_factory.mktemp("serve-cost"), extra=extra) as s:
        yield s


def ask(server, key: str, words: int) -> httpx.Response:
    body = {"model": "smollm2", "max_tokens": 1, "messages": [{"role": "user", "content": "hello " * words}]}
    return httpx.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


@pytest.mark.model
def test_a_request_over_the_cost_limit_is_a_400_stating_cost_and_limit(server):
    r = ask(server, KEY_B, 1000)  # ~1,000 tokens x 30 layers
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "request_too_costly" and err["param"] == "messages"
    assert str(LIMIT) in err["message"] and "--max-request-cost" in err["message"]
    assert ask(server, KEY_B, 5).status_code == 200  # the server keeps answering


@pytest.mark.model
def test_a_tenant_over_its_budget_gets_429_with_retry_after_while_others_are_served(server):
    first, second = ask(server, KEY_A, 380), ask(server, KEY_A, 380)  # ~12K token-layers each: 24K of 30K
    assert first.status_code == second.status_code == 200, first.text
    third = ask(server, KEY_A, 380)
    assert third.status_code == 429 and third.json()["error"]["code"] == "tenant_budget_exceeded"
    assert 1 <= int(third.headers["Retry-After"]) <= 60 and "--tenant-budget" in third.json()["error"]["message"]
    assert ask(server, KEY_B, 5).status_code == 200  # tenant B's budget is its own


def ingest(server, key: str, doc_id: str) -> httpx.Response:
    text = " ".join(f"Tide table {doc_id}: on day {d} the water at pier {d % 7} rose to {d % 5 + 1} metres."
                    for d in range(16))  # ~420 tokens with the prefix: ~12.5K token-layers
    return httpx.post(f"http://127.0.0.1:{server.port}/v1/documents", timeout=120,
                      json={"documents": [{"id": doc_id, "text": text}], "wait": False},
                      headers={"Authorization": f"Bearer {key}"})


@pytest.mark.model
def test_ingestion_is_charged_its_precompute_and_refused_once_the_tenant_is_over_its_budget(server):
    assert ingest(server, KEY_C, "tides-1").status_code == 202
    assert ask(server, KEY_C, 380).status_code == 200  # ~12K: ~26K of 30K with the ingestion's
    chat = ask(server, KEY_C, 380)
    assert chat.status_code == 429, "the ingestion's precompute was not charged"  # 24K alone would fit
    refused = ingest(server, KEY_C, "tides-2")
    err = refused.json()["error"]
    assert refused.status_code == 429 and err["code"] == "tenant_budget_exceeded", refused.text
    assert 1 <= int(refused.headers["Retry-After"]) <= 60 and "--tenant-budget" in err["message"]
    jobs = httpx.get(f"http://127.0.0.1:{server.port}/v1/documents/jobs", timeout=60,
                     headers={"Authorization": f"Bearer {KEY_C}"}).json()["data"]
    assert len(jobs) == 1  # the refused one was never recorded nor run
    assert ingest(server, KEY_B, "tides-1").status_code == 202  # another tenant's budget is its own
