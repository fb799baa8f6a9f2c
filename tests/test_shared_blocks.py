"""Shared block attention (ragkv.engine.fusion.shared_attention): `reuse` reading pooled blocks in place equals
`reuse` over its own re-rotated copy (fp32, 1e-4), in prefill and decode, alone, forked and batched, with the same
block at different offsets in different sequences; the pool reads each block from the store once and stays
bounded."""

import pytest
import torch
from tiny import make_segs, rand_ids

from ragkv.engine.kv.state import decode_batch, decode_step
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Segments
from ragkv.errors import InvalidRequestError, OptionError

TOL = 1e-4
COPIED = FusionOptions(mode="reuse")
SHARED = FusionOptions(mode="reuse", kv_layout="shared")


def maxdiff(a, b):
    return (a.cpu() - b.cpu()).abs().max().item()


def greedy(model, state, n):
    out, logits = [], [state.logits]
    for _ in range(n):
        out.append(int(state.logits.argmax()))
        logits.append(decode_step(model, state, out[-1]))
    return out, logits


@pytest.mark.parametrize("arch,positions", [("llama3", "reencoded"), ("qwen2", "reencoded"), ("mistral", "reencoded"),
                                            ("llama", "local")])
def test_shared_equals_copied_in_prefill_and_decode(arch, positions, tiny_engine):
    eng = tiny_engine(arch)
    segs = make_segs(prefix=7, blocks=(20, 33, 12, 25), query=9, seed=2)
    copied, s1 = eng.prefill(segs, FusionOptions(mode="reuse", positions=positions))
    shared, s2 = eng.prefill(segs, FusionOptions(mode="reuse", positions=positions, kv_layout="shared"))
    assert maxdiff(copied.logits, shared.logits) <= TOL
    assert (s1.reused_tokens, s1.recomputed_tokens) == (s2.reused_tokens, s2.recomputed_tokens)
    assert shared.cache.length == len(segs.query)  # the sequence holds only its own rows
    assert shared.next_position == copied.next_position
    toks_c, logits_c = greedy(eng.model, copied, 8)
    toks_s, logits_s = greedy(eng.model, shared, 8)
    assert toks_c == toks_s
    assert max(maxdiff(a, b) for a, b in zip(logits_c, logits_s)) <= TOL


@pytest.mark.parametrize("blend", [dict(ratio=0.3), dict(ratio=0.3, select="query"), dict(ratio=0.2, select="sinks",
                                                                                        sink_tokens=3),
                                   dict(mode="auto", ratio=0.2, max_risk=0.0),  # auto, escalated to all rows
                                   dict(ratio=0.3, select="query", draft_tokens=4)])  # its rows kept as lookahead
