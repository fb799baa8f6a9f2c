"""`--model FILE.gguf`: a GGUF file converted once per content into the models folder. The default model's own
GGUF, loaded by path, is the registered default; a second load and a renamed copy reuse the conversion; paths
that are no usable GGUF are one clear line."""

import hashlib
import os
import shutil
import time

import httpx
import numpy as np
import pytest
import torch

from ragkv.cli import main
from ragkv.errors import ModelNotFoundError, UnsupportedModelError
from ragkv.models import gguf_files
from ragkv.models.registry import KNOWN_MODELS, converted_path, gguf_path, is_converted, resolve_model_path

DEFAULT_DIR = converted_path("smollm2")  # read before this module points the models folder at a temporary one
PROMPT = "Explain in two sentences why a KV cache makes decoding faster."


def default_gguf():
    try:
        return gguf_path(KNOWN_MODELS["smollm2"])
    except ModelNotFoundError as e:
        pytest.skip(str(e))


def entries(folder):
    """What a re-conversion would change: every file's name, inode and mtime."""
    return sorted((p.name, p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir())


@pytest.fixture
def models_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGKV_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The default GGUF converted once by path into a private models folder (~30 s), for the whole module."""
    gguf = default_gguf()
    root = tmp_path_factory.mktemp("gguf-models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAGKV_MODELS_DIR", str(root))
        folder = resolve_model_path(str(gguf))
        yield gguf, folder
    shutil.rmtree(root, ignore_errors=True)  # 540 MB of fp32 weights


@pytest.fixture
def converted_env(converted, monkeypatch):
    gguf, folder = converted
    monkeypatch.setenv("RAGKV_MODELS_DIR", str(folder.parents[1]))
    return gguf, folder


def forbid(monkeypatch, *names):
    """Make the named gguf_files steps fail loudly: the code under test must not reach them."""
    for name in names:
        def refuse(*a, _name=name, **k):
            raise AssertionError(f"{_name} was called")
        monkeypatch.setattr(gguf_files, name, refuse)


@pytest.mark.model
def test_the_default_gguf_by_path_gives_the_registered_defaults_logits(converted_env):
    from ragkv.models.loader import load_model

    if not is_converted(DEFAULT_DIR):
        pytest.skip("default model not converted (run `ragkv models --prepare`)")
    gguf, folder = converted_env
    by_path = load_model(str(gguf), torch.float32)
    registered = load_model(str(DEFAULT_DIR), torch.float32)
    assert by_path.path == folder and folder.parent == gguf_files.converted_root()
    messages = [{"role": "user", "content": PROMPT}]
    ids = registered.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    assert by_path.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ours, ref = by_path.model(x, all_logits=True), registered.model(x, all_logits=True)
    assert ours.shape == ref.shape and (ours - ref).abs().max().item() <= 1e-4
    # Same weights, tokenizer and config: the same fingerprint, so both names share cached KV blocks.
    assert by_path.fingerprint == registered.fingerprint


@pytest.mark.model
def test_a_second_load_neither_hashes_nor_converts(converted_env, monkeypatch):
    gguf, folder = converted_env
    before = entries(folder)
    forbid(monkeypatch, "sha256_file", "read_header", "convert_file")
    assert resolve_model_path(str(gguf)) == folder
    assert entries(folder) == before
    assert [p.name for p in gguf_files.converted_root().iterdir() if p.is_dir()] == [folder.name]  # no leftovers


@pytest.mark.model
def test_a_renamed_copy_reuses_the_conversion_and_a_changed_file_converts_again(converted_env, tmp_path,
                                                                                monkeypatch):
    gguf, folder = converted_env
    before = entries(folder)
    copy = tmp_path / "renamed-elsewhere.gguf"
    shutil.copyfile(gguf, copy)
    hashed = []
    real_sha = gguf_files.sha256_file
    monkeypatch.setattr(gguf_files, "sha256_file", lambda p, *a: hashed.append(p) or real_sha(p, *a))
    forbid(monkeypatch, "convert_file")
    assert resolve_model_path(str(copy)) == folder and hashed == [copy]  # hashed once: new path, same bytes
    assert resolve_model_path(str(copy)) == folder and hashed == [copy]  # remembered now
    assert entries(folder) == before

    # One byte of tensor data changed at the same path: a new digest, so a conversion into a new folder starts
    # (stopped here: the real conversion above is the one this module pays for).
    with open(copy, "r+b") as fh:
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    started = []

    def record(src, target, note=None):
        started.append((target, note))
        raise RuntimeError("conversion stopped by the test")
    monkeypatch.setattr(gguf_files, "convert_file", record)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        resolve_model_path(str(copy))
    (target, note), = started
    assert target != folder and target.parent == folder.parent and not target.exists()
    assert note["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest() and note["architecture"] == "llama"


@pytest.mark.model
def test_models_command_lists_the_converted_file_and_prepare_takes_a_path(converted_env, capsys, monkeypatch):
    gguf, folder = converted_env
    forbid(monkeypatch, "convert_file")
    assert main(["models", "--prepare", str(gguf)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if str(folder) in ln)
    assert gguf.name in line and "llama" in line


@pytest.mark.model
def test_the_server_serves_a_gguf_path_without_converting_again(converted_env, tmp_path):
    from ragkv.bench.serve import ServerProcess

    gguf, folder = converted_env
    with ServerProcess(model=str(gguf), dtype="float32", device="cpu", store="memory:256MiB", startup_s=180,
                       cache_dir=tmp_path) as server:
        assert [m["id"] for m in httpx.get(server.url + "/v1/models", timeout=60).json()["data"]] == [str(gguf)]
        # A first request may wait behind the server's start-up profiling (2K-token prefills): slow on a busy CPU.
        r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
            "model": str(gguf), "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        log = server.log_path.read_text()
    assert "converting" not in log and str(gguf) in log


def write_gguf(path, arch):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(path, tokenizer_model="gpt2", vocab=64, hidden=16, ff=32, heads=2):
    """A complete one-layer Llama GGUF with random fp32 weights and a toy BPE vocabulary: converts in seconds."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list([chr(ord("a") + i % 26) * (1 + i // 26) for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["a a"])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (hidden, hidden)), ("attn_v", (hidden, hidden)),
                        ("attn_output", (hidden, hidden)), ("ffn_gate", (ff, hidden)), ("ffn_up", (ff, hidden)),
                        ("ffn_down", (hidden, ff))]:
        w.add_tensor(f"blk.0.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_conversion_that_fails_midway_leaves_no_entry_behind(tmp_path, models_tmp):
    write_tiny_llama(tmp_path / "good.gguf")
    folder = resolve_model_path(str(tmp_path / "good.gguf"))  # the whole path for real, on a tiny model
    assert is_converted(folder) and folder.parent == gguf_files.converted_root()
    # This one fails after its weights are written (transformers has no 'nonsense' tokenizer): a clear error,
    # and neither an entry nor a temporary folder is left.
    write_tiny_llama(tmp_path / "bad.gguf", tokenizer_model="nonsense")
    with pytest.raises(UnsupportedModelError, match="could not convert.*nonsense"):
        resolve_model_path(str(tmp_path / "bad.gguf"))
    assert sorted(p.name for p in gguf_files.converted_root().iterdir()) == sorted([folder.name, "digests.json"])
    assert [f for f, _ in gguf_files.converted_gguf_models()] == [folder]


def test_temporaries_of_killed_conversions_are_removed_once_stale(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    old = time.time() - 2 * 3600
    made = {name: tmp_path / name for name in (f".abc.partial-{dead}-x1", f".link-{dead}-x2",
                                               f".abc.partial-{dead}-x3", f".abc.partial-{os.getpid()}-x4")}
    for path in made.values():
        path.mkdir()
    for name in (f".abc.partial-{dead}-x1", f".link-{dead}-x2", f".abc.partial-{os.getpid()}-x4"):
        os.utime(made[name], (old, old))
    gguf_files.remove_stale_temporaries(tmp_path)
    # Gone: a dead process's old folders. Kept: a dead process's recent one, and a live process's.
    assert {p.name for p in tmp_path.iterdir()} == {f".abc.partial-{dead}-x3", f".abc.partial-{os.getpid()}-x4"}


def test_paths_that_are_no_usable_gguf_are_one_clear_line(capsys, tmp_path, models_tmp):
    (tmp_path / "notes.gguf").write_text("these are notes, not weights\n")
    (tmp_path / "truncated.gguf").write_bytes(b"GGUF\x03\x00\x00\x00")
    write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    write_gguf(tmp_path / "bare-llama.gguf", "llama")  # converted as is, it would be a default 7B of zeros
    cases = [(tmp_path / "missing.gguf", ["no such file or folder", "missing.gguf"]),
             (tmp_path / "notes.gguf", ["is not a GGUF file", "b'thes'"]),
             (tmp_path / "truncated.gguf", ["not a readable GGUF file"]),
             (tmp_path / "gpt2.gguf", ["architecture 'gpt2'", "llama, mistral, qwen2"]),
             (tmp_path / "bare-llama.gguf", ["lacks llama.block_count", "tokenizer.ggml.tokens"])]
    for path, needles in cases:
        code = main(["generate", "--prompt", "hi", "--dtype", "float32", "--model", str(path)])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert all(n in err for n in needles), err
    assert not models_tmp.exists()  # refused before any hashing or converting: nothing written, nothing half-made


def test_a_files_digest_is_remembered_until_its_bytes_or_identity_change(tmp_path, models_tmp, monkeypatch):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    hashed = []
    real_sha = gguf_files.sha256_file
    monkeypatch.setattr(gguf_files, "sha256_file", lambda p, *a: hashed.append(p) or real_sha(p, *a))

    def sha():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    assert gguf_files.file_digest(path) == sha() and len(hashed) == 1
    assert gguf_files.file_digest(path) == sha() and len(hashed) == 1  # unchanged: not read again
    st = path.stat()
    with open(path, "r+b") as fh:  # same size, same mtime restored, other bytes: a new mtime is the tell
        fh.seek(100)
        fh.write(b"\xff")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert gguf_files.file_digest(path) == sha() and len(hashed) == 2
    replacement = tmp_path / "new.gguf"  # swapped in by rename with the old size and mtime: a new inode
    replacement.write_bytes(b"GGUF" + bytes(reversed(range(256))) * 64)
    os.utime(replacement, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    os.replace(replacement, path)
    assert gguf_files.file_digest(path) == sha() and len(hashed) == 3
