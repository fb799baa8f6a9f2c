"""The cache-aware router's parts without Ray (serve/replicas): the ranking policy, the blocks named from a body
exactly as the engine names them, and a request answered in-process by the server's own app."""

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from tiny import default_model_available

from ragkv.serve.replicas.forward import call_asgi
from ragkv.serve.replicas.policy import InFlight, SentBlocks, WorkingSets, rank_by_balance, rank_by_home, rank_replicas


def test_the_holder_answers_unless_busier_than_the_slack():
    holdings = {"a": {"x", "y"}, "b": {"y"}, "c": set()}
    assert rank_replicas(["x", "y"], holdings, {"a": 3, "b": 1, "c": 1}, slack=4)[0] == ["a"]
    # a holds both but is 5 requests busier than the least loaded: the best holder within the slack answers
    assert rank_replicas(["x", "y"], holdings, {"a": 6, "b": 1, "c": 1}, slack=4)[0] == ["b"]
    ranks = rank_replicas(["x", "y"], holdings, {"a": 9, "b": 9, "c": 1}, slack=4)
    assert ranks[0] == ["c"] and set(ranks[1]) == {"a", "b"}  # no holder within the slack: the least loaded
    # while a replica is idle, only the idle ones may answer (the holder among them first)
    assert rank_replicas(["x", "y"], holdings, {"a": 1, "b": 0, "c": 0}, slack=4)[0] == ["b"]
    assert rank_replicas(["x", "y"], holdings, {"a": 0, "b": 0, "c": 1}, slack=4)[0] == ["a"]
    assert sorted(sum(ranks, [])) == ["a", "b", "c"]  # every replica stays a fallback


def test_new_passage_sets_spread_and_stick_without_any_report():
    loads = {"a": 0, "b": 0, "c": 0}
    chosen = {}
    for i in range(60):
        blocks = [f"ns/{i}-0", f"ns/{i}-1"]
        first = rank_replicas(blocks, {}, loads, slack=4)[0]
        assert len(first) == 1
        assert rank_replicas(list(reversed(blocks)), {}, loads, 4)[0] == first  # any order: the same replica
        chosen[i] = first[0]
    counts = {r: list(chosen.values()).count(r) for r in loads}
    assert min(counts.values()) >= 10, counts  # rendezvous hashing spreads new sets over the replicas
    # a request without blocks may go to any least loaded replica
    assert rank_replicas([], {}, {"a": 1, "b": 0, "c": 0}, 4) == [["b", "c"], ["a"]]


def test_home_partitions_the_blocks_and_spills_a_set_to_one_second_replica():
    idle = {"a": 0, "b": 0, "c": 0}
    homes = {}
    for i in range(90):
        blocks = [f"ns/{i}-{j}" for j in range(3)]
        ranks = rank_by_home(blocks, idle, slack=1)
        assert len(ranks[0]) == 1 and sorted(sum(ranks, [])) == ["a", "b", "c"]
        assert rank_by_home(list(reversed(blocks)), idle, 1) == ranks  # any order: the same home
        homes[i] = ranks[0][0]
    counts = {r: list(homes.values()).count(r) for r in idle}
    assert min(counts.values()) >= 18, counts  # sets spread over the replicas
    blocks = ["ns/7-0", "ns/7-1", "ns/7-2"]
    home = homes[7]
    # the home stays home while it is within the slack of the least loaded, whatever the others hold or do
    assert rank_by_home(blocks, {**idle, home: 1}, slack=1)[0] == [home]
    # beyond it, the set spills, and always to the same second replica (its hash order), not to the least loaded
    busy = {**idle, home: 5}
    second = rank_by_home(blocks, busy, 1)[0][0]
    assert second != home
    third = next(r for r in idle if r not in (home, second))
    assert rank_by_home(blocks, {**busy, third: 0, second: 1}, 1)[0] == [second]
    assert rank_by_home(blocks, {**busy, second: 6}, 1)[0] == [third]  # both busy: whoever qualifies
    assert rank_by_home([], {"a": 1, "b": 0, "c": 0}, 1) == [["b", "c"], ["a"]]


