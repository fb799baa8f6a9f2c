"""Bounded KV memory: n choices share their prompt's KV, caches grow with the answer instead of being
allocated for max_tokens, a finished or cancelled sequence gives its KV back at once, and the scheduler admits
generations by the KV they may hold."""

import threading
import time

import pytest
import torch
from test_scheduler import FakeSeq
from tiny import make_segs

from ragkv.engine.kv.kvbudget import KVBudget, kv_need
from ragkv.engine.kv.kvcache import DECODE_HEADROOM, bytes_per_token
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.serve.scheduling import KVTooLarge, Scheduler


class ByteText:
    """Enough of a tokenizer for decoding: tiny models carry none."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def engine(tiny_engine, arch="llama"):
    eng = tiny_engine(arch)
    eng.tokenizer = ByteText()
    return eng


def held_bytes(seqs) -> int:
    """Bytes of the distinct buffers the sequences' caches hold (a buffer two of them share counts once)."""
    storages = {}
    for s in seqs:
        cache = s.state.cache
        prefix = getattr(cache, "prefix", None)
        tensors = list(cache.keys) + list(cache.values) + (prefix.keys + prefix.values if prefix else [])
        for t in tensors:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def decode(eng, seqs):
    while not all(s.finished for s in seqs):
        for s in seqs:
            s.advance()
        eng.step(seqs)
    return [s.out.token_ids for s in seqs]


def test_n_choices_share_the_prompt_kv_instead_of_copying_it(tiny_engine):
    """8 choices of a 400-token prompt hold the prompt's rows once plus their own tokens' (today's copies held
    8 x (prompt + max_tokens) rows)."""
    eng = engine(tiny_engine)
    segs = make_segs(prefix=0, blocks=(), query=400, seed=2)
    per_token = bytes_per_token(eng.model)
    first = eng.start(segs, FusionOptions(mode="full"), GenerationOptions(max_new_tokens=100))
    seqs = [first] + [first.fork(i) for i in range(1, 8)]
    prompt = per_token * segs.num_tokens
    assert held_bytes(seqs) < 1.7 * prompt
    for _ in range(20):
        for s in seqs:
            s.advance()
        eng.step(seqs)
    assert held_bytes(seqs) < 1.7 * prompt  # each choice's own rows only
    assert held_bytes(seqs) <= kv_need(per_token, segs.num_tokens, 100, 8)
    decode(eng, seqs)
    assert held_bytes(seqs) == 0  # finished: released at once


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["full", "prefix", "reuse", "ape", "blend"])
def test_n_greedy_choices_equal_one_request(arch, mode, tiny_engine):
    """Choices reading a shared prompt decode token for token what the same request decodes alone (fp32)."""
    eng = engine(tiny_engine, arch)
    segs = make_segs(blocks=(20, 17, 25), query=9)
    fusion, gen = FusionOptions(mode=mode, prefix_chunk=8), GenerationOptions(max_new_tokens=40)
    alone = decode(eng, [eng.start(segs, fusion, gen)])[0]
    first = eng.start(segs, fusion, gen)
    assert decode(eng, [first] + [first.fork(i) for i in (1, 2)]) == [alone] * 3


def test_caches_grow_with_the_answer_up_to_its_budget(tiny_engine):
    """A prefill holds the prompt plus a little room, not prompt + max_tokens; decoding past that room grows the
    cache (the same tokens as one allocated up front) and never beyond prompt + budget."""
    eng = engine(tiny_engine)
    segs = make_segs(prefix=0, blocks=(), query=30, seed=4)
    seq = eng.start(segs, FusionOptions(mode="full"), GenerationOptions(max_new_tokens=400))
    assert seq.state.cache.capacity == segs.num_tokens + DECODE_HEADROOM
    grown = []
    while not seq.finished:
        seq.advance()
        if not seq.finished:
            grown.append(seq.state.cache.capacity)
            eng.step([seq])
    assert max(grown) == segs.num_tokens + seq.budget and len(seq.out.token_ids) == seq.budget == 400
    state, _ = eng.prefill(segs, FusionOptions(mode="full"), 400)  # the old way: one cache for everything
    from ragkv.engine.kv.state import decode_step
    ref = []
    for _ in range(400):
        ref.append(int(state.logits.argmax()))
        decode_step(eng.model, state, ref[-1])
    assert seq.out.token_ids == ref


def test_a_cancelled_sequence_gives_its_kv_back_while_still_referenced(tiny_engine):
    eng = engine(tiny_engine)
    first = eng.start(make_segs(), FusionOptions(mode="reuse"), GenerationOptions(max_new_tokens=50))
    seqs = [first, first.fork(1)]
    for s in seqs:
        s.advance()
    eng.step(seqs)
    seqs[1].cancel("cancelled")
    assert held_bytes(seqs[1:]) == 0 and held_bytes(seqs[:1]) > 0  # the other choice keeps the shared prompt
    seqs[0].cancel("cancelled")
    assert held_bytes(seqs) == 0


