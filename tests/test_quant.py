"""Weight-only quantized decode copies (ragkv.models.quant) against the exact path."""

import os

import pytest
import torch
from tiny import make_segs
from torch import nn

from ragkv.engine.kv.state import decode_step
from ragkv.engine.options import FusionOptions
from ragkv.errors import InvalidRequestError
from ragkv.models.quant import INT4_GROUP, PackedLinear, decode_copy

cpu_only = pytest.mark.skipif(os.environ.get("RAGKV_TEST_DEVICE", "cpu") != "cpu",
                              reason="decode copies use torch's CPU kernels (they refuse another device)")


def _representable_int4(n_out=96, n_in=128, seed=0):
    """A weight whose every group of 32 is exactly (q - 8) * scale + zero with q spanning 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n_out, n_in // INT4_GROUP, INT4_GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group uses the full range, so its min/max give back scale and zero
    scale = torch.rand(n_out, n_in // INT4_GROUP, 1, generator=g).bfloat16().float() * 0.1 + 0.01
    lo = torch.randn(n_out, n_in // INT4_GROUP, 1, generator=g).bfloat16().float() * 0.1
    return (q * scale + lo).reshape(n_out, n_in)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_packed_linear_equals_the_dequantized_matmul(kind):
    w = _representable_int4()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=True)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(5, w.shape[1])
    ref = lin(x.bfloat16().float())  # the kernel reads bf16 activations
    got = PackedLinear(lin, kind)(x)
    tol = 2e-2 if kind == "int4" else 5e-2  # int4 reproduces this weight; int8 rounds each row to 1/127
    assert got.dtype == x.dtype and ((got - ref).abs().max() / ref.abs().max()).item() < tol


@cpu_only
def test_decode_copy_shares_everything_but_the_linears(tiny_loaded):
    model = tiny_loaded["llama"].model
    packed = decode_copy(model, "int4")
    assert packed is not model and decode_copy(model, "exact") is model
    assert packed.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert packed.layers[0].input_layernorm.weight is model.layers[0].input_layernorm.weight
    assert isinstance(model.layers[0].self_attn.q_proj, nn.Linear)  # the exact model is untouched
    assert "qkv_proj" not in model.layers[0].self_attn.__dict__
    with pytest.raises(InvalidRequestError, match="choose one of"):
        decode_copy(model, "int3")


@cpu_only
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_decode_stays_close_to_exact(kind, tiny_engine):
    """Teacher-forced decode steps after an exact prefill: the packed copy's distributions stay close."""
    eng = tiny_engine("qwen2")  # QKV bias and tied embeddings
    packed = decode_copy(eng.model, kind)
    segs = make_segs()
    exact, _ = eng.prefill(segs, FusionOptions(mode="reuse"), 8)
    approx, _ = eng.prefill(segs, FusionOptions(mode="reuse"), 8)
    for tok in (5, 17, 200, 31, 9):
        a = decode_step(eng.model, exact, tok).log_softmax(-1)
        b = decode_step(packed, approx, tok).log_softmax(-1)
        kl = (a.exp() * (a - b)).sum().item()
        assert kl < 0.05, kl


@cpu_only
def test_transposed_decode_equals_exact_and_copies_only_wide_linears(tiny_engine):
    """`transposed` keeps the exact weights: decode steps equal the exact path to float rounding; only linears
    wider than their input (fused q/k/v, gate/up, the LM head) get a transposed copy, the others stay shared."""
    eng = tiny_engine("qwen2")  # QKV bias and tied embeddings
    model = eng.model
    copy_ = decode_copy(model, "transposed")
    attn, mlp = copy_.layers[0].self_attn, copy_.layers[0].mlp
    assert "qkv_proj" in attn.__dict__ and attn.qkv_proj.bias is not None
    assert attn.v_proj is model.layers[0].self_attn.v_proj  # shared (CacheBlend's project_v reads it), not copied
    assert attn.o_proj is model.layers[0].self_attn.o_proj  # square: shared, not copied
    assert "gate_up_proj" in mlp.__dict__ and mlp.down_proj is model.layers[0].mlp.down_proj
    assert copy_.lm_head is not model.lm_head and copy_.lm_head.wt.shape == model.lm_head.weight.T.shape
    segs = make_segs()
    exact, _ = eng.prefill(segs, FusionOptions(mode="reuse"), 8)
    other, _ = eng.prefill(segs, FusionOptions(mode="reuse"), 8)
    for tok in (5, 17, 200, 31, 9):
        a = decode_step(model, exact, tok)
        b = decode_step(copy_, other, tok)
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
        assert a.argmax() == b.argmax()


