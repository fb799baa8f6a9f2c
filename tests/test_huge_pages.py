"""Weight copies in 2 MB pages (ragkv/ops/huge_pages.py): the same values, contiguous, on a 2 MB boundary where the
kernel grants the mapping (RAGKV_HUGE_PAGES=1, `ragkv serve`'s default); small tensors and RAGKV_HUGE_PAGES=0 (every
other command's default) keep an ordinary copy."""

import gc

import pytest
import torch

from ragkv.ops import gemv_kernel, huge_pages


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("RAGKV_HUGE_PAGES", "1")


def test_a_big_tensor_is_copied_whole_onto_a_2mb_boundary(on):
    if not huge_pages.enabled():
        pytest.skip("no MADV_HUGEPAGE on this platform")
    w = torch.randn(2048, 1536).bfloat16()  # 6 MB
    view = w.t()  # a strided view is written in place of a .contiguous() copy
    out = huge_pages.on_huge_pages(view)
    assert out.is_contiguous() and out.shape == view.shape and out.dtype == view.dtype
    assert out.data_ptr() % huge_pages.PAGE == 0
    assert torch.equal(out, view)
    del view, w
    gc.collect()
    out.add_(1)  # the mapping lives as long as the tensor, writable
    assert torch.isfinite(out.float()).all()


def test_small_tensors_and_the_switch_keep_an_ordinary_copy(on, monkeypatch):
    small = torch.randn(64, 64)
    assert huge_pages.on_huge_pages(small).data_ptr() == small.data_ptr()  # already contiguous: itself
    assert huge_pages.on_huge_pages(small.t()).is_contiguous()
    big = torch.randn(1536, 2048)  # 12 MB fp32
    monkeypatch.setenv("RAGKV_HUGE_PAGES", "0")
    assert huge_pages.on_huge_pages(big).data_ptr() == big.data_ptr()
    strided = big.t()
    copied = huge_pages.on_huge_pages(strided)
    assert copied.is_contiguous() and torch.equal(copied, strided)


@pytest.mark.parametrize("int8", [False, True])
def test_a_packed_copy_in_2mb_pages_holds_the_weights(int8, on):
    """gemv_kernel.pack of a weight past MIN_BYTES: unpacking gives W back (bf16) or its int8 rounding."""
    w = torch.randn(4160, 896).bfloat16()
    packed, scales, _ = gemv_kernel.pack(w, None, int8=int8)
    if huge_pages.enabled():  # 3.7 MB (bf16) and 1.9 MB (int8): both past MIN_BYTES
        assert packed.data_ptr() % huge_pages.PAGE == 0
    back = gemv_kernel.unpack(packed, scales, 4160)
    if int8:
        assert (back - w.float()).abs().max() <= scales.max() / 2 + 1e-6
    else:
        assert torch.equal(back, w.float())
