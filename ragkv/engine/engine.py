"""The engine: a request's segments -> cache keys -> store -> re-rotation -> fusion -> decode.

    engine = Engine.load("smollm2")
    segs = engine.segments("Who wrote X?", [Passage(text, title), ...])
    answer = engine.generate(segs, FusionOptions(mode="reuse"), GenerationOptions(max_new_tokens=32))
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ragkv.config import dtype_name, resolve_device, resolve_dtype
from ragkv.engine.blocks.encode import BlockCache, KeptBlocks, route_id
from ragkv.engine.blocks.history import settle_history
from ragkv.engine.blocks.loading import LoadingPlanner, StoreProfiles
from ragkv.engine.blocks.pool import BlockPool
from ragkv.engine.blocks.prefix_cache import CHAIN, keep_chunks
from ragkv.engine.decode.answer import Answer, Run
from ragkv.engine.decode.generate import Sequence, step_sequences
from ragkv.engine.fusion.ape import DEFAULT_S, DEFAULT_T
from ragkv.engine.fusion.calibration import DEFAULT_MAX_RISK, load_ape_params, load_auto_params
from ragkv.engine.kv.kvcache import DECODE_HEADROOM
from ragkv.engine.kv.state import DecodeState
from ragkv.engine.kv.stepwise import Steps, drain
from ragkv.engine.measure.estimates import expected_kl, load_fidelity_fits, with_weights
from ragkv.engine.measure.risk import DEFAULT_SIGNAL, RecentShare
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.modes import get_mode, mode_names
from ragkv.engine.modes.context import ModeContext
from ragkv.engine.modes.history import WithHistory
from ragkv.engine.options import FusionOptions, GenerationOptions, validate_fusion
from ragkv.engine.request.segments import (
    Passage,
    PromptFormat,
    Segments,
    build_segments,
    chat_segments,
    history_segments,
    split_blocks,
    tokenize,
)
from ragkv.errors import PromptTooLongError
from ragkv.models.loader import LoadedModel, eos_ids, load_model
from ragkv.models.loop import outcome
from ragkv.models.quant import EXACT_COPIES, INEXACT_PREFILL, PREFILL_COPIES, decode_copy, resolve_decode_weights
from ragkv.ops import int8_kernel, prefill_kernel
from ragkv.ops.decode_kernel import kernel as decode_kernel
from ragkv.settings import DEFAULT_BLOCK_POOL_BYTES, DEFAULT_MODEL
from ragkv.store.base import CacheKey, KVStore
from ragkv.store.errors import MissingBlockError, StoreUnavailableError
from ragkv.store.memory import MemoryStore
from ragkv.store.tiered import TieredStore

log = logging.getLogger(__name__)


class Engine:
    """Public surface: the request methods below, the model facts (`model_name`, `fingerprint`, `device`,
    `num_layers`, `info()`), tokenizing (`tokenize`, `passage_ids`, `*_segments`), the cache (`warm`,
    `cache_keys`, `forget`, `store_stats`) and the store profile. `model`, `decode_model` and `tokenizer` are
    there for raw forwards in benchmarks and tests. What a mode (engine/modes) may use of the engine, and nothing
    else: `forward_model`, `fingerprint`, `block_cache` (keys, encoding), `block_pool` (blocks read in place),
    `layer_stream` (per-layer KV of keys), `loading_planner` (which tier, which ratio), `check_length`,
    `num_layers`, and the APE and `auto` defaults; everything else is internal."""

    def __init__(self, loaded: LoadedModel, store: KVStore | None = None, namespace: str = "default",
                 prompt_format: PromptFormat = PromptFormat(), decode_weights: str = "exact",
                 ape_params: tuple[float, float, str] = (DEFAULT_T, DEFAULT_S, "default"),
                 profiles: StoreProfiles | None = None, _decode_model=None,
                 auto_params: tuple[str, float, str] = (DEFAULT_SIGNAL, DEFAULT_MAX_RISK, "default"),
                 pool_bytes: int = DEFAULT_BLOCK_POOL_BYTES):
        self._loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        decode_weights, why = resolve_decode_weights(decode_weights, self.model)
        if _decode_model is None and decode_weights != "exact":
            log.info("decode weights %s (%s)", decode_weights, why)
        # the model itself unless copied (shared when `with_store` makes a sibling engine)
        self._decode_model = _decode_model or decode_copy(self.model, decode_weights)
        self._decode_weights = decode_weights
        if self.model.device.type == "cpu":  # build (first time) or load the C++ kernels now, not inside a request
            decode_kernel()
            if self.model.dtype == torch.bfloat16:
                prefill_kernel.kernel()
            if decode_weights == "w8a8":
                int8_kernel.kernel()
        self._store = store if store is not None else MemoryStore()
        self.block_cache = BlockCache(self.forward_model, self.fingerprint, self._store, namespace)
        # blocks read in place (kv_layout=shared); its own, like its store
        self.block_pool = BlockPool(self.model, pool_bytes)
        self.namespace = namespace
        self.prompt_format = prompt_format
        self.eos_ids = eos_ids(loaded)
        self.max_positions = loaded.args.max_positions
        self.ape_temperature, self.ape_scale, self.ape_source = ape_params
        self.auto_signal, self.auto_max_risk, self.auto_source = auto_params  # `auto`'s calibrated defaults
        self.lock = threading.RLock()  # the model runs one request at a time
        self.loading_planner = LoadingPlanner(self.model, self._store, profiles, loaded.fingerprint)
        self.block_cache.place = lambda tokens: self.loading_planner.placement(tokens, FusionOptions().ratio)
        # per-reply fidelity estimates fitted for this model (`ragkv calibrate --target fidelity`), else None:
        # replies then state the population estimate (engine/measure/estimates.py)
        self.fidelity_fits = load_fidelity_fits(loaded.name, self.dtype_name)
        self.escalations = RecentShare()  # `auto`'s recent escalations, against its escalation_budget
        self.mode_context = ModeContext(self)  # all a mode reads of the engine (modes/context.py)

    @classmethod
    def load(cls, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
             store: KVStore | None = None, namespace: str = "default", decode_weights: str = "exact",
             pool_bytes: int = DEFAULT_BLOCK_POOL_BYTES) -> "Engine":
        """Load the model, and the start-up state: APE's calibration and the store's saved load profiles."""
        dev = resolve_device(device)
        loaded = load_model(model, resolve_dtype(dtype, dev), dev)
        return cls(loaded, store=store, namespace=namespace, decode_weights=decode_weights,
                   ape_params=load_ape_params(loaded.fingerprint), profiles=StoreProfiles.load(),
                   auto_params=load_auto_params(loaded.fingerprint), pool_bytes=pool_bytes)

    def _sibling(self, store: KVStore, namespace: str, decode_weights: str, decode_model) -> "Engine":
        """An engine over the same model (weights shared) and this one's calibrations."""
        return Engine(self._loaded, store, namespace, self.prompt_format, decode_weights,
                      (self.ape_temperature, self.ape_scale, self.ape_source), self.loading_planner.profiles,
                      _decode_model=decode_model,
                      auto_params=(self.auto_signal, self.auto_max_risk, self.auto_source),
                      pool_bytes=self.block_pool.max_bytes)

    def with_store(self, store: KVStore, namespace: str | None = None) -> "Engine":
        """An engine over the same model (weights shared) reading and writing another store."""
        return self._sibling(store, namespace or self.namespace, self._decode_weights, self._decode_model)

    def exact_twin(self) -> "Engine":
        """This engine where its weights are exact; else one over the model's own (exact) weights, which a w8a8
        engine keeps: what its replies' fidelity is judged against (shadow checks). It shares the store but keys
        its blocks under the exact fingerprint."""
        if self._decode_weights not in INEXACT_PREFILL:
            return self
        return self._sibling(self._store, self.namespace, "exact", None)

    # -- model facts ------------------------------------------------------------------------------------
    @property
    def dtype_name(self) -> str:
        return dtype_name(self.model.dtype)

    @property
    def model_name(self) -> str:
        return self._loaded.name

    @property
    def model_path(self):
        return self._loaded.path

    @property
    def fingerprint(self) -> str:
        """Identifies the weights: part of every cache key, so that no two models share entries (w8a8's KV is
        another model's: its prefill runs on int8 products)."""
        return self._loaded.fingerprint + ("-w8a8" if self._decode_weights == "w8a8" else "")

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def num_layers(self) -> int:
        return self.model.args.num_layers

    @property
    def decode_model(self):
        """The module decode steps run on: `model` itself, or its int8/int4 copy (`decode_weights`)."""
        return self._decode_model

    @property
    def decode_weights(self) -> str:
        """The decode copy's kind, `auto` resolved (ragkv.models.quant)."""
        return self._decode_weights

    @property
    def forward_model(self):
        """The module prefill forwards run on (full, prefix, block encoding, a question over cached blocks, the rows
        a selection recomputes): the decode copy where its weights are the model's own (transposed, onednn: the
        same products in another order, each linear choosing its kernel by its rows, models/onednn.py), else
        `model` (int8/int4 copies stay decode-only); w8a8's copy runs prefill too, on int8 products (approximate)."""
        return self._decode_model if self._decode_weights in PREFILL_COPIES else self.model

    @property
    def store(self) -> KVStore:
        return self._store

    def info(self) -> dict:
        return {"model": self.model_name, "path": str(self.model_path), "fingerprint": self.fingerprint,
                "dtype": self.dtype_name, "device": str(self.device), "layers": self.num_layers,
                "max_positions": self.max_positions, "decode_weights": self._decode_weights,
                "threads": torch.get_num_threads()}

    # -- the store --------------------------------------------------------------------------------------
    def store_stats(self) -> dict:
        return self._store.stats() if hasattr(self._store, "stats") else {}

    def pool_stats(self) -> dict:
        """The block pool that `kv_layout=shared` reads blocks from in place (engine/blocks/pool.py)."""
        return self.block_pool.stats()

    def held_blocks(self, limit: int = 4096) -> list[str]:
        """The route ids (blocks.route_id) of the blocks in this engine's memory tier, most recently used last, at
        most `limit`: what a replica tells the cache-aware router it holds (serve/replicas)."""
        memory = self._store
        if hasattr(memory, "tier"):
            try:
                memory = memory.tier("memory")
            except KeyError:
                return []
        entries = memory.entries() if hasattr(memory, "entries") else []
        return [route_id(key) for key, _ in entries if key.conditioning != CHAIN][-limit:]

    def flush_store(self) -> None:
        """Wait for the store's background write-back (new blocks on their way to slower tiers)."""
        getattr(self._store, "flush", lambda: None)()

    def write_back_pending(self) -> int:
        """New blocks still on their way to slower tiers (0 for a store without background write-back)."""
        return getattr(self._store, "write_back_pending", lambda: 0)()

    def describe_store(self) -> str:
        return self._store.describe()

    def cache_keys(self, segs: Segments, fusion: FusionOptions = FusionOptions(),
                   namespace: str | None = None) -> list[CacheKey]:
        """The store entries `fusion.mode` reads for `segs` (block KV, the prefix as a block too; or hash-chained
        prefix chunks; none for full)."""
        return get_mode(validate_fusion(fusion).mode).cache_keys(self.mode_context, segs, fusion,
                                                                 namespace or self.namespace)

    def forget(self, segs: Segments, namespace: str | None = None, prefix_chunk: int = 32) -> int:
        """Delete what any mode stored for `segs`, keeping its shared prefix (system prompt); returns the count."""
        keys = {}
        for name in mode_names():
            fusion = FusionOptions(mode=name, prefix_chunk=prefix_chunk)
            own = self.cache_keys(segs, fusion, namespace)[get_mode(name).shared_key_count(segs, fusion):]
            keys.update(dict.fromkeys(own))
        self.block_pool.discard(keys)
        return sum(bool(self._store.delete(k)) for k in keys)

    def profile_store(self, refresh: bool = False) -> dict:
        """Measure (or re-measure) what the loading controller needs: each tier's load bandwidth and this
        model's recompute cost; saved for later processes. Runs at start-up or on `ragkv store profile`."""
        with self.lock:
            return self.loading_planner.profile(refresh)

    def profile_in_background(self, submit_background) -> None:
        """Start-up profiling that holds up a request by one forward at most: tier bandwidths on a thread (no model
        needed), then the recompute lengths as one background job handed to `submit_background` (a scheduler's),
        one forward per unit (`ragkv serve` runs it idle_only: never between two decode steps of an answer)."""
        import threading

        def measure(lengths):
            for n in lengths:
                yield from self.loading_planner.measuring_recompute_at(n)

        def run():
            try:
                self.loading_planner.profile_tiers()
            except Exception as e:  # noqa: BLE001 - no profile only means no loading plan yet
                log.warning("could not profile the store tiers (%s); blend runs without a loading plan until "
                            "`ragkv store profile` succeeds", e)
            lengths = self.loading_planner.recompute_lengths()
            if lengths:
                submit_background(lambda: measure(lengths))

        threading.Thread(target=run, name="ragkv-profile", daemon=True).start()

    # -- segments ---------------------------------------------------------------------------------------
    def segments(self, question: str, passages=(), system: str | None = None,
                 prompt_format: PromptFormat | None = None, turns: list[dict] = ()) -> Segments:
        """A RAG prompt: the prefix, the passages as blocks, the question; with `turns` (earlier messages
        [{"role", "content"}]), each turn a block after the passages (request.build_segments)."""
        return build_segments(self.tokenizer, question, passages, prompt_format or self.prompt_format, system,
                              turns)

    def chat_segments(self, prompt, system: str | None = None) -> Segments:
        """A chat without passages (a prompt, or turns [{"role", "content"}]) as one query segment."""
        return chat_segments(self.tokenizer, prompt, system)

    def history_segments(self, turns: list[dict], system: str | None = None) -> Segments:
        """A chat as blocks: the system message the prefix, each earlier message a block, the last the query; the
        same tokens as `chat_segments` (engine/blocks/history.py says how block modes run it)."""
        return history_segments(self.tokenizer, turns, system)

    def text_segments(self, text: str) -> Segments:
        """Raw text (no chat template) as one query segment: what /v1/completions without documents runs."""
        return Segments([], [], self.tokenize(text))

    def tokenize(self, text: str) -> list[int]:
        return tokenize(self.tokenizer, text)

    def passage_ids(self, passage: Passage) -> list[int]:
        """The token ids of `passage` as a block, exactly as a request would cache it."""
        return self.context_segments([passage]).blocks[0]

    def context_segments(self, passages, system: str | None = None) -> Segments:
        """Prefix and blocks of `passages` with no query: what `warm` takes to precompute them."""
        return build_segments(self.tokenizer, None, passages, self.prompt_format, system)

    def warm(self, segs: Segments, fusion: FusionOptions = FusionOptions(), namespace: str | None = None):
        """Precompute and store what `fusion.mode` would reuse for `segs` (its blocks, or its prefix chunks)
        without answering; returns the keys and what was encoded."""
        return get_mode(validate_fusion(fusion).mode).warm(self.mode_context, segs, fusion, namespace or self.namespace)

    def settle_history_steps(self, segs: Segments, namespace: str | None = None, prefix_chunk: int = 32,
                             chunk=None) -> Steps[dict]:
        """After a chat reply (`history_segments`), in units: encode its turns the store lacks as blocks (a later
        edit fuses them) and prefill its history exactly into the prefix cache if a fused reply left it out (the
        next turn is exact again); engine/blocks/history.py. The server runs it in the background while idle."""
        return settle_history(self.forward_model, self.block_cache, self.fingerprint, segs, namespace or self.namespace,
                              prefix_chunk, chunk)

    def worst_token_layers(self, segs: Segments, fusion: FusionOptions = FusionOptions(),
                           namespace: str | None = None) -> int:
        """The most rows `segs`' prefill may run through a layer, summed over layers, on a cold cache: what a server
        admits it by. A chat on the history path is planned as that path runs it (engine/blocks/history.py): a
        turn computed exactly counts once, not as a block encoded and a query recomputed."""
        mode = get_mode(validate_fusion(fusion).mode)
        if mode.takes_history(segs, fusion):
            return WithHistory(mode).worst_token_layers(self.mode_context, segs, fusion, namespace or self.namespace)
        return mode.worst_token_layers(segs, fusion, self.num_layers)

    def positions_needed(self, segs: Segments, fusion: FusionOptions = FusionOptions()) -> int:
        """Positions `fusion.mode` lays `segs` out on before the first generated token: the token count, except
        where blocks share positions (ape: prefix + the longest block + query)."""
        return get_mode(fusion.mode).positions(segs, fusion)

    def fit_to_window(self, segs: Segments, fusion: FusionOptions, max_new_tokens: int = 0) -> Segments:
        """With a mode whose blocks share positions (ape), blocks too long for the window are cut into pieces that
        fit beside the prefix, the query and `max_new_tokens` (APE section 6.3: a document longer than the window
        as parallel segments); unchanged otherwise, or when the prompt already fits."""
        if self.positions_needed(segs, fusion) + max_new_tokens <= self.max_positions or not segs.blocks:
            return segs
        if not get_mode(fusion.mode).shares_positions:
            return segs
        room = self.max_positions - len(segs.prefix) - len(segs.query) - max_new_tokens
        return split_blocks(segs, room) if room >= 1 else segs

    # -- prefill ----------------------------------------------------------------------------------------
    def check_length(self, positions: int, what: str = "fused prompt") -> None:
        if positions > self.max_positions:
            raise PromptTooLongError(positions, self.max_positions, what)

    def prefill(self, segs: Segments, fusion: FusionOptions = FusionOptions(), max_new_tokens: int = 0,
                namespace: str | None = None) -> tuple[DecodeState, RequestStats]:
        """Run `fusion.mode` up to the first token's logits; returns the decode state and statistics."""
        with self.lock:
            return drain(self.prefill_steps(segs, fusion, max_new_tokens, namespace))

    def prefill_steps(self, segs: Segments, fusion: FusionOptions = FusionOptions(), max_new_tokens: int = 0,
                      namespace: str | None = None, chunk=None) -> Steps:
        """`prefill` in units (each missed block encoded; each `chunk` tokens of a full or prefix prefill, where
        `chunk` is an int, None, or a function giving the next unit's size),
        yielding between them so that a scheduler can decode other requests in between. The caller holds the
        model (Engine.lock) while it advances the generator.

        A store that fails (a tier down, an entry that vanished or cannot be read) never fails the request: it starts
        over once with the store (the failed entry is gone now: a miss, encoded again; the other blocks hit), then,
        if the store fails again, without it, its blocks computed into request-local memory (`store_fault` in the
        stats). The blocks it had encoded are not encoded again (encode.KeptBlocks)."""
        kept = KeptBlocks()
        try:
            return (yield from self._prefill_steps(segs, fusion, max_new_tokens, namespace, chunk,
                                                   self.block_cache.for_request(kept)))
        except (MissingBlockError, StoreUnavailableError) as e:
            first = e
        log.warning("store failed during a request (%s); starting it over", first)
        try:
            state, stats = yield from self._prefill_steps(segs, fusion, max_new_tokens, namespace, chunk,
                                                          self.block_cache.for_request(kept))
        except (MissingBlockError, StoreUnavailableError) as e:
            log.warning("store failed again during a request (%s); computing its blocks without the cache", e)
            local = self.block_cache.for_request(kept, store=MemoryStore())
            state, stats = yield from self._prefill_steps(segs, fusion, max_new_tokens, namespace, chunk, local)
        stats.extra["store_fault"] = f"{type(first).__name__}: {first}"
        return state, stats

    def _prefill_steps(self, segs: Segments, fusion: FusionOptions, max_new_tokens: int, namespace: str | None,
                       chunk, blocks: BlockCache) -> Steps:
        stats = RequestStats(mode=fusion.mode, prompt_tokens=segs.num_tokens)
        t_start = time.perf_counter()
        mode = get_mode(validate_fusion(fusion).mode)
        mode.check(self.mode_context, fusion)
        if not segs.query:
            raise ValueError("a request needs a non-empty query segment")
        # room for the first answer tokens only: the cache grows as the answer does (KVCache), so a long
        # max_tokens costs memory only once it is used
        capacity = segs.num_tokens + min(max_new_tokens, DECODE_HEADROOM)
        state = yield from mode.prefill(self.mode_context, segs, fusion, capacity, stats, namespace or self.namespace, chunk,
                                        blocks)
        stats.full_token_layers = segs.num_tokens * self.num_layers
        stats.recomputed_token_layers = mode.token_layers(stats, self.num_layers)
        stats.fidelity = mode.fidelity(fusion, stats)
        stats.fidelity = self._estimate(stats, state.logits)
        history = stats.extra.get("history")
        if history is not None:  # chat turns: exact when nothing was fused (engine/blocks/history.py)
            stats.fidelity = {**stats.fidelity, "exact": bool(history["exact"] or stats.fidelity.get("exact")),
                              "history": history}
        if self._decode_weights not in EXACT_COPIES + ("exact",):  # int8 / int4: the answer after its first token
            stats.fidelity = {**stats.fidelity, "exact": False, "decode_weights": self._decode_weights,
                              "first_token_exact": bool(stats.fidelity.get("exact"))
                              and self._decode_weights not in PREFILL_COPIES}  # w8a8: the prefill too
        stats.ttft_ms = (time.perf_counter() - t_start) * 1000
        return state, stats

    def _estimate(self, stats: RequestStats, logits) -> dict:
        """The mode's fidelity statement with the model's fitted estimate where it has one. On w8a8 every reply,
        `full`'s too, is off the exact weights' `full`: a fit of w8a8's replies, else the exact weights' estimate
        composed with w8a8's own figures (estimates.with_weights)."""
        fidelity = stats.fidelity
        weights = self._decode_weights if self._decode_weights in INEXACT_PREFILL else None
        fits, share = self.fidelity_fits, stats.recomputed_token_layers / max(1, stats.full_token_layers)
        # the fit of these weights' replies first: only without one is the exact weights' estimate read and composed
        fitted = fits.estimate(fidelity, share, logits, weights) if fits is not None and weights else None
        if fitted is None and fits is not None and not fidelity.get("exact"):
            fitted = fits.estimate(fidelity, share, logits)  # the exact weights' fit
            fitted = with_weights(fitted or fidelity.get("estimate"), weights) if weights else fitted
        elif fitted is None and weights:
            fitted = with_weights(fidelity.get("estimate"), weights)
        if weights:
            return {**fidelity, "exact": False, "estimate": fitted}
        return {**fidelity, "estimate": fitted} if fitted is not None else fidelity

    def expected_kl(self, logits, share: float, select: str = "query") -> float:
        """A blend reply's expected first-token KL to `full` at that recomputed share (the `expected_kl` signal)."""
        return expected_kl(self.fidelity_fits, logits, share, "blend", select)

    def layer_stream(self, keys, uncached: dict, store: KVStore, tiers=None):
        """Per-layer KV of `keys`: those the store could not keep from memory, the others from the store (from
        the tiers the loading plan names, when there is one)."""
        if not keys:
            return iter(())
        if tiers is not None:
            return store.iter_layers(keys, self.model.args.num_layers, tiers=tiers, device=self.device)
        if uncached:
            here = MemoryStore()
            for key, kv in uncached.items():
                here.put(key, kv)
            store = TieredStore([here, store], pipelined=getattr(store, "pipelined", False), promote=False)
        if isinstance(store, TieredStore):  # copies to the compute device overlap compute (a no-op on CPU)
            return store.iter_layers(keys, self.model.args.num_layers, device=self.device)
        return store.iter_layers(keys, self.model.args.num_layers)

    # -- generation ----------------------------------------------------------------------------------------
    def start(self, segs: Segments, fusion: FusionOptions = FusionOptions(),
              gen: GenerationOptions = GenerationOptions(), namespace: str | None = None) -> Sequence:
        """Prefill now; the returned sequence is decoded by `step` (alone or batched with others)."""
        with self.lock:
            return drain(self.start_steps(segs, fusion, gen, namespace))

    def start_steps(self, segs: Segments, fusion: FusionOptions = FusionOptions(),
                    gen: GenerationOptions = GenerationOptions(), namespace: str | None = None,
                    chunk=None) -> Steps[Sequence]:
        """`start` in units (see `prefill_steps`); the caller holds Engine.lock while advancing it."""
        state, stats = yield from self.prefill_steps(segs, fusion, gen.max_new_tokens, namespace, chunk)
        seq = Sequence(state, gen, self.tokenizer, self.eos_ids, stats, self.max_positions, segs.all_ids())
        if segs.history and stats.fidelity.get("exact") and self.decode_weights in ("exact",) + EXACT_COPIES:
            # a chat's next turn starts with this prompt and this answer: their exact KV goes to the prefix cache
            # as the answer ends (an agent's next step then prefills only the tool's result)
            ns = namespace or self.namespace
            seq.on_finish = lambda s: keep_chunks(self.store, self.fingerprint, ns, s.prompt_ids + s.out.token_ids,
                                                  s.state.cache, fusion.prefix_chunk)
        return seq

    def step(self, seqs: list[Sequence], rows: int | None = None, forwards=()) -> list:
        """Advance every unfinished sequence by one token in one batched forward (call `advance()` first), with
        `forwards` (prefill units yielded by `start_steps`) in the same pass over the layers; returns their outputs.
        A forward of another model (the prefill's weights where the decode copy's differ: int8, int4) runs alone.
        rows: every forward at this row count, so that an answer does not depend on its neighbours (state.py)."""
        with self.lock:
            together = [f for f in forwards if f.model is self._decode_model]
            outs = dict(zip(map(id, together), step_sequences(self._decode_model, seqs, rows, together)))
            return [outs[id(f)] if id(f) in outs else outcome(f) for f in forwards]

    def stream(self, segs: Segments, fusion: FusionOptions = FusionOptions(),
               gen: GenerationOptions = GenerationOptions(), namespace: str | None = None) -> Run:
        """Prefill now; decoding happens as the returned Run is iterated."""
        seq = self.start(segs, fusion, gen, namespace)

        def deltas():
            while True:
                yield from seq.advance()
                if seq.finished:
                    return
                self.step([seq])

        return Run(deltas(), seq)

    def generate(self, segs: Segments, fusion: FusionOptions = FusionOptions(),
                 gen: GenerationOptions = GenerationOptions(), namespace: str | None = None) -> Answer:
        return self.stream(segs, fusion, gen, namespace).answer()


__all__ = ["Engine", "Answer", "Run", "Passage", "FusionOptions", "GenerationOptions", "Segments"]