@cpu_only
def test_onednn_decode_equals_exact_in_every_linear(tiny_engine, tiny_bf16_engine, monkeypatch):
    """`onednn`: every linear (fused q/k/v and gate/up, o, down, the LM head) runs through oneDNN's kernel on the
    model's own weights; decode steps equal the exact path to float rounding, alone and batched; bf16 is refused on
    a CPU without native bf16 (tests/test_cpu_bf16.py tests it where there is)."""
    from ragkv.engine.kv.state import decode_batch
    from ragkv.models.onednn import OneDnnLinear

    eng = tiny_engine("qwen2")  # QKV bias and tied embeddings
    model = eng.model
    copy_ = decode_copy(model, "onednn")
    attn, mlp = copy_.layers[0].self_attn, copy_.layers[0].mlp
    assert isinstance(attn.qkv_proj, OneDnnLinear) and attn.qkv_proj.bias is not None
    own = model.layers[0].self_attn  # q, k and v now view one buffer, which the joined path reads: no copy
    assert attn.qkv_proj.weight.data_ptr() == own.q_proj.weight.data_ptr()
    assert own.v_proj.weight.data_ptr() == own.q_proj.weight.data_ptr() + 4 * (own.q_proj.weight.numel()
                                                                              + own.k_proj.weight.numel())
    assert decode_copy(model, "onednn").layers[0].mlp.gate_up_proj.weight.data_ptr() \
        == mlp.gate_up_proj.weight.data_ptr()  # a second path finds them joined
    assert isinstance(attn.o_proj, OneDnnLinear) and isinstance(mlp.gate_up_proj, OneDnnLinear)
    assert isinstance(mlp.down_proj, OneDnnLinear) and isinstance(copy_.lm_head, OneDnnLinear)
    segs = [make_segs(seed=s) for s in (0, 1)]
    exact = [eng.prefill(s, FusionOptions(mode="reuse"), 8)[0] for s in segs]
    alone = [eng.prefill(s, FusionOptions(mode="reuse"), 8)[0] for s in segs]
    batched = [eng.prefill(s, FusionOptions(mode="reuse"), 8)[0] for s in segs]
    for tok in (5, 17, 200, 31, 9):
        rows = decode_batch(copy_, batched, [tok, tok])
        for e, a, row in zip(exact, alone, rows):
            want = decode_step(model, e, tok)
            for got in (decode_step(copy_, a, tok), row):
                assert torch.allclose(want, got, atol=1e-4, rtol=1e-4), (want - got).abs().max()
                assert want.argmax() == got.argmax()
    import ragkv.models.quant as quant

    monkeypatch.setattr(quant, "bf16_matrix_units", lambda: False)
    with pytest.raises(InvalidRequestError, match="AVX-512 BF16.*float32"):
        decode_copy(tiny_bf16_engine.model, "onednn")


@cpu_only
def test_auto_weights_choose_onednn_for_fp32_on_a_cpu(tiny_engine, tiny_bf16_engine, monkeypatch):
    """`auto` (the CLI's and server's default): oneDNN's kernel for fp32 on a CPU, and for bf16 on a CPU that
    multiplies bf16 natively (AVX-512 BF16 or AMX), exact otherwise; any named kind stays itself."""
    import ragkv.models.quant as quant
    from ragkv.models.quant import resolve_decode_weights

    assert resolve_decode_weights("auto", tiny_engine("qwen2").model)[0] == "onednn"
    for native in (True, False):
        monkeypatch.setattr(quant, "bf16_matrix_units", lambda native=native: native)
        assert resolve_decode_weights("auto", tiny_bf16_engine.model)[0] == ("onednn" if native else "exact")
    monkeypatch.undo()
    assert resolve_decode_weights("int4", tiny_bf16_engine.model) == ("int4", "asked for")
    eng = tiny_engine("qwen2", decode_weights="auto")
    assert eng.info()["decode_weights"] == eng.decode_weights == "onednn" and eng.forward_model is eng.decode_model


