"""`ragkv bench lookahead|ceiling|profile|weights` (ragkv/bench/{lookahead,ceiling,prefill_profile,weights}.py) on
the tiny random Llama: what each reports is checked against what it must be, not only that it runs."""

import json

import pytest
from tiny import IdText, make_segs, rand_ids

from ragkv.bench.ceiling import CeilingBenchConfig, run_ceiling_bench
from ragkv.bench.lookahead import LookaheadBenchConfig, run_lookahead_bench
from ragkv.bench.prefill_profile import ProfileBenchConfig, run_profile_bench
from ragkv.bench.weights import COLD, WeightsBenchConfig, run_weights_bench
from ragkv.engine.measure.flops import linear_flops

quiet = lambda *a, **k: None  # noqa: E731


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_lookahead_takes_the_drafts_rows_while_the_answer_repeats_it(tiny_engine, tmp_path):
    eng = tiny_engine()
    eng.tokenizer, eng.eos_ids = IdText(), set()  # every answer runs to its budget
    questions = [(str(i), make_segs(seed=i)) for i in range(4)]
    cfg = LookaheadBenchConfig(ratio=0.5, draft_tokens=4, max_new_tokens=8)
    res = run_lookahead_bench(eng, cfg, questions, tmp_path, quiet)
    taken = []
    for r in res["rows"]:
        w, wo = r["with"], r["without"]
        assert r["same_answer"] and w["tokens"] == wo["tokens"] and len(w["tokens"]) == 8
        assert len(w["draft"]) == 4 and wo["taken"] == 0
        # a row is taken while the answer repeats the draft; the last token is never fed back
        assert w["taken"] == min(_common_prefix(w["draft"], w["tokens"]), len(w["tokens"]) - 1)
        taken.append(w["taken"])
    assert sum(taken) > 0 and min(taken) < 4  # both the taken and the dropped paths ran
    saved = json.loads((tmp_path / "lookahead.json").read_text())
    assert saved["summary"]["taken"] == sum(taken) and saved["summary"]["same_answers"] == 4
    assert "| 0 |" in (tmp_path / "lookahead.md").read_text()


def test_ceiling_counts_the_engines_flops_and_splits_the_profile(tiny_engine, tmp_path):
    eng = tiny_engine()
    a = eng.model.args
    cfg = CeilingBenchConfig(tokens=96, batch_sizes=(1, 2), sgemm_sizes=(64,), rounds=1)
    res = run_ceiling_bench(eng, cfg, rand_ids(200, 1), [make_segs(seed=s) for s in range(2)], tmp_path, quiet)
    T, L = 96, a.num_layers
    assert res["tokens"] == T
    # the linears' FLOPs from the weights themselves: 2 per weight per token, every layer (LM head apart)
    weights = sum(p.numel() for n, p in eng.model.named_parameters()
                  if n.endswith("proj.weight") and "layers." in n)
    assert res["linear_flop"] == 2 * T * weights == T * L * linear_flops(a)
    assert res["linear_s"] > 0 and res["attention_s"] > 0
    assert res["linear_s"] + res["attention_s"] + res["other_s"] == pytest.approx(res["profiled_self_s"], abs=1e-5)
    assert res["ceiling_s"] == pytest.approx((res["linear_flop"] + res["attention_flop"])
                                             / res["sgemm_peak_gflops"] / 1e9, rel=1e-2)
    steps = res["decode_steps"]
    assert set(steps) == {1, 2} and all(s["step_ms"] > 0 for s in steps.values())
    assert steps[2]["profile_ms"]["linear"] > 0
    assert json.loads((tmp_path / "ceiling.json").read_text())["tokens"] == T


def test_profile_times_the_warm_prefill_only(tiny_engine, tmp_path):
    eng = tiny_engine()
    segs = make_segs()
    res = run_profile_bench(eng, ProfileBenchConfig(mode="reuse", repeats=3, top=5), segs, tmp_path, quiet)
    assert len(res["wall_ms_runs"]) == 3 and min(res["wall_ms_runs"]) <= res["wall_ms_median"]
    assert res["tokens"]["blocks"] == [len(b) for b in segs.blocks]
    assert res["reused_tokens"] == len(segs.prefix) + sum(map(len, segs.blocks))  # all from the store
    assert res["stats_ms"].get("encode_ms", 0) == 0
    assert 0 < len(res["ops"]) <= 5 and sum(o["share"] for o in res["ops"]) <= 1.0001
    assert res["ops"] == sorted(res["ops"], key=lambda o: -o["self_ms"])


