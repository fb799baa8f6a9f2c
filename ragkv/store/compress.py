"""KV compression in the store (`?kv=int8|int4|fp8` on a tier): fewer bytes kept and loaded per token.

Scale layout after KIVI (Liu et al., ICML 2024, sec. 3): keys have a few outlier channels, so every key channel
gets its own scale (over groups of `key_group` tokens); values have none and attention mixes them token by token,
so every value token gets its own scale (over groups of `value_group` channels). The store keeps keys before RoPE,
where KVQuant (Hooper et al., NeurIPS 2024, sec. 3.1-3.2) found per-channel quantization works best.
Scales (and int4's minima) are bfloat16, rounded outward so that no value clips: an element's round-trip error is
at most half its group's scale (int8, int4), or max(|x| / 16, scale / 1024) for fp8 e4m3 (3 mantissa bits).
CacheGen (Liu et al., SIGCOMM 2024) adds entropy coding on top; not here, so that every layer keeps a fixed size
and can be read alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ragkv.store.base import BlockKV

SCALE_DTYPE = torch.bfloat16  # fp32's range (no overflow for any KV), 2 bytes
PART_ALIGN = 8                # every stored part starts 8-byte aligned, so it can be viewed in place
# torch runs a CPU op over more elements than this on its intra-op thread pool; decompression (in a prefetch thread,
# beside the model's compute) goes head by head below it instead, rather than fight the model for the cores
INLINE_ELEMENTS = 32768
FP8_MAX = 448.0               # largest finite float8_e4m3fn


@dataclass(frozen=True)
class Codec:
    """How one tier stores KV. Symmetric codecs keep one scale per group (absmax / qmax); int4 also keeps the
    group's minimum (asymmetric, KIVI's choice at low bit widths, where a zero point is worth its bytes)."""

    name: str
    key_group: int    # tokens sharing one per-channel key scale
    value_group: int  # channels sharing one per-token value scale (0: the whole head)

    @property
    def zero_point(self) -> bool:
        return self.name == "int4"

    @property
    def data_dtype(self) -> torch.dtype:
        return {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}[self.name]

    def value_group_of(self, head_dim: int) -> int:
        g = self.value_group
        return g if g and head_dim % g == 0 else head_dim

    def part_shapes(self, heads: int, tokens: int, head_dim: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of one layer's stored parts, in storage order."""
        packed = head_dim // 2 if self.name == "int4" else head_dim  # int4: two channels per byte
        nk = math.ceil(tokens / self.key_group)
        nv = head_dim // self.value_group_of(head_dim)
        parts = []
        for name, scales in (("k", (heads, nk, head_dim)), ("v", (heads, tokens, nv))):
            parts += [(name, self.data_dtype, (heads, tokens, packed)), (f"{name}_scale", SCALE_DTYPE, scales)]
            if self.zero_point:
                parts.append((f"{name}_min", SCALE_DTYPE, scales))
        return parts

    def layer_nbytes(self, heads: int, tokens: int, head_dim: int) -> int:
        """Bytes one stored layer (K and V, with scales and alignment padding) takes."""
        return sum(padded(math.prod(shape) * dt.itemsize) for _, dt, shape in self.part_shapes(heads, tokens, head_dim))

    def compress(self, kv: BlockKV) -> "CompressedKV":
        """Quantize on the tensors' own device (a GPU block never passes through host memory uncompressed)."""
        if kv.keys.shape[-1] % 2 and self.name == "int4":
            raise ValueError(f"int4 packs channel pairs; head_dim {kv.keys.shape[-1]} is odd")
        parts = {}
        for name, x, groups in (("k", kv.keys, _key_groups), ("v", kv.values, _value_groups)):
            parts.update(_quantize(self, name, x, groups))
        return CompressedKV(self, kv.dtype, tuple(kv.keys.shape), parts)

    def decompress(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [..., T, D] in `dtype` from parts with any leading dims (one layer, or all of them)."""
        q = parts["k"]
        if q.device.type == "cpu" and q.dim() > 2 and q.numel() * (2 if self.name == "int4" else 1) > INLINE_ELEMENTS:
            shape = (*q.shape[:-1], parts["k_scale"].shape[-1])
            keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            for i in range(q.shape[0]):
                keys[i], values[i] = self.decompress({n: t[i] for n, t in parts.items()}, dtype)
            return keys, values
        return (_dequantize(self, parts, "k", dtype, _per_key_group),
                _dequantize(self, parts, "v", dtype, _per_value_group))


CODECS = {
    "int8": Codec("int8", key_group=128, value_group=0),
    "int4": Codec("int4", key_group=32, value_group=32),  # KIVI's group size 32
    "fp8": Codec("fp8", key_group=128, value_group=0),
}
KV_CHOICES = ("none",) + tuple(CODECS)  # what `?kv=` accepts


def codec_named(name: str | None) -> Codec | None:
    """The codec called `name`; None for None or "none" (uncompressed)."""
    if name is None or name == "none":
        return None
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown KV codec {name!r}; choose one of {', '.join(KV_CHOICES)}") from None


def layer_nbytes(codec: Codec | None, heads: int, tokens: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one layer of a block (K and V) takes in a tier with `codec` (None: uncompressed, in `dtype`)."""
    if codec is None:
        return 2 * heads * tokens * head_dim * dtype.itemsize
    return codec.layer_nbytes(heads, tokens, head_dim)


def padded(n: int) -> int:
    return -(-n // PART_ALIGN) * PART_ALIGN


@dataclass
class CompressedKV:
    """A block's KV as a codec keeps it: parts [L, ...] (see Codec.part_shapes), decompressed on read."""

    codec: Codec
    dtype: torch.dtype                  # the working dtype the KV was given in and is decompressed into
    shape: tuple[int, int, int, int]    # L, Hkv, T, D
    parts: dict[str, torch.Tensor]

    @property
    def num_layers(self) -> int:
        return self.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codec.decompress({n: t[i] for n, t in self.parts.items()}, self.dtype)

    def decompress(self) -> BlockKV:
        return BlockKV(*self.codec.decompress(self.parts, self.dtype))


# --- quantization: x [..., T, D] viewed as groups whose last-but-one or last dim is reduced -------------------

def _key_groups(x: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, int]:
    """[..., T, D] -> [..., nG, G, D] (per channel over G tokens; the last group padded with its last token, which
    leaves its min and max as they are), reduced over dim -2."""
    T, g = x.shape[-2], codec.key_group
    pad = math.ceil(T / g) * g - T
    if pad and T:
        x = torch.cat([x, x[..., -1:, :].expand(*x.shape[:-2], pad, x.shape[-1])], dim=-2)
    return x.unflatten(-2, (math.ceil(T / g), g)), -2


def _value_groups(x: torch.Tensor, codec: Codec) -> tuple[torch.Tensor, int]:
    """[..., T, D] -> [..., T, D / G, G] (per token over G channels), reduced over dim -1."""
    return x.unflatten(-1, (-1, codec.value_group_of(x.shape[-1]))), -1


def _round_up(x: torch.Tensor) -> torch.Tensor:
    """The nearest SCALE_DTYPE value >= x (so dividing by it never pushes a value past the largest level)."""
    y = x.to(SCALE_DTYPE)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, math.inf)), y)


