"""Batched decode equals decoding alone: every mode, different lengths, requests joining and leaving mid-batch."""

import pytest
import torch
from tiny import default_model_available, make_segs

from ragkv.engine.kv.state import decode_batch, decode_step
from ragkv.engine.options import FusionOptions, GenerationOptions

MODES = [FusionOptions(mode="full"), FusionOptions(mode="prefix", prefix_chunk=8), FusionOptions(mode="reuse"),
         FusionOptions(mode="ape", ape_temperature=0.8, ape_scale=0.9), FusionOptions(mode="blend", ratio=0.3),
         FusionOptions(mode="reuse", kv_layout="shared"), FusionOptions(mode="blend", ratio=0.3, kv_layout="shared")]
SHAPES = [dict(blocks=(20, 17, 25), query=9), dict(prefix=5, blocks=(11,), query=4),
          dict(blocks=(30, 8), query=12, seed=3), dict(blocks=(14, 22, 9), query=6, seed=4),
          dict(prefix=0, blocks=(40, 12), query=7, seed=5), dict(blocks=(), query=15, seed=6),
          dict(prefix=6, blocks=(18, 21), query=5, seed=7)]
STEPS = [12, 7, 15, 10, 9, 5, 8]   # tokens each request decodes
JOINS = [0, 0, 2, 4, 5, 9, 3]      # batch step at which each request joins


def greedy_alone(eng, segs, fusion, n):
    state, _ = eng.prefill(segs, fusion, n)
    out = []
    for _ in range(n):
        out.append(int(state.logits.argmax()))
        decode_step(eng.model, state, out[-1])
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_greedy_decode_equals_decoding_alone(arch, tiny_engine):
    """A batch mixing full, prefix, reuse, ape and blend requests of different lengths, joining at different
    steps and leaving when done, produces token for token (fp32) what each request produces alone."""
    eng = tiny_engine(arch)
    segs = [make_segs(**shape) for shape in SHAPES]
    alone = [greedy_alone(eng, s, f, n) for s, f, n in zip(segs, MODES, STEPS)]
    outs, _ = staggered(eng, segs)
    assert outs == alone


