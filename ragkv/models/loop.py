"""The one layer loop: every forward over the decoder layers (plain causal, block encoding, every fusion mode's
prefill, batched decode, fine-tuning) is `run_layers(model, x, plan)`; only a plain decode step whose products all
run on the packed bf16 kernel takes the lean layers beside it (models/lean_decode.py, bitwise these numbers).

What varies between those lives in the `LayerPlan` the loop is handed (as mlx-lm keeps its variation in the
per-layer cache object): which rows are computed (`begin`, which may load context or drop rows), at which
positions, where their K/V go and what keys they see (`store`), and how they attend (`attend`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ragkv.ops.attention import SegmentedMask, causal_attention, prefill_mask, sdpa
from ragkv.ops.rope import apply_rope


class LayerPlan(Protocol):
    positions: torch.Tensor  # [T] or [B, T] int64 positions of the rows now in x

    def begin(self, layer: int, decoder_layer, x: torch.Tensor) -> torch.Tensor:
        """Before layer `layer` (the module `decoder_layer`): may load its context KV or select the rows that go
        on (returns them)."""

    def store(self, layer: int, raw_k: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Keep this layer's K/V (raw K before RoPE and rotated K); return what the rows attend to (for
        `attend`), or None to stop after storing (block encoding: the last layer's output is not needed)."""

    def attend(self, layer: int, q: torch.Tensor, kv) -> torch.Tensor:
        """Attention output [B, Hq, T, D] of the rows' rotated queries over what `store` returned."""


def run_layers(model, x: torch.Tensor, plan: LayerPlan) -> torch.Tensor:
    """x: embedded rows [B, T, H] -> the residual stream after the last layer plan let run."""
    pos = tables = None
    for i, decoder_layer in enumerate(model.layers):
        x = plan.begin(i, decoder_layer, x)
        q, k, v = decoder_layer.project_qkv(x)
        if plan.positions is not pos:  # cos/sin looked up once per set of rows, not per layer
            pos = plan.positions
            tables = model.rope_tables(pos)
        kv = plan.store(i, k, apply_rope(k, *tables), v)
        if kv is None:
            break
        x = decoder_layer.finish(x, plan.attend(i, apply_rope(q, *tables), kv))
    return x


class CausalPlan:
    """Ordinary causal attention over a KVCache (or none): new rows see the cache and the new rows before them.

    Covers the model's plain forward, `full` and `prefix` prefill and fine-tuning (an explicit `mask`, e.g.
    the Block-Attention mask, replaces the causal one). `window` is Mistral's sliding window: a row at
    position p sees keys at positions > p - window only (cache index == position here).
    """

    def __init__(self, positions: torch.Tensor, cache=None, mask: torch.Tensor | SegmentedMask | None = None,
                 window: int | None = None):
        self.positions, self.cache, self.segments = positions, cache, None
        T = positions.shape[-1]
        past = cache.length if cache is not None else 0
        plain = mask is None and (window is None or window >= past + T)  # nothing but causality limits the rows
        if isinstance(mask, SegmentedMask):  # fine-tuning's Block-Attention mask, attended block by block
            if past == 0 and (window is None or window >= T):
                self.segments, mask = mask, None
            else:
                mask = mask.dense(positions.device)
        if T > 1:
            causal = prefill_mask(T, past + T, window, positions.device)
            mask = causal if mask is None else (mask if causal is None else mask & causal)
        elif window is not None and window < past + T:  # one row: only the window limits it
            mask = prefill_mask(T, past + T, window, positions.device) if mask is None else mask
        self.mask, self.causal = mask, mask is None and T > 1 and self.segments is None
        self.causal_after = past if T > 1 and plain else None  # ops.attention.causal_attention takes these

    def begin(self, layer, decoder_layer, x):
        return x

    def store(self, layer, raw_k, k, v):
        return self.cache.append(layer, k, v) if self.cache is not None else (k, v)

    def attend(self, layer, q, kv):
        if self.segments is not None:
            return self.segments.attend(q, *kv)
        if self.causal_after is not None:
            return causal_attention(q, *kv, self.causal_after, self.mask)
        return sdpa(q, *kv, mask=self.mask, causal=self.causal)


# -- one forward for several plans ------------------------------------------------------------------------
# A server step runs the decode rows of every answer and prefill chunks of waiting requests in one pass over the
# layers (vLLM v1's one forward per step): the products run over all rows at once, attention per plan. A prefill
# hands its forward over as a `Forward` (yielded by its generator, `computed`) and gets the output back.


class Forward:
    """One forward to run: embedded rows `x` [B, T, H] of `model` under `plan`; `run()` alone, `run_together` with
    others. `rows` is what the forward weighs against a step's token budget."""

    def __init__(self, model, x: torch.Tensor, plan: LayerPlan):
        self.model, self.x, self.plan = model, x, plan
        # run as it was made: without autograd for inference (a scheduler runs it elsewhere), with it for training
        self.inference = torch.is_inference_mode_enabled() or not torch.is_grad_enabled()

    @property
    def rows(self) -> int:
        return self.x.shape[0] * self.x.shape[1]

    def run(self) -> torch.Tensor:
        with torch.inference_mode(self.inference):
            return run_layers(self.model, self.x, self.plan)


def computed(fwd: Forward):
    """`out = yield from computed(fwd)` in a prefill generator: a driver that batches forwards sends back the
    output of `fwd` run with others; one that does not (plain `next()`) gets it run here, alone."""
    out = yield fwd
    return fwd.run() if out is None else out