def _round_down(x: torch.Tensor) -> torch.Tensor:
    y = x.to(SCALE_DTYPE)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, -math.inf)), y)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    return torch.where(s == 0, torch.ones_like(s), s)  # a constant group: every level is 0 anyway


def _quantize(codec: Codec, name: str, x: torch.Tensor, groups) -> dict[str, torch.Tensor]:
    T, D = x.shape[-2:]
    xg, dim = groups(x.float(), codec)
    out = {}
    if codec.zero_point:  # int4: levels 0..15 from the group's minimum
        lo = _round_down(xg.amin(dim, keepdim=True))
        scale = _round_up((xg.amax(dim, keepdim=True) - lo.float()) / 15)
        q = torch.round((xg - lo.float()) / _safe(scale)).clamp_(0, 15).to(torch.uint8)
        out[f"{name}_min"] = lo.squeeze(dim)
    elif codec.name == "fp8":
        scale = _round_up(xg.abs().amax(dim, keepdim=True) / FP8_MAX)
        q = (xg / _safe(scale)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:  # int8: symmetric levels -127..127
        scale = _round_up(xg.abs().amax(dim, keepdim=True) / 127)
        q = torch.round(xg / _safe(scale)).clamp_(-127, 127).to(torch.int8)
    q = q.flatten(-3, -2)[..., :T, :] if dim == -2 else q.flatten(-2)
    if codec.name == "int4":
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    out[name] = q.contiguous()
    out[f"{name}_scale"] = scale.squeeze(dim)
    return out


def _per_key_group(x: torch.Tensor, s: torch.Tensor, codec: Codec, op) -> None:
    """x[..., t, d] op= s[..., t // G, d], in place, broadcasting over each group of G tokens (no expanded copy)."""
    T, g = x.shape[-2], codec.key_group
    full = T // g
    if full:
        op(x[..., :full * g, :].unflatten(-2, (full, g)), s[..., :full, :].unsqueeze(-2))
    if T % g:
        op(x[..., full * g:, :], s[..., full:full + 1, :])


def _per_value_group(x: torch.Tensor, s: torch.Tensor, codec: Codec, op) -> None:
    """x[..., t, d] op= s[..., t, d // G], in place."""
    op(x.unflatten(-1, (s.shape[-1], -1)), s.unsqueeze(-1))


def _dequantize(codec: Codec, parts: dict, name: str, dtype: torch.dtype, per_group) -> torch.Tensor:
    q = parts[name]
    if codec.name == "int4":
        q = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)
    x = q.float()
    per_group(x, parts[f"{name}_scale"].float(), codec, torch.Tensor.mul_)
    if codec.zero_point:
        per_group(x, parts[f"{name}_min"].float(), codec, torch.Tensor.add_)
    return x.to(dtype)
