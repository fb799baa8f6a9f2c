"""The one-pass RoPE (ops/rope_kernel.py) returns torch's ops' result bitwise, for every layout the model hands it."""

import pytest
import torch

from ragkv.ops import rope_kernel
from ragkv.ops.rope import RopeConfig, RotaryTable, rotate_half

pytestmark = pytest.mark.skipif(rope_kernel.kernel() is None, reason="no C++ compiler here")


def torch_rope(x, cos, sin):
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "projection_view", "per_row_positions"])
def test_the_pass_equals_torchs_ops_bitwise(dtype, layout):
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 3, 37, 64
    table = RotaryTable(RopeConfig(head_dim=D, theta=1e6))
    if layout == "projection_view":  # q as the fused projection leaves it: [B, T, H, D] memory seen as [B, H, T, D]
        x = (torch.randn(B, T, H * D, generator=g) * 8).to(dtype).view(B, T, H, D).transpose(1, 2)
    else:
        x = (torch.randn(B, H, T, D, generator=g) * 8).to(dtype)
    if layout == "per_row_positions":  # each sequence its own positions (decode batches, blocks re-rotated)
        cos, sin = table.lookup(torch.randint(0, 5000, (B, T), generator=g))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    else:
        cos, sin = table.lookup(torch.arange(100, 100 + T))
    got = rope_kernel.rope_pass(x, cos, sin)
    assert got is not None and got.dtype == dtype and got.shape == x.shape and got.stride() == x.stride()
    assert torch.equal(got, torch_rope(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 16])
def test_a_block_rotated_into_its_cache_slot_is_torchs_result_bitwise(dtype, D):
    """Re-rotation (`rope_into`, from half tables, into a strided cache slot) through the pass: torch's result
    bitwise, nothing written outside the slot (AVX-512 path at D % 32 == 0, the plain loop otherwise)."""
    from ragkv.ops.rope import half_tables, rope_into

    g = torch.Generator().manual_seed(1)
    H, T, cap, off = 2, 45, 128, 20
    table = RotaryTable(RopeConfig(head_dim=D, theta=1e6))
    x = (torch.randn(1, H, T, D, generator=g) * 8).to(dtype)
    cos, sin = table.lookup(torch.arange(300, 300 + T))
    cache = torch.full((1, H, cap, D), 7.0, dtype=dtype)
    rope_into(cache[:, :, off:off + T], x, *half_tables(cos, sin))
    assert torch.equal(cache[:, :, off:off + T], torch_rope(x, cos, sin))
    assert (cache[:, :, :off] == 7).all() and (cache[:, :, off + T:] == 7).all()
    assert rope_kernel.rope_half_into(cache[:, :, :T], x, *half_tables(cos, sin))  # the pass took it
    assert not rope_kernel.rope_half_into(cache[:, :, :T].float() if dtype != torch.float32 else cache[:, :, :T].half(),
                                          x, *half_tables(cos, sin))  # dtypes differ: torch's ops (the caller's)


def test_shapes_the_pass_does_not_take_fall_back_to_torch():
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)  # 3-d
    cos, sin = RotaryTable(RopeConfig(head_dim=64)).lookup(torch.arange(5))
    assert rope_kernel.rope_pass(x, cos, sin) is None
    assert rope_kernel.rope_pass(x.half().unsqueeze(0), cos, sin) is None  # fp16
    from ragkv.ops.rope import apply_rope
    assert torch.equal(apply_rope(x, cos, sin), torch_rope(x, cos, sin))


def test_broadcasts_to_agrees_with_torch_broadcast_shapes():
    from itertools import product

    from ragkv.ops.rope_kernel import broadcasts_to

    dims = (0, 1, 2, 3)
    shapes = [torch.Size(s) for n in range(4) for s in product(dims, repeat=n)]
    for shape, target in product(shapes, [torch.Size(t) for t in product(dims, repeat=3)]):
        try:
            torch_says = torch.broadcast_shapes(shape, target) == target
        except RuntimeError:
            torch_says = False
        assert broadcasts_to(shape, target) == torch_says, (shape, target)