def test_cli_default_decode_weights_is_auto():
    """Every command with --decode-weights defaults to `auto` and accepts each named kind."""
    import argparse

    from ragkv.cli.common import add_model_args
    from ragkv.models.quant import DECODE_WEIGHTS

    p = argparse.ArgumentParser()
    add_model_args(p)
    assert p.parse_args([]).decode_weights == "auto"
    assert all(p.parse_args(["--decode-weights", k]).decode_weights == k for k in DECODE_WEIGHTS)


@cpu_only
@pytest.mark.parametrize("weights", ["onednn", "transposed"])
@pytest.mark.parametrize("fusion", [dict(mode="full"), dict(mode="prefix", prefix_chunk=8), dict(mode="reuse"),
                                    dict(mode="ape"), dict(mode="reuse", kv_layout="shared"),
                                    dict(mode="blend", ratio=0.3), dict(mode="blend", select="query", ratio=0.3),
                                    dict(mode="blend", select="sinks", sink_tokens=4), dict(mode="auto", ratio=0.3)])
def test_every_forward_runs_on_an_exact_copy_and_equals_exact(fusion, weights, tiny_engine, monkeypatch):
    """With decode weights that are the model's own, every prefill forward (full, prefix, block encoding, the
    question over cached blocks, every selection's recompute, CacheBlend's deviation check) runs on the copy, each
    linear choosing its kernel by its rows: products of up to FEW_ROWS rows on the copy's kernel, more in slices of
    FEW_ROWS (onednn) or on the model's weights (transposed); a prompt's prefill runs in forwards of FEW_ROWS rows.
    Cold and warm, the logits equal the exact engine's."""
    import ragkv.models.onednn as onednn
    import ragkv.models.quant as quant

    for module in (onednn, quant):  # the tiny prompts' forwards take both paths (the linears', the prompt's rows)
        monkeypatch.setattr(module, "FEW_ROWS", 8)
    exact, fast = tiny_engine("qwen2"), tiny_engine("qwen2", decode_weights=weights)
    segs, fusion = make_segs(seed=4), FusionOptions(**fusion)
    calls = {"few": [], "many": []}
    for path in calls:
        cls = onednn.OneDnnLinear if weights == "onednn" else quant.TransposedLinear
        real = getattr(cls, path + "_rows")
        monkeypatch.setattr(cls, path + "_rows",
                            lambda self, x, real=real, path=path: calls[path].append(x.numel() // self.in_features)
                            or real(self, x))
    for _ in ("cold", "warm"):
        want = exact.prefill(segs, fusion)[0].logits
        got = fast.prefill(segs, fusion)[0].logits
        assert torch.allclose(want, got, atol=1e-4, rtol=1e-4), (want - got).abs().max()
    assert calls["few"] and max(calls["few"]) <= 8
    assert all(n > 8 for n in calls["many"])
    if fusion.mode in ("full", "prefix"):  # a prompt's forwards go in units of the copy's forward_rows
        assert not calls["many"]
    if fusion.mode == "blend" and fusion.select == "deviation":  # CacheBlend's first layers see every token
        assert calls["many"]


@cpu_only
def test_a_model_whose_linears_read_one_buffer_saves_and_loads_back(tiny_dirs, tmp_path):
    """The oneDNN path joins q/k/v (and gate/up) into one buffer that the model's parameters view; a fine-tuning
    checkpoint of such a model still saves each weight as its own tensor and loads back equal."""
    from conftest import _load_tiny

    from ragkv.train.checkpoint import save_model_folder

    model = _load_tiny(tiny_dirs["qwen2"]).model
    decode_copy(model, "onednn")
    q = model.layers[0].self_attn.q_proj.weight
    assert q.untyped_storage().nbytes() > q.numel() * q.element_size()  # a view of the joined buffer
    save_model_folder(model, tiny_dirs["qwen2"], tmp_path / "saved")
    again = _load_tiny(tmp_path / "saved").model
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@cpu_only
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_decode_is_named_in_every_replys_fidelity(kind, tiny_engine):
    """The prefill runs on the exact weights, the answer after its first token on the quantized copy: every reply
    says so (not exact; which weights; whether its first token is)."""
    eng = tiny_engine("qwen2", decode_weights=kind)
    for mode in ("full", "reuse", "blend"):
        _, stats = eng.prefill(make_segs(), FusionOptions(mode=mode), 8)
        assert stats.fidelity["exact"] is False and stats.fidelity["decode_weights"] == kind
        assert stats.fidelity["first_token_exact"] is (mode == "full"), (mode, stats.fidelity)
    _, stats = tiny_engine("qwen2").prefill(make_segs(), FusionOptions(mode="full"), 8)
    assert stats.fidelity == {"mode": "full", "exact": True}


def test_int8_products_sum_the_integers_exactly_and_scale_once():
    """w8a8's pieces: per-row activation quantization rounds each value to within half a step (the row's max to
    127), and the int8 x int8 product (oneDNN's kernel) sums the integers exactly before both scales."""
    from ragkv.models.quant import int8_product
    from ragkv.ops.int8_kernel import quantize_rows

    g = torch.Generator().manual_seed(3)
    for m, k, n in ((17, 64, 48), (40, 96, 130), (300, 256, 72)):
        x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
        xq, xs = quantize_rows(x)
        assert xq.dtype == torch.int8 and (xq.abs().amax(dim=1) == 127).all()
        assert ((xq.float() * xs[:, None] - x).abs() <= xs[:, None] / 2 * (1 + 1e-5)).all()
        wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
        ws, bias = torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g)
        sums = xq.long() @ wq.long().t()  # exact
        want = sums.double() * xs[:, None].double() * ws.double() + bias.double()
        got = int8_product(xq, xs, wq, ws, bias)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5), (got.double() - want).abs().max()


