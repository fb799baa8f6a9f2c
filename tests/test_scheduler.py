"""The continuous-batching scheduler (ragkv.serve.scheduling) and prefill in units (Engine.start_steps)."""

import queue
import threading
import time

import pytest
import torch
from tiny import make_segs

from ragkv.engine.kv.stepwise import drain
from ragkv.engine.options import FusionOptions
from ragkv.serve.scheduling import LongPrefillsBusy, QueueFull, Scheduler


class FakeSeq:
    """Stands in for engine.generate.Sequence: `n` tokens, one per advance()."""

    def __init__(self, n, name):
        self.n, self.name, self.done_tokens, self.finished = n, name, 0, False
        self.out = type("Out", (), {"finish_reason": "length", "text": ""})()
        self.stats = None

    def advance(self):
        if self.done_tokens >= self.n:
            self.finished = True
            return []
        self.done_tokens += 1
        self.finished = self.done_tokens >= self.n
        return [type("D", (), {"text": f"{self.name}{self.done_tokens}"})()]

    def cancel(self, reason):
        self.finished, self.out.finish_reason = True, reason


def run_jobs(sched, jobs, timeout=10):
    deadline = time.monotonic() + timeout
    for job in jobs:
        job.future.result(timeout=max(0.1, deadline - time.monotonic()))


def test_prefill_units_interleave_with_decode_steps():
    """A newcomer's prefill runs one unit between two decode steps of the running batch."""
    steps = []
    sched = Scheduler(step=lambda seqs: steps.append(sorted(s.name for s in seqs)), max_batch=4)
    gate = threading.Event()
    units_seen = []

    def start_long():
        gate.wait(5)
        yield
        return FakeSeq(10**6, "a"), "A"

    def start_chunked():
        for _ in range(10):  # ten units, e.g. ten prefill chunks
            units_seen.append(sched.steps)
            yield
        return FakeSeq(3, "b"), "B"

    a = sched.submit_generation(start_long)
    gate.set()
    time.sleep(0.2)  # A is decoding
    b = sched.submit_generation(start_chunked)
    run_jobs(sched, [b])
    a.cancel()
    run_jobs(sched, [a])
    # between consecutive units of B's prefill, exactly one decode step of the batch ran
    gaps = [y - x for x, y in zip(units_seen, units_seen[1:])]
    assert gaps and all(g == 1 for g in gaps), units_seen
    assert any(s == ["a", "b"] for s in steps)  # B joined the running batch
    assert a.future.result()[2] == "cancelled" and b.future.result()[1].done_tokens == 3


def test_a_long_prefill_takes_at_most_its_share_of_the_time_while_answers_decode():
    """Units of a long prefill beside a decoding answer run only once the decode steps since the last one took as
    long (LONG_SHARE 0.5): the answer keeps about half its speed, where one long unit between every two steps made
    it ~20x slower in the soak. Judged on the durations measured here, as the scheduler judges (not on counts: a
    step slowed by the machine earns more)."""
    events = []  # ("step" | "long", seconds)

    def timed(kind, seconds):
        t0 = time.perf_counter()
        time.sleep(seconds)
        events.append((kind, time.perf_counter() - t0))

    sched = Scheduler(step=lambda seqs: timed("step", 0.01), max_batch=4)

    def start_decoding():
        yield
        return FakeSeq(10**6, "a"), "A"

    def start_long():
        for _ in range(6):
            timed("long", 0.03)
            yield
        return FakeSeq(1, "b"), "B"

    a = sched.submit_generation(start_decoding)
    time.sleep(0.2)  # A is decoding (nothing is banked meanwhile: no long prefill waits)
    b = sched.submit_generation(start_long, tenant="B", long=True)
    run_jobs(sched, [b])
    a.cancel()
    run_jobs(sched, [a])
    at = [i for i, (kind, _) in enumerate(events) if kind == "long"]
    assert len(at) == 6
    # the decode time between two long units covers the first one's: judged at 0.6, for the scheduler's clock also
    # counts its own overhead around each step (on a loaded machine two 10 ms steps read 23 ms here: enough by its clock);
    # one long unit between every two steps (the old behaviour) would read 0.33
    for x, y in zip(at, at[1:]):
        assert sum(sec for _, sec in events[x + 1:y]) >= 0.6 * events[x][1], events[x:y + 1]


