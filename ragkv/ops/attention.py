"""Attention kernels: SDPA (fast path), attention that also returns log-sum-exp, LSE merging, masks.

Shapes: q [B, Hq, T, D]; k, v [B, Hkv, S, D] with Hq a multiple of Hkv (grouped-query attention).
Boolean masks are True where attention is allowed, shaped [T, S] (broadcast over batch and heads).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ragkv.ops import decode_kernel, prefill_kernel
from ragkv.ops.decode_kernel import append_attention_many_cpu, decode_attention_cpu, decode_attention_many_cpu
from ragkv.ops.kernel_choice import KernelChooser, row_class

log = logging.getLogger(__name__)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with GQA; `causal` only for square self-attention."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=gqa)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """Rows attending causally after `past` cached keys and to nothing else: ragkv's bf16 kernel (ops/prefill_kernel.py,
    its AVX-512 BF16 or its AMX path) where it applies and was measured the fastest here (choose_prefill_attention),
    else SDPA with `mask` (None: the square causal case)."""
    path = prefill_kernel_path(q, k)
    if path is not None:
        return prefill_kernel.prefill_attention(q, k, v, past=past, amx=path == "amx")
    return sdpa(q, k, v, mask=mask, causal=mask is None)


# (dtype, query heads, KV heads, head dim) -> "kernel", "amx" or "sdpa" per row class (kernel_choice.ROW_CLASSES). On
# an AMX Xeon (1,329 causal rows, 14/2 heads of 64) torch's flash attention (oneDNN's brgemm on the matrix unit) took
# 6.7 ms, ragkv's AVX-512 BF16 kernel 18.4, its AMX path 3.7; on a Zen 5 the AVX-512 kernel was 1.7-2x SDPA's speed.
_PREFILL_CHOICE: dict[tuple, list[str]] = {}


def _heads_key(dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> tuple:
    return (dtype, q_heads, kv_heads, head_dim)


PREFILL_ATTENTION = ("kernel", "amx", "sdpa")  # the candidates for a prefill's causal attention


def prefill_attention_choice(q: torch.Tensor, k: torch.Tensor) -> str:
    """The measured choice for these rows' heads (the kernel where none was measured: it was written for the CPUs
    it is built on)."""
    choice = _PREFILL_CHOICE.get(_heads_key(q.dtype, q.shape[1], k.shape[1], q.shape[-1]))
    return choice[row_class(q.shape[2])] if choice else "kernel"


def prefill_kernel_path(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """"kernel" or "amx" where ragkv's prefill kernel takes these rows and that path was measured the fastest here,
    else None (SDPA)."""
    if not prefill_kernel.applies(q, k):
        return None
    choice = prefill_attention_choice(q, k)
    return choice if choice in ("kernel", "amx") else None


def choose_prefill_attention(chooser: KernelChooser, dtype: torch.dtype, q_heads: int, kv_heads: int,
                             head_dim: int) -> list[str]:
    """Time ragkv's prefill kernel (its AVX-512 BF16 path, and its AMX path where built) against SDPA on square causal
    rows of each row class (cached by `chooser`) and use the fastest from then on; where the kernel is not built,
    SDPA unmeasured."""
    key = _heads_key(dtype, q_heads, kv_heads, head_dim)

    def make(kernel: str):
        def at(rows: int):
            q = torch.randn(1, q_heads, rows, head_dim, dtype=dtype)
            k, v = torch.randn(2, 1, kv_heads, rows, head_dim, dtype=dtype)
            if kernel == "sdpa":
                return lambda: sdpa(q, k, v, causal=True)
            if not (prefill_kernel.amx_applies if kernel == "amx" else prefill_kernel.applies)(q, k):
                return None
            return lambda: prefill_kernel.prefill_attention(q, k, v, past=0, amx=kernel == "amx")
        return at

    product = f"causal attention heads={q_heads}/{kv_heads} dim={head_dim}"
    _PREFILL_CHOICE[key] = chooser.choose(product, dtype, 0, {n: make(n) for n in PREFILL_ATTENTION}, "sdpa")
    return _PREFILL_CHOICE[key]


DECODE_PROBE_SEQUENCES, DECODE_PROBE_KEYS = 16, 1024  # a busy server's decode step, as timed for the choice


def forced_decode_attention() -> str:
    """RAGKV_DECODE_ATTENTION: "kernel" or "torch" (which decode attention), "avx512" or "amx" (the kernel, on that
    bf16 path), else "auto" (measured)."""
    forced = os.environ.get("RAGKV_DECODE_ATTENTION", "auto")
    return forced if forced in ("kernel", "torch", "avx512", "amx") else "auto"


def choose_decode_attention(chooser: KernelChooser, dtype: torch.dtype, q_heads: int, kv_heads: int,
                            head_dim: int) -> str:
    """Time the bf16 decode kernel's two paths, AVX-512 BF16 and AMX (ops/decode_amx.py), on a step of
    DECODE_PROBE_SEQUENCES sequences of DECODE_PROBE_KEYS keys (cached by `chooser`) and use the faster for every
    step from then on: one choice for all batch sizes, so that a sequence's numbers do not depend on what decodes
    beside it. Where the AMX path is not built here, the AVX-512 one unmeasured. The choice is the process's (one
    switch in the kernel), made for the last model that asked. RAGKV_DECODE_ATTENTION=avx512 or amx fixes it."""
    mod = decode_kernel.kernel()
    if dtype != torch.bfloat16 or mod is None or not mod.amx_built():
        return "avx512"
    forced = forced_decode_attention()
    if forced in ("avx512", "amx"):  # RAGKV_DECODE_ATTENTION fixes the path (A/B runs), unmeasured
        mod.use_amx(forced == "amx")
        return forced

    def make(path: str):
        def at(rows: int):
            if rows != DECODE_PROBE_SEQUENCES:
                return None
            g = torch.Generator().manual_seed(rows)
            keys = [torch.randn(1, kv_heads, DECODE_PROBE_KEYS, head_dim, generator=g).to(dtype) for _ in range(rows)]
            q = torch.randn(rows, q_heads, 1, head_dim, generator=g).to(dtype)
            return lambda: (mod.use_amx(path == "amx"), decode_attention_many_cpu(q, keys, keys))
        return at

    product = f"decode attention heads={q_heads}/{kv_heads} dim={head_dim} {DECODE_PROBE_KEYS} keys"
    choice = chooser.choose(product, dtype, 0, {n: make(n) for n in ("avx512", "amx")}, "avx512")
    chosen = choice[row_class(DECODE_PROBE_SEQUENCES)]
    mod.use_amx(chosen == "amx")
    return chosen


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention returning (out [B,Hq,T,D], lse [B,Hq,T]) in fp32 math.

    Scores are q.k / (sqrt(D) * temperature). Meant for the few query rows of a request, where
    materializing [T, S] scores is cheap. Fully masked rows give lse = -inf and out = 0.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qf = q.float().reshape(B, Hkv, g * T, D) * (1.0 / (math.sqrt(D) * temperature))  # one KV group per head set
    scores = torch.matmul(qf, k.float().transpose(-1, -2)).reshape(B, Hkv, g, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # One shared max/exp/sum gives both the LSE and the output; normalizing the small output, not the
    # [T, S] probabilities, keeps this at four passes over the scores.
    m = scores.amax(dim=-1, keepdim=True)
    if mask is not None:
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows: exp(-inf) = 0
    scores.sub_(m).exp_()
    total = scores.sum(dim=-1, keepdim=True)  # [B, Hkv, g, T, 1]
    out = torch.matmul(scores.reshape(B, Hkv, g * T, S), v.float()).reshape(B, Hkv, g, T, D) / total
    if mask is not None:
        out = torch.nan_to_num(out, nan=0.0)
    lse = (m + total.log()).squeeze(-1)  # [B, Hkv, g, T]
    return out.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)


def unmasked_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_with_lse` without a mask (a query over keys that all precede it, e.g. one block). On the CPU,
    torch's fused flash kernel, which returns the LSE too: with no mask the GQA group folds into the rows, so K/V
    are read as they are, not expanded (1.4-1.8x faster than the explicit form at 1-50 rows over 600 keys)."""
    if q.device.type != "cpu" or q.shape[0] != 1:
        return attention_with_lse(q, k, v, temperature=temperature)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(B, Hkv, Hq // Hkv * T, D), k, v, 0.0, False, scale=1.0 / (math.sqrt(D) * temperature))
    return out.reshape(B, Hq, T, D), lse.reshape(B, Hq, T)


def merge_by_lse(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Combine attention over disjoint key sets: softmax over the parts' LSEs weights their outputs.

    Equals one attention over the union of the key sets when the LSEs are unmodified.
    """
    stacked = torch.stack(lses, dim=0)  # [P, B, H, T]
    weights = torch.softmax(stacked, dim=0)
    weights = torch.nan_to_num(weights, nan=0.0).unsqueeze(-1)  # all parts empty -> 0
    return sum(w * o for w, o in zip(weights, outs))


def causal_mask(q_len: int, k_len: int, device=None) -> torch.Tensor:
    """Queries are the last q_len of k_len positions: row i sees keys [0, k_len - q_len + i]."""
    offset = k_len - q_len
    rows = torch.arange(q_len, device=device).unsqueeze(1) + offset
    return torch.arange(k_len, device=device).unsqueeze(0) <= rows


def window_mask(q_len: int, k_len: int, window: int, device=None) -> torch.Tensor:
    """Causal mask limited to a sliding window (Mistral): row i sees keys in (pos_i - window, pos_i]."""
    offset = k_len - q_len
    rows = torch.arange(q_len, device=device).unsqueeze(1) + offset
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    return (cols <= rows) & (cols > rows - window)


def prefill_mask(q_len: int, k_len: int, window: int | None = None, device=None) -> torch.Tensor | None:
    """The mask of new rows (the last q_len of k_len positions) attending causally, within `window` if the
    model has one; None where SDPA's causal kernel does it (square, no window in reach)."""
    if window is not None and window < k_len:
        return window_mask(q_len, k_len, window, device)
    return causal_mask(q_len, k_len, device) if k_len > q_len else None


def block_attention_mask(segment_ids: torch.Tensor, open_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Block-Attention mask (Ma et al. 2025, sec. 3): causal, and a token of a closed block sees only its block.

    segment_ids: [N] int, non-decreasing block index per token. Tokens whose block is in `open_ids`
    (the query, and the answer during fine-tuning) attend causally to everything before them.
    """
    n = segment_ids.shape[0]
    causal = causal_mask(n, n, segment_ids.device)
    same = segment_ids.unsqueeze(1) == segment_ids.unsqueeze(0)
    if open_ids is None:
        return causal & same
    is_open = torch.isin(segment_ids, open_ids).unsqueeze(1)
    return causal & (same | is_open)


_KERNEL_WINS: dict = {}  # dtype -> whether the C++ decode kernel beat the torch path on this machine


def kernel_wins(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C++ decode kernel is the faster path here: timed once per dtype against the torch path, over
    2,048 keys with the first call's heads. It was 1.7-2x faster than SDPA where it was written; in fp32 its generic
    loop was 3.4x slower than SDPA on a 2-core AVX2 Zen 3 (1.47 ms against 0.43 ms per layer at 2.4K keys), its
    AVX2 path (ops/decode_f32.py) takes a 16-sequence step's attention in about half SDPA's time. The choice holds
    for the process (every sequence decodes through the same path: batch invariance); RAGKV_DECODE_ATTENTION=kernel
    or torch fixes it (avx512 or amx: the kernel, on that path)."""
    forced = forced_decode_attention()
    if forced != "auto":  # avx512 / amx: the kernel, on that path (bf16)
        return forced != "torch"
    if q.dtype == torch.bfloat16 and q.dtype not in _KERNEL_WINS:
        # bf16: the torch path is three small ops with a thread fork/join each; timed alone it was level with the
        # kernel (0.14-0.28 ms against 0.13-0.24 per layer, Zen 4), but inside `ragkv serve` it took ~0.9 ms per
        # layer, 30% of a decode step (py-spy), and the kernel made the server's decode 13.7 -> 20 tok/s. A timing
        # race at start-up cannot see that: the kernel wherever it is built.
        _KERNEL_WINS[q.dtype] = decode_attention_cpu(q[:, :, :1], k[:, :, :1], v[:, :, :1]) is not None
    if q.dtype not in _KERNEL_WINS:
        k = torch.randn(k.shape[:2] + (2048, k.shape[3]), dtype=k.dtype, device=k.device)
        v = torch.randn_like(k)
        if decode_attention_cpu(q, k, v) is None:
            _KERNEL_WINS[q.dtype] = False
        else:
            def best_us(fn) -> float:
                fn()  # warm
                times = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                return min(times) * 1e6

            ours = best_us(lambda: decode_attention_cpu(q, k, v))
            theirs = best_us(lambda: _torch_decode_attention(q, k, v))
            _KERNEL_WINS[q.dtype] = ours <= theirs
            log.info("decode attention (%s, %d keys): C++ kernel %.0f us, torch %.0f us: using %s", q.dtype,
                     k.shape[2], ours, theirs, "the kernel" if ours <= theirs else "torch")
    return _KERNEL_WINS[q.dtype]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of a few new rows over a whole cache (decode), no mask.

    On CPU, one row per head: the C++ kernel of ragkv.ops.decode_kernel where it is the faster path on this
    machine (`kernel_wins`). Otherwise SDPA in fp32; for bf16/fp16 on CPU, SDPA's flash kernel is ~10x slower than
    two small matmuls (790 us vs ~80 us per layer at 1.3K keys), so scores go through matmul with an fp32 softmax,
    as K @ q^T (K in its cache layout): q @ K^T made the CPU copy K to transpose it (1.4x slower).
    """
    if q.device.type == "cpu" and q.shape[0] == 1 and q.shape[2] == 1 and q.dtype in (torch.float32, torch.bfloat16) \
            and kernel_wins(q, k, v):
        out = decode_attention_cpu(q, k, v)
        if out is not None:
            return out
    return _torch_decode_attention(q, k, v)


def decode_attention_many(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """`decode_attention` of B sequences at once: q [B, Hq, 1, D], keys[b] / values[b] [1, Hkv, S_b, D] -> [B, Hq,
    1, D]. Row b is what `decode_attention(q[b:b+1], keys[b], values[b])` gives, bitwise; where the C++ kernel is
    the path, one call runs them all (one parallel loop per layer, not one per sequence)."""
    if q.device.type == "cpu" and q.shape[2] == 1 and q.dtype in (torch.float32, torch.bfloat16) \
            and kernel_wins(q[:1], keys[0], values[0]):
        out = decode_attention_many_cpu(q, keys, values)
        if out is not None:
            return out
    return torch.cat([decode_attention(q[b:b + 1], k, v) for b, (k, v) in enumerate(zip(keys, values))])


def append_attention_many(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                          key_buffers: list[torch.Tensor], value_buffers: list[torch.Tensor],
                          lengths: list[int]) -> torch.Tensor | None:
    """A decode step's new rows written into B caches and attended in one call: k_new, v_new [B, Hkv, 1, D] go to
    row lengths[b] of key_buffers[b] / value_buffers[b] [1, Hkv, capacity, D], then row b is
    `decode_attention(q[b:b+1], keys[:lengths[b] + 1], values[:lengths[b] + 1])`, bitwise. None where the C++
    kernel is not the path (nothing written): the caller writes and attends as usual."""
    if q.device.type == "cpu" and q.shape[2] == 1 and q.dtype in (torch.float32, torch.bfloat16) \
            and k_new.dtype == q.dtype and kernel_wins(q[:1], key_buffers[0][:, :, :1], value_buffers[0][:, :, :1]):
        return append_attention_many_cpu(q, k_new, v_new, key_buffers, value_buffers, lengths)
    return None


def _torch_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    if q.dtype == torch.float32 and q.device.type == "cpu" and q.shape[0] == 1:
        # the GQA group folded into the rows, K/V read once per KV head: 2.2x faster than SDPA's enable_gqa alone
        # at 1.4K keys on Zen 3; Qwen 0.5B decode steps over 2.4K tokens 0.94-0.96x (serve_vllm/s23)
        return unmasked_attention_with_lse(q, k, v)[0]
    if q.dtype == torch.float32 or q.device.type != "cpu":
        return sdpa(q, k, v)
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scores = torch.matmul(k, q.reshape(B, Hkv, g * T, D).transpose(-1, -2)).transpose(-1, -2).float()
    scores = scores * (1.0 / math.sqrt(D))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, Hq, T, D)


def decode_attention_parts(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`decode_attention` over a cache kept as segments [(K, V), ...] in order (a prompt prefix shared by n
    choices, then one choice's own rows), equal to attending over their concatenation. The CPU kernel reads two
    segments in place with the same arithmetic as one buffer; elsewhere they are joined first."""
    if len(parts) == 1:
        return decode_attention(q, *parts[0])
    if len(parts) == 2 and q.device.type == "cpu" and q.shape[0] == 1 and q.shape[2] == 1 \
            and q.dtype in (torch.float32, torch.bfloat16) and kernel_wins(q, *parts[0]):
        (k1, v1), (k2, v2) = parts
        out = decode_attention_cpu(q, k1, v1, k2, v2)
        if out is not None:
            return out
    return decode_attention(q, torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2))


@dataclass(frozen=True)
class SegmentedMask:
    """Block-Attention masks of a batch kept as their segments: per example, spans (start, end, open) covering
    0..T. A closed span attends causally within itself, an open one causally to everything before it.

    Equals `block_attention_mask` (`dense`; tested), but attending span by span lets SDPA take its causal kernel
    and skips the masked-out blocks instead of computing [T, T] scores and discarding most of them.
    """
    spans: tuple[tuple[tuple[int, int, bool], ...], ...]

    @classmethod
    def from_segment_ids(cls, rows: Sequence[Sequence[int]], open_ids: Sequence[int]) -> "SegmentedMask":
        """rows: per example, the non-decreasing segment id of each token (all rows of one length)."""
        out = []
        for seg, open_id in zip(rows, open_ids):
            spans, start = [], 0
            for t in range(1, len(seg) + 1):
                if t == len(seg) or seg[t] != seg[start]:
                    spans.append((start, t, seg[start] == open_id))
                    start = t
            out.append(tuple(spans))
        return cls(tuple(out))

    @property
    def length(self) -> int:
        return self.spans[0][-1][1] if self.spans and self.spans[0] else 0

    def to(self, device) -> "SegmentedMask":
        return self  # plain integers: nothing lives on a device

    def dense(self, device=None) -> torch.Tensor:
        """The same masks as booleans [B, 1, T, T] (True = may attend), from `block_attention_mask`."""
        out = []
        for spans in self.spans:
            seg = torch.repeat_interleave(torch.arange(len(spans), device=device),
                                          torch.tensor([e - s for s, e, _ in spans], device=device))
            open_ids = torch.tensor([i for i, (_, _, is_open) in enumerate(spans) if is_open], dtype=torch.long,
                                    device=device)
            out.append(block_attention_mask(seg, open_ids))
        return torch.stack(out).unsqueeze(1)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output [B, Hq, T, D] of rotated q over k, v under these masks."""
        rows = []
        for b, spans in enumerate(self.spans):
            qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
            parts = [sdpa(qb[:, :, s:e], kb[:, :, :e], vb[:, :, :e], mask=causal_mask(e - s, e, q.device))
                     if is_open and s > 0 else
                     sdpa(qb[:, :, s:e], kb[:, :, s:e], vb[:, :, s:e], causal=True)
                     for s, e, is_open in spans]
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)