def test_balance_adds_fewest_blocks_keeps_working_sets_even_and_respects_the_slack():
    idle = {"a": 0, "b": 0}
    # the replica holding the request's blocks answers
    assert rank_by_balance(["x", "y"], {"a": {"x"}, "b": {"x", "y"}}, {"a": 2, "b": 2}, idle, 1)[0] == ["b"]
    # a holder whose working set is far above the mean loses a request it would add only one block for:
    # cost a = 1 missing + 0.5 x (12 - 7) = 3.5 > b's 2 missing
    assert rank_by_balance(["x", "y"], {"a": {"x"}, "b": set()}, {"a": 12, "b": 2}, idle, 1)[0] == ["b"]
    # beyond the slack the holder is passed over; every replica stays a fallback
    ranks = rank_by_balance(["x", "y"], {"a": {"x", "y"}, "b": set()}, {"a": 2, "b": 0}, {"a": 3, "b": 0}, 1)
    assert ranks == [["b"], ["a"]]
    # new sets in any order go to the same replica; over many, both replicas get some
    firsts = []
    for i in range(40):
        blocks = [f"ns/{i}-0", f"ns/{i}-1"]
        first = rank_by_balance(blocks, {}, {}, idle, 1)[0]
        assert rank_by_balance(list(reversed(blocks)), {}, {}, idle, 1)[0] == first
        firsts.append(first[0])
    assert 10 <= firsts.count("a") <= 30
    assert rank_by_balance([], {}, {}, {"a": 1, "b": 0}, 0)[0] == ["b"]


def test_working_sets_are_the_blocks_of_the_last_requests():
    ws = WorkingSets(window=2)
    ws.add("a", ["x", "y"])
    ws.add("a", ["y", "z"])
    assert ws.of("a") == {"x", "y", "z"} and ws.size("a") == 3
    ws.add("a", ["w"])  # the first request leaves the window
    assert ws.of("a") == {"y", "z", "w"}
    ws.forget("a")
    assert ws.size("a") == 0 and ws.of("b") == set()


def test_sent_blocks_are_bounded_and_forgotten_with_their_replica():
    sent = SentBlocks(per_replica=3)
    sent.add("a", ["1", "2", "3"])
    sent.add("a", ["1", "4"])  # "1" used again: "2", the oldest, goes
    assert sent.of("a") == {"1", "3", "4"}
    sent.forget("a")
    assert sent.of("a") == set()


def test_in_flight_counts_survive_a_finish_reported_before_the_route():
    busy = InFlight(remember=2)
    busy.routed("a", "r1")
    busy.routed("a", "r2")
    busy.finished("a", "r1")
    assert busy.load("a") == 1
    busy.finished("b", "r3")  # Ray's done-callback ran before it reported the route: no request left counted
    busy.routed("b", "r3")
    assert busy.load("b") == 0
    busy.finished("a", "r2")
    assert busy.load("a") == 0
    for i in range(5):  # finishes of requests never routed (rejected) are remembered within a bound
        busy.finished("a", f"x{i}")
    assert len(busy._finished_first) == 2
    busy.routed("c", "r4")
    busy.forget("c")
    assert busy.load("c") == 0