@pytest.mark.parametrize("budget_ms, together", [(10_000, True), (1, False)])
def test_a_stall_budget_runs_newcomers_prefill_units_back_to_back(budget_ms, together):
    """prefill_stall_ms (serve --prefill-stall-ms): after a decode step, newcomers' prefill units (three requests
    of three units, 5 ms each) run back to back until the budget is spent, so all three join the next step; a
    budget shorter than one unit leaves one unit per step."""
    steps, units_seen, jobs = [], [], []

    def start_chunked(name):
        def start():
            for _ in range(3):
                units_seen.append(sched.steps)
                time.sleep(0.005)
                yield
            return FakeSeq(2, name), name
        return start

    def step(seqs):
        steps.append(sorted(s.name for s in seqs))
        if not jobs:  # the newcomers arrive during the first step
            jobs.extend(sched.submit_generation(start_chunked(n)) for n in "bcd")

    sched = Scheduler(step=step, max_batch=8, prefill_stall_ms=budget_ms)

    def start_long():
        yield
        return FakeSeq(10**6, "a"), "A"

    a = sched.submit_generation(start_long)
    deadline = time.monotonic() + 5
    while len(jobs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    run_jobs(sched, jobs)
    a.cancel()
    run_jobs(sched, [a])
    if together:
        assert len(set(units_seen)) == 1, units_seen  # nine units, no step between them
        assert ["a", "b", "c", "d"] in steps
    else:  # a step after every 5 ms unit
        assert len(units_seen) == 9 and all(y > x for x, y in zip(units_seen, units_seen[1:])), units_seen
    with pytest.raises(ValueError, match="prefill_stall_ms"):
        Scheduler(step=step, prefill_stall_ms=-1, thread=False)


def test_idle_only_background_work_waits_for_decoding_to_end_and_ingestion_does_not():
    """Start-up profiling (idle_only, a unit is a long forward) never runs between two decode steps; ingestion
    (a normal background job) still advances between them."""
    steps = []
    sched = Scheduler(step=lambda seqs: steps.append(len(seqs)) or time.sleep(0.001), max_batch=4)
    gate = threading.Event()
    ran_at = {"idle": [], "ingest": []}

    def units(name, n):
        def start():
            for _ in range(n):
                ran_at[name].append((len(sched.running), sched.steps))
                yield
            return name
        return start

    def start_gen():
        gate.wait(5)
        yield
        return FakeSeq(200, "a"), "A"

    gen = sched.submit_generation(start_gen)
    time.sleep(0.1)  # the generation is being prefilled (waiting on the gate)
    idle = sched.submit_background(units("idle", 3), timeout_s=30, idle_only=True)
    ingest = sched.submit_background(units("ingest", 3), timeout_s=30)
    gate.set()
    run_jobs(sched, [gen, ingest, idle])
    assert any(r for r, _ in ran_at["ingest"])  # ingestion ran beside the decoding answer
    assert all(r == 0 for r, _ in ran_at["idle"])  # profiling only once nothing decoded
    assert min(s for _, s in ran_at["idle"]) >= 199  # i.e. after the answer's decode steps
    assert idle.future.result() == "idle" and ingest.future.result() == "ingest"


def test_on_finish_gets_the_first_choice_stats_and_every_choice_tokens():
    """n > 1: one prefill's figures once, the tokens of every choice (what /metrics counts)."""
    seen = []
    sched = Scheduler(step=lambda seqs: None, max_batch=4,
                      on_finish=lambda stats, tokens: seen.append((stats, tokens)))

    def start():
        yield
        seqs = [FakeSeq(n, name) for n, name in ((2, "a"), (5, "b"))]
        for s in seqs:
            s.stats = type("Stats", (), {"completion_tokens": s.n})()
        return seqs, "info"

    job = sched.submit_generation(start)
    time.sleep(0.2)
    job.cancel()
    run_jobs(sched, [job])
    assert len(seen) == 1 and seen[0][1] == 7 and seen[0][0] is job.seqs[0].stats


def test_cancelled_and_expired_jobs_leave_the_batch():
    sched = Scheduler(step=lambda seqs: time.sleep(0.002), max_batch=8, timeout_s=0.5)

    def start(n, name):
        def gen():
            yield
            return FakeSeq(n, name), name
        return gen

    long = sched.submit_generation(start(10**6, "x"))
    other = sched.submit_generation(start(10**6, "y"))
    time.sleep(0.1)
    other.cancel()
    assert other.future.result(timeout=5)[2] == "cancelled"
    assert long.future.result(timeout=5)[2] == "timeout"  # its deadline passed while decoding
    assert sched.batch_size == 0


class FailingSeq(FakeSeq):
    """Its token choice raises at its `fail_at`-th advance (as sampling did on NaN probabilities)."""

    def __init__(self, n, name, fail_at):
        super().__init__(n, name)
        self.fail_at, self.calls = fail_at, 0

    def advance(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return super().advance()


@pytest.mark.parametrize("fail_at", [1, 3])  # its first token (right after the prefill), a later one (the batch)
def test_a_requests_failed_token_choice_ends_it_alone_and_at_once(fail_at):
    """A failure while choosing one request's token fails that request at once with its error (it used to hang
    until its deadline, or fail every request of the batch), and the others decode on."""
    sched = Scheduler(step=lambda seqs: time.sleep(0.001), max_batch=8, timeout_s=30)

    def start(seq):
        def gen():
            yield
            return seq, seq.name
        return gen

    good = sched.submit_generation(start(FakeSeq(20, "g")))
    bad = sched.submit_generation(start(FailingSeq(20, "b", fail_at)))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="probability"):
        bad.future.result(timeout=5)
    assert time.monotonic() - t0 < 5
    _, seq, reason = good.future.result(timeout=5)
    assert (seq.done_tokens, reason) == (20, "length")
    assert sched.batch_size == 0 and sched.kv.reserved == 0


def test_a_long_prefill_that_could_not_end_by_its_deadline_beside_the_others_is_refused_at_once():
    """LongLane: long prefills share the lane, so one admitted beside another slows both (in the soak a second one
    passed the 300 s deadline: a 504 after 5 minutes). Once a long prefill has ended (the rate is known), a new one is
    refused at once, with when to retry, if beside those in flight it or one of them would end past 0.9 of its
    deadline: here the newcomer is small and would end first, but it would make the big one late. Alone, or short,
    a prefill is admitted."""
    sched = Scheduler(step=lambda seqs: time.sleep(0.001), max_batch=8, timeout_s=2.0)
    gate = threading.Event()

    def start(units, unit_s, name, wait=False):
        def gen():
            for _ in range(units):
                time.sleep(unit_s)
                yield
            while wait and not gate.is_set():
                time.sleep(0.001)
                yield
            return FakeSeq(1, name), name
        return gen

    # 1000 token-layers in 5 units of 20 ms: the lane runs about 10 token-layers per ms
    first = sched.submit_generation(start(5, 0.02, "l1"), long=True, cost=1000, tenant="a")
    first.future.result(timeout=5)
    assert sched.long_lane.rate == pytest.approx(10, rel=0.5)
    # alone, a prefill of 2 s (at half the worker) is admitted; beside it another 0.2 s would end past 1.8 s
    big = sched.submit_generation(start(1, 0.0, "l2", wait=True), long=True, cost=10_000, tenant="a")
    time.sleep(0.05)
    with pytest.raises(LongPrefillsBusy, match="one would end beyond 90% of the server's 2 s deadline") as refused:
        sched.submit_generation(start(1, 0.0, "l3"), long=True, cost=1000, tenant="b")
    assert refused.value.retry_after_s >= 1
    short = sched.submit_generation(start(1, 0.0, "s"), tenant="b")  # a short one is not the lane's
    short.future.result(timeout=5)
    gate.set()
    big.future.result(timeout=5)
    sched.submit_generation(start(1, 0.0, "l3"), long=True, cost=1000, tenant="b").future.result(timeout=5)


def test_the_long_lane_expects_the_share_of_the_worker_long_prefills_have_really_had():
    """Long prefills' speed is measured, not assumed: under the fuzzers' load long units got less than LONG_SHARE of
    the wall clock, and a request admitted as able to end in 270 s got a 504 after 304 s (48-minute soak). The lane's
    share is the worker ms of long units over the wall ms during which one was admitted."""
    from ragkv.serve.scheduling import Job, LongLane

    lane = LongLane()
    lane.SHARE_MIN_S = 0.1
    lane.rate = 10.0  # token-layers per worker ms
    running = Job(60.0, start=None, long=True, cost=1000)
    lane.admit(running)
    lane.tick()
    time.sleep(0.4)
    lane.tick(long_ms=100.0)  # long units had about a quarter of the 400 ms
    assert lane.share() == pytest.approx(0.25, abs=0.08)
    newcomer = Job(60.0, start=None, long=True, cost=1000)
    lane.admit(newcomer)
    # both share the lane: each ends after 2000 token-layers at 10 per ms and a quarter of the wall clock
    assert newcomer.expected_s == pytest.approx(2000 / (10 * lane.share() * 1000), rel=0.01)
    assert newcomer.expected_s > 2000 / (10 * 0.5 * 1000) * 1.5  # what LONG_SHARE would have promised


def test_full_queue_refuses():
    sched = Scheduler(step=lambda seqs: None, max_queue=1)
    block = threading.Event()

    def start(wait):
        def gen():
            if wait:
                block.wait(5)
            yield
            return FakeSeq(1, "q"), None
        return gen

    sched.submit_generation(start(True))
    time.sleep(0.1)  # the worker is busy with the first job's prefill
    sched.submit_generation(start(False))
    with pytest.raises(QueueFull):
        sched.submit_generation(start(False))
    block.set()


def recording_starts(order: list, release: threading.Event):
    """start(name, hold) -> a generation's start that records its name when its prefill begins; `hold`: a long
    prefill, unit after unit, until `release` is set."""
    def start(name, hold=False):
        def gen():
            order.append(name)
            while hold and not release.is_set():
                time.sleep(0.01)
                yield
            yield
            return FakeSeq(1, name), name
        return gen
    return start


def kv_limited_scheduler():
    """A scheduler with 100 bytes of KV memory, the order prefills began in, the event that ends a held prefill, and
    `recording_starts` over them."""
    from ragkv.engine.kv.kvbudget import KVBudget

    order, release = [], threading.Event()
    sched = Scheduler(step=lambda seqs: None, max_batch=8, kv_budget=KVBudget(100))
    return sched, order, release, recording_starts(order, release)


def test_a_request_waiting_for_kv_memory_blocks_only_its_own_tenant():
    """A generation whose KV does not fit beside the running ones waits first in line; another tenant's that fits
    passes it, its own tenant's waits behind it, and it starts once memory is released (the soak: a second long
    `ape` request waiting for KV held every tenant's requests for minutes)."""
    sched, order, release, start = kv_limited_scheduler()

    a1 = sched.submit_generation(start("a1", hold=True), kv_bytes=70, tenant="A", long=True)
    time.sleep(0.2)
    a2 = sched.submit_generation(start("a2"), kv_bytes=60, tenant="A")  # does not fit: waits
    a3 = sched.submit_generation(start("a3"), kv_bytes=10, tenant="A")  # fits, but behind its tenant's a2
    time.sleep(0.2)
    b = sched.submit_generation(start("b"), kv_bytes=20, tenant="B")  # fits: passes a2
    b.future.result(timeout=5)
    assert order == ["a1", "b"] and not a2.future.done() and not a3.future.done()
    release.set()
    run_jobs(sched, [a1, a2, a3])
    assert order.index("a2") < order.index("a3")


def test_a_long_request_waiting_for_kv_memory_does_not_hold_its_own_tenant():
    """A long generation waiting for KV lets its own tenant's short ones that fit pass it (in the soak a long `ape`
    request waited minutes for KV while its tenant's chat requests timed out behind it); it starts once memory is
    released."""
    sched, order, release, start = kv_limited_scheduler()

    b1 = sched.submit_generation(start("b1", hold=True), kv_bytes=70, tenant="B", long=True)
    time.sleep(0.2)
    a_long = sched.submit_generation(start("a-long"), kv_bytes=60, tenant="A", long=True)  # does not fit: waits
    a_short = sched.submit_generation(start("a-short"), kv_bytes=10, tenant="A")  # fits: passes its tenant's long
    a_short.future.result(timeout=5)
    assert order == ["b1", "a-short"] and not a_long.future.done()
    release.set()
    run_jobs(sched, [b1, a_long])
    assert order[-1] == "a-long"


def test_a_tenant_holding_its_share_of_kv_memory_does_not_pass_another_tenants_waiting_request():
    """While A's request waits for KV, B (holding 70 of 100 bytes, above its share of 50) may not start another one
    that fits; C (holding none) may. In the soak the fuzzer's reservations, renewed as they ended, kept another
    tenant's long `ape` request waiting past its deadline."""
    sched, order, release, start = kv_limited_scheduler()

    b1 = sched.submit_generation(start("b1", hold=True), kv_bytes=70, tenant="B", long=True)
    time.sleep(0.2)
    a = sched.submit_generation(start("a"), kv_bytes=60, tenant="A", long=True)  # does not fit: waits
    time.sleep(0.2)
    b2 = sched.submit_generation(start("b2"), kv_bytes=20, tenant="B")  # fits, but B holds more than its share
    c = sched.submit_generation(start("c"), kv_bytes=20, tenant="C")  # fits: passes A's
    c.future.result(timeout=5)
    assert order == ["b1", "c"] and not a.future.done() and not b2.future.done()
    release.set()
    run_jobs(sched, [b1, a, b2])
    assert order.index("a") < order.index("b2")


def test_background_work_takes_a_turn_under_a_steady_load_of_prefills():
    """Ingestion advances while prefills are in flight, as one more tenant in the rotation (it used to run only when
    no prefill was waiting: under the soak's steady load it never ran and the queue stayed full)."""
    order = []
    sched = Scheduler(step=lambda seqs: None, max_batch=4)

    def prefill(name, units):
        def gen():
            for _ in range(units):
                order.append(name)
                time.sleep(0.005)
                yield
            return FakeSeq(1, name), name
        return gen

    def ingest():
        for _ in range(3):
            order.append("ingest")
            yield
        return "done"

    a = sched.submit_generation(prefill("a", 40), tenant="A", long=True)
    time.sleep(0.05)
    bg = sched.submit_background(ingest, 10, tenant="A")
    assert bg.future.result(timeout=5) == "done"
    run_jobs(sched, [a])
    last = max(i for i, n in enumerate(order) if n == "ingest")
    assert last < max(i for i, n in enumerate(order) if n == "a"), order  # done while A still prefilled


def test_one_tenant_cannot_fill_the_background_queue():
    """Ingestion jobs are bounded per tenant (a quarter of the queue): one tenant's uploads are refused before
    another's are (the 40-minute soak: a fuzzer's accepted ingests made every other tenant's documents a 429)."""
    sched = Scheduler(step=lambda seqs: None, max_queue=64, thread=False)  # no worker: jobs stay queued
    work = lambda: iter(())  # noqa: E731
    for _ in range(sched.max_background_per_tenant):
        sched.submit_background(work, 10, tenant="A")
    with pytest.raises(QueueFull, match="this tenant already has 4"):
        sched.submit_background(work, 10, tenant="A")
    sched.submit_background(work, 10, tenant="B")
    sched.submit_background(work, 10)  # the server's own jobs (no tenant) count only against the whole queue
    for _ in range(sched.max_background):  # idle-only work (never run under load) fills only its own queue
        sched.submit_background(work, 10, idle_only=True)
    with pytest.raises(QueueFull):
        sched.submit_background(work, 10, idle_only=True)
    sched.submit_background(work, 10, tenant="C")


@pytest.mark.parametrize("mode", ["full", "prefix", "reuse", "ape"])
def test_prefill_in_units_equals_prefill_at_once(mode, tiny_engine):
    eng = tiny_engine("llama")
    segs = make_segs(blocks=(30, 25, 41), query=20)
    fusion = FusionOptions(mode=mode, prefix_chunk=8)
    ref, _ = eng.prefill(segs, fusion)
    steps = eng.prefill_steps(segs, fusion, chunk=16)
    units = 0
    while True:
        try:
            units += next(steps) is None  # a unit boundary (a Forward is a unit's pass over the model)
        except StopIteration as done:
            state, stats = done.value
            break
    assert (state.logits - ref.logits).abs().max().item() <= 1e-4
    if mode == "full":
        assert units == (segs.num_tokens - 1) // 16  # one pause between consecutive chunks
    assert drain(eng.prefill_steps(segs, fusion, chunk=16))[0].next_position == ref.next_position
    assert isinstance(state.logits, torch.Tensor) and stats.ttft_ms > 0



def gated_prefills(order: list, gate: threading.Event):
    """start(name, units): a prefill of `units` units, each recorded in `order`; the first unit of "a1" waits for
    `gate` (the other requests queue meanwhile)."""
    def start(name, units):
        def gen():
            for _ in range(units):
                order.append(name)
                if name == "a1" and len(order) == 1:
                    gate.wait(5)
                yield
            return FakeSeq(1, name), name
        return gen
    return start


def test_another_tenants_request_prefills_beside_a_long_one_and_a_tenants_own_wait_in_order():
    """Tenant A's prefill of many units (a long `ape` request) does not hold the model until it ends: tenant B's
    request is admitted beside it, their units alternate, and B answers first; A's second request waits for A's
    first (one prefill in flight per tenant)."""
    order = []
    sched = Scheduler(step=lambda seqs: None, max_batch=4)
    gate = threading.Event()
    start = gated_prefills(order, gate)

    a1 = sched.submit_generation(start("a1", 20), tenant="A")
    time.sleep(0.1)
    a2 = sched.submit_generation(start("a2", 2), tenant="A")
    b = sched.submit_generation(start("b", 3), tenant="B")
    gate.set()
    run_jobs(sched, [a1, a2, b])
    assert order.index("b") < 3 and len([n for n in order[:order.index("b") + 6] if n == "b"]) == 3, order
    assert max(i for i, n in enumerate(order) if n == "b") < max(i for i, n in enumerate(order) if n == "a1")
    assert min(i for i, n in enumerate(order) if n == "a2") > max(i for i, n in enumerate(order) if n == "a1")


def test_a_long_prefill_does_not_hold_its_own_tenants_later_requests():
    """A long prefill (`long`: many units, e.g. a hostile `ape` request) keeps its tenant's place only as a normal
    one would not: the tenant's next request is admitted beside it and finishes first; units go round-robin by
    tenant, then by request within the tenant (A's two share A's turns, B keeps its own)."""
    order = []
    sched = Scheduler(step=lambda seqs: None, max_batch=4)
    gate = threading.Event()
    start = gated_prefills(order, gate)

    a1 = sched.submit_generation(start("a1", 30), tenant="A", long=True)
    time.sleep(0.1)
    a2 = sched.submit_generation(start("a2", 3), tenant="A")
    b = sched.submit_generation(start("b", 6), tenant="B")
    gate.set()
    run_jobs(sched, [a1, a2, b])
    last = {n: max(i for i, x in enumerate(order) if x == n) for n in ("a1", "a2", "b")}
    assert last["a2"] < last["a1"] and last["b"] < last["a1"], order
    # while all three are in flight, B has every other unit and A's two requests alternate in A's turns
    window = order[1:13]
    assert window.count("b") == 6 and window.count("a2") == 3 and window.count("a1") == 3, window


def test_waiting_requests_are_taken_round_robin_by_tenant():
    from ragkv.serve.scheduling import Job, TenantQueues

    q = TenantQueues(maxsize=4)
    for name, tenant in (("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B")):
        job = Job(10, start=None, tenant=tenant)
        job.name = name
        q.put_nowait(job)
    with pytest.raises(queue.Full):
        q.put_nowait(Job(10, start=None, tenant="C"))
    assert q.get(block=False, skip={"A"}).name == "b1"
    assert [q.get(block=False).name for _ in range(3)] == ["a1", "a2", "a3"] and q.empty()
    for name, tenant in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("b2", "B")):
        job = Job(10, start=None, tenant=tenant)
        job.name = name
        q.put_nowait(job)
    assert [q.get(block=False).name for _ in range(4)] == ["a1", "b1", "a2", "b2"]


def test_a_prefill_alone_takes_the_steps_whole_budget_a_unit():
    """Scheduler.unit_tokens: the fixed unit while anything else decodes, waits or prefills; the step's whole
    token budget while one prefill is the only work (vLLM's chunked prefill fills its budget alike)."""
    sched = Scheduler(step=lambda seqs: None, max_batch=4, thread=False, max_num_batched_tokens=2048)
    assert sched.unit_tokens(512) == 2048 and sched.unit_tokens(4096) == 4096
    sched.prefilling = [object()]  # itself
    assert sched.unit_tokens(512) == 2048
    sched.prefilling = [object(), object()]  # another prefill in flight
    assert sched.unit_tokens(512) == 512
    sched.prefilling = [object()]
    sched.running = [object()]  # an answer decoding
    assert sched.unit_tokens(512) == 512
    sched.running = []
    sched.submit_generation(lambda: iter(()))  # a request queued (no worker: it stays there)
    assert sched.unit_tokens(512) == 512
