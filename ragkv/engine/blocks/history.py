"""Chat history as blocks: the longest start of a conversation that can be computed exactly (planned here), then the
other turns fused at their new offsets by the request's block mode (engine/modes/history.py runs the two).

A conversation sent statelessly (the whole `messages` list every turn) repeats its earlier turns. The turns the
hash-chained prefix cache (engine/blocks/prefix_cache.py) already holds, and new turns right after them, are prefilled
exactly over that prefix, and their chunks stored: an unedited conversation is computed exactly as `prefix` would.
After an edit (a summary replacing ten turns, a dropped message) the prefix cache stops at the edit; the turns after
it that the block store holds (each encoded alone, in the background after an earlier reply: `settle_history`)
are fused with the mode (reuse, blend, auto) instead of prefilled again, so the edit costs the edited part. Turns
after the last stored one (the newest exchange, an edited turn near the end) join the query: computed exactly over
everything before them, not encoded alone.

With documents (`Segments.passages`), the passages are the conversation's first blocks (after the system prompt):
while they stay the same from turn to turn, the prefix cache reaches through them and the history is exact.
"""

from __future__ import annotations

from ragkv.engine.blocks.encode import NO_CONDITIONING
from ragkv.engine.blocks.prefix_cache import chunk_keys, prefill_prefix
from ragkv.engine.kv.stepwise import Steps
from ragkv.engine.measure.stats import RequestStats
from ragkv.engine.request.segments import Segments

# a run of stored turns shorter than this is prefilled exactly: fusing it would save little and leave every later
# token approximate (a repeated short answer such as "OK." must not end the exact prefix)
MIN_FUSED_TOKENS = 128


def cached_prefix_tokens(store, ids: list[int], chunk: int, fingerprint: str, namespace: str) -> int:
    """Tokens at the start of `ids` the prefix cache holds (whole chunks)."""
    n = 0
    for key in chunk_keys(ids, chunk, fingerprint, namespace):
        if not store.contains(key):
            break
        n += chunk
    return n


def exact_turns(segs: Segments, covered: int, stored: list[bool], min_fused: int = MIN_FUSED_TOKENS) -> int:
    """How many leading turns are computed exactly: those the prefix cache reaches (`covered` tokens), then turns
    the block store lacks (encoding one alone would cost as much as prefilling it) and runs of stored turns shorter
    than `min_fused` tokens, up to the first run of stored turns worth fusing."""
    start, j, n = len(segs.prefix), 0, len(segs.blocks)
    while j < n:
        if start < covered or not stored[j]:
            start += len(segs.blocks[j])
            j += 1
            continue
        k, run = j, 0
        while k < n and stored[k]:
            run += len(segs.blocks[k])
            k += 1
        if run >= min_fused:
            break
        start, j = start + run, k
    return j


def history_counts(segs: Segments, j: int, k: int) -> dict:
    """What `usage.history` reports when blocks [j, k) are fused: turns and passages, each exact or fused."""
    P, n = segs.passages, len(segs.blocks)
    fused = range(j, k)
    fused_turns = sum(1 for i in fused if i >= P)
    fused_passages = len(fused) - fused_turns
    return {"turns": n - P, "exact_turns": n - P - fused_turns, "fused_turns": fused_turns,
            "passages": P, "fused_passages": fused_passages}


def with_exact_prefix(cache, n: int, layer_iter):
    """Each layer's cached parts behind the exact prefix's first `n` rows, K already rotated at their positions."""
    for layer, parts in enumerate(layer_iter):
        yield [(cache.keys[layer][0, :, :n], cache.values[layer][0, :, :n], "rotated")] + list(parts)


def plan_history(blocks, fingerprint: str, segs: Segments, chunk_size: int, ns: str) -> tuple[int, int]:
    """Blocks [j, k) of `segs` the history path fuses with the store as it is now (j == len(segs.blocks): none,
    the whole prompt exact); those before j are computed exactly, those after k join the query."""
    store = blocks.store
    covered = cached_prefix_tokens(store, segs.all_ids(), chunk_size, fingerprint, ns)
    stored = [store.contains(blocks.key(b, NO_CONDITIONING, ns)) for b in segs.blocks]
    j = exact_turns(segs, covered, stored)
    k = len(segs.blocks)
    while k > j and not stored[k - 1]:
        k -= 1
    return j, k


def fused_rest(segs: Segments, j: int, k: int) -> Segments:
    """What the mode fuses for plan (j, k): the exact start as its prefix, blocks [j, k), the later turns and the
    query as its query."""
    exact_ids = segs.prefix + [t for b in segs.blocks[:j] for t in b]
    tail = [t for b in segs.blocks[k:] for t in b]
    return Segments(exact_ids, segs.blocks[j:k], tail + segs.query, history=True)


def settle_history(model, blocks, fingerprint: str, segs: Segments, ns: str, prefix_chunk: int,
                   prefill_chunk=None) -> Steps[dict]:
    """What follows a chat reply while the server is idle, so that the next turn is cheap whatever the client
    sends: the turns the block store lacks are encoded alone (a later edit fuses them instead of prefilling them),
    and a history the prefix cache does not hold (the reply fused turns behind an edit) is prefilled exactly into
    it (the next turn is exact again). Yields between blocks and between `prefill_chunk`-token units."""
    # the question just answered is a turn of the next request: encoded now, it is not a miss after an edit
    turns = segs.blocks + ([segs.next_turn] if segs.next_turn else [])
    res = yield from blocks.ensure_steps(turns, NO_CONDITIONING, namespace=ns, chunk=prefill_chunk)
    # the whole prompt, its question too: the next request repeats it as a turn, so the prefix cache then reaches
    # into the new exchange and only that is prefilled
    ids = segs.all_ids()
    healed = 0
    whole_chunks = len(ids) // prefix_chunk * prefix_chunk
    if cached_prefix_tokens(blocks.store, ids, prefix_chunk, fingerprint, ns) < whole_chunks:
        stats = RequestStats(mode="prefix")
        yield from prefill_prefix(model, blocks.store, fingerprint, ns, ids, prefix_chunk, len(ids), stats,
                                  prefill_chunk)
        healed = stats.recomputed_tokens
    return {"encoded_turns": res.misses, "prefilled_tokens": healed}
