"""Block encoding and the block cache: each passage's raw K (before RoPE) and V, computed once.

Block-Attention (Ma et al., ICLR 2025, eq. 2): a block attends only to itself and its K is stored with the
position standardized to zero, so it can be re-rotated to any later position. APE (Yang et al. 2025, sec. 4.1)
instead conditions every block on a shared prefix; that conditioning is part of the cache key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ragkv.engine.kv.stepwise import Steps, drain
from ragkv.models.loop import Forward, computed
from ragkv.ops.attention import causal_attention, prefill_mask, sdpa
from ragkv.store.base import BlockKV, CacheKey, KVStore, hash_tokens

NO_CONDITIONING = "none"


def route_id(key: CacheKey) -> str:
    """A block's name for routing: its namespace and tokens, whatever the conditioning a mode stores it under (the
    replicas of one deployment share the model fingerprint). The cache-aware router compares these (serve/replicas)."""
    return f"{key.namespace}/{key.token_hash[:24]}"


def block_route_id(ids: list[int], namespace: str) -> str:
    """`route_id` of the block of token ids `ids` in `namespace`, computed without a model (the router's side)."""
    return f"{namespace}/{hash_tokens(ids)[:24]}"


def prefix_conditioning(prefix_ids: list[int]) -> str:
    return f"prefix:{hash_tokens(prefix_ids)[:32]}"


class EncodePlan:
    """A block's rows alone (or after a prefix): keep raw K and V of every layer, stop before the last finish."""

    def __init__(self, model, T: int, prefix: BlockKV | None):
        dev = model.device
        self.model, self.prefix, self.num_layers = model, prefix, model.args.num_layers
        P = prefix.num_tokens if prefix is not None else 0
        self.positions = torch.arange(P, P + T, device=dev)
        self.prefix_positions = torch.arange(P, device=dev)
        window = model.args.sliding_window
        self.mask = prefill_mask(T, P + T, window, dev)
        self.causal_after = P if window is None or window >= P + T else None  # no window in reach: plain causal
        self.keys, self.values = [], []

    def begin(self, layer, decoder_layer, x):
        return x

    def store(self, layer, raw_k, k, v):
        self.keys.append(raw_k[0])
        self.values.append(v[0])
        if layer == self.num_layers - 1:
            return None  # the last layer's output is not part of the KV
        if self.prefix is not None:
            dev = k.device
            pk = self.model.rope(self.prefix.keys[layer].unsqueeze(0).to(dev), self.prefix_positions)
            k = torch.cat([pk, k], dim=2)
            v = torch.cat([self.prefix.values[layer].unsqueeze(0).to(dev), v], dim=2)
        return k, v

    def attend(self, layer, q, kv):
        if self.causal_after is not None:
            return causal_attention(q, *kv, self.causal_after, self.mask)
        return sdpa(q, *kv, mask=self.mask, causal=self.mask is None)


def encode_block_forward(model, ids: list[int], prefix: BlockKV | None = None) -> tuple[Forward, EncodePlan]:
    """The forward that encodes a block (not yet run) and the plan that keeps its raw K and V."""
    plan = EncodePlan(model, len(ids), prefix)
    with torch.inference_mode():
        return Forward(model, model.embed(torch.tensor([ids], device=model.device)), plan), plan


def _block_kv(plan: EncodePlan) -> BlockKV:
    return BlockKV(torch.stack(plan.keys), torch.stack(plan.values))


def encode_block(model, ids: list[int], prefix: BlockKV | None = None) -> BlockKV:
    """Run the block alone (or after `prefix`, whose tokens sit at positions 0..P-1); return raw K and V.

    The block's tokens take positions P..P+T-1 (P = 0 without prefix); K is kept before RoPE.
    """
    fwd, plan = encode_block_forward(model, ids, prefix)
    fwd.run()
    return _block_kv(plan)


def _joined(a: BlockKV | None, b: BlockKV | None) -> BlockKV | None:
    """Two runs of consecutive rows as one (raw K and V of every layer: [L, H, T, D])."""
    if a is None or b is None:
        return a if b is None else b
    return BlockKV(torch.cat([a.keys, b.keys.to(a.keys.device)], dim=2),
                   torch.cat([a.values, b.values.to(a.values.device)], dim=2))


def encode_block_steps(model, ids: list[int], prefix: BlockKV | None = None, chunk=None) -> Steps[BlockKV]:
    """`encode_block` in units of `chunk` tokens (an int, None for all at once, or a function giving the next
    unit's size), yielding between them: each unit runs after the block's earlier rows (and `prefix`) with its
    positions continuing theirs, so it computes the rows a one-shot encode does (equal up to rounding), and a long
    block pauses the other requests for one unit, not for the whole block (a 5.9K-token block was a 26 s unit)."""
    own, a = None, 0
    while a < len(ids):
        step = min((chunk() if callable(chunk) else chunk) or len(ids) - a, len(ids) - a)
        fwd, plan = encode_block_forward(model, ids[a:a + step], _joined(prefix, own))
        yield from computed(fwd)  # alone, or in one pass with a server step's decode rows
        own = _joined(own, _block_kv(plan))
        a += step
        if a < len(ids):
            yield
    return own


@dataclass
class EnsureResult:
    keys: list[CacheKey]
    hits: int
    misses: int
    encode_ms: float
    uncached: dict = field(default_factory=dict)  # key -> BlockKV the store could not keep: used from memory
    hit_tokens: int = 0  # tokens of the blocks found in the store (not encoded by this request)


KEEP_STORED_BYTES = 256 << 20  # of blocks a tier kept, what one request holds on to in case it starts over


@dataclass
class KeptBlocks:
    """The blocks one request encoded, used from memory if a store fault makes it start over: every one no tier
    kept (the request holds it anyway), and those a tier kept up to KEEP_STORED_BYTES (a store smaller than one
    request evicts its first blocks before they are read: encoded again, they would be evicted again)."""

    blocks: dict = field(default_factory=dict)  # CacheKey -> BlockKV
    stored_bytes: int = 0

    def keep(self, key: CacheKey, kv: BlockKV, stored: bool) -> None:
        if stored:
            if self.stored_bytes + kv.nbytes > KEEP_STORED_BYTES:
                return
            self.stored_bytes += kv.nbytes
        self.blocks[key] = kv


class BlockCache:
    """Names blocks by (model fingerprint, conditioning, token hash, namespace) and encodes them on a miss."""

    def __init__(self, model, fingerprint: str, store: KVStore, namespace: str = "default", place=None,
                 kept: KeptBlocks | None = None):
        self.model, self.fingerprint, self.store, self.namespace = model, fingerprint, store, namespace
        self.place = place  # tokens -> tier indices a new block goes to (the loading controller), or None: all
        self.kept = kept  # one request's blocks it encoded, used from memory if it starts over

    def for_request(self, kept: KeptBlocks, store: KVStore | None = None) -> "BlockCache":
        """This cache for one request that may start over after a store fault: the blocks it encodes are remembered
        in `kept` (KeptBlocks says which) and not encoded again (a 27K-token `ape` request whose store failed near
        its end encoded its 8 blocks twice, and passed its deadline: the 48-minute soak). `store`: another store."""
        own = store is None  # `place` names this store's tiers
        return BlockCache(self.model, self.fingerprint, self.store if own else store, self.namespace,
                          self.place if own else None, kept)

    def key(self, ids: list[int], conditioning: str = NO_CONDITIONING, namespace: str | None = None) -> CacheKey:
        return CacheKey(self.fingerprint, conditioning, hash_tokens(ids), len(ids), namespace or self.namespace)

    def ensure(self, blocks: list[list[int]], conditioning: str = NO_CONDITIONING, prefix_ids: list[int] | None = None,
               namespace: str | None = None) -> EnsureResult:
        """Make sure every block is in the store (encoding misses first); return their keys in order."""
        return drain(self.ensure_steps(blocks, conditioning, prefix_ids, namespace))

    def ensure_steps(self, blocks: list[list[int]], conditioning: str = NO_CONDITIONING,
                     prefix_ids: list[int] | None = None, namespace: str | None = None,
                     chunk=None) -> Steps[EnsureResult]:
        """`ensure`, yielding after each block it encodes, and within a block every `chunk` tokens
        (encode_block_steps)."""
        keys, hits, misses, encode_ms, uncached, hit_tokens = [], 0, 0, 0.0, {}, 0
        prefix_kv = None
        for ids in blocks:
            key = self.key(ids, conditioning, namespace)
            if self.kept is not None and key in self.kept.blocks:  # this request encoded it before it started over
                misses += 1
                uncached[key] = self.kept.blocks[key]
            elif self.store.contains(key):
                hits, hit_tokens = hits + 1, hit_tokens + len(ids)
            else:
                misses += 1
                t0 = time.perf_counter()
                if conditioning != NO_CONDITIONING and prefix_kv is None and prefix_ids:
                    prefix_kv = self.get_or_encode(prefix_ids, namespace=namespace)
                kv = yield from encode_block_steps(self.model, ids, prefix_kv, chunk)
                tiers = self.place(len(ids)) if self.place is not None else None
                self.store.put(key, kv) if tiers is None else self.store.put(key, kv, tiers=tiers)
                if not self.store.contains(key):  # refused (too big, tier down, read-only): still used
                    uncached[key] = kv
                if self.kept is not None:
                    self.kept.keep(key, kv, stored=key not in uncached)
                encode_ms += (time.perf_counter() - t0) * 1000  # own work only, not what ran between units
                yield
            keys.append(key)
        return EnsureResult(keys, hits, misses, encode_ms, uncached, hit_tokens)

    def get_or_encode(self, ids: list[int], namespace: str | None = None) -> BlockKV:
        key = self.key(ids, NO_CONDITIONING, namespace)
        kv = self.store.get(key)
        if kv is None:
            kv = encode_block(self.model, ids)
            self.store.put(key, kv)
        return kv
