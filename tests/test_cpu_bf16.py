"""The bf16 fast paths on CPUs that multiply bf16 natively (AVX-512 BF16, AMX): ragkv's bandwidth-bound product
kernel (ragkv.ops.gemv_kernel) and the `onednn` copy built on it, against torch's plain bf16 path.

Where the CPU has no native bf16 these are skipped (the kernel is not built there and `auto` keeps `exact`; that
choice is tested in test_quant.py)."""

import os

import pytest
import torch
import torch.nn.functional as F

from ragkv.engine.options import FusionOptions
from ragkv.engine.state import decode_batch, decode_step
from ragkv.models.quant import bf16_matrix_units
from ragkv.ops import gemv_kernel

from tiny import make_segs

native_bf16 = pytest.mark.skipif(os.environ.get("RAGKV_TEST_DEVICE", "cpu") != "cpu" or not bf16_matrix_units(),
                                 reason="needs a CPU with AVX-512 BF16 or AMX")
needs_kernel = pytest.mark.skipif(gemv_kernel.kernel() is None, reason="the bf16 product kernel is not built here")


def _bf16_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(1152, 896), (130, 64), (64, 4864), (1000, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_product_kernel_equals_torch_to_bf16_rounding(out_features, in_features, rows):
    """Each output is one fp32 sum of the same products, rounded to bf16 once: against the fp32 product it errs no
    more than torch's own bf16 kernel does (one bf16 rounding, ~2^-8 relative), with or without bias, at any
    number of outputs (padded to the kernel's blocks of 64) and rows, on contiguous and strided rows."""
    g = torch.Generator().manual_seed(rows * 7 + in_features)
    w = (torch.randn(out_features, in_features, generator=g) * 0.05).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    wide = torch.randn(rows, 2 * in_features, generator=g).bfloat16()
    for x in (wide[:, :in_features].contiguous(), wide[:, ::2]):  # the second: rows read through a stride
        for bias in (None, b):
            exact = x.float() @ w.float().T + (0 if bias is None else bias.float())
            got = gemv_kernel.gemv(x, *gemv_kernel.pack(w, bias), out_features)
            torch_err = _bf16_rel_err(F.linear(x, w, bias), exact)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            assert _bf16_rel_err(got, exact) <= max(torch_err, 2 ** -8) * 1.01, (_bf16_rel_err(got, exact),
                                                                                 torch_err)


def _bf16_qwen(tiny_dirs):
    from conftest import _load_tiny
    from ragkv.engine.engine import Engine

    return lambda **kw: Engine(_load_tiny(tiny_dirs["qwen2"], torch.bfloat16), **kw)  # QKV bias, tied LM head


@native_bf16
@pytest.mark.parametrize("kernel", ["ragkv", "onednn-packed"])
def test_bf16_onednn_decode_equals_exact(kernel, tiny_dirs, monkeypatch):
    """`onednn` in bf16: decode steps (alone and batched) through ragkv's product kernel, or where it is not built
    through oneDNN's prepacked weights, give the exact bf16 path's next-token distribution to bf16 rounding and the
    same greedy token."""
    from ragkv.models.quant import OneDnnLinear

    if kernel == "onednn-packed":
        monkeypatch.setattr(gemv_kernel, "packable", lambda w: False)
    elif gemv_kernel.kernel() is None:
        pytest.skip("the bf16 product kernel is not built here")
    make = _bf16_qwen(tiny_dirs)
    exact, fast = make(), make(decode_weights="onednn")
    lm = fast.decode_model.lm_head
    assert isinstance(lm, OneDnnLinear) and (lm.gemv is not None) == (kernel == "ragkv")
    assert fast.forward_model is fast.decode_model
    segs = [make_segs(seed=s) for s in (0, 1)]
    want_states = [exact.prefill(s, FusionOptions(mode="reuse"), 8)[0] for s in segs]
    alone = [fast.prefill(s, FusionOptions(mode="reuse"), 8)[0] for s in segs]
    batched = [fast.prefill(s, FusionOptions(mode="reuse"), 8)[0] for s in segs]
    for tok in (5, 17, 200, 31):
        rows = decode_batch(fast.decode_model, batched, [tok, tok])
        for e, a, row in zip(want_states, alone, rows):
            want = decode_step(exact.model, e, tok).float()
            for got in (decode_step(fast.decode_model, a, tok), row):
                assert (want.log_softmax(-1).exp() - got.float().log_softmax(-1).exp()).abs().max() < 2e-2
                assert want.argmax() == got.argmax()


@native_bf16
@pytest.mark.parametrize("fusion", [dict(mode="full"), dict(mode="prefix", prefix_chunk=8), dict(mode="reuse"),
                                    dict(mode="ape"), dict(mode="blend", ratio=0.3),
                                    dict(mode="blend", select="query", ratio=0.3)])
def test_bf16_prefill_on_the_onednn_copy_equals_exact(fusion, tiny_dirs):
    """Every prefill forward in bf16 runs on the `onednn` copy (oneDNN at many rows, the product kernel at few):
    cold and warm, the last token's distribution equals the exact bf16 engine's to bf16 rounding."""
    make = _bf16_qwen(tiny_dirs)
    exact, fast = make(), make(decode_weights="onednn")
    segs, fusion = make_segs(seed=4), FusionOptions(**fusion)
    for _ in ("cold", "warm"):
        want = exact.prefill(segs, fusion)[0].logits.float().softmax(-1)
        got = fast.prefill(segs, fusion)[0].logits.float().softmax(-1)
        assert (want - got).abs().max() < 2e-2 and want.argmax() == got.argmax()
