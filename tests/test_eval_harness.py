"""Evaluation harness: fidelity of `full` to itself, resume after interruption, summaries, sweeps, calibration,
report and bad input. A tiny random model with a word-hashing tokenizer stands in for the real one; the CLI
round trip uses the default model on a two-passage file when it is converted."""

import json
import zlib

import pytest
from tiny import default_model_available  # noqa: E402 (conftest puts tests/ on sys.path)

from ragkv.cli import main
from ragkv.config import cpu_name
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Passage
from ragkv.errors import RagkvError
from ragkv.eval.datasets import Example
from ragkv.eval.harness import fidelity, run_eval, task_scores
from ragkv.eval.modes import ModeKeyError, engine_defaults, parse_mode_key, resolve_modes, split_mode_list
from ragkv.eval.references import ReferenceStore
from ragkv.eval.results import ResultsFile, read_results
from ragkv.eval.summary import summarize, text_table


class WordTokenizer:
    """Whitespace words hashed into the tiny vocabulary; decodes to 'w<id>' words."""
    chat_template = None
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [10 + zlib.crc32(w.encode()) % 300 for w in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def engine(tiny_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))  # calibration files stay in the test
    eng = tiny_engine("llama")
    eng.tokenizer = WordTokenizer()
    eng.eos_ids = set()  # always generate max_new_tokens: deterministic lengths
    return eng


def _examples(n=2, words=12):
    out = []
    for i in range(n):
        passages = [Passage(text=" ".join(f"fact{i}_{j}_{k}" for k in range(words)), title=f"T{j}") for j in range(3)]
        out.append(Example(f"ex{i}", f"what is thing {i} ?", passages, [f"w{10 + i}", "answer"], "qa", "accuracy"))
    return out


def _modes(engine, keys):
    return resolve_modes(split_mode_list(keys), FusionOptions(mode="full"), engine_defaults(engine))


def test_full_is_exactly_faithful_to_itself(engine):
    run = run_eval(engine, _examples(), _modes(engine, "full,prefix,reuse"), max_new_tokens=6, progress=False)
    by = {(r["example_id"], r["mode_key"]): r for r in run["records"]}
    for ex in ("ex0", "ex1"):
        f = by[(ex, "full")]["fidelity"]
        assert f == {"first_token_kl": 0.0, "top1_agreement": 1.0, "greedy_agreement": 1.0, "prefix_agreement": 6}
        assert by[(ex, "prefix")]["fidelity"]["first_token_kl"] < 1e-6  # exact mode (docs/invariants.md, invariant 3)
        assert by[(ex, "prefix")]["prediction"] == by[(ex, "full")]["prediction"]
        assert by[(ex, "reuse")]["fidelity"]["first_token_kl"] > 0  # blocks lost their cross attention
    ans = engine.generate(engine.segments("q ?", [Passage("a b c")]), FusionOptions(mode="full"))
    assert fidelity(ans, ans)["first_token_kl"] == 0.0


def test_resume_after_interruption_gives_the_same_records(engine, tmp_path):
    exs, modes = _examples(3), _modes(engine, "full,reuse,blend:r=0.5")
    clean = run_eval(engine, exs, modes, ResultsFile(tmp_path / "clean.jsonl", {"c": 1}), max_new_tokens=4,
                     progress=False)["records"]

    path = tmp_path / "run.jsonl"
    results = ResultsFile(path, {"c": 1})
    real_append = results.append

    def append_then_die(rec):
        real_append(rec)
        if len(results.records()) == 4:  # interrupted inside example 2, after its `full` row
            raise KeyboardInterrupt
    results.append = append_then_die
    with pytest.raises(KeyboardInterrupt):
        run_eval(engine, exs, modes, results, max_new_tokens=4, progress=False)

    calls = []
    real_generate = engine.generate
    engine.generate = lambda segs, fusion, gen: calls.append(fusion.mode) or real_generate(segs, fusion, gen)
    resumed = ResultsFile(path, {"c": 1})
    run = run_eval(engine, exs, modes, resumed, max_new_tokens=4, progress=False)
    # example 2 reads its `full` reference from the copy kept beside the results; example 3 runs everything once
    assert calls == ["reuse", "blend", "full", "reuse", "blend"] and run["recomputed_references"] == 0
    _, records = read_results(path)
    assert sorted((r["example_id"], r["mode_key"]) for r in records) == sorted(
        (r["example_id"], r["mode_key"]) for r in clean)
    key = lambda r: (r["example_id"], r["mode_key"])  # noqa: E731
    for a, b in zip(sorted(records, key=key), sorted(clean, key=key)):
        assert a["prediction"] == b["prediction"] and a["scores"] == b["scores"]
        assert a["fidelity"]["first_token_kl"] == pytest.approx(b["fidelity"]["first_token_kl"], abs=1e-9)
    # nothing left to do: a third run computes nothing
    engine.generate = lambda *a, **k: pytest.fail("should not run")
    assert len(run_eval(engine, exs, modes, ResultsFile(path, {"c": 1}), max_new_tokens=4,
                        progress=False)["records"]) == 9


