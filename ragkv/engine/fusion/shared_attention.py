"""Shared block attention: a sequence attends to pooled blocks in place instead of to its own re-rotated
copy of them.

RoPE is relative: a query at position m and a key j of a block placed at offset o meet through
<R(m) q, R(o + j) k> = <R(m - o) q, R(j) k>. So the pool keeps each block's K rotated once at its own positions j,
and the query, already rotated at m by the layer, is rotated back by o (one rotation of the query's rows per
block); scores, and so the attention, are today's. Each block is one attention with its log-sum-exp, the sequence's
own rows (query, generated tokens) another, causal; the parts merge through their LSEs (ragkv.ops.attention), which
equals one softmax over the concatenation. The sequence's cache holds only its own rows.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ragkv.engine.blocks.pool import PooledBlock
from ragkv.engine.fusion.layout import Layout
from ragkv.engine.kv.kvcache import KVCache
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.measure.stats import RequestStats
from ragkv.errors import InvalidRequestError
from ragkv.models.loop import Forward, computed
from ragkv.ops.attention import attention_with_lse, causal_mask, kernel_wins, merge_by_lse, unmasked_attention_with_lse
from ragkv.ops.decode_kernel import parts_attention_cpu
from ragkv.ops.rope import apply_rope


@dataclass(frozen=True)
class SharedBlocksAttention:
    """Callable as a decode attention policy (ragkv.engine.kv.state): q [1, Hq, T, D] rotated at its positions, k/v
    the sequence's own rows [1, Hkv, S, D], the last T of them q's own.

    With APE (`temperature`, `scale` != 1), the blocks from `context_from` on are its context: attended with the
    temperature and merged into one part whose LSE is scaled by S * T (ragkv.engine.fusion.ape), the blocks before it (the
    prefix) attended plainly."""
    blocks: tuple[PooledBlock, ...]
    cos: torch.Tensor  # [nb, 1, 1, D] fp32: cos(o_b * f)
    sin: torch.Tensor  # [nb, 1, 1, D] fp32: -sin(o_b * f), a rotation by -o_b
    context_from: int = 0
    temperature: float = 1.0
    scale: float = 1.0
    # blend's recomputed rows (keep_own_rows): per layer, per block a bool mask of the rows read in place (None:
    # all), and the recomputed context rows that replace the others, (K, V) [1, Hkv, m, D] rotated at their
    # positions (None: none at that layer)
    keep: tuple | None = None
    overrides: tuple | None = None

    @property
    def own_rows(self) -> int:
        """The recomputed context rows this sequence keeps apart from its cache, per layer on average."""
        if not self.overrides:
            return 0
        return -(-sum(o[0].shape[2] for o in self.overrides if o is not None) // len(self.overrides))

    def release(self) -> None:
        """The sequence is done: the kernel's cached step tables must not keep its blocks alive past the pool's
        bound."""
        _StepTables.forget(self)

    def _mask(self, layer: int, b: int):
        return None if self.keep is None else self.keep[layer][b]

    def _override(self, layer: int):
        return None if self.overrides is None else self.overrides[layer]

    @classmethod
    def at(cls, model, blocks: list[PooledBlock], offsets: list[int], **ape) -> "SharedBlocksAttention":
        cos, sin = model.rotary.lookup(torch.tensor(offsets, dtype=torch.long, device=model.device))
        return cls(tuple(blocks), cos[:, None, None], -sin[:, None, None], **ape)

    def _temperature(self, b: int) -> float:
        return self.temperature if b >= self.context_from else 1.0

    def _combine(self, parts: list, own, dtype) -> torch.Tensor:
        """Merge the blocks' parts (in block order) and the own rows' part into the attention output."""
        if (self.temperature == 1.0 and self.scale == 1.0) or len(parts) <= self.context_from:
            merged = parts + [own]
        else:  # APE: the context is one part, its joint LSE scaled by S * T
            ctx = parts[self.context_from:]
            lses = torch.stack([lse for _, lse in ctx])
            joint = (merge_by_lse([o for o, _ in ctx], list(lses)), torch.logsumexp(lses, dim=0))
            merged = parts[:self.context_from] + [(joint[0], joint[1] * (self.scale * self.temperature)), own]
        return merge_by_lse([o for o, _ in merged], [lse for _, lse in merged]).to(dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.shape[2] == 1:  # a decode step: every part in one kernel call where there is one
            out = _attend_in_kernel(layer, [(self, q, k, v)])
            if out is not None:
                return out[0]
        moved = apply_rope(q, self.cos, self.sin)  # [nb, Hq, T, D]: each block's view of the query, at m - o_b
        parts = [self._block_part(layer, b, moved[b:b + 1]) for b in range(len(self.blocks))]
        T, S = q.shape[2], k.shape[2]
        if T > 1:
            own = attention_with_lse(q, k, v, mask=causal_mask(T, S, q.device))
        else:
            own = unmasked_attention_with_lse(q, k, v)
        over = self._override(layer)
        if over is not None:  # recomputed context rows: all before the query's, no mask
            own = _merged(own, unmasked_attention_with_lse(q, *over))
        return self._combine(parts, own, q.dtype)

    def _block_part(self, layer: int, b: int, q: torch.Tensor):
        blk, mask = self.blocks[b], self._mask(layer, b)
        if mask is None:
            return unmasked_attention_with_lse(q, blk.keys[layer], blk.values[layer], self._temperature(b))
        return attention_with_lse(q, blk.keys[layer], blk.values[layer], mask=mask, temperature=self._temperature(b))

    @staticmethod
    def attend_batch(layer: int, rows: list[tuple["SharedBlocksAttention", torch.Tensor, torch.Tensor,
                                                   torch.Tensor]]) -> list[torch.Tensor]:
        """One decode step's attention for several sequences (policy, q [1, Hq, 1, D], own k, own v): each block
        any of them holds is read once, by all its holders' query rows together (each rotated back by its own
        offset), instead of once per sequence: on the CPU all of it (blocks, own rows, the merges) in one kernel
        call per layer (ragkv.ops.decode_kernel), otherwise one attention per distinct block."""
        out = _attend_in_kernel(layer, rows)
        if out is not None:
            return out
        if any(policy.keep is not None for policy, *_ in rows):  # masks differ per holder: each alone
            return [policy(layer, q, k, v) for policy, q, k, v in rows]
        parts: list[list] = [[None] * len(policy.blocks) for policy, *_ in rows]
        holders: dict[tuple[int, float], tuple[PooledBlock, list[tuple[int, int, torch.Tensor]]]] = {}
        for i, (policy, q, k, v) in enumerate(rows):
            moved = apply_rope(q, policy.cos, policy.sin)  # [nb, Hq, 1, D]
            for b, blk in enumerate(policy.blocks):
                holders.setdefault((id(blk), policy._temperature(b)), (blk, []))[1].append((i, b, moved[b]))
        for (_, temperature), (blk, users) in holders.items():
            q_rows = torch.cat([m for *_, m in users], dim=1).unsqueeze(0)  # [1, Hq, users, D]: independent rows
            o, lse = unmasked_attention_with_lse(q_rows, blk.keys[layer], blk.values[layer], temperature)
            for u, (i, b, _) in enumerate(users):
                parts[i][b] = (o[:, :, u:u + 1], lse[:, :, u:u + 1])
        return [policy._combine(p, unmasked_attention_with_lse(q, k, v), q.dtype)
                for p, (policy, q, k, v) in zip(parts, rows)]


def _attend_in_kernel(layer: int, rows: list[tuple[SharedBlocksAttention, torch.Tensor, torch.Tensor,
                                                   torch.Tensor]]) -> list[torch.Tensor] | None:
    """`attend_batch` as one call of the CPU parts kernel: a query row per (sequence, block) rotated back by the
    block's offset, and one per sequence over its own rows; each distinct block is one part, read once. None where
    the kernel does not apply (not the CPU, more than one row per sequence, another dtype, no kernel) or is not
    the faster path on this machine: the parts kernel shares its inner loop with the decode kernel, so it follows
    that kernel's timed choice (ragkv.ops.attention.kernel_wins; 1.12-1.29x slower than the torch path per step on
    a 2-core AVX2 Zen 3, where the decode kernel lost to SDPA)."""
    q0 = rows[0][1]
    if q0.device.type != "cpu" or q0.dtype not in (torch.float32, torch.bfloat16) \
            or any(q.shape[2] != 1 for _, q, _, _ in rows) or not kernel_wins(q0, rows[0][2], rows[0][3]):
        return None
    D = q0.shape[3]
    policies = [policy for policy, *_ in rows]
    if any(policy.keep is not None or policy.overrides is not None for policy in policies):
        tables = _StepTables(policies, 1.0 / math.sqrt(D), layer)  # blend's masks and rows differ per layer
    else:
        tables = _StepTables.of(policies, 1.0 / math.sqrt(D))
    return tables.attend(layer, rows)


class _StepTables:
    """What a decode step's kernel call needs besides the tensors: each row's part, score scale, sequence, group
    and key mask, and each block row's rotation. Rows: block rows first, then each sequence's own rows (part
    nb + i), then blend's recomputed context rows (after those). Without blend's masks and rows the tables are the
    same at every layer: built at the step's first layer and kept for the others (`of`); with them, per layer."""
    _last: "_StepTables | None" = None  # decode runs on the model thread only

    def __init__(self, policies: list[SharedBlocksAttention], base: float, layer: int | None = None):
        self.policies = policies  # held: their ids cannot be reused while this is cached
        none = torch.empty(0, dtype=torch.bool)
        index: dict[int, int] = {}
        self.blocks, block_seq, cos, sin, part, scale, group, masks = [], [], [], [], [], [], [], []
        for i, policy in enumerate(policies):
            ape = policy.temperature != 1.0 or policy.scale != 1.0
            for b, blk in enumerate(policy.blocks):
                mask = None if layer is None else policy._mask(layer, b)
                if mask is not None and not mask.any():
                    continue  # every row of the block recomputed at this layer: read none of it
                if id(blk) not in index:
                    index[id(blk)] = len(self.blocks)
                    self.blocks.append(blk)
                block_seq.append(i)
                cos.append(policy.cos[b, 0])  # [1, D]
                sin.append(policy.sin[b, 0])
                part.append(index[id(blk)])
                scale.append(base / policy._temperature(b))
                group.append(1 if ape and b >= policy.context_from else 0)
                masks.append(none if mask is None else mask.reshape(-1))
        n, nb = len(policies), len(self.blocks)
        self.over_seq = [] if layer is None else [i for i, p in enumerate(policies) if p._override(layer) is not None]
        own = n + len(self.over_seq)  # rows over a sequence's own keys: unrotated query, plain scale, no mask
        self.block_seq = torch.tensor(block_seq, dtype=torch.long)
        self.cos = torch.stack(cos) if cos else None  # [rows, 1, D]: one rotation for every block row
        self.sin = torch.stack(sin) if sin else None
        self.part = torch.tensor(part + [nb + j for j in range(own)])
        self.scale = torch.tensor(scale + [base] * own)
        self.seq = torch.tensor(block_seq + list(range(n)) + self.over_seq)
        self.group = torch.tensor(group + [0] * own)
        self.factor = torch.tensor([policy.scale * policy.temperature for policy in policies])
        self.masks = masks + [none] * own

    @classmethod
    def of(cls, policies: list[SharedBlocksAttention], base: float) -> "_StepTables":
        last = cls._last
        if last is None or len(last.policies) != len(policies) or \
                any(a is not b for a, b in zip(last.policies, policies)):
            last = cls._last = cls(policies, base)
        return last

    @classmethod
    def forget(cls, policy: SharedBlocksAttention) -> None:
        if cls._last is not None and any(p is policy for p in cls._last.policies):
            cls._last = None

    def attend(self, layer: int, rows) -> list[torch.Tensor] | None:
        q = torch.cat([q[:, :, 0] for _, q, _, _ in rows])  # [n, Hq, D]
        moved = apply_rope(q[self.block_seq], self.cos, self.sin) if self.cos is not None else q[:0]
        over = [self.policies[i]._override(layer) for i in self.over_seq]
        keys = [blk.keys[layer][0] for blk in self.blocks] + [k[0] for _, _, k, _ in rows] + [k[0] for k, _ in over]
        values = [blk.values[layer][0] for blk in self.blocks] + [v[0] for *_, v in rows] + [v[0] for _, v in over]
        q_rows = torch.cat([moved, q, q[self.over_seq]])
        out = parts_attention_cpu(q_rows, keys, values, self.part, self.scale, self.seq, self.group, self.factor,
                                  len(rows), self.masks)
        if out is None:
            return None
        out = out.to(q.dtype)
        return [out[i].reshape(1, q.shape[1], 1, q.shape[2]) for i in range(len(rows))]


