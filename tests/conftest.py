import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import ARCHS, default_model_available, make_tiny  # noqa: E402
from redis_fixture import redis_server, redis_url  # noqa: E402, F401 (fixtures for every test module)

torch.set_num_threads(2)
# RAGKV_TEST_DEVICE=cuda runs the tiny-model tests on a GPU (the engine's CUDA check); CI runs them on the CPU.
TEST_DEVICE = os.environ.get("RAGKV_TEST_DEVICE", "cpu")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny(arch, root) for arch in ARCHS}


def _load_tiny(path, dtype=torch.float32):
    from ragkv.models import loader

    real = loader.load_tokenizer
    loader.load_tokenizer = lambda p: None  # tiny models carry no tokenizer; tests feed token ids
    try:
        return loader.load_model(str(path), dtype, device=TEST_DEVICE)
    finally:
        loader.load_tokenizer = real


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dirs):
    return {arch: _load_tiny(p) for arch, p in tiny_dirs.items()}


@pytest.fixture
def tiny_engine(tiny_loaded):
    from ragkv.engine.engine import Engine

    def make(arch="llama", **kw):
        return Engine(tiny_loaded[arch], **kw)
    return make


@pytest.fixture(scope="session")
def tiny_bf16_engine(tiny_dirs):
    """The tiny llama in bf16 (loaded once)."""
    from ragkv.engine.engine import Engine

    return Engine(_load_tiny(tiny_dirs["llama"], torch.bfloat16))


@pytest.fixture(scope="session")
def default_engine():
    if not default_model_available():
        pytest.skip("default model not converted (run `ragkv models --prepare` or the README set-up)")
    from ragkv.engine.engine import Engine
    return Engine.load("smollm2", dtype="float32", device="cpu")


# A user's settings file must not change what the tests run (tests/settings.toml: what the tests set); tests of
# the settings file point this elsewhere.
os.environ.setdefault("RAGKV_SETTINGS", str(Path(__file__).parent / "settings.toml"))
# The tests' KV store, index, calibration and profiles live in a private cache (the default store is persistent
# and shared by every command): converted models are still found where they are.
os.environ.setdefault("RAGKV_MODELS_DIR", str(Path(os.environ.get("RAGKV_CACHE_DIR", "~/.cache/ragkv")).expanduser()
                                              / "models"))
os.environ["RAGKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="ragkv-test-cache-")
atexit.register(shutil.rmtree, os.environ["RAGKV_CACHE_DIR"], ignore_errors=True)
