"""Batched decode equals decoding alone: every mode, different lengths, requests joining and leaving mid-batch."""

import pytest
import torch

from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.engine.state import decode_batch, decode_step

from tiny import default_model_available, make_segs

MODES = [FusionOptions(mode="full"), FusionOptions(mode="prefix", prefix_chunk=8), FusionOptions(mode="reuse"),
         FusionOptions(mode="ape", ape_temperature=0.8, ape_scale=0.9), FusionOptions(mode="blend", ratio=0.3),
         FusionOptions(mode="reuse", kv_layout="shared")]
SHAPES = [dict(blocks=(20, 17, 25), query=9), dict(prefix=5, blocks=(11,), query=4),
          dict(blocks=(30, 8), query=12, seed=3), dict(blocks=(14, 22, 9), query=6, seed=4),
          dict(prefix=0, blocks=(40, 12), query=7, seed=5), dict(blocks=(), query=15, seed=6)]
STEPS = [12, 7, 15, 10, 9, 5]   # tokens each request decodes
JOINS = [0, 0, 2, 4, 5, 9]      # batch step at which each request joins


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

    states, outs, running = {}, {i: [] for i in range(len(segs))}, []
    for step in range(max(JOINS) + max(STEPS) + 1):
        for i, join in enumerate(JOINS):
            if join == step:
                states[i], _ = eng.prefill(segs[i], MODES[i], STEPS[i])
                running.append(i)
        feed = list(running)
        for i in running:
            outs[i].append(int(states[i].logits.argmax()))
        if feed:
            decode_batch(eng.model, [states[i] for i in feed], [outs[i][-1] for i in feed])
        running = [i for i in running if len(outs[i]) < STEPS[i]]
    assert [outs[i] for i in range(len(segs))] == alone
    assert not running


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


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_engine_step_batches_real_requests_like_alone(default_engine):
    """Engine.start/step on the real model: three modes decoded together give each one's solo answer."""
    from ragkv.engine.request import Passage

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