class OwnRowsPlan:
    """The query's rows: their K/V are the cache's first rows; they attend to the blocks in place and to
    themselves."""

    def __init__(self, cache: KVCache, positions: torch.Tensor, attention: SharedBlocksAttention):
        self.cache, self.positions, self.attention = cache, positions, attention

    def begin(self, layer, decoder_layer, x):
        return x

    def store(self, layer, raw_k, k, v):
        T = k.shape[2]
        self.cache.keys[layer][:, :, :T] = k
        self.cache.values[layer][:, :, :T] = v
        return self.cache.keys[layer][:, :, :T], self.cache.values[layer][:, :, :T]

    def attend(self, layer, q, kv):
        return self.attention(layer, q, *kv)


def _merged(a, b):
    """Two (out, lse) attention parts over disjoint keys as one."""
    return merge_by_lse([a[0], b[0]], [a[1], b[1]]), torch.logaddexp(a[1], b[1])


@torch.inference_mode()
def keep_own_rows(model, state: DecodeState, blocks: list[PooledBlock], layout: Layout, capacity: int,
                  stats: RequestStats) -> DecodeState:
    """A fused prefill's sequence (blend: some block rows recomputed into a copy) re-expressed over the pooled
    blocks, for decoding: per layer, a block row whose V is bitwise the pooled one is still the block's (V is
    never rotated, and a recomputed row is a different computation), and is read in place; the others, and the
    query's rows, are the sequence's own. The copy is released."""
    N, total = layout.context_len, state.next_position
    starts = ([0] if layout.prefix_len else []) + layout.block_offsets()
    keep, overrides, own_tokens = [], [], 0
    for layer in range(model.args.num_layers):
        masks, rows = [], []
        for blk, o in zip(blocks, starts):
            n = blk.values[layer].shape[2]
            same = (state.cache.values[layer][:, :, o:o + n] == blk.values[layer]).all(dim=3).all(dim=1)[0]  # [n]
            masks.append(None if bool(same.all()) else same.view(1, 1, 1, n))
            rows.append(o + (~same).nonzero().squeeze(1))
        idx = torch.cat(rows)
        keep.append(tuple(masks))
        overrides.append((state.cache.keys[layer][:, :, idx].clone(), state.cache.values[layer][:, :, idx].clone())
                         if len(idx) else None)
        own_tokens += len(idx)
    own = total - N + len(state.lookahead)  # the query's rows, and a draft's that stage 2 ran after it
    cache = KVCache.for_model(model, max(capacity - N, own))
    for layer in range(model.args.num_layers):
        cache.keys[layer][:, :, :own] = state.cache.keys[layer][:, :, N:N + own]
        cache.values[layer][:, :, :own] = state.cache.values[layer][:, :, N:N + own]
    cache.commit(own)
    state.cache.release()
    stats.extra["own_context_rows"] = round(own_tokens / model.args.num_layers, 1)  # per layer, on average
    attention = SharedBlocksAttention.at(model, blocks, block_offsets(layout), keep=tuple(keep),
                                         overrides=tuple(overrides))
    return DecodeState(cache, total, state.logits, attention, lookahead=state.lookahead)