@cpu_only
def test_w8a8_linear_is_int8s_product_at_few_rows_and_close_to_exact_at_many():
    """Few rows: the same int8 weights times bf16 activations, as the int8 decode copy computes them. Many rows:
    int8 activations too, within a few 1/127 steps of the exact product."""
    from ragkv.models.quant import Int8ProductLinear

    torch.manual_seed(0)
    lin = nn.Linear(128, 96, bias=True)
    w8a8, int8 = Int8ProductLinear(lin), PackedLinear(lin, "int8")
    few = torch.randn(3, 128)
    assert torch.equal(w8a8(few), int8(few))
    many = torch.randn(64, 128)
    ref = lin(many)
    got = w8a8(many)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 3e-2


@cpu_only
@pytest.mark.parametrize("mode", ["full", "prefix", "reuse", "blend", "ape"])
def test_w8a8_runs_every_prefill_on_int8_products_says_so_and_keeps_its_kv_apart(mode, tiny_engine, monkeypatch):
    """`w8a8` is the one decode copy that prefill runs on too: its forwards of many rows take the int8 product, its
    first token is close to the exact one but not it, every reply says so (first_token_exact false even for
    `full`), and its KV is keyed under another fingerprint (a store shared with an exact engine never hands one's
    blocks to the other)."""
    import ragkv.models.quant as quant

    exact = tiny_engine("qwen2")
    fast = type(exact)(exact._loaded, exact.store, decode_weights="w8a8")  # the same model and store
    assert fast.fingerprint != exact.fingerprint and fast.forward_model is fast.decode_model
    products = []
    real = quant.int8_product
    monkeypatch.setattr(quant, "int8_product", lambda *a: products.append(a[0].shape[0]) or real(*a))
    fusion = FusionOptions(mode=mode, prefix_chunk=8) if mode == "prefix" else FusionOptions(mode=mode)
    segs = make_segs(seed=4)
    want, _ = exact.prefill(segs, fusion, 8)
    got, stats = fast.prefill(segs, fusion, 8)
    assert products and min(products) > quant.gemv_kernel.MAX_ROWS
    a, b = want.logits.float().log_softmax(-1), got.logits.float().log_softmax(-1)
    assert 0 < (a.exp() * (a - b)).sum().item() < 0.05
    assert stats.fidelity["exact"] is False and stats.fidelity["decode_weights"] == "w8a8"
    assert stats.fidelity["first_token_exact"] is False
    keys = set(exact.cache_keys(segs, fusion)), set(fast.cache_keys(segs, fusion))
    assert (mode == "full") is (not keys[0]) and len(keys[0]) == len(keys[1]) and not keys[0] & keys[1]