def _flat_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [1, H, B*T, D], rows in batch order (the inverse of _batched_heads)."""
    B, H, T, D = t.shape
    return t if B == 1 else t.transpose(0, 1).reshape(1, H, B * T, D)


def _batched_heads(t: torch.Tensor, B: int) -> torch.Tensor:
    """[1, H, B*T, D] -> [B, H, T, D]."""
    if B == 1:
        return t
    _, H, N, D = t.shape
    return t.reshape(H, B, N // B, D).transpose(0, 1)


class MixedPlan:
    """Several plans' rows as one [1, N, H] batch: the products run over every row; `begin`, `store` and `attend`
    go to each plan over its own rows, in its own layout ([B, T] rows: a decode plan's B sequences of one row).
    A plan may drop rows in `begin` (a recompute's selection) or stop after storing (block encoding: its rows
    then ride along to the end of the layer, their output unused)."""

    def __init__(self, plans: list, batches: list[int], rows: list[int]):
        self.plans, self.batches, self.rows = plans, batches, rows
        self.done = [False] * len(plans)
        self.errors: list[Exception | None] = [None] * len(plans)  # a plan that failed (a store fault) ends alone
        self._pos_of, self._pos = None, None

    @property
    def positions(self) -> torch.Tensor:
        now = tuple(p.positions for p in self.plans)
        if self._pos_of is None or any(a is not b for a, b in zip(now, self._pos_of)):
            self._pos_of = now
            self._pos = torch.cat([p.reshape(-1) if p.dim() == 2 or B == 1 else p.expand(B, -1).reshape(-1)
                                   for p, B in zip(now, self.batches)])  # [T] shared by B rows: repeated
        return self._pos

    def _pieces(self, t: torch.Tensor, dim: int):
        return torch.split(t, self.rows, dim=dim)

    def begin(self, layer, decoder_layer, x):
        out = []
        for i, (plan, B, piece) in enumerate(zip(self.plans, self.batches, self._pieces(x, 1))):
            if not self.done[i]:
                try:
                    piece = plan.begin(layer, decoder_layer, piece.reshape(B, -1, piece.shape[-1]))
                except Exception as e:  # noqa: BLE001 - this plan's rows ride along unused; the others go on
                    self._failed(i, e)
                piece = piece.reshape(1, -1, piece.shape[-1])
                self.rows[i] = piece.shape[1]
            out.append(piece)
        return torch.cat(out, dim=1)

    def store(self, layer, raw_k, k, v):
        kvs = []
        for i, (plan, B, rk, kk, vv) in enumerate(zip(self.plans, self.batches, self._pieces(raw_k, 2),
                                                      self._pieces(k, 2), self._pieces(v, 2))):
            kv = None
            if not self.done[i]:
                try:
                    kv = plan.store(layer, _batched_heads(rk, B), _batched_heads(kk, B), _batched_heads(vv, B))
                except Exception as e:  # noqa: BLE001
                    self._failed(i, e)
                self.done[i] = kv is None
            kvs.append(kv)
        return None if all(self.done) else kvs

    def attend(self, layer, q, kvs):
        out = []
        for i, (plan, B, qq, kv) in enumerate(zip(self.plans, self.batches, self._pieces(q, 2), kvs)):
            if kv is not None:
                try:
                    out.append(_flat_heads(plan.attend(layer, _batched_heads(qq, B), kv)))
                    continue
                except Exception as e:  # noqa: BLE001
                    self._failed(i, e)
            out.append(torch.zeros_like(qq))
        return torch.cat(out, dim=2)

    def _failed(self, i: int, e: Exception) -> None:
        self.errors[i], self.done[i] = e, True


def run_together(forwards: list[Forward]) -> list[torch.Tensor]:
    """Run several forwards of one model as one pass over the layers; each gets the output rows its plan kept
    ([B, T', H], as `run` gives), or the exception its plan raised (a block that vanished from the store: that
    request alone fails, `resume` throws it into its generator). Every row's numbers are its own forward's up to the
    products' rounding (a GEMM's blocking depends on its row count)."""
    if len(forwards) == 1:
        return [forwards[0].run()]
    model = forwards[0].model
    if any(f.model is not model for f in forwards):
        raise ValueError("forwards run together must be of one model")
    H = forwards[0].x.shape[-1]
    plan = MixedPlan([f.plan for f in forwards], [f.x.shape[0] for f in forwards], [f.rows for f in forwards])
    x = torch.cat([f.x.reshape(1, -1, H) for f in forwards], dim=1)
    with torch.inference_mode(any(f.inference for f in forwards)):  # a server step: inference
        x = run_layers(model, x, plan)
    return [err if err is not None else piece.reshape(B, -1, H)
            for piece, B, err in zip(torch.split(x, plan.rows, dim=1), plan.batches, plan.errors)]


def outcome(fwd: Forward):
    """`fwd.run()`, or the exception it raised (for the prefill that yielded it, not for the step that ran it)."""
    try:
        return fwd.run()
    except Exception as e:  # noqa: BLE001
        return e


def resume(steps, value):
    """Resume a prefill generator with its forward's output, or throw into it the exception that forward raised
    (where it can be handled: a request restarts without the store that failed it)."""
    return steps.throw(value) if isinstance(value, BaseException) else steps.send(value)