def test_adding_modes_reads_fulls_stored_reference_and_recomputes_one_it_cannot_trust(engine, tmp_path):
    exs, path = _examples(2), tmp_path / "r.jsonl"
    run_eval(engine, exs, _modes(engine, "full,reuse"), ResultsFile(path, {"c": 1}), max_new_tokens=4,
             progress=False)
    modes = _modes(engine, "full,reuse,blend:r=0.5,ape")
    fresh = {(r["example_id"], r["mode_key"]): r for r in
             run_eval(engine, exs, modes, max_new_tokens=4, progress=False)["records"]}  # no file: all computed
    calls = []
    real_generate = engine.generate
    engine.generate = lambda segs, fusion, gen: calls.append(fusion.mode) or real_generate(segs, fusion, gen)
    run = run_eval(engine, exs, modes[:3], ResultsFile(path, {"c": 1}), max_new_tokens=4, progress=False)
    assert calls == ["blend", "blend"] and run["recomputed_references"] == 0
    for r in run["records"]:
        f = fresh[(r["example_id"], r["mode_key"])]["fidelity"]
        assert r["fidelity"]["first_token_kl"] == pytest.approx(f["first_token_kl"], abs=1e-9)
        assert r["fidelity"]["greedy_agreement"] == f["greedy_agreement"]

    store = ReferenceStore(path, {"c": 1})
    full0 = next(r for r in run["records"] if r["example_id"] == "ex0" and r["mode_key"] == "full")
    assert store.load("ex0", full0).token_ids == full0["token_ids"]
    assert ReferenceStore(path, {"c": 2}).load("ex0") is None  # made under another run configuration
    assert store.load("ex0", {**full0, "token_ids": [1, 2, 3, 4]}) is None  # not the `full` that was recorded
    store._path("ex0").write_bytes(b"not a tensor file")  # a corrupt copy: `full` re-runs and rewrites it
    calls.clear()
    run = run_eval(engine, exs, modes, ResultsFile(path, {"c": 1}), max_new_tokens=4, progress=False)
    assert calls == ["full", "ape", "ape"] and run["recomputed_references"] == 1
    assert store.load("ex0", full0) is not None
    for r in run["records"]:
        f = fresh[(r["example_id"], r["mode_key"])]["fidelity"]
        assert r["fidelity"]["first_token_kl"] == pytest.approx(f["first_token_kl"], abs=1e-9)


def test_a_data_sets_stop_string_ends_every_modes_answer(engine):
    exs, modes = _examples(1), _modes(engine, "full,reuse")
    words = run_eval(engine, exs, modes, max_new_tokens=6, progress=False)["records"][0]["prediction"].split()
    stop = " " + words[2]  # the third word, as a one-line summary ends at its newline
    recs = run_eval(engine, exs, modes, max_new_tokens=6, progress=False, stop=(stop,))["records"]
    full = next(r for r in recs if r["mode_key"] == "full")
    assert full["prediction"] == " ".join(words[:2]) and full["finish_reason"] == "stop"
    assert all(stop not in r["prediction"] for r in recs)


def test_changed_mode_parameters_refuse_to_resume(engine, tmp_path):
    path = tmp_path / "r.jsonl"
    run_eval(engine, _examples(1), _modes(engine, "full,blend"), ResultsFile(path, {}), max_new_tokens=2,
             progress=False)
    other = resolve_modes(["blend"], FusionOptions(mode="full", ratio=0.3), {"ape_temperature": 0.9, "ape_scale": 0.9})
    with pytest.raises(RagkvError, match="blend.*--overwrite"):
        run_eval(engine, _examples(2), other, ResultsFile(path, {}), max_new_tokens=2, progress=False)


def test_records_that_stored_a_later_field_at_its_default_still_resume(engine):
    """Records written while kv_layout was stored at its default ("copied") resume under today's keys, which omit
    it; a stored non-default still refuses."""
    from ragkv.eval.harness import check_mode_params

    modes = _modes(engine, "reuse")
    check_mode_params([{"mode_key": "reuse", "params": {"kv_layout": "copied"}}], modes)
    with pytest.raises(RagkvError, match="reuse"):
        check_mode_params([{"mode_key": "reuse", "params": {"kv_layout": "shared"}}], modes)


def test_too_long_examples_are_skipped_and_first_token_only_runs(engine):
    long_ex = Example("long", "q ?", [Passage(" ".join(["x"] * 600))], ["a"], "qa", "accuracy")
    run = run_eval(engine, _examples(1) + [long_ex], _modes(engine, "full,reuse"), max_new_tokens=0, progress=False)
    assert run["skipped"] == ["long"] and len(run["records"]) == 2
    run = run_eval(engine, _examples(1), _modes(engine, "full,ape"), max_new_tokens=0, progress=False)
    rec = next(r for r in run["records"] if r["mode_key"] == "ape")
    assert rec["scores"] == {} and "greedy_agreement" not in rec["fidelity"] and rec["params"] == {
        "ape_temperature": 0.9, "ape_scale": 0.9}


