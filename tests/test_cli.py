"""The command line: every subcommand listed, bad input answered with one line and exit code 2."""

import json

import pytest

from ragkv.cli import main
from tiny import default_model_available

needs_model = pytest.mark.skipif(not default_model_available(), reason="default model not converted")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("generate", "models", "ask", "bench", "store", "ingest", "serve", "eval", "sweep", "calibrate",
                "report", "finetune"):
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for bench in ("ttft", "engine", "store", "serve"):
        assert bench in out


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--prompt", "hi", "--dtype", "float8"], "unknown dtype"),
    (["generate", "--prompt", "hi", "--device", "tpu"], "unknown device"),
    (["generate", "--prompt", "hi", "--model", "/no/such/folder"], "not a known name"),
    (["ask", "--doc", "/no/such/file.txt", "--question", "q", "--dtype", "float32"], "cannot read passage"),
    (["ask", "--question", "q", "--mode", "blend", "--ratio", "1.5", "--doc", "x"], "ratio"),
    (["finetune-report", "--row", "base="], "KEY=FILE,FILE"),
    (["finetune-report", "--row", "base=/no/such/results.jsonl"], "/no/such/results.jsonl"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    code, _, err = run(capsys, *argv)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_model_folder_problems(capsys, tmp_path, tiny_dirs):
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--model", str(tmp_path / "empty"))
    assert code == 2 and "config.json" in err
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--model", str(gpt2))
    assert code == 2 and "llama, mistral, qwen2" in err
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--model", str(tiny_dirs["llama"]))
    assert code == 2 and "tokenizer" in err  # the tiny checkpoint has weights but no tokenizer


@needs_model
@pytest.mark.model
def test_generate_json_and_overlong_prompt(capsys):
    code, out, _ = run(capsys, "generate", "--prompt", "Name a color.", "--max-new-tokens", "4", "--json",
                       "--dtype", "float32")
    rec = json.loads(out)
    assert code == 0 and {"text", "prompt_tokens", "completion_tokens", "ttft_ms", "tokens_per_s", "model",
                          "dtype"} <= rec.keys() and rec["dtype"] == "float32"
    code, _, err = run(capsys, "generate", "--prompt", "word " * 9000, "--dtype", "float32")
    assert code == 2 and "8192" in err and "90" in err


@needs_model
@pytest.mark.model
def test_ask_two_questions_second_hits_every_block(capsys):
    code, out, _ = run(capsys, "ask", "--docs-dir", "examples/docs", "--question", "What does APE scale?",
                       "--question", "What does CacheBlend recompute?", "--json", "--max-new-tokens", "4",
                       "--dtype", "float32", "--mode", "reuse")
    first, second = json.loads(out)
    assert code == 0 and first["cache_misses"] == 4 and second["cache_hits"] == 4 and second["cache_misses"] == 0
    assert {"answer", "mode", "ttft_ms", "prompt_tokens", "reused_tokens", "recomputed_tokens", "fetch_ms",
            "rerotate_ms", "recompute_ms", "query_prefill_ms"} <= second.keys()


def test_ask_states_how_close_to_full_each_answer_is(capsys):
    """Every answer says how it was computed: exact for full, approximate with its signal for a recompute."""
    common = ("ask", "--docs-dir", "examples/docs", "--question", "What does APE scale?", "--max-new-tokens", "2",
              "--dtype", "float32")
    code, _, err = run(capsys, *common, "--mode", "full")
    assert code == 0 and "exact (equals full)" in err
    code, out, err = run(capsys, *common, "--mode", "blend", "--select", "query", "--ratio", "0.2")
    assert code == 0 and "[blend select=query r=0.2]" in err and "approximate: expected KL to full " in err
    assert "first token as full's " in err and "risk shift" in err
    code, out, err = run(capsys, *common, "--json")  # no --mode: the documents default, a mode key
    fidelity = json.loads(out)["fidelity"]
    assert code == 0 and fidelity["mode"] == "blend" and fidelity["select"] == "query", fidelity
    assert fidelity["estimate"]["expected_kl"] is not None
    code, out, err = run(capsys, *common, "--mode", "blend:sel=recent,r=0.1", "--json")
    assert code == 0 and json.loads(out)["fidelity"]["select"] == "recent"
    code, _, err = run(capsys, *common, "--mode", "blend:nope=1")
    assert code == 2 and "nope" in err
    code, out, _ = run(capsys, *common, "--mode", "blend", "--select", "query", "--json")
    fidelity = json.loads(out)["fidelity"]
    assert fidelity["select"] == "query" and fidelity["exact"] is False and fidelity["signal"] >= 0
    code, out, _ = run(capsys, *common, "--mode", "blend", "--select", "query", "--draft-tokens", "3", "--json")
    assert code == 0 and json.loads(out)["fidelity"]["draft_tokens"] == 3


@pytest.mark.parametrize("case,needle", [
    ("brace", "not valid JSON"), ("empty", "not valid JSON"), ("list", "not an object"),
    ("no vocab", "vocab_size"), ("negative size", "positive integer"), ("a billion layers", "num_hidden_layers"),
    ("wrong hidden size", "does not match the weights"), ("garbage weights", "not a readable safetensors"),
])
def test_a_broken_model_folder_is_one_line_before_anything_is_allocated(capsys, tmp_path, tiny_dirs, case, needle):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    text = {"brace": "{", "empty": "", "list": "[]"}.get(case)
    if case == "no vocab":
        del cfg["vocab_size"]
    elif case == "negative size":
        cfg["intermediate_size"] = -5
    elif case == "a billion layers":
        cfg["num_hidden_layers"] = 1_000_000_000
    elif case == "wrong hidden size":
        cfg["hidden_size"] *= 2
    elif case == "garbage weights":
        (folder / "model.safetensors").write_bytes(b"not safetensors" * 64)
    (folder / "config.json").write_text(text if text is not None else json.dumps(cfg))
    code, _, err = run(capsys, "generate", "--prompt", "hi", "--model", str(folder))
    assert code == 2 and needle in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,needle", [
    (["--port", "80000"], "--port"), (["--max-queue", "0"], "--max-queue"), (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"), (["--namespace", "../x"], "namespace"), (["--max-body", "0"], "--max-body"),
    (["--store", "disk:/tmp/x:-5GiB"], "-5GiB"), (["--store", "disk:/tmp/x:1GiB:extra"], "extra"),
    (["--api-key", "short"], "API key"), (["--api-keys", "/no/such/keys.txt"], "--api-keys"),
    (["--api-key", "key-aaaaaaaa:../tenant"], "namespace"), (["--mode", "blend", "--ratio", "2"], "ratio"),
    (["--prefill-stall-ms", "-5"], "--prefill-stall-ms"), (["--prefill-stall-ms", "inf"], "--prefill-stall-ms"),
    (["--keep-alive", "0"], "--keep-alive"),
])
def test_serve_flags_are_checked_before_the_model_loads(capsys, argv, needle):
    code, _, err = run(capsys, "serve", "--model", "/no/such/model", *argv)
    assert code == 2 and needle in err and "/no/such/model" not in err, err