def test_weights_alternates_engines_that_compute_the_same(tiny_engine, tmp_path):
    engines = {w: tiny_engine(decode_weights=w) for w in ("exact", "transposed")}
    segs = [make_segs(seed=s) for s in range(2)]
    cfg = WeightsBenchConfig(weights=("exact", "transposed"), modes=("full", "blend:sel=query,r=0.3"),
                             batch_sizes=(1, 2), rounds=1)
    res = run_weights_bench(engines, cfg, segs, tmp_path, quiet)
    rows = {r["case"]: r for r in res["rows"]}
    assert list(rows) == ["full", "blend:sel=query,r=0.3", COLD, "step b=1", "step b=2"]
    for case in ("full", "blend:sel=query,r=0.3", COLD):
        assert rows[case]["ratio"]["exact"] == 1.0
        assert rows[case]["max_logit_diff"]["exact"] == 0
        assert rows[case]["max_logit_diff"]["transposed"] < 1e-3  # the same products in another order
    assert all(v > 0 for r in rows.values() for v in r["ms"].values())
    assert res["weights"] == {"exact": "exact", "transposed": "transposed"}
    fid = res["fidelity"]["transposed"]  # the same products in another order: the same greedy tokens
    assert fid["prompts"] == 2 and fid["first_token_kl_max"] < 1e-6
    assert fid["top1_agreement"] == fid["greedy_agreement"] == 1.0 and fid["agreeing_tokens_mean"] == 17
    assert "Fidelity against exact" in (tmp_path / "weights.md").read_text()


def test_weights_measures_an_approximate_copys_fidelity(tiny_engine, tmp_path):
    """w8a8 (int8 products in prefill) is not the exact path: the bench states how far its first token is."""
    engines = {w: tiny_engine(decode_weights=w) for w in ("exact", "w8a8")}
    segs = [make_segs(seed=s) for s in range(3)]
    cfg = WeightsBenchConfig(weights=("exact", "w8a8"), modes=("full",), cold=False, batch_sizes=(1,), rounds=1,
                             greedy_steps=4)
    fid = run_weights_bench(engines, cfg, segs, tmp_path, quiet)["fidelity"]["w8a8"]
    assert fid["prompts"] == 3 and 0 < fid["first_token_kl_mean"] <= fid["first_token_kl_max"] < 0.05
    assert 0 <= fid["greedy_agreement"] <= fid["top1_agreement"] <= 1 and fid["greedy_tokens"] == 5


def test_decode_bench_judges_its_rounds_by_the_median_of_bandwidth_probes_around_them(tiny_engine, tmp_path,
                                                                                      monkeypatch):
    """A shared host's bandwidth moves within minutes: the bench probes it before every round and after the last,
    and the bound is the median probe's, with the range stated."""
    import ragkv.bench.decode as bench_decode
    from ragkv.engine.engine import Engine

    eng = tiny_engine()
    eng.tokenizer, eng.eos_ids = IdText(), set()
    probes = iter([10.0, 40.0, 20.0, 30.0])
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: eng))
    monkeypatch.setattr(bench_decode, "_requests", lambda engine, n, k: [make_segs(seed=i) for i in range(n)])
    monkeypatch.setattr(bench_decode, "probe_buffer", lambda: None)
    monkeypatch.setattr(bench_decode, "read_bandwidth_gbs", lambda buf: next(probes))
    cfg = bench_decode.DecodeBenchConfig(model="tiny", configs=(("float32", "exact"),), batch_sizes=(2,), steps=3,
                                         rounds=3, fidelity_examples=0)
    res = bench_decode.run_decode_bench(cfg, tmp_path, quiet)
    assert res["read_bandwidth_probes_gbs"] == [10.0, 40.0, 20.0, 30.0] and res["read_bandwidth_gbs"] == 25.0
    row = res["rows"][0]
    reads = row["bytes_per_step"]
    assert row["bandwidth_bound_tokens_per_s"] == round(25e9 / (reads["weights"] + reads["kv"]), 1)
    assert "the median of 4 probes, one before each round and one after: 10.0-40.0 GB/s" in \
        (tmp_path / "decode.md").read_text()