@pytest.mark.parametrize("kernel", [True, False])
def test_blend_in_place_decodes_as_blend_copied(blend, kernel, tiny_engine, monkeypatch):
    """blend with kv_layout=shared: prefilled as a copy, then only the rows it recomputed (which override the pooled
    blocks' rows for this sequence only) and the query's are kept, the rest read in place. Its decode equals blend
    over its copy (1e-4, 8 steps), alone and in a batch beside a `reuse` sequence that reads the same blocks
    unmasked at other offsets; with the CPU kernel and with the torch path."""
    monkeypatch.setenv("RAGKV_DECODE_ATTENTION", "kernel" if kernel else "torch")  # not this machine's timed choice
    eng = tiny_engine("qwen2")
    segs = make_segs(prefix=7, blocks=(20, 33, 12, 25), query=9, seed=2)
    blend = {"mode": "blend", **blend}
    copied = eng.prefill(segs, FusionOptions(**blend))[0]
    shared, stats = eng.prefill(segs, FusionOptions(kv_layout="shared", **blend))
    assert torch.equal(copied.logits, shared.logits)  # the same prefill
    assert shared.cache.length == len(segs.query) + len(shared.lookahead)
    assert shared.next_position == copied.next_position and len(shared.lookahead) == blend.get("draft_tokens", 0)
    for (tok_s, ahead_s), (tok_c, ahead_c) in zip(shared.lookahead, copied.lookahead):
        assert tok_s == tok_c and torch.equal(ahead_s, ahead_c)
    own = stats.extra["own_context_rows"]
    # recomputed rows only, not the whole context (even escalated: layer 0's K/V are projections of the
    # embeddings, bitwise the stored ones, and so read in place)
    assert 0 < own < len(segs.prefix) + sum(len(b) for b in segs.blocks)
    neighbour_segs = Segments(segs.prefix, segs.blocks[::-1], rand_ids(5, 9))  # same blocks, other offsets
    neighbour = eng.prefill(neighbour_segs, SHARED)[0]
    neighbour_alone = eng.prefill(neighbour_segs, COPIED)[0]
    toks_c, logits_c = greedy(eng.model, copied, 8)
    for i, tok in enumerate(toks_c):
        pair = decode_batch(eng.model, [shared, neighbour], [tok, 11])
        assert maxdiff(pair[0], logits_c[i + 1]) <= TOL
        assert maxdiff(pair[1], decode_step(eng.model, neighbour_alone, 11)) <= TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ape_in_place_equals_ape_copied_alone_and_batched(arch, tiny_engine):
    """APE's context (the blocks after the prefix, sharing one position range) as one part with temperature T and
    its LSE scaled by S, over pooled blocks: equal to the copied path, in prefill, decode and a batched step."""
    eng = tiny_engine(arch)
    ape = dict(mode="ape", ape_temperature=0.8, ape_scale=0.9)
    segs = [make_segs(prefix=7, blocks=(20, 33, 12), query=9, seed=2), make_segs(prefix=7, blocks=(33, 25), seed=2)]
    copied = [eng.prefill(s, FusionOptions(**ape))[0] for s in segs]
    shared = [eng.prefill(s, FusionOptions(**ape, kv_layout="shared"))[0] for s in segs]
    for c, s in zip(copied, shared):
        assert maxdiff(c.logits, s.logits) <= TOL and s.cache.length == len(segs[0].query)
    for tok in (4, 61, 200):
        batched = decode_batch(eng.model, shared, [tok, tok])
        for row, c in zip(batched, copied):
            assert maxdiff(row, decode_step(eng.model, c, tok)) <= TOL
    none = make_segs(prefix=0, blocks=(20, 12), seed=9)  # no prefix: every block is context
    assert maxdiff(eng.prefill(none, FusionOptions(**ape))[0].logits,
                   eng.prefill(none, FusionOptions(**ape, kv_layout="shared"))[0].logits) <= TOL


def test_one_block_at_different_offsets_is_pooled_once_and_read_in_place(tiny_engine):
    """Two requests hold the same block at offsets 12+20 and 12: both equal their copied path, the pool read the
    block from the store once, and a batched step over both (beside a copied sequence) equals each alone."""
    eng = tiny_engine("llama")
    common, other = rand_ids(26, 5), rand_ids(20, 6)
    a = Segments(rand_ids(12, 1), [other, common], rand_ids(8, 7))
    b = Segments(rand_ids(12, 1), [common, rand_ids(15, 8)], rand_ids(11, 9))
    sa, _ = eng.prefill(a, SHARED)
    before = eng.block_pool.stats()
    sb, _ = eng.prefill(b, SHARED)
    after = eng.block_pool.stats()
    assert after["hits"] - before["hits"] == 2 and after["misses"] - before["misses"] == 1  # prefix + common
    ref_a, ref_b = eng.prefill(a, COPIED)[0], eng.prefill(b, COPIED)[0]
    assert maxdiff(sa.logits, ref_a.logits) <= TOL and maxdiff(sb.logits, ref_b.logits) <= TOL
    plain, _ = eng.prefill(make_segs(seed=4), COPIED)
    alone = [eng.prefill(make_segs(seed=4), COPIED)[0], eng.prefill(a, COPIED)[0], eng.prefill(b, COPIED)[0]]
    for tok in (3, 77, 150, 9):
        batched = decode_batch(eng.model, [plain, sa, sb], [tok, tok, tok])
        for row, state in zip(batched, alone):
            assert maxdiff(row, decode_step(eng.model, state, tok)) <= TOL