def block_offsets(layout: Layout) -> list[int]:
    """The position of each context segment's first token (the prefix's, then each block's), in cache order."""
    starts = ([0] if layout.prefix_len else []) + layout.block_offsets()
    return layout.context_positions[starts].tolist() if starts else []


@torch.inference_mode()
def prefill_shared(model, blocks: list[PooledBlock], layout: Layout, query_ids: list[int], capacity: int,
                   stats: RequestStats, **ape) -> DecodeState:
    """The query's prefill with the blocks read in place from the pool: no per-request copy or re-rotation (`reuse`;
    `ape` with its temperature and scale over the blocks after the prefix)."""
    N, Tq = layout.context_len, len(query_ids)
    window = model.args.sliding_window
    if window is not None and window < layout.query_start + Tq:
        raise InvalidRequestError("kv_layout=shared does not support a sliding window in reach; use "
                                  "kv_layout=copied")
    t0 = time.perf_counter()
    cache = KVCache.for_model(model, max(capacity - N, Tq))
    attention = SharedBlocksAttention.at(model, blocks, block_offsets(layout), **ape)
    positions = torch.arange(layout.query_start, layout.query_start + Tq, device=model.device)
    x = yield from computed(Forward(model, model.embed(torch.tensor([query_ids], device=model.device)),
                                    OwnRowsPlan(cache, positions, attention)))
    cache.commit(Tq)
    logits = model.logits(x[:, -1:])[0, -1]
    stats.query_prefill_ms += (time.perf_counter() - t0) * 1000
    stats.reused_tokens += N
    stats.recomputed_tokens += Tq
    return DecodeState(cache, layout.query_start + Tq, logits, attention)
