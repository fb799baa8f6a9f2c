"""DESIGN Invariant 2: our layer-by-layer runner equals transformers (fp32) on every supported family."""

import pytest
import torch

from tiny import ARCHS, hf_model
from ragkv.engine.kvcache import KVCache


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, tiny_dirs, tiny_loaded):
    ids = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tiny_dirs[arch])(ids).logits
    ours = tiny_loaded[arch].model(ids, all_logits=True)
    assert (ref - ours).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_incremental_decoding_equals_full_forward(arch, tiny_loaded):
    model = tiny_loaded[arch].model
    ids = torch.randint(0, 320, (1, 60), generator=torch.Generator().manual_seed(2))
    full = model(ids, all_logits=True)[0]
    cache = KVCache.for_model(model, capacity=8)  # forces growth while decoding
    model(ids[:, :40], cache=cache)
    for t in range(40, 60):
        step = model(ids[:, t:t + 1], cache=cache)[0, -1]
        assert (step - full[t]).abs().max().item() <= 1e-4
    chunk = KVCache.for_model(model)
    model(ids[:, :30], cache=chunk)
    rest = model(ids[:, 30:], cache=chunk, all_logits=True)[0]
    assert (rest - full[30:]).abs().max().item() <= 1e-4


def test_llama3_scaling_changes_frequencies(tiny_loaded):
    a, b = tiny_loaded["llama"].model.rotary.inv_freq, tiny_loaded["llama3"].model.rotary.inv_freq
    assert a.shape == b.shape and not torch.allclose(a, b)