def test_beyond_the_window_ape_runs_without_a_reference_and_truncation_is_the_baseline(engine):
    from ragkv.eval.harness import truncate_to_window

    # 3 passages of 300 words: 900+ tokens on a 512-position model; the gold passage (the answer) is the first
    passages = [Passage(" ".join([f"p{j}w{k}" for k in range(300)])) for j in range(3)]
    ex = Example("wide", "what ?", passages, ["w10"], "qa", "accuracy", {"gold_index": 0})
    run = run_eval(engine, [ex], _modes(engine, "full,reuse,ape"), max_new_tokens=4, progress=False)
    assert run["skipped"] == [] and [r["mode_key"] for r in run["records"]] == ["ape"]  # full and reuse cannot
    rec = run["records"][0]
    assert rec["fidelity"] == {} and "accuracy" in rec["scores"] and rec["num_passages"] == 3
    table = summarize(run["records"])
    assert table["ape"]["n"] == 1 and table["ape"]["first_token_kl"] is None
    cut = truncate_to_window(engine, [ex], max_new_tokens=4)[0]
    assert cut.passages == passages[2:] and cut.meta == {"gold_index": -1, "truncated_passages": 2}
    run = run_eval(engine, [cut], _modes(engine, "full,reuse"), max_new_tokens=4, progress=False)
    assert {r["mode_key"] for r in run["records"]} == {"full", "reuse"}
    assert all(r["truncated_passages"] == 2 and r["gold_index"] == -1 for r in run["records"])


def _rec(ex, mode, kl, top1, greedy, ttft, scores):
    return {"example_id": ex, "mode_key": mode, "scores": scores, "ttft_ms": ttft, "encode_ms": 0.0,
            "reused_tokens": 10, "recomputed_tokens": 5, "prompt_tokens": 15, "completion_tokens": 4,
            "fidelity": {"first_token_kl": kl, "top1_agreement": top1, "greedy_agreement": greedy,
                         "prefix_agreement": 4 * greedy}}


def test_summary_means_medians_and_ttft_ratio():
    recs = [_rec("a", "full", 0.0, 1.0, 1.0, 100.0, {"accuracy": 1.0, "f1": 0.5}),
            _rec("b", "full", 0.0, 1.0, 1.0, 300.0, {"accuracy": 0.0, "f1": 0.0}),
            _rec("a", "reuse", 0.1, 1.0, 0.0, 10.0, {"accuracy": 1.0, "f1": 1.0}),
            _rec("b", "reuse", 0.5, 0.0, 0.0, 30.0, {"accuracy": 0.0, "f1": 0.0}),
            _rec("c", "reuse", 0.3, 1.0, 1.0, 20.0, {"accuracy": 1.0, "f1": 0.5}),
            _rec("s", "other", 0.2, 1.0, 1.0, 20.0, {"rouge_l": 0.25})]
    s = summarize(recs, ["full", "reuse"])
    assert list(s) == ["full", "reuse"]
    assert s["full"]["accuracy"] == 0.5 and s["full"]["first_token_kl"] == 0.0 and s["full"]["ttft_vs_full"] == 1.0
    r = s["reuse"]
    assert r["n"] == 3 and r["accuracy"] == pytest.approx(2 / 3) and r["f1"] == 0.5
    assert r["first_token_kl"] == pytest.approx(0.3) and r["first_token_kl_median"] == 0.3
    assert r["top1_agreement"] == pytest.approx(2 / 3) and r["greedy_agreement"] == pytest.approx(1 / 3)
    assert r["ttft_vs_full"] == pytest.approx(40 / 400)  # over the examples `full` also ran: a and b
    assert "rouge_l" not in r and summarize(recs)["other"]["rouge_l"] == 0.25
    table = text_table(s)
    assert table.splitlines()[0].split()[:6] == ["mode", "n", "accuracy", "[95%", "CI]", "f1"] and "10.0%" in table
    # every task metric has a 95% bootstrap interval; the other modes a paired difference to `full`
    assert s["full"]["accuracy_ci"] == [0.0, 1.0] and "accuracy_vs_full" not in s["full"]
    assert r["accuracy_vs_full"] == 0.0 and r["accuracy_vs_full_ci"] == [0.0, 0.0] and r["accuracy_vs_full_n"] == 2
    assert r["f1_vs_full"] == pytest.approx(0.25) and r["f1_vs_full_ci"] == [0.0, 0.5]
    assert "0.667 [" in table and "+0.000 [+0.000, +0.000]" in table
    assert summarize(recs, ["full", "reuse"]) == s  # seeded: the same records give the same intervals


def test_task_scores_per_task():
    qa = Example("1", "q", [], ["Paris"], "qa", "accuracy")
    assert task_scores(qa, "It is Paris.\nMore text") == {"accuracy": 1.0, "f1": pytest.approx(0.5)}
    summ = Example("2", "q", [], ["the cat sat"], "summary", "rouge_l")
    assert task_scores(summ, "the cat sat") == {"rouge_l": 1.0}


