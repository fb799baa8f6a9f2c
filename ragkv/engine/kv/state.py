"""What every fusion mode hands to decoding (the fused KV cache, the next position, the attention policy), and
batched decode: every running sequence advances one token in one forward, whatever its mode or length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ragkv.engine.kv.kvcache import KVCache
from ragkv.models.lean_decode import lean_decode
from ragkv.models.loop import Forward
from ragkv.ops.attention import append_attention_many, decode_attention_many, decode_attention_parts

# (layer, q [1,Hq,T,D], all K, all V) -> attention output; None means plain attention over the whole cache.
AttentionPolicy = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class DecodeState:
    cache: KVCache
    next_position: int
    logits: torch.Tensor  # [V] fp32: distribution of the next token
    attention: AttentionPolicy | None = None
    # tokens whose rows the prefill already computed, each with the next token's distribution after it (a draft
    # that blend's stage 2 ran beside the query, recompute/query.py); their KV are the cache's last rows
    lookahead: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def take_lookahead(self, token: int) -> bool:
        """If `token` is the next precomputed one, step past it without a forward (its KV is in the cache) and
        return True; otherwise forget every precomputed row and return False."""
        if self.lookahead and self.lookahead[0][0] == token:
            self.next_position += 1
            self.logits = self.lookahead.pop(0)[1]
            return True
        self.drop_lookahead()
        return False

    def drop_lookahead(self) -> None:
        if self.lookahead:
            self.cache.truncate(self.cache.length - len(self.lookahead))
            self.lookahead = []

    def fork(self) -> "DecodeState":
        """Another continuation of the same prompt (n > 1 choices): the prefill and the prompt's KV are shared,
        not copied (each choice appends its own tokens to buffers of its own: KVCache.fork); the logits (never
        changed in place: each step replaces them) and the attention policy (stateless) are shared. Precomputed
        tokens are dropped first (the choices would share their rows)."""
        self.drop_lookahead()
        return DecodeState(self.cache.fork(), self.next_position, self.logits, self.attention)

    def prompt_rows(self) -> int:
        """Rows of KV this sequence holds for itself (its cache's, and rows its attention policy keeps apart:
        blend's recomputed rows over pooled blocks, per layer on average, rounded up)."""
        return self.cache.length + getattr(self.attention, "own_rows", 0)

    def release(self) -> None:
        """Give the KV back now: the sequence is finished, cancelled or failed (its logits too: a view of the
        whole batch's), and let its attention policy drop what it cached for the decode steps."""
        self.cache.release()
        self.logits, self.lookahead = None, []
        release = getattr(self.attention, "release", None)
        if release is not None:
            release()


class DecodePlan:
    """One new token per sequence: rows are sequences, each with its own cache, position and attention policy.

    The projections and MLP run batched over all rows (the weights are read once per step); attention runs per
    sequence over its own cache, so lengths, layouts and policies (APE) can differ within a batch. Policies with an
    `attend_batch` (blocks read in place, engine/fusion/shared_attention.py) attend together, so that a block several
    sequences hold is read once per step, unless the forward runs at a fixed row count (batch invariance).
    """

    def __init__(self, states: list[DecodeState], device, window: int | None, rows: int | None = None):
        """rows: a forward at this fixed row count (decode_batch): the rows after the sequences' attend to
        nothing, and each sequence attends alone (a row's numbers must not depend on its neighbours)."""
        self.states, self.window, self.fixed = states, window, rows is not None
        self.pad = rows - len(states) if rows is not None else 0
        self.positions = torch.tensor([[s.next_position] for s in states] + [[0]] * self.pad, device=device)
        # plain sequences (own buffer, no policy, inside any window): their row is written and attended in one
        # call a layer (ops.attention.append_attention_many), room for it made here once for every layer
        self.direct = [b for b, s in enumerate(states) if s.attention is None and s.cache.prefix is None
                       and (window is None or s.cache.length + 1 <= window)]
        for b in self.direct:
            states[b].cache.reserve(states[b].cache.length + 1)
        self._direct_set, self._new = set(self.direct), None

    def begin(self, layer, decoder_layer, x):
        return x

    def store(self, layer, raw_k, k, v):
        self._new = (k, v)  # the direct sequences' rows: written by `attend`
        return [None if b in self._direct_set else s.cache.append_parts(layer, k[b:b + 1], v[b:b + 1])
                for b, s in enumerate(self.states)]

    def attend(self, layer, q, kv):
        outs, grouped, plain = [None] * len(self.states), {}, []
        if self.direct:
            got = self._attend_direct(layer, q, kv, outs)
            if got is not None and len(self.direct) == len(self.states):  # every row: the call's output as it is
                return got if not self.pad else torch.cat([got, q.new_zeros((self.pad,) + q.shape[1:])])
        for b, (s, parts) in enumerate(zip(self.states, kv)):
            if parts is None:  # attended above
                continue
            qb = q[b:b + 1]
            if len(parts) > 1:  # a choice over its prompt's shared rows
                if s.attention is None and self.window is None:
                    outs[b] = decode_attention_parts(qb, parts)
                    continue
                parts = [(torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2))]
            keys, values = parts[0]
            batch = None if self.fixed else getattr(s.attention, "attend_batch", None)
            if batch is not None:  # policies that read shared blocks: one call for all their sequences, below
                grouped.setdefault(batch, []).append((b, (s.attention, qb, keys, values)))
            elif s.attention is not None:
                outs[b] = s.attention(layer, qb, keys, values)
            else:
                if self.window is not None:  # sequential layouts: cache index == position
                    keys, values = keys[:, :, -self.window:], values[:, :, -self.window:]
                plain.append((b, keys, values))
        if plain:  # the plain sequences in one call (each row's numbers are those it gets alone)
            idx = [b for b, _, _ in plain]
            qs = q[idx[0]:idx[0] + 1] if len(idx) == 1 else q[idx]
            got = decode_attention_many(qs, [k for _, k, _ in plain], [v for _, _, v in plain])
            for i, b in enumerate(idx):
                outs[b] = got[i:i + 1]
        for batch, members in grouped.items():
            for (b, _), out in zip(members, batch(layer, [row for _, row in members])):
                outs[b] = out
        if self.pad:
            outs.append(q.new_zeros((self.pad,) + q.shape[1:]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _attend_direct(self, layer, q, kv, outs):
        """The direct sequences' new rows written and attended in one call (returned, rows in `direct`'s order);
        where the kernel is not the path, written here for the others' path (kv gets their parts), and None."""
        idx, (k, v) = self.direct, self._new
        caches = [self.states[b].cache for b in idx]
        # consecutive rows (every row, as a plain batch has) are a view; others a gather (3 copies a layer)
        first, n = idx[0], len(idx)
        pick = (lambda t: t[first:first + n]) if idx[-1] - first + 1 == n else (lambda t: t[idx])
        got = append_attention_many(pick(q), pick(k), pick(v), [c.keys[layer] for c in caches],
                                    [c.values[layer] for c in caches], [c.length for c in caches])
        if got is not None:
            if n < len(self.states):  # others attend apart: each row to its place (all direct: `got` as it is)
                for i, b in enumerate(idx):
                    outs[b] = got[i:i + 1]
            return got
        for b, c in zip(idx, caches):
            kv[b] = c.append_parts(layer, k[b:b + 1], v[b:b + 1])
        return None


@torch.inference_mode()
def decode_batch(model, states: list[DecodeState], tokens: list[int], rows: int | None = None) -> torch.Tensor:
    """Feed tokens[b] to states[b] at its next position; returns next-token logits [B, V] fp32 and advances
    every state (its `logits` included).

    rows: run every forward at exactly this many rows (the batch in groups of `rows`, the last padded with rows
    that attend to nothing), so that each sequence gets the numbers it gets alone whatever runs beside it (batch
    invariance: GEMM kernels choose their blocking, and so their summation order, by the row count; measured on
    Zen 3 fp32, a linear's row computed alone and among others differs by 5e-5; in a fixed shape it does not
    depend on the other rows or on its own index)."""
    if rows is None:
        return _forward(model, states, tokens)
    return torch.cat([_forward(model, states[i:i + rows], tokens[i:i + rows], rows)
                      for i in range(0, len(states), rows)])


def _forward(model, states: list[DecodeState], tokens: list[int], rows: int | None = None) -> torch.Tensor:
    return finish_decode(model, states, decode_forward(model, states, tokens, rows).run())


@torch.inference_mode()
def decode_forward(model, states: list[DecodeState], tokens: list[int], rows: int | None = None) -> Forward:
    """The decode step's forward, not yet run (a server step runs it with prefill chunks: models.loop.run_together);
    `finish_decode` takes its output."""
    dev = model.device
    for s in states:  # a token fed to the model was not the precomputed one (Sequence takes those without a forward)
        s.drop_lookahead()
    x = model.embed(torch.tensor(tokens, device=dev).unsqueeze(1))
    plan = DecodePlan(states, dev, model.args.sliding_window, rows)
    if plan.pad:
        x = torch.cat([x, x.new_zeros((plan.pad,) + x.shape[1:])])  # zero rows stay zero through every layer
    return DecodeForward(model, x, plan)


class DecodeForward(Forward):
    """A decode step's forward. Run alone on a bf16 decode copy with every sequence plain (no policy, own buffer),
    it goes through the lean layers (models/lean_decode.py: the same kernels on the same tensors, bitwise, with
    ~10% less time a step); otherwise, and run with others, through the general loop."""

    def run(self) -> torch.Tensor:
        plan = self.plan
        lean = lean_decode(self.model) if len(plan.direct) == len(plan.states) and not plan.pad else None
        if lean is None or not lean.takes():
            return super().run()
        caches = [s.cache for s in plan.states]
        with torch.inference_mode(self.inference):
            return lean.run(self.x, plan.positions, caches, [c.length for c in caches])


@torch.inference_mode()
def finish_decode(model, states: list[DecodeState], x: torch.Tensor) -> torch.Tensor:
    """After the decode forward (output rows x [B, 1, H]): next-token logits [B, V] fp32; every state advanced."""
    logits = model.logits(x)[:len(states), -1]
    for b, s in enumerate(states):
        s.cache.commit(1)
        s.next_position += 1
        s.logits = logits[b]
    return logits


def decode_step(model, state: DecodeState, token: int) -> torch.Tensor:
    """Feed one token to one sequence; returns its next-token logits [V]."""
    return decode_batch(model, [state], [token])[0]
