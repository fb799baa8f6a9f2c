"""The lean decode layers (models/lean_decode.py) against the general layer loop they stand in for: the same
kernels on the same tensors, so the same logits and the same caches, bitwise; and the general loop wherever the
lean one does not apply. Needs ragkv's bf16 product kernel (AVX-512 BF16); skipped where it is not built."""

import pytest
import torch
from tiny import make_segs

from ragkv.engine.kv import state as kv_state
from ragkv.engine.kv.state import decode_batch
from ragkv.engine.options import FusionOptions
from ragkv.models import lean_decode as lean_module
from ragkv.models.loop import Forward
from ragkv.ops import gemv_kernel
from ragkv.ops.kernel_choice import ROW_CLASSES

pytestmark = pytest.mark.skipif(gemv_kernel.kernel() is None, reason="the bf16 product kernel is not built here")


@pytest.fixture(scope="module")
def fast_engine(tiny_dirs):
    """The tiny Qwen2 (QKV bias, tied LM head) in bf16 with the `onednn` decode copy, every product on the packed
    kernel at every decode row count (the chooser may prefer oneDNN at these toy shapes)."""
    from conftest import _load_tiny

    from ragkv.engine.engine import Engine
    from ragkv.models.onednn import OneDnnLinear

    eng = Engine(_load_tiny(tiny_dirs["qwen2"], torch.bfloat16), decode_weights="onednn")
    for m in eng.decode_model.modules():
        if isinstance(m, OneDnnLinear):
            m.kernels = None  # the packed kernel wherever it takes the rows
    eng.decode_model.__dict__.pop("_lean_decode", None)
    return eng


def _decode(eng, segs, fusions, steps, general: bool, monkeypatch):
    """Greedy steps of every prompt together: the logits of each step and every cache's rows after them."""
    with monkeypatch.context() as m:
        if general:
            m.setattr(kv_state.DecodeForward, "run", Forward.run)
        states = [eng.prefill(s, f, steps + 2)[0] for s, f in zip(segs, fusions)]
        tokens, seen = [int(s.logits.argmax()) for s in states], []
        for _ in range(steps):
            logits = decode_batch(eng.decode_model, states, tokens)
            seen.append(logits)
            tokens = logits.argmax(-1).tolist()
    caches = [[(st.cache.keys[i][:, :, :st.cache.length].clone(), st.cache.values[i][:, :, :st.cache.length].clone())
               for i in range(len(st.cache.keys))] for st in states]
    return seen, caches


def _lean_calls(monkeypatch) -> list:
    calls, run = [], lean_module.LeanDecode.run
    monkeypatch.setattr(lean_module.LeanDecode, "run", lambda self, *a: calls.append(a[0].shape[0]) or run(self, *a))
    return calls


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_lean_layers_give_the_general_loops_logits_and_caches_bitwise(batch, fast_engine, monkeypatch):
    segs = [make_segs(seed=s) for s in range(batch)]
    fusions = [FusionOptions(mode="reuse" if s % 2 else "full") for s in range(batch)]
    calls = _lean_calls(monkeypatch)
    lean_logits, lean_caches = _decode(fast_engine, segs, fusions, 4, False, monkeypatch)
    assert calls == [batch] * 4  # every step went through the lean layers
    calls.clear()
    want_logits, want_caches = _decode(fast_engine, segs, fusions, 4, True, monkeypatch)
    assert calls == []
    for got, want in zip(lean_logits, want_logits):
        assert torch.equal(got, want)
    for got_seq, want_seq in zip(lean_caches, want_caches):
        for (gk, gv), (wk, wv) in zip(got_seq, want_seq):
            assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_a_sequence_with_an_attention_policy_sends_the_step_through_the_general_loop(fast_engine, monkeypatch):
    """APE attends through its policy: a batch holding it runs the general loop, with the same numbers as without
    the lean layers at all."""
    segs = [make_segs(seed=s) for s in range(2)]
    fusions = [FusionOptions(mode="full"), FusionOptions(mode="ape")]
    calls = _lean_calls(monkeypatch)
    got, _ = _decode(fast_engine, segs, fusions, 3, False, monkeypatch)
    assert calls == []
    want, _ = _decode(fast_engine, segs, fusions, 3, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_torch_decode_attention_keeps_the_general_loop(fast_engine, monkeypatch):
    """Where the decode attention goes through torch (RAGKV_DECODE_ATTENTION=torch) the lean layers stand aside."""
    from ragkv.ops import attention

    segs, fusions = [make_segs(seed=0)], [FusionOptions(mode="full")]
    calls = _lean_calls(monkeypatch)
    monkeypatch.setenv("RAGKV_DECODE_ATTENTION", "torch")
    monkeypatch.setattr(attention, "_KERNEL_WINS", {})
    _decode(fast_engine, segs, fusions, 2, False, monkeypatch)
    assert calls == []


@pytest.mark.parametrize("kernel", ["onednn", "stock"])
def test_products_on_another_kernel_run_through_their_own_methods_bitwise(kernel, fast_engine, monkeypatch):
    """Where the chooser picked another kernel for some products at these rows (a noisy timing, the AMX kernel), the
    lean layers call those products as the general loop does (`add_to`, `swiglu`, the linear itself): the same
    logits and caches, bitwise."""
    from ragkv.models.onednn import OneDnnLinear

    model = fast_engine.decode_model
    layers = model.layers
    for mod in (layers[0].mlp.down_proj, layers[0].mlp.__dict__["gate_up_proj"], layers[1].self_attn.o_proj,
                layers[1].self_attn.__dict__["qkv_proj"]):
        assert isinstance(mod, OneDnnLinear) and mod.takes(kernel, 3)
        monkeypatch.setattr(mod, "kernels", [kernel] * len(ROW_CLASSES))
    monkeypatch.setattr(lean_module.lean_decode(model), "_ops", {})
    segs = [make_segs(seed=s) for s in range(3)]
    fusions = [FusionOptions(mode="full")] * 3
    calls = _lean_calls(monkeypatch)
    got_logits, got_caches = _decode(fast_engine, segs, fusions, 3, False, monkeypatch)
    assert calls == [3] * 3
    want_logits, want_caches = _decode(fast_engine, segs, fusions, 3, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got_logits, want_logits))
    for got_seq, want_seq in zip(got_caches, want_caches):
        for (gk, gv), (wk, wv) in zip(got_seq, want_seq):
            assert torch.equal(gk, wk) and torch.equal(gv, wv)


def test_the_exact_copy_and_fp32_models_have_no_lean_layers(fast_engine, tiny_engine):
    assert lean_module.lean_decode(fast_engine.model) is None  # bf16, but its linears are the model's own
    assert lean_module.lean_decode(tiny_engine("qwen2", decode_weights="exact").model) is None