def test_mode_keys():
    assert split_mode_list("full, ape:T=0.8,S=0.9,blend:r=0.3,reuse,full") == [
        "full", "ape:T=0.8,S=0.9", "blend:r=0.3", "reuse"]
    f = parse_mode_key("blend:r=0.3,dev=k,check=1+4,gradual=1,sink=2")
    assert (f.mode, f.ratio, f.deviation, f.check_layers, f.gradual, f.sink_tokens) == ("blend", 0.3, "k", (1, 4),
                                                                                        True, 2)
    assert parse_mode_key("blend", FusionOptions(mode="full", ratio=0.2)).ratio == 0.2
    (ape,) = resolve_modes(["ape"], FusionOptions(mode="full"), {"ape_temperature": 0.7, "ape_scale": 0.8})
    assert ape.params == {"ape_temperature": 0.7, "ape_scale": 0.8}
    local, plain = resolve_modes(["reuse:pos=local", "reuse"], FusionOptions(mode="full"), {"ape_temperature": 0.9, "ape_scale": 0.9})
    assert local.fusion.positions == "local" and local.params == {"positions": "local"}
    assert plain.params == {}  # results written before `positions` existed still resume
    for bad, msg in (("turbo", "unknown mode"), ("ape:r=0.1", "ape takes: T, S"), ("blend:r=x", "bad value"),
                     ("blend:r=2", "ratio"), ("reuse:T=1", "takes: pos"),
                     ("reuse:pos=global", "positions must be")):
        with pytest.raises(ModeKeyError, match=msg):
            parse_mode_key(bad)
    with pytest.raises(ModeKeyError):
        split_mode_list(" , ")


def test_sweeps_calibration_and_report(engine, tmp_path):
    from ragkv.bench.report import render_report
    from ragkv.bench.sweeps import SweepRun, blend_ratio_sweep, calibrate_ape
    from ragkv.engine.fusion.calibration import load_ape_params

    sw = SweepRun(engine, tmp_path / "out", tmp_path / "runs", "tiny", {"dataset": "tiny"}, max_new_tokens=3,
                  progress=False)
    blend = blend_ratio_sweep(sw, _examples(1), ratios=(0.0, 1.0))
    assert blend["rows"][1]["first_token_kl"] < 1e-8  # r = 1 recomputes everything: `full` (docs/invariants.md, invariant 6)
    assert (tmp_path / "out" / "sweep-blend-ratio-tiny.png").stat().st_size > 1000

    sw.max_new_tokens = 0
    grid = calibrate_ape(sw, _examples(2), temperatures=(0.8, 1.0), scales=(0.9, 1.0))
    best = grid["best"]
    assert best["first_token_kl"] == min(min(row) for row in grid["first_token_kl"])
    assert load_ape_params(engine.fingerprint)[:2] == (best["temperature"], best["scale"])
    assert (tmp_path / "out" / "calibration-tiny.png").is_file()
    with pytest.raises(ValueError, match="answers"):  # a task score needs generated answers
        calibrate_ape(sw, _examples(2), temperatures=(0.8,), scales=(0.9,), objective="score")
    # by task score (the APE paper's choice), stored for the examples' task beside the KL one
    sw_score = SweepRun(engine, tmp_path / "out", tmp_path / "runs-score", "tiny", {"dataset": "tiny"},
                        max_new_tokens=3, progress=False)
    by_score = calibrate_ape(sw_score, _examples(2), temperatures=(0.8, 1.0), scales=(0.9, 1.0), objective="score")
    b, metric = by_score["best"], by_score["metric"]
    assert by_score["objective"] == "score" and b[metric] == max(max(row) for row in by_score[metric])
    ties = [(t, s) for i, t in enumerate((0.8, 1.0)) for j, s in enumerate((0.9, 1.0))
            if by_score[metric][i][j] == b[metric]]
    assert b["first_token_kl"] == min(by_score["first_token_kl"][(0.8, 1.0).index(t)][(0.9, 1.0).index(s)]
                                      for t, s in ties)  # ties go to the lower KL
    assert load_ape_params(engine.fingerprint, "qa")[:2] == (b["temperature"], b["scale"])
    assert load_ape_params(engine.fingerprint, "summarization")[:2] == (b["temperature"], b["scale"])  # latest

    rf = ResultsFile(tmp_path / "runs" / "eval-tiny.jsonl", {"dataset": "tiny", "model": "tiny", "dtype": "float32",
                                                             "device": "cpu", "max_new_tokens": 3})
    run_eval(engine, _examples(2), _modes(engine, "full,reuse"), rf, max_new_tokens=3, progress=False)
    (tmp_path / "out" / "notes.md").write_text("Hand-written analysis.")
    page = render_report([rf.path], tmp_path / "nope.json", tmp_path / "out").read_text()
    assert "Hand-written analysis." in page and "### tiny" in page and "No `ragkv bench ttft` output" in page
    assert "## Sweep: CacheBlend recompute ratio" in page and "## APE calibration" in page
    assert (tmp_path / "out" / "quality-kl.png").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["datasets"]["tiny"]["n_examples"] == 2
    # every figure says which CPU made it: each record, and the table's caption
    assert {r["cpu"] for r in rf.records()} == {cpu_name()}
    assert f"on cpu ({cpu_name()}, " in page