def staggered(eng, segs, rows=None):
    """Greedy decode of every request, joining at JOINS and leaving after STEPS: the tokens and the logits each
    request saw before each of its tokens."""
    states, outs, seen, running = {}, {i: [] for i in range(len(segs))}, {i: [] for i in range(len(segs))}, []
    for step in range(max(JOINS) + max(STEPS) + 1):
        for i, join in enumerate(JOINS):
            if join == step:
                states[i], _ = eng.prefill(segs[i], MODES[i], STEPS[i])
                running.append(i)
        for i in running:
            seen[i].append(states[i].logits.clone())
            outs[i].append(int(states[i].logits.argmax()))
        if running:
            decode_batch(eng.model, [states[i] for i in running], [outs[i][-1] for i in running], rows)
        running = [i for i in running if len(outs[i]) < STEPS[i]]
    assert not running
    return [outs[i] for i in range(len(segs))], [seen[i] for i in range(len(segs))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fixed_rows_make_each_answer_bitwise_its_own(dtype, tiny_engine, tiny_bf16_engine):
    """Batch invariance (serve --batch-invariant): at a fixed row count every request's logits at every step are
    bitwise those it gets decoded alone at that row count, whatever joins, leaves or shares its blocks beside it
    (seven requests, up to six at once, in groups of 4 rows: padded rows and a split batch both occur)."""
    eng = tiny_engine("llama") if dtype == "float32" else tiny_bf16_engine
    segs = [make_segs(**shape) for shape in SHAPES]
    for seg, fusion, n in zip(segs, MODES, STEPS):   # both passes hit the caches: a prefix hit and a miss run
        eng.prefill(seg, fusion, n)                  # different row counts, bitwise equal on the CPU, not on CUDA
    _, together = staggered(eng, segs, rows=4)
    for i, (seg, fusion, n) in enumerate(zip(segs, MODES, STEPS)):
        state, _ = eng.prefill(seg, fusion, n)
        for step in range(n):
            assert torch.equal(state.logits, together[i][step]), (i, step)
            decode_batch(eng.model, [state], [int(state.logits.argmax())], rows=4)


def test_batched_logits_match_alone_tightly(tiny_engine):
    """Beyond argmax: each row's logits in a batch of four equal its logits alone within 1e-4."""
    eng = tiny_engine("llama")
    segs = [make_segs(**shape) for shape in SHAPES[:4]]
    solo = [eng.prefill(s, f)[0] for s, f in zip(segs, MODES[:4])]
    batch = [eng.prefill(s, f)[0] for s, f in zip(segs, MODES[:4])]
    tokens = [7, 19, 101, 250]
    expected = [decode_step(eng.model, st, t) for st, t in zip(solo, tokens)]
    got = decode_batch(eng.model, batch, tokens)
    for e, g in zip(expected, got):
        assert (e - g).abs().max().item() <= 1e-4



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_one_call_row_write_and_the_torch_path_give_the_same_batch(dtype, tiny_engine, tiny_bf16_engine,
                                                                       monkeypatch):
    """A step's plain sequences write their rows and attend in one kernel call; where that kernel is not the path
    (RAGKV_DECODE_ATTENTION=torch) each row is written from Python and attended by torch: the same tokens, the
    logits within 1e-3 (fp32) / bf16 rounding, and every cache one row longer either way."""
    from ragkv.ops import attention, decode_kernel

    if decode_kernel.kernel() is None:
        pytest.skip("no C++ decode kernel here: the torch path is the only one")
    eng = tiny_engine("llama") if dtype == "float32" else tiny_bf16_engine
    segs = [make_segs(**shape) for shape in SHAPES[:4]]
    runs, calls, one_call = {}, [], attention.append_attention_many_cpu
    monkeypatch.setattr(attention, "append_attention_many_cpu", lambda *a: calls.append(1) or one_call(*a))
    for path in ("kernel", "torch"):
        calls.clear()
        monkeypatch.setenv("RAGKV_DECODE_ATTENTION", path)
        monkeypatch.setattr(attention, "_KERNEL_WINS", {})
        states = [eng.prefill(s, FusionOptions(mode="full"))[0] for s in segs]
        lengths = [st.cache.length for st in states]
        tokens, seen = [7, 19, 101, 250], []
        for _ in range(3):
            logits = decode_batch(eng.model, states, tokens)
            seen.append(logits.float())
            tokens = logits.argmax(-1).tolist()
        assert [st.cache.length for st in states] == [n + 3 for n in lengths]
        assert len(calls) == (3 * eng.model.args.num_layers if path == "kernel" else 0)  # one call a layer
        runs[path] = seen
    tol = 1e-3 if dtype == "float32" else 0.1
    for a, b in zip(runs["kernel"], runs["torch"]):
        assert torch.equal(a.argmax(-1), b.argmax(-1)) and (a - b).abs().max().item() <= tol

@pytest.mark.model
@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_engine_step_batches_real_requests_like_alone(default_engine):
    """Engine.start/step on the real model: three modes decoded together give each one's solo answer."""
    from ragkv.engine.request.segments import Passage

    passages = [Passage("The Eiffel Tower is in Paris. It was finished in 1889.", "Eiffel Tower"),
                Passage("Mount Fuji is the highest mountain in Japan.", "Fuji")]
    reqs = [(default_engine.segments("Where is the Eiffel Tower?", passages), FusionOptions(mode="reuse")),
            (default_engine.segments("What is the highest mountain in Japan?", passages), FusionOptions(mode="full")),
            (default_engine.segments("When was the tower finished?", passages[:1]), FusionOptions(mode="ape"))]
    gen = GenerationOptions(max_new_tokens=12)
    alone = [default_engine.generate(s, f, gen).text for s, f in reqs]
    seqs = [default_engine.start(s, f, gen) for s, f in reqs]
    while not all(s.finished for s in seqs):
        for s in seqs:
            s.advance()
        default_engine.step(seqs)
    assert [s.out.text for s in seqs] == alone
    assert all(s.stats.completion_tokens > 0 for s in seqs)


def test_batch_invariant_server_answers_under_load_as_alone(tmp_path):
    """`serve --batch-invariant` over real HTTP (a tiny random model): six greedy requests of four modes sent at
    once answer, token and logprob for logprob (bitwise), what each answers sent alone; with 4 rows per step and
    16-token prefill units, steps are padded, split, and prefills interleave with decoding."""
    import threading

    import httpx
    from tiny import make_tiny_served

    from ragkv.bench.serve import ServerProcess

    docs = [{"title": "Farm", "text": "The farm in Lintwick keeps forty-two alpacas named after rivers."},
            {"title": "Tower", "text": "Lintwick Tower was built in 1893 from red sandstone by Ada Morrow."}]
    bodies = [{"model": "tiny", "messages": [{"role": "user", "content": f"Question {i}: who built it?" * (1 + i % 3)}],
               "max_tokens": 10 + i, "temperature": 0, "logprobs": True,
               "ragkv": {"mode": mode, "documents": docs[:1 + i % 2]}}
              for i, mode in enumerate(("reuse", "full", "ape", "blend", "prefix", "reuse"))]
    extra = ("--served-model-name", "tiny", "--max-batch", "4", "--prefill-chunk", "16", "--batch-invariant")
    with ServerProcess(model=str(make_tiny_served(tmp_path)), dtype="float32", device="cpu", store="memory:64MiB",
                       startup_s=300, cache_dir=tmp_path, extra=extra) as server:
        def ask(body):
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return [(t["token"], t["logprob"]) for t in r.json()["choices"][0]["logprobs"]["content"]]

        alone = [ask(b) for b in bodies]
        together = [None] * len(bodies)

        def one(i):
            together[i] = ask(bodies[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        [t.start() for t in threads]
        [t.join(timeout=300) for t in threads]
    assert together == alone
