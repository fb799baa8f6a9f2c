"""One forward per step: decode rows and prefill units of several requests in one pass over the layers
(models.loop.run_together) give every row what it gets alone, for every mode, and the scheduler mixes them."""

import pytest
import threading
import time

import torch
from tiny import IdText, make_segs

from ragkv.engine.kv.state import decode_forward, decode_step, finish_decode
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.serve.scheduling import Scheduler
from ragkv.models.loop import Forward, run_together

TOL = 1e-4  # fp32: only the products' blocking differs with the row count (test_batched_decode's tolerance too)
MODES = [FusionOptions(mode="full"), FusionOptions(mode="prefix", prefix_chunk=8), FusionOptions(mode="reuse"),
         FusionOptions(mode="ape", ape_temperature=0.8, ape_scale=0.9), FusionOptions(mode="blend", ratio=0.3),
         FusionOptions(mode="blend", ratio=0.3, select="query"), FusionOptions(mode="blend", ratio=0.2,
                                                                             select="sinks", sink_tokens=2),
         FusionOptions(mode="reuse", kv_layout="shared"), FusionOptions(mode="blend", ratio=0.3, kv_layout="shared"),
         FusionOptions(mode="auto", ratio=0.2, max_risk=0.0)]
SHAPES = [dict(blocks=(20, 17, 25), query=9), dict(prefix=5, blocks=(11,), query=4, seed=2),
          dict(blocks=(30, 8), query=12, seed=3), dict(blocks=(14, 22, 9), query=6, seed=4),
          dict(prefix=0, blocks=(40, 12), query=7, seed=5), dict(blocks=(16, 16), query=5, seed=6),
          dict(prefix=6, blocks=(18, 21), query=5, seed=7), dict(blocks=(19, 23), query=8, seed=8),
          dict(blocks=(26, 10), query=6, seed=9), dict(blocks=(12, 15, 9), query=7, seed=10)]


def maxdiff(a, b):
    return (a.float() - b.float()).abs().max().item()


def prefill_beside_decode(eng, prefills, running):
    """Drive every prefill generator, each of its forwards run in one pass with the other prefills' pending forwards
    and a decode step of `running` ([(state, token)]: each fed its greedy token every step). Returns the prefills'
    results and the logits each running state saw, step by step."""
    values, pending, done, seen = [None] * len(prefills), {}, {}, [[] for _ in running]
    while len(done) < len(prefills):
        for i, gen in enumerate(prefills):
            while i not in done and i not in pending:
                try:
                    item = gen.send(values[i])
                except StopIteration as end:
                    done[i] = end.value
                    break
                values[i] = None
                if isinstance(item, Forward):
                    pending[i] = item
        if not pending:
            break
        order = list(pending)
        states = [s for s, _ in running]
        tokens = [int(s.logits.argmax()) for s in states]
        outs = run_together([decode_forward(eng.model, states, tokens)] + [pending.pop(i) for i in order])
        finish_decode(eng.model, states, outs[0])
        for k, s in enumerate(states):
            seen[k].append(s.logits.clone())
        for i, out in zip(order, outs[1:]):
            values[i] = out
    return [done[i] for i in range(len(prefills))], seen


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_every_mode_prefilled_in_a_mixed_forward_equals_it_alone(arch, tiny_engine):
    """Ten requests of every mode and selection prefill together, their forwards (prefill chunks, blocks encoded,
    queries over cached blocks, recomputed rows, stage 1 and 2) run in the same passes as two answers' decode steps:
    each prefill's first-token logits and its next decode step, and every decode step, equal what they are alone."""
    eng = tiny_engine(arch)
    segs = [make_segs(**shape) for shape in SHAPES]
    alone = [eng.prefill(s, f, 4)[0] for s, f in zip(segs, MODES)]
    eng_mixed = tiny_engine(arch)  # a cold store: the blocks are encoded inside the mixed forwards too
    decoding = [eng_mixed.prefill(make_segs(blocks=(9,), query=5, seed=40 + k), FusionOptions(mode="full"), 64)[0]
                for k in range(2)]
    solo = [eng_mixed.prefill(make_segs(blocks=(9,), query=5, seed=40 + k), FusionOptions(mode="full"), 64)[0]
            for k in range(2)]
    gens = [eng_mixed.prefill_steps(s, f, 4, chunk=16) for s, f in zip(segs, MODES)]
    results, seen = prefill_beside_decode(eng_mixed, gens, [(s, None) for s in decoding])
    assert seen[0], "no forward ran beside the decode rows"
    for fusion, (state, stats), ref in zip(MODES, results, alone):
        assert maxdiff(state.logits, ref.logits) <= TOL, fusion
        token = int(ref.logits.argmax())
        assert maxdiff(decode_step(eng_mixed.model, state, token), decode_step(eng.model, ref, token)) <= TOL, fusion
    for k, s in enumerate(solo):  # the answers decoding beside them saw what they see alone
        for logits in seen[k]:
            assert maxdiff(logits, decode_step(eng_mixed.model, s, int(s.logits.argmax()))) <= TOL


