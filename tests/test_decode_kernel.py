"""The C++ decode-attention kernel (ragkv.ops.decode_kernel) against SDPA."""

import pytest
import torch
import torch.nn.functional as F

from ragkv.ops.decode_kernel import decode_attention_cpu, kernel

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler: the torch path is used instead")

# the bf16 kernel's paths (ops/decode_amx.py: the AMX one where this CPU and build have it)
NEEDS_AMX = pytest.mark.skipif(kernel() is None or not kernel().amx_built(),
                               reason="the AMX path is built only on CPUs with AMX-BF16")
BF16_PATHS = ["avx512", pytest.param("amx", marks=NEEDS_AMX)]


@pytest.fixture
def bf16_path(request):
    """Runs the test on one of the bf16 kernel's paths, then puts back the one this process had chosen."""
    mod, before = kernel(), kernel().amx_in_use()
    mod.use_amx(request.param == "amx")
    yield request.param
    mod.use_amx(before)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,d,s", [(9, 3, 64, 1300), (4, 4, 32, 7), (8, 2, 48, 3000), (14, 2, 64, 1)])
def test_kernel_equals_sdpa_over_cache_views(dtype, tol, hq, hkv, d, s):
    g = torch.Generator().manual_seed(s)
    cap = s + 37  # a cache view: capacity beyond the valid keys, as in KVCache
    k = torch.randn(1, hkv, cap, d, generator=g).to(dtype)[:, :, :s]
    v = torch.randn(1, hkv, cap, d, generator=g).to(dtype)[:, :, :s]
    q = (torch.randn(1, hq, 1, d, generator=g) * 3).to(dtype)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=hq != hkv)
    got = decode_attention_cpu(q, k, v)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("hq,hkv,rows,s", [(14, 2, 1, 2425), (9, 3, 1, 7), (4, 4, 1, 300), (14, 2, 3, 900)])
def test_torch_decode_path_equals_sdpa_over_cache_views(hq, hkv, rows, s):
    """The torch decode path (fp32: the GQA group folded into the rows of torch's flash kernel) over a cache view
    gives SDPA's answer with the heads expanded."""
    from ragkv.ops import attention

    g = torch.Generator().manual_seed(s)
    k = torch.randn(1, hkv, s + 37, 64, generator=g)[:, :, :s]
    v = torch.randn(1, hkv, s + 37, 64, generator=g)[:, :, :s]
    q = torch.randn(1, hq, rows, 64, generator=g) * 3
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))
    got = attention._torch_decode_attention(q, k, v)
    assert got.shape == q.shape and (got - ref).abs().max().item() <= 1e-5


def test_decode_attention_takes_the_faster_path_and_either_equals_sdpa(monkeypatch):
    """`decode_attention` times the kernel against the torch path once per dtype and keeps the faster (the kernel
    lost 3.4x to SDPA on a Zen 3); RAGKV_DECODE_ATTENTION fixes the choice, and each path gives SDPA's answer."""
    from ragkv.ops import attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 14, n, 64, generator=g)[:, :2 if i else 14] for i, n in enumerate((1, 900, 900)))
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    monkeypatch.setattr(attention, "_KERNEL_WINS", {})
    chosen = attention.kernel_wins(q, k, v)
    assert attention._KERNEL_WINS == {torch.float32: chosen}  # timed once, kept
    for forced in ("kernel", "torch"):
        monkeypatch.setenv("RAGKV_DECODE_ATTENTION", forced)
        assert attention.kernel_wins(q, k, v) is (forced == "kernel")
        assert (attention.decode_attention(q, k, v) - ref).abs().max().item() <= 1e-5


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one():
    """torch's builder leaves its `lock` file behind when killed mid-build; the next process must still load."""
    import os
    import subprocess
    import sys

    from torch.utils.cpp_extension import _get_build_directory

    from ragkv.ops.decode_kernel import _NAME
    stale = os.path.join(_get_build_directory(_NAME, verbose=False), "lock")
    open(stale, "w").close()
    code = "from ragkv.ops.decode_kernel import kernel; assert kernel() is not None"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=240)
    assert not os.path.exists(stale)


@pytest.mark.parametrize("bf16_path", BF16_PATHS, indirect=True)
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (9, 3, 64), (12, 2, 128), (8, 2, 48), (16, 1, 64)])
def test_several_sequences_in_one_call_get_each_its_own_answer_bitwise(hq, hkv, d, bf16_path):
    """`decode_attention_many` runs B sequences of different lengths in one call (bf16: one parallel loop); each
    sequence's rows equal its own call's bitwise (batch invariance), and SDPA's to bf16 rounding. The shapes cover
    the AVX-512 BF16 path's instantiations (group sizes 1-8, head dims 64 and 128) and the generic path beside it
    (head dim 48, a group of 16); the AMX path takes groups of up to 16 at head dims 64 and 128, with a last block
    of keys shorter than its tiles (7, 17, 300)."""
    from ragkv.ops.decode_kernel import decode_attention_many_cpu

    g = torch.Generator().manual_seed(d)
    lengths = [1, 7, 300, 2418, 17]
    ks = [torch.randn(1, hkv, n + 5, d, generator=g).bfloat16()[:, :, :n] for n in lengths]
    vs = [torch.randn(1, hkv, n + 5, d, generator=g).bfloat16()[:, :, :n] for n in lengths]
    q = (torch.randn(len(lengths), hq, 1, d, generator=g) * 3).bfloat16()
    many = decode_attention_many_cpu(q, ks, vs)
    assert many.shape == q.shape and many.dtype == q.dtype
    for b in range(len(lengths)):
        one = decode_attention_cpu(q[b:b + 1], ks[b], vs[b])
        assert torch.equal(one, many[b:b + 1])
        ref = F.scaled_dot_product_attention(q[b:b + 1].float(), ks[b].float(), vs[b].float(), enable_gqa=True)
        rounding = (ref.bfloat16().float() - ref).abs().max().item()  # what the bf16 output itself costs
        assert (one.float() - ref).abs().max().item() <= 3 * rounding + 1e-6


