"""Shadow verification (serve/shadow.py): sampled approximate answers re-run with `full` while the server is idle;
what it measures equals the fidelity computed directly from the engine, exact answers are never checked, and the
budget holds."""

import time

import pytest

from tiny import default_model_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]

DOCS = ["The Lintwick viaduct was finished in 1893 by the engineer Mara Osk.",
        "Osk later designed the harbour crane of Velbay, which still stands.",
        "The viaduct's twelve arches are made of local granite."]


def make_server(engine, **kw):
    from ragkv.serve.server import Server

    return Server(engine, "smollm2", worker_thread=True, **kw)


def prepared(server, mode: str, question: str = "Who finished the Lintwick viaduct?"):
    from ragkv.serve.schemas import ChatRequest

    body = {"model": "smollm2", "max_tokens": 8, "temperature": 0, "documents": DOCS,
            "messages": [{"role": "user", "content": question}], "ragkv": {"mode": mode}}
    return server.requests.chat(ChatRequest.model_validate(body))


def wait_for(cond, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_a_checked_answer_is_measured_as_the_engine_measures_it(default_engine):
    from ragkv.bench.shadow_cost import shadow_counters
    from ragkv.engine.options import FusionOptions
    from ragkv.eval.metrics import prefix_agreement, top1_agreement
    from ragkv.ops.divergence import first_token_kl

    server = make_server(default_engine, shadow_fraction=1.0)
    try:
        exact = prepared(server, "full")
        server.start(exact).future.result(timeout=120)
        p = prepared(server, "reuse")
        _, seq, _ = server.start(p).future.result(timeout=120)
        assert wait_for(lambda: server.shadow.means().get("reuse", {}).get("checks") == 1)
        means = server.shadow.means()
        assert "full" not in means  # an exact answer is never checked

        full = default_engine.generate(p.segs, FusionOptions(mode="full"), p.gen, p.namespace)
        kl = first_token_kl(full.first_logits, seq.first_logits)
        assert kl > 1e-4  # reuse is not full on this prompt: the check has something to measure
        m = means["reuse"]
        assert m["first_token_kl"] == pytest.approx(kl, rel=1e-4, abs=1e-6)
        assert m["top1_agreement"] == top1_agreement(full.first_logits, seq.first_logits)
        tokens = seq.out.token_ids
        assert m["greedy_agreement"] == pytest.approx(prefix_agreement(full.token_ids, tokens) / len(tokens))
        stated = seq.stats.fidelity["estimate"]
        assert m["expected_kl"] == pytest.approx(stated["expected_kl"])
        body, _ = server.metrics.render()
        text = body.decode()
        assert 'ragkv_fidelity_checks_total{mode="reuse"} 1.0' in text
        assert 'ragkv_fidelity_first_token_kl{mode="reuse"}' in text
        assert shadow_counters(text) == {"checks_done": 1, "checks_skipped": 0}  # what `bench shadow` reads
    finally:
        server.scheduler.stop()


def test_the_budget_skips_what_it_cannot_hold_and_zero_checks_nothing(default_engine):
    server = make_server(default_engine, shadow_fraction=1.0, shadow_max_pending=1)
    try:
        jobs = [server.start(prepared(server, "reuse", f"Question {i}: who finished the viaduct?"))
                for i in range(3)]
        for job in jobs:
            job.future.result(timeout=120)
        # the three answers finish together: one check is queued, two are skipped; it runs once they are done
        assert wait_for(lambda: server.shadow.means().get("reuse", {}).get("checks") == 1)
        assert server.shadow.skipped == 2 and server.shadow.pending == 0
    finally:
        server.scheduler.stop()
    server = make_server(default_engine, shadow_fraction=0.0)
    try:
        server.start(prepared(server, "reuse")).future.result(timeout=120)
        time.sleep(0.5)
        assert server.shadow.means() == {} and server.shadow.pending == 0
    finally:
        server.scheduler.stop()


def test_a_w8a8_server_checks_its_answers_full_included_against_the_exact_weights(default_engine):
    """On w8a8 weights every answer is approximate, `full`'s too, and states its distance to the exact weights'
    `full`: the shadow check measures that distance (the exact twin's `full`), not w8a8's own `full` (zero)."""
    from ragkv.engine.engine import Engine
    from ragkv.engine.options import FusionOptions
    from ragkv.ops.divergence import first_token_kl

    fast = Engine(default_engine._loaded, default_engine.store, decode_weights="w8a8")
    assert fast.exact_twin().decode_weights == "exact" and default_engine.exact_twin() is default_engine
    server = make_server(fast, shadow_fraction=1.0)
    try:
        p = prepared(server, "full")
        _, seq, _ = server.start(p).future.result(timeout=120)
        assert seq.stats.fidelity["exact"] is False and seq.stats.fidelity["estimate"]["expected_kl"] > 0
        assert wait_for(lambda: server.shadow.means().get("full", {}).get("checks") == 1)
        exact = default_engine.generate(p.segs, FusionOptions(mode="full"), p.gen, p.namespace)
        kl = first_token_kl(exact.first_logits, seq.first_logits)
        assert kl > 1e-5
        assert server.shadow.means()["full"]["first_token_kl"] == pytest.approx(kl, rel=1e-3, abs=1e-6)
    finally:
        server.scheduler.stop()