def test_an_app_answers_in_process_as_a_stream_and_hears_the_client_leave():
    app = FastAPI()
    heard = asyncio.Event()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.body()

        async def chunks():
            yield body
            i = 0
            try:
                for i in range(500):
                    yield f"[{i}]".encode()
                    await asyncio.sleep(0.01)
            finally:
                if i < 499:  # ended early: the app heard its client leave
                    heard.set()
        return StreamingResponse(chunks(), headers={"x-test": "1"})

    async def run():
        stream = call_asgi(app, "POST", "/echo", b"", [(b"content-type", b"text/plain")], b"hello",
                           extra_headers=[(b"x-ragkv-replica", b"r1")])
        status, headers = await stream.__anext__()
        assert status == 200 and (b"x-test", b"1") in headers and (b"x-ragkv-replica", b"r1") in headers
        assert await stream.__anext__() == b"hello"
        assert await stream.__anext__() == b"[0]"
        await stream.aclose()  # the caller goes: the app sees a disconnect and stops
        await asyncio.wait_for(heard.wait(), 5)
    asyncio.run(run())


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
@pytest.mark.parametrize("case", ["documents", "history", "tenant_salt", "tools"])
def test_route_ids_are_the_engine_own_block_keys(default_engine, case):
    """What the ingress names from the body (tokenizer only) is what the engine stores the request's blocks under:
    the server's RequestBuilder builds the request, the engine warms its blocks, and its memory tier reports them."""
    from ragkv.engine.blocks.encode import block_route_id
    from ragkv.engine.options import FusionOptions
    from ragkv.serve.auth import ApiKeys
    from ragkv.serve.replicas.route_keys import RouteKeys
    from ragkv.serve.requests import RequestBuilder
    from ragkv.serve.schemas import ChatRequest
    from ragkv.serve.server import Limits

    keys = ApiKeys.parse(["k-tenant-a:tenantA"]) if case == "tenant_salt" else ApiKeys({})
    body = {"model": "smollm2", "messages": [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": "Who built the tower?"}]}
    if case in ("documents", "tenant_salt", "tools"):
        body["documents"] = [f"Tower {case} {i} was built by engineer number {i} in {1880 + i}." for i in range(3)]
    if case == "history":
        body["messages"] += [{"role": "assistant", "content": "Engineer Tomas Vrba built it."},
                             {"role": "user", "content": "In which year?"}]
    if case == "tenant_salt":
        body["cache_salt"] = "s3cret"
    if case == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    auth = "Bearer k-tenant-a" if case == "tenant_salt" else None
    tenant = "tenantA" if case == "tenant_salt" else "default"

    builder = RequestBuilder(default_engine, keys, Limits(), FusionOptions(), 4, library=None)
    prepared = builder.chat(ChatRequest.model_validate(body), tenant)
    namespace = prepared.namespace or default_engine.namespace
    expected = [block_route_id(ids, namespace) for ids in prepared.segs.blocks]
    route = RouteKeys(default_engine.tokenizer, default_engine.prompt_format, keys, default_engine.namespace)
    got = route.of("/v1/chat/completions", json.dumps(body).encode(), auth)
    assert got == expected and len(got) == (3 if case != "history" else 2)
    if case == "tenant_salt":
        assert all(g.startswith("tenantA.salt-") for g in got)
    default_engine.warm(prepared.segs, FusionOptions(mode="reuse"), namespace)
    held = set(default_engine.held_blocks())
    assert set(got) <= held  # the engine's own keys, as the replica reports them
    # refused or foreign requests route without blocks (the replica answers them)
    assert route.of("/v1/chat/completions", b"{not json", auth) == []
    assert route.of("/v1/embeddings", json.dumps(body).encode(), auth) == []
    if case == "tenant_salt":
        assert route.of("/v1/chat/completions", json.dumps(body).encode(), "Bearer wrong") == []


def test_the_bench_compares_every_router_with_the_single_server_and_round_robin():
    from ragkv.bench.replicas import ReplicaBenchConfig, summarize
    from ragkv.errors import InvalidRequestError

    runs = [{"config": c, "block_hit_rate": h, "ttft_p50_s": t, "ttft_p95_s": 2 * t, "req_per_s": 0.5}
            for c, h, t in [("single", 0.9, 0.3), ("affinity", 0.72, 0.5), ("home:1", 0.855, 0.4),
                            ("round-robin", 0.63, 1.0)]]
    s = summarize(runs)
    assert s["home:1"]["hit_rate_vs_single"] == 0.95 and s["round-robin"]["hit_rate_vs_single"] == 0.7
    assert s["home_slack_1_ttft_p50_vs_round_robin"] == 0.4 and s["affinity_ttft_p50_vs_round_robin"] == 0.5
    with pytest.raises(InvalidRequestError, match=":SLACK"):
        ReplicaBenchConfig(routers=("home:x",))


def test_a_host_beyond_loopback_or_a_joined_cluster_says_what_it_exposes_and_how_to_protect_it():
    from ragkv.cli.serve_replicas import exposure_warning

    assert exposure_warning("127.0.0.1", 8000, None, True) is None
    assert exposure_warning("::1", 8000, None, False) is None
    said = exposure_warning("0.0.0.0", 8000, None, True)
    assert "0.0.0.0:8000" in said and "stay on 127.0.0.1" in said and "--api-key" in said
    said = exposure_warning("127.0.0.1", 8000, "auto", True)
    assert "RAY_AUTH_MODE=token" in said and "private network" in said
    assert "no authentication" in exposure_warning("10.0.0.5", 8000, "ray://head:10001", False)