@pytest.mark.parametrize("kernel", [True, False])
def test_a_batched_step_reads_each_shared_block_once(kernel, tiny_engine, monkeypatch):
    """Three sequences holding the same prefix and block at different offsets: per layer, each distinct block is
    attended once for all its holders (plus each sequence's own rows), and the rows equal decoding alone. With
    the CPU kernel: one call per layer whose parts are the distinct blocks and the own rows; without it (other
    devices), one attention per distinct block."""
    import ragkv.engine.fusion.shared_attention as shared_attention
    from ragkv.ops.decode_kernel import kernel as cpp

    eng = tiny_engine("qwen2")
    if kernel and (cpp() is None or eng.device.type != "cpu"):
        pytest.skip("the CPU parts kernel is not available here")
    common, prefix = rand_ids(30, 11), rand_ids(10, 12)
    reqs = [Segments(prefix, [common, rand_ids(9 + i, 20 + i)][::1 - 2 * (i % 2)], rand_ids(6 + i, 30 + i))
            for i in range(3)]
    states = [eng.prefill(r, SHARED)[0] for r in reqs]
    alone = [eng.prefill(r, COPIED)[0] for r in reqs]
    calls = []
    monkeypatch.setenv("RAGKV_DECODE_ATTENTION", "kernel" if kernel else "torch")  # not this machine's timed choice
    if kernel:
        real_parts = shared_attention.parts_attention_cpu
        monkeypatch.setattr(shared_attention, "parts_attention_cpu",
                            lambda q, keys, *a: calls.append(len(keys)) or real_parts(q, keys, *a))
    else:
        real = shared_attention.unmasked_attention_with_lse
        monkeypatch.setattr(shared_attention, "unmasked_attention_with_lse",
                            lambda q, k, v, *t: calls.append(k.shape[2]) or real(q, k, v, *t))
    batched = decode_batch(eng.model, states, [5, 6, 7])
    distinct = {id(b) for s in states for b in s.attention.blocks}
    assert len(distinct) == 2 + 3  # prefix, common, each request's own block
    if kernel:
        assert calls == [len(distinct) + len(states)] * eng.model.args.num_layers
    else:
        assert len(calls) == eng.model.args.num_layers * (len(distinct) + len(states))
    monkeypatch.undo()
    for row, state, tok in zip(batched, alone, [5, 6, 7]):
        assert maxdiff(row, decode_step(eng.model, state, tok)) <= TOL
    if kernel:  # the step's cached tables hold the sequences' blocks only until one of them is released
        assert shared_attention._StepTables._last is not None
        states[1].release()
        assert shared_attention._StepTables._last is None


def test_forked_choices_read_the_blocks_in_place(tiny_engine):
    eng = tiny_engine("qwen2")
    segs = make_segs(seed=3)
    ref, _ = eng.prefill(segs, COPIED)
    shared, _ = eng.prefill(segs, SHARED)
    first, second = shared.fork(), shared.fork()
    assert maxdiff(decode_step(eng.model, first, 11), decode_step(eng.model, ref.fork(), 11)) <= TOL
    assert maxdiff(decode_step(eng.model, second, 200), decode_step(eng.model, ref.fork(), 200)) <= TOL


def test_the_pool_is_bounded_and_an_evicted_block_still_serves_its_sequence(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(seed=5)
    ref, _ = eng.prefill(segs, COPIED)
    state, _ = eng.prefill(segs, SHARED)
    one = max(b.nbytes for b in state.attention.blocks)
    eng.block_pool.max_bytes = one  # everything but the newest block goes
    for seed in (6, 7):
        eng.prefill(make_segs(seed=seed), SHARED)
    stats = eng.block_pool.stats()
    assert stats["bytes"] <= stats["max_bytes"] and stats["blocks"] == 1
    assert maxdiff(decode_step(eng.model, state, 42), decode_step(eng.model, ref, 42)) <= TOL


def test_forget_drops_the_pooled_blocks(tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(seed=8)
    eng.prefill(segs, SHARED)
    blocks = eng.block_pool.stats()["blocks"]
    eng.forget(segs)
    assert eng.block_pool.stats()["blocks"] == blocks - len(segs.blocks)  # the shared prefix is kept


def test_a_sliding_window_in_reach_is_refused_with_what_to_do(tiny_engine):
    eng = tiny_engine("mistral_window")
    with pytest.raises(InvalidRequestError, match="kv_layout=copied"):
        eng.prefill(make_segs(), SHARED)


def test_a_sequence_reading_in_place_reserves_only_its_own_rows():
    from ragkv.engine.modes import get_mode

    segs = make_segs()
    reuse = get_mode("reuse")
    assert reuse.own_rows(segs, SHARED) == len(segs.query) and reuse.own_rows(segs, COPIED) == segs.num_tokens
    history = Segments(segs.prefix, segs.blocks, segs.query, history=True)  # its exact start is its own
    assert reuse.own_rows(history, SHARED) == history.num_tokens


def test_kv_layout_is_a_declared_option():
    """Refused with its field and choices named; reached from an eval key as from the flag and the HTTP field."""
    from ragkv.eval.modes import parse_mode_key

    with pytest.raises(OptionError) as e:
        FusionOptions(mode="reuse", kv_layout="borrowed")
    assert e.value.param == "kv_layout" and "copied" in str(e.value) and "shared" in str(e.value)
    assert parse_mode_key("reuse:kv=shared", FusionOptions()).kv_layout == "shared"
    assert parse_mode_key("reuse", FusionOptions()).kv_layout == "copied"  # the default: each request's own copy