@cpu_only
def test_int8_passes_kernel_equals_the_torch_path(monkeypatch):
    """The fused C++ passes around the int8 product (ragkv.ops.int8_kernel) compute what the torch path does:
    the same int8 values and scales, the same scaled sums bit for bit, and silu(gate) * up to bf16 rounding."""
    from ragkv.ops import int8_kernel

    if int8_kernel.kernel() is None:
        pytest.skip("the int8 passes kernel is not built here")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 96, generator=g) * 4
    sums = torch.randint(-50000, 50000, (37, 64), dtype=torch.int32, generator=g)
    xs, ws, bias = torch.rand(37, generator=g) * 0.01, torch.rand(64, generator=g) * 0.01, torch.randn(64, generator=g)
    fast = {"q": [int8_kernel.quantize_rows(t) for t in (x, x.bfloat16(), x[:, :48])],
            "d": [int8_kernel.dequantize(sums, xs, ws, b, dt, sw) for b in (bias, None)
                  for dt in (torch.float32, torch.bfloat16) for sw in (False, True)]}
    monkeypatch.setattr(int8_kernel, "kernel", lambda: None)
    slow = {"q": [int8_kernel.quantize_rows(t) for t in (x, x.bfloat16(), x[:, :48])],
            "d": [int8_kernel.dequantize(sums, xs, ws, b, dt, sw) for b in (bias, None)
                  for dt in (torch.float32, torch.bfloat16) for sw in (False, True)]}
    for (qa, sa), (qb, sb) in zip(fast["q"], slow["q"]):
        assert torch.equal(qa, qb) and torch.equal(sa, sb)
    for i, (a, b) in enumerate(zip(fast["d"], slow["d"])):
        assert a.dtype == b.dtype and a.shape == b.shape
        if i % 2 == 0:  # no silu: the same fp32 operations in the same order
            assert torch.equal(a, b), i
        else:
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3), i


def test_silu_mul_pass_equals_torchs_ops_and_serves_the_bf16_swiglu():
    """int8_kernel.silu_mul: silu(gate) * up of a bf16 gate/up product in one pass, equal to torch's ops in fp32
    rounded once (torch rounds silu(gate) to bf16 first: at most one bf16 step apart); OneDnnLinear's stock bf16
    SwiGLU returns it."""
    from ragkv.models.onednn import OneDnnLinear, bf16_matrix_units
    from ragkv.ops import int8_kernel

    if int8_kernel.kernel() is None:
        pytest.skip("the int8 passes kernel is not built here")
    g = torch.Generator().manual_seed(3)
    y = (torch.randn(37, 2 * 40, generator=g) * 6).bfloat16()
    gate, up = y.float().chunk(2, dim=-1)
    fp32 = (torch.nn.functional.silu(gate) * up).bfloat16()
    got = int8_kernel.silu_mul(y)
    assert got.shape == (37, 40) and got.dtype == torch.bfloat16
    assert (got.float() - fp32.float()).abs().max() <= fp32.float().abs().max() * 2 ** -7
    assert (got != fp32).float().mean() < 0.01  # equal but for a rare rounding of the polynomial e^x
    torch_ops = torch.nn.functional.silu(y[:, :40]) * y[:, 40:]
    assert torch.allclose(got.float(), torch_ops.float(), rtol=2 ** -7, atol=1e-2)
    assert int8_kernel.silu_mul(y.float()) is None  # fp32: torch's ops stay
    if not bf16_matrix_units():
        return
    lin = [torch.nn.Linear(24, 40, bias=False).bfloat16() for _ in range(2)]
    m = OneDnnLinear(lin)
    m.kernels = ["stock"] * 5  # the chooser's stock product at every row count: then the one pass
    x = torch.randn(64, 24, generator=g).bfloat16()
    a, b = torch.nn.functional.linear(x, lin[0].weight), torch.nn.functional.linear(x, lin[1].weight)
    torch.testing.assert_close(m.swiglu(x), int8_kernel.silu_mul(torch.cat([a, b], dim=-1)), rtol=0, atol=0)