def fake_job(n_tokens, name, started=None):
    def start():
        if started is not None:
            started.append(name)
        yield
        return FakeSeq(n_tokens, name), name
    return start


def wait_until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_scheduler_admits_by_kv_budget_and_refuses_what_never_fits():
    budget = KVBudget(100)
    gate = threading.Event()
    sched = Scheduler(step=lambda seqs: gate.wait(5), max_batch=8, kv_budget=budget)
    started = []
    a = sched.submit_generation(fake_job(10**6, "a", started), kv_bytes=60)
    wait_until(lambda: started == ["a"])
    b = sched.submit_generation(fake_job(2, "b", started), kv_bytes=60)  # fits only once a has left
    gate.set()
    wait_until(lambda: sched.stats()["kv_waiting"] == 1)  # polled, not slept: a loaded machine is slow
    time.sleep(0.2)  # b stays waiting while a runs
    st = sched.stats()
    assert started == ["a"] and st["kv_waiting"] == 1 and st["kv_bytes_reserved"] == 60 and st["queue_depth"] == 1
    with pytest.raises(KVTooLarge) as e:
        sched.submit_generation(fake_job(1, "c"), kv_bytes=101)
    assert e.value.param == "max_tokens" and "100" in str(e.value)
    a.cancel()
    assert a.future.result(timeout=5)[2] == "cancelled"
    assert b.future.result(timeout=5)[2] == "length" and started == ["a", "b"]
    assert sched.stats()["kv_bytes_reserved"] == 0
    sched.stop()


def test_kv_need_counts_the_prompt_once():
    assert kv_need(10, 100, 50, 1) == 1500
    assert kv_need(10, 100, 50, 8) == 10 * (100 + 8 * 50)
    assert kv_need(10, 100, 0, 4) == 1000
    b = KVBudget(None)
    assert b.fits_ever(10**15) and b.try_reserve(10**15)


def test_an_idle_server_trims_its_heap_again_after_the_first_trim(monkeypatch):
    """What is freed after the idle trim (responses, a cancelled stream's cycle) goes back too: IDLE_RETRIMS more
    trims while idle, none while busy with nothing freed, and none once they are spent."""
    from ragkv.engine.kv import kvbudget

    trims = []
    monkeypatch.setattr(kvbudget, "give_back", lambda collect=False: trims.append(collect))
    monkeypatch.setattr(kvbudget, "IDLE_RETRIM_S", 0.0)
    b = KVBudget(100)
    assert not b.maybe_give_back(idle=True)  # nothing released yet
    b.try_reserve(50)
    b.release(50)
    assert b.maybe_give_back(idle=True) and trims == [True]
    assert not b.maybe_give_back(idle=False)  # busy: the retrims wait for idleness
    assert [b.maybe_give_back(idle=True) for _ in range(kvbudget.IDLE_RETRIMS + 2)] == \
        [True] * kvbudget.IDLE_RETRIMS + [False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 255, 300, 700])
def test_attention_over_a_shared_prefix_equals_one_buffer_exactly(dtype, split, monkeypatch):
    """The decode kernel reading (shared prefix, own rows) in place gives bit for bit what it gives over the
    same rows in one buffer: the same chunks, the same arithmetic. (The kernel forced: on a machine where the
    torch path is faster, decode uses that, and the parts are joined first.)"""
    from ragkv.ops.attention import decode_attention, decode_attention_parts

    monkeypatch.setenv("RAGKV_DECODE_ATTENTION", "kernel")

    g = torch.Generator().manual_seed(split)
    q = torch.randn(1, 9, 1, 64, generator=g).to(dtype)
    k = torch.randn(1, 3, 701, 64, generator=g).to(dtype)
    v = torch.randn(1, 3, 701, 64, generator=g).to(dtype)
    whole = decode_attention(q, k, v)
    parts = [(k[:, :, :split].clone(), v[:, :, :split].clone()), (k[:, :, split:].clone(), v[:, :, split:].clone())]
    assert torch.equal(decode_attention_parts(q, parts), whole)


def test_frozen_objects_leave_collections_while_later_cycles_are_still_freed():
    """The server freezes what it loaded (a full collection over it stalled requests ~150 ms): what exists then is
    never walked again, and a reference cycle made afterwards (an abandoned stream's frame) is still freed."""
    import gc
    import weakref

    from ragkv.engine.kv.kvbudget import freeze_long_lived, give_back

    class Node:
        pass

    before = gc.get_freeze_count()
    old = Node()
    old.self = old
    old_ref = weakref.ref(old)
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() > before
        del old
        new = Node()
        new.self = new
        new_ref = weakref.ref(new)
        del new
        give_back(collect=True)
        assert new_ref() is None  # made after the freeze: collected
        assert old_ref() is not None  # frozen: kept (the price of the freeze, paid once for start-up objects)
    finally:
        gc.unfreeze()
        gc.collect()
    assert old_ref() is None