def test_a_mixed_forward_of_a_block_that_stops_early_and_rows_a_selection_drops():
    """run_together's bookkeeping on its own: a plan that stops after storing (block encoding) rides along, and one
    that drops rows in `begin` gets back only the rows it kept."""
    from ragkv.models.loop import MixedPlan

    class Keep:
        def __init__(self, T, drop_at=None, stop_at=None):
            self.positions, self.drop_at, self.stop_at = torch.arange(T), drop_at, stop_at

        def begin(self, layer, dl, x):
            if layer == self.drop_at:
                self.positions = self.positions[::2]
                return x[:, ::2]
            return x

        def store(self, layer, raw_k, k, v):
            return None if layer == self.stop_at else (k, v)

        def attend(self, layer, q, kv):
            return q

    plans = [Keep(6, drop_at=1), Keep(4, stop_at=0), Keep(1)]  # the last: 3 rows of one position, as decode's
    mixed = MixedPlan(plans, [1, 1, 3], [6, 4, 3])
    assert mixed.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0, 0]  # [T] shared by B rows: repeated
    x = torch.randn(1, 13, 8)
    y = mixed.begin(1, None, x)
    assert y.shape[1] == 10 and mixed.rows == [3, 4, 3] and mixed.positions[:3].tolist() == [0, 2, 4]
    q = torch.randn(1, 2, 10, 4)
    kvs = mixed.store(0, q, q, q)
    assert kvs[1] is None and mixed.done == [False, True, False]
    out = mixed.attend(0, q, kvs)
    assert torch.equal(out[:, :, 3:7], torch.zeros(1, 2, 4, 4)) and torch.equal(out[:, :, 7:], q[:, :, 7:])


def test_the_scheduler_runs_prefill_units_in_the_decode_steps_and_answers_stay_the_same(tiny_engine):
    """Through the scheduler (mixed, a token budget): newcomers' prefill chunks run in the running answers' decode
    forwards, several at once, and every greedy answer is the one it gets alone."""
    eng = tiny_engine("llama")
    eng.tokenizer = IdText()
    gen = GenerationOptions(max_new_tokens=12)
    requests = [(make_segs(blocks=(40, 30), query=9, seed=s), m)
                for s, m in zip(range(6), ["full", "reuse", "blend", "prefix", "ape", "full"])]
    alone = [eng.generate(s, FusionOptions(mode=m), gen).token_ids for s, m in requests]
    eng2 = tiny_engine("llama")
    eng2.tokenizer = IdText()
    sched = Scheduler(lambda seqs, forwards=(): eng2.step(seqs, None, forwards), max_batch=8, mixed=True,
                      max_num_batched_tokens=64)

    def start(segs, mode):
        def begin():
            seq = yield from eng2.start_steps(segs, FusionOptions(mode=mode), gen, chunk=16)
            return seq, mode
        return begin
    try:
        jobs = [sched.submit_generation(start(s, m)) for s, m in requests]
        answers = [job.future.result(timeout=60)[1].out.token_ids for job in jobs]
    finally:
        sched.stop()
    assert answers == alone
    stats = sched.stats()
    assert stats["mixed_steps"] > 0 and stats["mixed_prefill_rows"] > 0, stats


def test_mixed_steps_keep_within_the_token_budget():
    """Prefills of several tenants stage their forwards for one step while the step's rows, decode and prefill,
    stay within max_num_batched_tokens; a forward that does not fit waits for the next step."""
    class FakeForward(Forward):
        def __init__(self, rows):
            super().__init__(None, torch.zeros(1, rows, 1), None)

        def run(self):
            return "alone"

    class Seq:
        def __init__(self, n):
            self.finished, self.n, self.stats = False, n, None
            self.out = type("Out", (), {"finish_reason": "length"})()

        def advance(self):
            self.n -= 1
            self.finished = self.n <= 0
            return []

        def cancel(self, reason):
            self.finished = True

    seen = []

    def step(seqs, forwards=()):
        seen.append((len(seqs), [f.rows for f in forwards]))
        return ["mixed"] * len(forwards)

    def start(rows, units, tokens):
        def begin():
            for _ in range(units):
                assert (yield FakeForward(rows)) in ("alone", "mixed")
            return Seq(tokens), rows
        return begin

    sched = Scheduler(step, max_batch=8, mixed=True, max_num_batched_tokens=40)
    try:
        first = sched.submit_generation(start(1, 1, 40), tenant="t0")
        jobs = [sched.submit_generation(start(r, 3, 2), tenant=f"t{i + 1}") for i, r in enumerate((16, 16, 16, 30))]
        for job in [first] + jobs:
            job.future.result(timeout=30)
    finally:
        sched.stop()
    mixed = [(d, rows) for d, rows in seen if rows]
    assert mixed and all(d + sum(rows) <= 40 for d, rows in mixed), seen
    assert any(len(rows) > 1 for _, rows in mixed), seen  # several requests' units in one forward