def test_a_reader_that_leaves_early_is_not_a_traceback(tmp_path):
    """`ragkv finetune-report ... | head` with the reader gone: exit 141 as `cat` would, no traceback."""
    import os
    import subprocess
    import sys

    from ragkv.eval.results import ResultsFile

    f = ResultsFile(tmp_path / "r.jsonl", {"model": "m"})
    f.append({"example_id": "q0", "mode_key": "full", "completion_tokens": 2, "scores": {"accuracy": 1, "f1": 1},
              "fidelity": {"first_token_kl": 0.0}})
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "ragkv.cli", "finetune-report", "--row", f"base={f.path}"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "Exception" not in done.stderr, done.stderr


def test_asks_line_names_the_selection_its_ratio_and_its_ranking():
    """`ragkv ask` prints what ran beside each answer: the default's second-half ranking too."""
    from ragkv.cli.ask import mode_label
    from ragkv.engine.options import FusionOptions

    assert mode_label(FusionOptions(mode="blend", select="query", ratio=0.14, score_from=0.5)) == \
        "blend select=query r=0.14 score_from=0.5"
    assert mode_label(FusionOptions(mode="blend", ratio=0.15)) == "blend select=deviation r=0.15"
    assert mode_label(FusionOptions(mode="reuse")) == "reuse"