@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (9, 3, 64), (12, 2, 128), (8, 1, 64), (8, 2, 48), (16, 1, 64)])
def test_several_fp32_sequences_in_one_call_get_each_its_own_answer_bitwise(hq, hkv, d):
    """The fp32 path (ops/decode_f32.py, AVX2 and FMA: group sizes 1-8, head dims 64 and 128; the generic path for
    head dim 48 or a group of 16) runs B sequences of different lengths in one call; each sequence's rows equal its
    own call's bitwise and SDPA's to fp32 rounding, with lengths around its blocks of 8 keys and its chunks."""
    from ragkv.ops.decode_kernel import decode_attention_many_cpu

    g = torch.Generator().manual_seed(d + hq)
    lengths = [1, 7, 9, 256, 300, 2418, 17]
    ks = [torch.randn(1, hkv, n + 5, d, generator=g)[:, :, :n] for n in lengths]
    vs = [torch.randn(1, hkv, n + 5, d, generator=g)[:, :, :n] for n in lengths]
    q = torch.randn(len(lengths), hq, 1, d, generator=g) * 3
    many = decode_attention_many_cpu(q, ks, vs)
    assert many.shape == q.shape and many.dtype == q.dtype
    for b in range(len(lengths)):
        one = decode_attention_cpu(q[b:b + 1], ks[b], vs[b])
        assert torch.equal(one, many[b:b + 1])
        ref = F.scaled_dot_product_attention(q[b:b + 1].double(), ks[b].double(), vs[b].double(), enable_gqa=True)
        assert (one.double() - ref).abs().max().item() <= 1e-5  # as the single-call test


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(14, 2, 64), (12, 2, 128), (8, 2, 48)])
def test_new_rows_written_and_attended_in_one_call_equal_a_write_then_attention(dtype, hq, hkv, d):
    """`append_attention_many` writes each sequence's new row at its length, in its own cache buffer (nothing else
    changes), and attends over the grown rows: bitwise what writing the row, then `decode_attention_many` over
    the views, gives."""
    from ragkv.ops.decode_kernel import append_attention_many_cpu, decode_attention_many_cpu

    g = torch.Generator().manual_seed(hq + d)
    lengths = [0, 6, 1299, 40]
    bufs = [(torch.randn(1, hkv, n + 3, d, generator=g).to(dtype), torch.randn(1, hkv, n + 3, d, generator=g)
             .to(dtype)) for n in lengths]
    q = (torch.randn(len(lengths), hq, 1, d, generator=g) * 3).to(dtype)
    # the new rows as the model makes them: a transposed view, not contiguous
    k_new = torch.randn(len(lengths), 1, hkv, d, generator=g).to(dtype).transpose(1, 2)
    v_new = torch.randn(len(lengths), 1, hkv, d, generator=g).to(dtype).transpose(1, 2)
    want_bufs = [(k.clone(), v.clone()) for k, v in bufs]
    for b, n in enumerate(lengths):
        want_bufs[b][0][:, :, n] = k_new[b, :, 0]
        want_bufs[b][1][:, :, n] = v_new[b, :, 0]
    want = decode_attention_many_cpu(q, [k[:, :, :n + 1] for (k, _), n in zip(want_bufs, lengths)],
                                     [v[:, :, :n + 1] for (_, v), n in zip(want_bufs, lengths)])
    got = append_attention_many_cpu(q, k_new, v_new, [k for k, _ in bufs], [v for _, v in bufs], lengths)
    assert torch.equal(got, want)
    for (k, v), (wk, wv) in zip(bufs, want_bufs):
        assert torch.equal(k, wk) and torch.equal(v, wv)



@pytest.mark.parametrize("dtype,bf16_path", [(torch.float32, "avx512"), (torch.bfloat16, "avx512"),
                                             pytest.param(torch.bfloat16, "amx", marks=NEEDS_AMX)],
                         indirect=["bf16_path"])
@pytest.mark.parametrize("hq,hkv,d,split", [(14, 2, 64, 700), (12, 2, 128, 1), (9, 3, 64, 1299)])
def test_two_segments_read_in_place_equal_one_buffer_bitwise(dtype, hq, hkv, d, split, bf16_path):
    """A shared prompt prefix and a choice's own rows, read in place as two segments, give bitwise the answer of
    one buffer holding both (the same arithmetic row by row, whichever path the dtype and shape take; the AMX path
    copies a block of keys that spans the two segments, 700 and 1299 here, before its tile load)."""
    g = torch.Generator().manual_seed(split)
    k = torch.randn(1, hkv, 1300, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, 1300, d, generator=g).to(dtype)
    q = (torch.randn(1, hq, 1, d, generator=g) * 3).to(dtype)
    whole = decode_attention_cpu(q, k, v)
    parts = decode_attention_cpu(q, k[:, :, :split], v[:, :, :split], k[:, :, split:].contiguous(),
                                 v[:, :, split:].contiguous())
    assert torch.equal(whole, parts)
