"""docs/invariants.md, invariant 2: our layer-by-layer runner equals transformers (fp32) on every supported family."""

import pytest
import torch
from tiny import ARCHS, hf_model

from ragkv.engine.kv.kvcache import KVCache


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(arch, tiny_dirs, tiny_loaded):
    ids = torch.randint(0, 320, (1, 150), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tiny_dirs[arch])(ids).logits
    model = tiny_loaded[arch].model
    ours = model(ids.to(model.device), all_logits=True).cpu()
    assert (ref - ours).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_incremental_decoding_equals_full_forward(arch, tiny_loaded):
    model = tiny_loaded[arch].model
    ids = torch.randint(0, 320, (1, 60), generator=torch.Generator().manual_seed(2)).to(model.device)
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


def test_sliding_window_matches_transformers_past_the_window(tiny_dirs, tiny_loaded):
    """Mistral's sliding window (16 here) on a prompt of 60, then decoding 20 more tokens one at a time."""
    from ragkv.engine.kv.state import DecodeState, decode_step

    model = tiny_loaded["mistral_window"].model
    assert model.args.sliding_window == 16
    ids = torch.randint(0, 320, (1, 80), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(tiny_dirs["mistral_window"])(ids).logits[0]
        unwindowed = hf_model(tiny_dirs["mistral"])(ids).logits[0]
    assert (ref - unwindowed).abs().max().item() > 1e-2  # the window really changes the result
    cache = KVCache.for_model(model, capacity=8)
    ref = ref.to(model.device)
    first = model(ids[:, :60].to(model.device), cache=cache, all_logits=True)[0]
    assert (first - ref[:60]).abs().max().item() <= 1e-4
    state = DecodeState(cache, 60, first[-1])
    for t in range(60, 80):
        assert (decode_step(model, state, int(ids[0, t])) - ref[t]).abs().max().item() <= 1e-4


def test_llama3_scaling_changes_frequencies(tiny_loaded):
    a, b = tiny_loaded["llama"].model.rotary.inv_freq, tiny_loaded["llama3"].model.rotary.inv_freq
    assert a.shape == b.shape and not torch.allclose(a, b)