class _RowsForward(Forward):
    def __init__(self, rows, name):
        super().__init__(None, torch.zeros(1, rows, 1), None)
        self.name = name

    def run(self):
        return "alone"


class _Seq:
    def __init__(self, n, until=None):
        self.finished, self.n, self.stats, self.until = False, n, None, until
        self.out = type("Out", (), {"finish_reason": "length"})()

    def advance(self):
        self.n -= 1
        self.finished = self.until.is_set() if self.until is not None else self.n <= 0
        return []

    def cancel(self, reason):
        self.finished = True


def _one_tenants_steps(cap, tenants=("t",) * 4, rows=(8, 8, 8, 8), budget=64):
    """Steps of a scheduler serving one answer and, while it decodes, a burst of prefills of three units each:
    which requests' forwards each step ran, and the order their prefills ended."""
    seen, ended, burst_done = [], [], threading.Event()

    def step(seqs, forwards=()):
        seen.append([f.name for f in forwards])
        return ["mixed"] * len(forwards)

    def start(name, rows, units, tokens, until=None):
        def begin():
            for _ in range(units):
                assert (yield _RowsForward(rows, name)) in ("alone", "mixed")
            ended.append(name)
            return _Seq(tokens, until), name
        return begin

    sched = Scheduler(step, max_batch=8, mixed=True, max_num_batched_tokens=budget, max_prefills_per_tenant=cap)
    try:
        first = sched.submit_generation(start("answer", 1, 1, 1, until=burst_done), tenant="x")
        deadline = time.monotonic() + 10
        while not sched.running and time.monotonic() < deadline:
            time.sleep(0.005)
        with sched.lock:  # the whole burst is queued before the worker admits any of it
            jobs = [sched.submit_generation(start(f"r{i}", r, 3, 2), tenant=t)
                    for i, (t, r) in enumerate(zip(tenants, rows))]
        for job in jobs:
            job.future.result(timeout=30)
        burst_done.set()
        first.future.result(timeout=30)
    finally:
        sched.stop()
    return [[n for n in names if n != "answer"] for names in seen if set(names) - {"answer"}], ended[1:]


def test_one_tenants_prefills_share_a_step_within_the_budget_and_end_in_order():
    """One tenant's waiting requests start prefilling beside its own in flight once those have staged their
    forwards, so their forwards share one pass (the lever for many clients of one tenant); the first admitted never
    ends after a later one. `max_prefills_per_tenant=1` keeps one at a time."""
    mixed, ended = _one_tenants_steps(cap=0)
    assert max(len(names) for names in mixed) == 4, mixed
    assert ended == ["r0", "r1", "r2", "r3"], ended
    alone, ended = _one_tenants_steps(cap=1)
    assert all(len(names) == 1 for names in alone) and ended == ["r0", "r1", "r2", "r3"], alone
    capped, _ = _one_tenants_steps(cap=2)
    assert max(len(names) for names in capped) == 2, capped


def test_one_tenants_prefills_keep_within_the_budget_and_leave_room_for_another_tenant():
    """A tenant's several prefills stay within max_num_batched_tokens, and a step's forwards go round-robin by
    tenant: another tenant's prefill is not kept out of a step by the first tenant's second and third."""
    mixed, _ = _one_tenants_steps(cap=0, tenants=("a", "a", "a", "b"), rows=(20, 20, 20, 20), budget=50)
    assert all(len(names) <= 2 for names in mixed), mixed  # 1 decode row + two forwards of 20 rows
    assert any("r3" in names and "r0" in names for names in mixed), mixed  # b's forward beside a's first


def test_a_plan_that_fails_in_a_mixed_forward_fails_alone(tiny_engine):
    """A store fault while one request's context loads (its plan's `begin` raises) comes back as that forward's
    exception (thrown into its generator, which starts over without the store); the others' rows are unchanged."""
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(9,), query=5, seed=3)
    ref = eng.prefill(segs, FusionOptions(mode="full"))[0]

    class Broken:
        positions = torch.arange(4)

        def begin(self, layer, dl, x):
            raise RuntimeError("block vanished")

    gen = eng.prefill_steps(segs, FusionOptions(mode="full"))
    fwd = next(gen)
    with torch.inference_mode():
        broken = Forward(eng.model, eng.model.embed(torch.tensor([[5, 6, 7, 8]])), Broken())
    out, err = run_together([fwd, broken])
    assert isinstance(err, RuntimeError) and "vanished" in str(err)
    try:
        gen.send(out)
    except StopIteration as done:
        state, _ = done.value
    assert maxdiff(state.logits, ref.logits) <= TOL
