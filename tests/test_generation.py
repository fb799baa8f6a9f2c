"""Decoding: stop strings, streaming deltas, EOS, seeded sampling and top-p (default model, short prompts)."""

import pytest
import torch

from ragkv.engine.decode.generate import _held_back, _stop_index
from ragkv.engine.decode.sampling import sample
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.errors import OptionError

FULL = FusionOptions(mode="full")


def test_sampling_rules():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    assert sample(logits) == 1
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    draws1 = [sample(logits, 1.0, 1.0, g1) for _ in range(20)]
    assert draws1 == [sample(logits, 1.0, 1.0, g2) for _ in range(20)] and len(set(draws1)) > 1
    g = torch.Generator().manual_seed(0)
    assert {sample(logits, 1.0, 0.3, g) for _ in range(50)} == {1}  # nucleus keeps only the top token


def test_stop_string_helpers():
    assert _stop_index("abc END def", ("END",)) == 4 and _stop_index("abc", ("END",)) == -1
    assert _held_back("text EN", ("END",)) == 2 and _held_back("text", ("END",)) == 0


@pytest.mark.model
def test_streaming_deltas_equal_the_final_text(default_engine):
    segs = default_engine.chat_segments("Count from one to ten in words.")
    run = default_engine.stream(segs, FULL, GenerationOptions(max_new_tokens=24))
    pieces = [d.text for d in run]
    assert "".join(pieces) == run.generation.text and len(pieces) > 3


@pytest.mark.model
def test_stop_string_cuts_the_output(default_engine):
    segs = default_engine.chat_segments("Count from one to ten in words.")
    free = default_engine.generate(segs, FULL, GenerationOptions(max_new_tokens=24))
    mid = len(free.text) // 2
    stop = free.text[mid:mid + 2]  # a string that really occurs mid-output
    run = default_engine.stream(segs, FULL, GenerationOptions(max_new_tokens=24, stop=(stop,)))
    streamed = "".join(d.text for d in run)
    assert streamed == free.text[: free.text.index(stop)] and run.generation.finish_reason == "stop"


@pytest.mark.model
def test_eos_ends_generation_and_seeded_sampling_repeats(default_engine):
    segs = default_engine.chat_segments("What is 2+2? Answer with a number only.")
    ans = default_engine.generate(segs, FULL, GenerationOptions(max_new_tokens=64))
    assert ans.finish_reason == "stop" and len(ans.token_ids) < 64
    opts = GenerationOptions(max_new_tokens=12, temperature=0.9, seed=3)
    a = default_engine.generate(segs, FULL, opts)
    b = default_engine.generate(segs, FULL, opts)
    assert a.token_ids == b.token_ids


def test_min_tokens_holds_back_every_end_until_reached(tiny_engine):
    """vLLM's min_tokens: no end-of-sequence token (its logit masked) and no stop string before that many tokens."""
    from tiny import IdText, make_segs

    eng = tiny_engine("llama")
    eng.tokenizer = IdText()
    segs = make_segs(blocks=(12,))
    free = eng.generate(segs, FULL, GenerationOptions(max_new_tokens=12))
    end = free.token_ids[2]
    eng.eos_ids = {end}  # the greedy answer's third token now ends it
    cut = eng.generate(segs, FULL, GenerationOptions(max_new_tokens=12))
    k = free.token_ids.index(end)
    assert cut.token_ids == free.token_ids[:k] and cut.finish_reason == "stop"
    held = eng.generate(segs, FULL, GenerationOptions(max_new_tokens=12, min_tokens=6))
    assert len(held.token_ids) >= 6 and end not in held.token_ids[:6] and held.token_ids[:k] == free.token_ids[:k]
    eng.eos_ids = set()
    assert eng.generate(segs, FULL, GenerationOptions(max_new_tokens=12, stop=("<",))).text == ""
    late = eng.generate(segs, FULL, GenerationOptions(max_new_tokens=12, stop=("<",), min_tokens=4))
    assert late.text == IdText().decode(free.token_ids[:4]) and late.finish_reason == "stop"
    with pytest.raises(OptionError, match="min_tokens"):
        GenerationOptions(max_new_tokens=4, min_tokens=5)

