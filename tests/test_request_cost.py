"""Cost before admission (serve/budget.py): every mode's worst prefill cost in token-layers, a per-request limit
(400 stating the cost and the limit) and a per-tenant budget over a minute (429 with Retry-After), against a real
`ragkv serve` on 127.0.0.1 with two tenants' keys."""

import httpx
import pytest
from tiny import default_model_available

from ragkv.bench.serve import ServerProcess
from ragkv.engine.modes import get_mode
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Segments
from ragkv.serve.budget import TenantBudget, TenantInFlight, TenantOverBudget

KEY_A, KEY_B = "key-cost-tenant-a-01", "key-cost-tenant-b-02"
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not default_model_available():
        pytest.skip("default model not converted")
    extra = ("--api-key", f"{KEY_A}:tenantA", "--api-key", f"{KEY_B}:tenantB", "--max-request-cost", str(LIMIT),
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