def test_every_benchmark_json_names_its_machine(tmp_path):
    from ragkv.bench.common import save_json

    result = {"rows": [], "machine": {"loadavg_at_end": [0.1]}}
    saved = json.loads(save_json(tmp_path / "b.json", result).read_text())
    assert saved == result  # the returned result names its machine too
    assert saved["machine"]["cpu"] == cpu_name() and saved["machine"]["cpus"] >= 1
    assert saved["machine"]["loadavg_at_end"] == [0.1]  # a benchmark's own machine facts are kept


def _hotpot_file(path, n=2):
    recs = [{"question": f"Which city is the capital of country {i}?", "answer": "Paris", "type": "bridge",
             "level": "easy", "supporting_facts": {"title": ["A"], "sent_id": [0]},
             "context": {"title": ["A", "B"], "sentences": [["Paris is the capital of France."],
                                                             ["Berlin is in Germany."]]}} for i in range(n)]
    path.write_text(json.dumps(recs))
    return path


def test_cli_bad_input(tmp_path, capsys):
    data = _hotpot_file(tmp_path / "h.json")
    cases = [(["eval", "--dataset", "nope"], "unknown dataset"),
             (["eval", "--dataset", "hotpotqa", "--modes", "full,turbo"], "unknown mode 'turbo'"),
             (["eval", "--data-file", str(data), "--format", "weird"], "unknown: 'weird'"),
             (["eval", "--data-file", str(data), "--format", "hotpotqa", "--limit", "5"], "limit 5 is larger"),
             (["eval", "--data-file", str(tmp_path / "missing.json"), "--format", "hotpotqa"], "not found"),
             (["eval"], "no data"),
             (["calibrate", "--dataset", "musique"], "evaluation data"),
             (["eval", "--dataset", "hotpotqa", "--gold-position", "1"], "nq format only"),
             (["eval", "--dataset", "nq-distractors", "--gold-position", "10"], "gold_position must be in [0, 9]"),
             (["report", str(tmp_path / "none.jsonl")], "not found")]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        assert msg in capsys.readouterr().err, argv


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_cli_round_trip_on_default_model(default_engine, tmp_path, capsys, monkeypatch):
    from ragkv.engine.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: default_engine))  # load once per session
    data, out = _hotpot_file(tmp_path / "h.json"), tmp_path / "r.jsonl"
    argv = ["eval", "--data-file", str(data), "--format", "hotpotqa", "--modes", "full,reuse", "--limit", "1",
            "--max-new-tokens", "3", "--device", "cpu", "--output", str(out), "--json", "--no-progress"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert set(summary) == {"full", "reuse"} and summary["full"]["first_token_kl"] == 0.0
    assert {"accuracy", "f1", "top1_agreement", "greedy_agreement", "ttft_ms"} <= set(summary["reuse"])
    for r in read_results(out)[1]:  # each record keeps the top two log-probabilities of its first tokens
        steps = r["answer_steps"]
        assert len(steps) == len(r["token_ids"]) <= 3 and all(len(s) == 2 and s[0] >= s[1] for s in steps)
    # a results file of another configuration is never overwritten without --overwrite
    assert main(argv[:-6] + ["--max-new-tokens", "2", "--output", str(out), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(argv[:-6] + ["--max-new-tokens", "2", "--output", str(out), "--no-progress", "--overwrite"]) == 0
    assert "reuse" in capsys.readouterr().out


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_short_answer_sets_ask_for_short_answers_and_rag_keeps_the_engines_prompt(default_engine, tmp_path, capsys,
                                                                                  monkeypatch):
    """MuSiQue and HotpotQA (token F1) run under their own short-answer instruction; `--prompt rag` gives the
    engine's RAG prompt (the records written before), `--prompt short` the instruction to any set, and each file's
    header says which prompt made it."""
    from dataclasses import asdict

    from ragkv.config import data_dir
    from ragkv.engine.engine import Engine
    from ragkv.eval.datasets import SHORT_ANSWER_PROMPT, dataset_prompt

    if not (data_dir() / "MANIFEST.md").is_file():
        pytest.skip("the shared data is not beside the checkout")
    assert dataset_prompt("musique") is SHORT_ANSWER_PROMPT and dataset_prompt("hotpotqa") is SHORT_ANSWER_PROMPT
    assert "five words" in SHORT_ANSWER_PROMPT.system and "{question}" in SHORT_ANSWER_PROMPT.query_template
    assert dataset_prompt("nq-distractors") is None  # accuracy (gold string contained): the RAG prompt
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: default_engine))
    argv = ["eval", "--dataset", "hotpotqa", "--modes", "full", "--limit", "1", "--max-new-tokens", "1",
            "--device", "cpu", "--no-progress"]
    own, rag = tmp_path / "own.jsonl", tmp_path / "rag.jsonl"
    assert main(argv + ["--output", str(own)]) == 0
    assert main(argv + ["--prompt", "rag", "--output", str(rag)]) == 0
    capsys.readouterr()
    assert read_results(own)[0]["prompt_format"] == asdict(SHORT_ANSWER_PROMPT)
    assert read_results(rag)[0]["prompt_format"] == asdict(default_engine.prompt_format)
    # a file made under one prompt does not resume under the other
    assert main(argv + ["--output", str(rag)]) == 2 and "--overwrite" in capsys.readouterr().err
    # `--prompt short`: the short-answer instruction for any question set (held-out calibration data)
    short = tmp_path / "short.jsonl"
    assert main(argv[:2] + ["nq-distractors-heldout"] + argv[3:] + ["--prompt", "short", "--output", str(short)]) == 0
    assert read_results(short)[0]["prompt_format"] == asdict(SHORT_ANSWER_PROMPT)


def test_cli_shards_merge_into_the_unsharded_run(default_engine, tmp_path, capsys, monkeypatch):
    from ragkv.engine.engine import Engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: default_engine))
    data = _hotpot_file(tmp_path / "h.json", n=3)
    argv = ["eval", "--data-file", str(data), "--format", "hotpotqa", "--modes", "full,reuse", "--max-new-tokens",
            "2", "--device", "cpu", "--no-progress"]
    whole, shards = tmp_path / "whole.jsonl", [tmp_path / "s1.jsonl", tmp_path / "s2.jsonl"]
    assert main(argv + ["--output", str(whole)]) == 0
    for k, path in enumerate(shards, start=1):
        assert main(argv + ["--shard", f"{k}/2", "--output", str(path)]) == 0
    assert [len({r["example_id"] for r in read_results(p)[1]}) for p in shards] == [2, 1]  # examples 1, 3 | 2
    capsys.readouterr()
    assert main(["report", *map(str, shards), "--tables"]) == 0
    merged = capsys.readouterr().out
    assert main(["report", str(whole), "--tables"]) == 0
    alone = capsys.readouterr().out
    assert merged.count("### ") == 1 and "3 examples" in merged
    def quality(out):  # mode .. greedy agreement: everything but the timings
        return [line.split(" | ")[:9] for line in out.splitlines() if line.startswith(("| full", "| reuse"))]

    assert len(quality(merged)) == 2 and quality(merged) == quality(alone)
    with pytest.raises(SystemExit):  # argparse: usage and the reason, exit status 2
        main(argv + ["--shard", "3/2"])
    assert "1 <= K <= N" in capsys.readouterr().err


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_a_w8a8_run_is_judged_against_the_exact_weights_full(default_engine, tmp_path, capsys, monkeypatch):
    """`eval --decode-weights w8a8 --reference-from EXACT_RUN`: every mode, `full` included, runs on the int8
    products and is judged against the exact run's stored `full` answers; its records say which weights made them
    and the estimate they stated. A reference of other prompts, of fewer examples, or of approximate weights is a
    clear error."""
    from ragkv.engine.engine import Engine

    fast = Engine(default_engine._loaded, default_engine.store, decode_weights="w8a8")
    monkeypatch.setattr(Engine, "load", classmethod(
        lambda cls, *a, **k: fast if k.get("decode_weights") == "w8a8" else default_engine))
    data = _hotpot_file(tmp_path / "h.json", n=3)
    argv = ["eval", "--data-file", str(data), "--format", "hotpotqa", "--modes", "full,reuse", "--max-new-tokens",
            "2", "--device", "cpu", "--no-progress"]
    exact, approx = tmp_path / "exact.jsonl", tmp_path / "w8a8.jsonl"
    assert main(argv + ["--limit", "2", "--output", str(exact)]) == 0
    w8a8 = argv + ["--decode-weights", "w8a8", "--reference-from", str(exact)]
    assert main(w8a8 + ["--limit", "2", "--output", str(approx)]) == 0
    config, recs = read_results(approx)
    assert config["decode_weights"] == "w8a8" and config["reference_from"] == ["exact.jsonl"]
    full = [r for r in recs if r["mode_key"] == "full"]
    assert len(full) == 2 and all(r["fidelity"]["first_token_kl"] > 0 for r in full)  # not its own reference
    for r in recs:
        mf = r["mode_fidelity"]
        assert mf["exact"] is False and mf["decode_weights"] == "w8a8" and mf["estimate"]["expected_kl"] > 0
    capsys.readouterr()
    assert main(w8a8 + ["--limit", "3", "--output", str(tmp_path / "more.jsonl")]) == 2
    assert "no stored `full` answer for 1 of the 3 examples" in capsys.readouterr().err
    other = _hotpot_file(tmp_path / "other.json", n=2)
    assert main([*w8a8[:2], str(other), *w8a8[3:], "--limit", "2", "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "data_file differ" in capsys.readouterr().err
    assert main(argv + ["--decode-weights", "w8a8", "--reference-from", str(approx), "--limit", "2", "--output",
                        str(tmp_path / "x.jsonl")]) == 2
    assert "not run on this model's exact weights" in capsys.readouterr().err
    assert main(argv + ["--decode-weights", "w8a8", "--output", str(tmp_path / "y.jsonl")]) == 2
    assert "pass that results file as --reference-from" in capsys.readouterr().err


def test_cli_gold_position_names_the_run():
    import argparse

    from ragkv.cli.eval_data import dataset_spec

    args = argparse.Namespace(dataset="nq-distractors", data_file=None, format=None, num_passages=None, split=None,
                              gold_position=4)
    label, desc, kw = dataset_spec(args, None)
    assert label == "nq-distractors-g4" and desc["gold_position"] == 4 and kw["gold_position"] == 4
    label, desc, kw = dataset_spec(argparse.Namespace(**{**vars(args), "gold_position": None}), None)
    assert label == "nq-distractors" and "gold_position" not in desc  # older results files still resume


def test_lost_in_the_middle_table_and_figure(tmp_path, capsys):
    def rec(ex, mode, acc):
        return {"example_id": ex, "mode_key": mode, "scores": {"accuracy": acc}, "ttft_ms": 1.0,
                "fidelity": {"first_token_kl": 0.0, "top1_agreement": 1.0}}

    paths = []
    for g, full_right in ((0, 3), (4, 1), (9, 2)):
        path = tmp_path / f"eval-nq-g{g}.jsonl"
        rf = ResultsFile(path, {"model": "m", "dtype": "bfloat16", "device": "cpu", "threads": 1, "max_new_tokens": 32,
                                "dataset": "nq-distractors", "gold_position": g})
        for i in range(4):
            rf.append(rec(str(i), "full", float(i < full_right)))
            rf.append(rec(str(i), "reuse", 0.0))
        if g == 4:
            rf.append(rec("4", "full", 1.0))  # `reuse` still pending on example 4: left out everywhere
        paths.append(str(path))
    png = tmp_path / "litm.png"
    assert main(["report", *paths, "--lost-in-the-middle", str(png)]) == 0
    table = capsys.readouterr().out
    assert png.is_file()
    assert table.splitlines()[0] == "| model | n | mode | gold at 0 | gold at 4 | gold at 9 | all positions |"
    assert "| m (bfloat16) | 4 | full | 0.750 [" in table and "; -0.750 [" in table  # reuse vs full at gold 0
    # all positions: per question the mean over its 3 positions (full: 1, 2/3, 1/3, 0), resampled by question
    full_row, reuse_row = table.splitlines()[2:4]
    assert full_row.split(" | ")[-1].startswith("0.500 [") and reuse_row.split(" | ")[-1].startswith("0.000 [0.000, "
                                                                                                     "0.000]; -0.500 [")
    assert main(["report", *paths, "--tables"]) == 0
    out = capsys.readouterr().out
    assert "### nq-distractors-g4" in out and "--gold-position 4" in out and "acc - full [95% CI]" in out
    assert not (tmp_path / "README.md").exists()


def test_quality_vs_work_pools_the_runs_and_pairs_with_full(tmp_path, capsys):
    """`report --vs-work`: per mode, the mean work and the accuracy difference to full paired per question over
    every run given, only where all modes finished; the interval resamples questions, each with all its gold
    positions together (a cluster bootstrap: the positions share the question and its distractors)."""
    def rec(ex, mode, acc, work, kl):
        return {"example_id": ex, "mode_key": mode, "scores": {"accuracy": acc}, "ttft_ms": 1.0,
                "recompute_vs_full": work, "fidelity": {"first_token_kl": kl, "top1_agreement": 1.0}}

    paths = []
    for g in (0, 9):
        path = tmp_path / f"eval-nq-g{g}.jsonl"
        rf = ResultsFile(path, {"model": "m", "dtype": "float32", "device": "cpu", "threads": 1, "max_new_tokens": 32,
                                "dataset": "nq-distractors", "gold_position": g})
        for i in range(3):
            rf.append(rec(str(i), "full", 1.0, 1.0, 0.0))
            rf.append(rec(str(i), "blend:r=0.2", float(i != 0), 0.2 + 0.1 * (g == 9), 0.1))
        rf.append(rec("3", "full", 1.0, 1.0, 0.0))  # blend still pending: left out
        paths.append(str(path))
    png = tmp_path / "work.png"
    assert main(["report", *paths, "--vs-work", str(png)]) == 0
    table = capsys.readouterr().out
    assert png.is_file()
    row = next(line for line in table.splitlines() if "| blend:r=0.2 |" in line)
    assert "| m (float32) | 6 (3 q) | blend:r=0.2 | 0.250 | 0.667 [" in row and "; -0.333 [" in row and row.endswith(
        "| 0.100 |")
    # a mode run at one position only shrinks the comparison to that position, unless --modes leaves it out
    extra = ResultsFile(tmp_path / "eval-nq-g0.jsonl", {"model": "m", "dtype": "float32", "device": "cpu", "threads": 1,
                                         "max_new_tokens": 32, "dataset": "nq-distractors", "gold_position": 0})
    for i in range(3):
        extra.append(rec(str(i), "reuse", 0.0, 0.03, 0.4))
    assert main(["report", *paths, "--vs-work", str(png)]) == 0
    assert "| m (float32) | 3 (3 q) | blend:r=0.2 |" in capsys.readouterr().out
    assert main(["report", *paths, "--vs-work", str(png), "--modes", "blend:r=0.2"]) == 0
    table = capsys.readouterr().out
    assert "| m (float32) | 6 (3 q) | blend:r=0.2 |" in table and "reuse" not in table


def test_the_pooled_interval_resamples_questions_not_question_position_pairs():
    from ragkv.bench.report import _pooled_over_positions

    def rec(q, pos, mode, acc):
        return {"example_id": f"{pos}:{q}", "question": q, "mode_key": mode, "scores": {"accuracy": acc}}

    # 8 questions at 3 positions each; a mode right on half the questions at every position
    recs = [rec(str(q), p, m, 1.0 if m == "full" or q % 2 else 0.0) for q in range(8) for p in range(3)
            for m in ("full", "blend")]
    clustered = _pooled_over_positions(recs, ["full", "blend"], "accuracy")["blend"]["accuracy_vs_full_ci"]
    naive = _pooled_over_positions([{**r, "question": r["example_id"]} for r in recs], ["full", "blend"],
                                   "accuracy")["blend"]["accuracy_vs_full_ci"]
    assert clustered[1] - clustered[0] > 1.4 * (naive[1] - naive[0])  # 8 clusters, not 24 independent pairs


def test_cli_calibrates_auto_on_held_out_records_and_auto_uses_it(default_engine, tmp_path, capsys, monkeypatch):
    """`ragkv calibrate --target auto`: runs full and the query-aware blend (first token only), picks a risk
    signal and threshold, stores them per model; `auto` then escalates on them unless a request sets its own."""
    from ragkv.engine.engine import Engine
    from ragkv.engine.fusion.calibration import load_auto_params

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: default_engine))
    # the calibration it stores must not reach later tests that load the default model (models stay found)
    monkeypatch.setenv("RAGKV_CACHE_DIR", str(tmp_path / "cache"))
    data = _hotpot_file(tmp_path / "h.json", n=4)
    argv = ["calibrate", "--target", "auto", "--data-file", str(data), "--format", "hotpotqa", "--limit", "4",
            "--ratio", "0.2",
            "--target-kl", "0", "--max-escalation", "0.5", "--output-dir", str(tmp_path / "cal"),
            "--results-dir", str(tmp_path / "runs"), "--no-progress", "--json"]
    assert main(argv) == 0
    cal = json.loads(capsys.readouterr().out)
    from ragkv.engine.measure.risk import SIGNALS

    assert cal["n"] == 4 and cal["escalation_rate"] == 0.5 and cal["signal"] in SIGNALS
    assert set(cal["spearman"]) == set(SIGNALS)  # the query-aware selection gives every signal
    assert load_auto_params(default_engine.fingerprint)[:2] == (cal["signal"], cal["threshold"])
    records = next((tmp_path / "runs").glob("sweep-calibrate-auto-*.jsonl"))
    # the same records, read back instead of run again, give the same choice
    assert main(["calibrate", "--target", "auto", "--records", str(records), "--ratio", "0.2", "--target-kl", "0",
                 "--max-escalation", "0.5", "--output-dir", str(tmp_path / "cal"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["signal"], again["threshold"]) == (cal["signal"], cal["threshold"])
    monkeypatch.setattr(default_engine, "auto_signal", cal["signal"])
    monkeypatch.setattr(default_engine, "auto_max_risk", cal["threshold"])
    monkeypatch.setattr(default_engine, "auto_source", "test")
    from ragkv.engine.options import FusionOptions
    from ragkv.eval.datasets import load_dataset

    ex = load_dataset(None, str(data), "hotpotqa", 4)
    escalated = []
    for e in ex:
        st = default_engine.prefill(default_engine.segments(e.question, e.passages), FusionOptions(mode="auto",
                                                                                                  ratio=0.2))[1]
        at_risk = st.recompute.risks[0][cal["signal"]] > cal["threshold"]
        assert st.fidelity["escalations"] == int(at_risk) and st.fidelity["exact"] == at_risk
        assert st.fidelity["calibration"] == "test" and st.fidelity["signal_name"] == cal["signal"]
        escalated.append(at_risk)
    assert sum(escalated) == 2  # the same answers the calibration escalated: half of them
