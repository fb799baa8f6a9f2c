"""The one-pass RMSNorm (ragkv.ops.norm_kernel) against torch's F.rms_norm."""

import pytest
import torch
import torch.nn.functional as F

from ragkv.ops.norm_kernel import kernel, rms_norm_pass

pytestmark = pytest.mark.skipif(kernel() is None, reason="no C++ compiler: torch's op is used instead")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 896), (1, 700, 896), (16, 1, 1536), (3, 5, 70)])
def test_the_pass_equals_torchs_rms_norm_to_its_rounding(dtype, shape):
    """The sum of squares runs in another order than torch's reduction, so a row's scale may differ in its last fp32
    bits: in fp32 outputs agree to 1e-5 relative (a sum of D terms errs by up to ~D x 2^-24), in bf16 by one unit
    of bf16 at most, and nearly all bitwise."""
    g = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    want = F.rms_norm(x, (shape[-1],), w, 1e-6)
    got = rms_norm_pass(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    rel = 1e-5 if dtype == torch.float32 else 1.01 * torch.finfo(dtype).eps
    assert ((got.float() - want.float()).abs() <= rel * want.float().abs() + 1e-30).all()
    assert (got == want).float().mean() > (0.5 if dtype == torch.float32 else 0.95)


def test_what_the_pass_does_not_take_goes_back_to_torch():
    x = torch.randn(2, 8, 64)
    assert rms_norm_pass(x.transpose(0, 1), torch.ones(64), 1e-6) is None  # not contiguous
    assert rms_norm_pass(x.half(), torch.ones(64).half(), 1e-6) is None
    assert rms_norm_pass(x, torch.ones(64).bfloat16(), 1e-6) is None
    w = torch.ones(64, requires_grad=True)
    assert rms_norm_pass(x, w, 1e-6) is None  # a gradient wanted: torch's op
