"""Chat history as blocks (engine/blocks/history.py): an unedited conversation is exact, an edited one fuses the stored
turns behind the edit, and every selection keeps its invariants there (r=1 equals full, r=0 equals reuse)."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from tiny import default_model_available, rand_ids

from ragkv.engine.blocks.history import MIN_FUSED_TOKENS, exact_turns
from ragkv.engine.kv.stepwise import drain
from ragkv.engine.options import FusionOptions
from ragkv.engine.request.segments import Segments, chat_segments, history_segments

TOL = 1e-4


def chat(turn_lens=(30, 41, 28, 57, 63, 45), seed=0) -> Segments:
    return Segments(rand_ids(9, seed), [rand_ids(n, seed + 10 + i) for i, n in enumerate(turn_lens)],
                    rand_ids(7, seed + 99), history=True)


def first_logits(engine, segs, **kw):
    state, stats = engine.prefill(segs, FusionOptions(**kw))
    return state.logits.float(), stats


def test_exact_turns_follow_the_prefix_cache_then_misses_then_stop_at_a_run_worth_fusing():
    segs = Segments([1] * 10, [[2] * 50, [3] * 60, [4] * 70, [5] * 80], [6])
    assert exact_turns(segs, covered=0, stored=[False] * 4) == 4  # nothing stored: all exact (prefix's path)
    assert exact_turns(segs, covered=0, stored=[True] * 4) == 0  # all stored, 260 tokens: fused
    assert exact_turns(segs, covered=70, stored=[True] * 4) == 2  # the cache reaches into turn 1
    assert exact_turns(segs, covered=0, stored=[False, True, True, True]) == 1  # an edited first turn
    # a stored run shorter than MIN_FUSED_TOKENS (turn 1 alone) is prefilled: a later miss keeps the prefix exact
    assert 60 < MIN_FUSED_TOKENS
    assert exact_turns(segs, covered=0, stored=[False, True, False, False]) == 4


def test_an_unedited_conversation_is_exact_and_fills_the_prefix_cache(tiny_engine):
    engine = tiny_engine("llama")
    segs = chat()
    full, _ = first_logits(engine, segs, mode="full")
    # on each conversation the first mode computes the chunks (`full` stores none) and the others read them: exact
    # either way
    fresh = chat(seed=1)
    runs = [first_logits(engine, fresh, mode=mode) for mode in ("reuse", "blend", "auto")]
    runs += [first_logits(engine, segs, mode=mode) for mode in ("reuse", "blend", "auto")]
    refs = [first_logits(engine, fresh, mode="full")[0]] * 3 + [full] * 3
    for (logits, stats), ref in zip(runs, refs):
        assert (logits - ref).abs().max().item() < TOL, stats.mode
        assert stats.fidelity["exact"] is True and stats.extra["history"]["exact"] is True
        assert stats.fidelity["history"]["fused_turns"] == 0
    cached = [stats.cached_tokens for _, stats in runs]
    low, high = 32, segs.num_tokens - 32
    assert [c < low for c in cached] == [True, False, False] * 2 and min(cached[1:3] + cached[4:]) >= high, cached
    assert (refs[0] - full).abs().max().item() > 1e-2  # two conversations, two answers: not vacuous


def test_a_chat_reply_is_kept_so_the_next_turn_prefills_only_what_is_new(tiny_engine):
    """An agent's loop: each step sends the last prompt, the model's own answer (a tool call) and a tool result.
    The answer's KV, decoded after an exact prompt, goes to the prefix cache as it ends: the next turn reads
    prompt and answer from it (whole chunks) and stays exact."""
    from tiny import IdText

    from ragkv.engine.request.generation import GenerationOptions

    engine = tiny_engine("llama")
    engine.tokenizer, engine.eos_ids = IdText(), set()
    first = chat(turn_lens=(30, 41), seed=3)
    seq = engine.start(first, FusionOptions(mode="reuse"), GenerationOptions(max_new_tokens=40, min_tokens=40))
    while not seq.finished:
        list(seq.advance())
        if not seq.finished:
            engine.step([seq])
    reply = seq.out.token_ids
    assert len(reply) == 40 and seq.stats.fidelity["exact"] is True
    nxt = Segments(first.prefix, first.blocks + [first.query, reply], rand_ids(25, 77), history=True)
    logits, stats = first_logits(engine, nxt, mode="reuse")
    kept = (len(first.all_ids()) + len(reply) - 1) // 32 * 32  # the last answer token was never fed: no KV yet
    assert stats.cached_tokens == kept > len(first.all_ids()) // 32 * 32, stats.cached_tokens
    full, _ = first_logits(engine, nxt, mode="full")
    assert (logits - full).abs().max().item() < TOL and stats.fidelity["exact"] is True
    # not vacuous: the answer's tokens matter to the next turn's answer
    other = Segments(first.prefix, first.blocks + [first.query, rand_ids(40, 5)], nxt.query, history=True)
    assert (first_logits(engine, other, mode="full")[0] - full).abs().max().item() > 1e-2


def test_an_edit_fuses_the_stored_turns_behind_it_with_the_mode_invariants(tiny_engine):
    engine = tiny_engine("llama")
    segs = chat()
    # what the server runs in the background after a reply (here none came first: the history is prefilled too)
    assert drain(engine.settle_history_steps(segs)) == {"encoded_turns": 6, "prefilled_tokens": segs.num_tokens}
    edited = Segments(segs.prefix, [rand_ids(25, 500)] + segs.blocks[3:], segs.query, history=True)
    full, _ = first_logits(engine, edited, mode="full")
    reuse, stats = first_logits(engine, edited, mode="reuse")
    h = stats.extra["history"]
    assert h == {**h, "exact": False, "exact_turns": 1, "fused_turns": 3}  # the new summary exact, the rest fused
    assert stats.fidelity["exact"] is False and (reuse - full).abs().max().item() > 1e-2
    assert stats.reused_tokens + stats.recomputed_tokens == edited.num_tokens
    # the fused path equals reuse over the exact start taken as the prefix (its K computed once, not re-rotated)
    exact_ids = edited.prefix + edited.blocks[0]
    ref, _ = first_logits(engine, Segments(exact_ids, edited.blocks[1:], edited.query), mode="reuse")
    assert (reuse - ref).abs().max().item() < TOL
    for select in ("deviation", "query", "sinks"):
        # r=1 recomputes every fused token through the selection itself (sinks: every token is a block's sink)
        sinks = 10 ** 6 if select == "sinks" else 0
        whole, st = first_logits(engine, edited, mode="blend", ratio=1.0, select=select, sink_tokens=sinks)
        assert (whole - full).abs().max().item() < TOL, select
        assert st.fidelity["exact"] is True
        if select != "sinks":
            none, _ = first_logits(engine, edited, mode="blend", ratio=0.0, select=select)
            assert (none - reuse).abs().max().item() < TOL, select
    some, st = first_logits(engine, edited, mode="blend", ratio=0.3, select="query")
    assert 0 < st.recomputed_token_layers < edited.num_tokens * engine.num_layers
    # settling after the fused reply prefills the edited history exactly: the next turn is exact again
    assert drain(engine.settle_history_steps(edited))["prefilled_tokens"] > 0
    follow = Segments(edited.prefix, edited.blocks + [edited.query, rand_ids(20, 600)], rand_ids(6, 601), history=True)
    again, st = first_logits(engine, follow, mode="blend", ratio=0.3, select="query")
    assert st.fidelity["exact"] is True and st.extra["history"]["fused_turns"] == 0
    assert (again - first_logits(engine, follow, mode="full")[0]).abs().max().item() < TOL


def test_a_chat_with_documents_fuses_the_passages_then_turns_exact_and_is_exact_once_settled(tiny_engine):
    """Passages first, then the turns, then the question: the first follow-up fuses the stored passages and computes
    the new turns with the question (the reply equals reuse with the turns as query); once settled, the prefix
    cache reaches through the passages and every later turn is exact."""
    engine = tiny_engine("qwen2")
    passages, turns = [rand_ids(70, 700), rand_ids(80, 701)], [rand_ids(12, 702), rand_ids(20, 703)]
    question = rand_ids(8, 704)
    engine.prefill(Segments(rand_ids(9, 705), passages, rand_ids(6, 706)), FusionOptions(mode="reuse"))  # turn 1
    segs = Segments(rand_ids(9, 705), passages + turns, question, history=True, passages=2)
    got, st = first_logits(engine, segs, mode="reuse")
    h = st.extra["history"]
    assert h == {**h, "turns": 2, "passages": 2, "exact_turns": 2, "fused_turns": 0, "fused_passages": 2,
                 "exact": False}
    ref, _ = first_logits(engine, Segments(segs.prefix, passages, turns[0] + turns[1] + question), mode="reuse")
    assert (got - ref).abs().max().item() < TOL
    drain(engine.settle_history_steps(segs))
    follow = Segments(segs.prefix, passages + turns + [question, rand_ids(15, 707)], rand_ids(9, 708),
                      history=True, passages=2)
    again, st = first_logits(engine, follow, mode="reuse")
    assert st.fidelity["exact"] is True and st.extra["history"]["fused_passages"] == 0
    assert (again - first_logits(engine, follow, mode="full")[0]).abs().max().item() < TOL


class MergingTemplate:
    """A tokenizer whose template merges consecutive tool messages into one turn (as Qwen2.5's does): the cut
    between them is not a rendering boundary, so both share one block."""
    chat_template = "merging"

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=False):
        out, prev = "", None
        for m in msgs:
            if m["role"] == "tool":
                out += ("" if prev == "tool" else "<u>") + f"[{m['content']}]"
            else:
                out += ("</u>" if prev == "tool" else "") + f"<{m['role']}>{m['content']}</>"
            prev = m["role"]
        out += "</u>" if prev == "tool" else ""
        return out + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_history_segments_cut_at_rendering_boundaries_and_share_a_block_where_the_template_merges():
    tok = MergingTemplate()
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
             {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}, {"role": "user", "content": "q"}]
    segs = history_segments(tok, turns, system="S")
    text = lambda ids: "".join(map(chr, ids))  # noqa: E731
    assert text(segs.prefix) == "<system>S</>"
    assert [text(b) for b in segs.blocks] == ["<user>hi</>", "<assistant>yo</>", "<u>[a][b]</u>"]
    assert text(segs.query) == "<user>q</><assistant>"
    assert text(segs.next_turn) == "<user>q</>"  # the block this question becomes in the next request
    assert segs.all_ids() == chat_segments(tok, turns, "S").query


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_history_segments_are_the_chat_prompt_on_the_default_model(default_engine):
    turns = [{"role": "user", "content": "My cat is Tom."}, {"role": "assistant", "content": "Nice cat!"},
             {"role": "tool", "content": '{"weather": "rain"}'}, {"role": "user", "content": "Name my cat."}]
    for system in (None, "Be brief."):
        segs = default_engine.history_segments(turns, system)
        assert segs.history and len(segs.blocks) == 3
        follow = default_engine.history_segments(turns + [{"role": "assistant", "content": "Tom."},
                                                          {"role": "user", "content": "Thanks."}], system)
        assert follow.blocks[3] == segs.next_turn  # encoded after this reply, found by the next request
        assert segs.all_ids() == default_engine.chat_segments(turns, system).query
        if system:
            assert default_engine.tokenizer.decode(segs.prefix).count("Be brief.") == 1
    logits = [first_logits(default_engine, segs, mode=m)[0] for m in ("full", "reuse")]
    assert torch.allclose(logits[0], logits[1], atol=TOL)  # unedited: exact


# -- documents longer than the window (APE section 6.3) ---------------------------------------------------------
def test_ape_answers_a_prompt_longer_than_the_window_where_sequential_modes_are_refused(tiny_engine):
    from ragkv.engine.request.segments import split_blocks
    from ragkv.errors import PromptTooLongError

    engine = tiny_engine("llama")  # 512 positions
    segs = Segments(rand_ids(12, 1), [rand_ids(400, 2 + i) for i in range(3)], rand_ids(9, 3))  # 1,221 tokens
    assert engine.positions_needed(segs, FusionOptions(mode="reuse")) == segs.num_tokens
    assert engine.positions_needed(segs, FusionOptions(mode="ape")) == 12 + 400 + 9
    state, stats = engine.prefill(segs, FusionOptions(mode="ape"))
    assert state.logits.isfinite().all() and stats.prompt_tokens == 1221
    with pytest.raises(PromptTooLongError):
        engine.prefill(segs, FusionOptions(mode="reuse"))
    # one document of 1,500 tokens: cut into pieces that fit beside the prefix, the query and the answer
    long = Segments(segs.prefix, [rand_ids(1500, 7)], segs.query)
    fitted = engine.fit_to_window(long, FusionOptions(mode="ape"), max_new_tokens=16)
    room = 512 - 12 - 9 - 16
    assert [len(b) for b in fitted.blocks] == [room, room, room, 1500 - 3 * room]
    assert fitted.all_ids() == long.all_ids()  # the same tokens, only cut
    assert engine.positions_needed(fitted, FusionOptions(mode="ape")) + 16 <= 512
    assert engine.fit_to_window(long, FusionOptions(mode="reuse"), 16) is long  # sequential: nothing to gain
    assert split_blocks(segs, 1000).blocks == segs.blocks
    engine.prefill(fitted, FusionOptions(mode="ape"))


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_the_server_takes_a_document_longer_than_the_window_with_ape_and_says_why_not_without(default_engine):
    from ragkv.engine.options import FusionOptions as FO
    from ragkv.serve.requests import RequestBuilder
    from ragkv.serve.schemas import ChatRequest, FieldError
    from ragkv.serve.server import Limits

    builder = RequestBuilder(default_engine, {}, Limits(), FO(), 8, library=None)
    words = " ".join(f"word{i}" for i in range(6000))  # ~ 2x smollm2's 8,192 positions
    body = {"messages": [{"role": "user", "content": "What is the last word?"}], "max_tokens": 8,
            "documents": [{"title": "long", "text": words}]}
    p = builder.chat(ChatRequest.model_validate({**body, "ragkv": {"mode": "ape"}}))
    window = default_engine.max_positions
    assert p.segs.num_tokens > 1.5 * window and len(p.segs.blocks) >= 2
    assert default_engine.positions_needed(p.segs, p.fusion) + 8 <= window
    with pytest.raises(FieldError) as e:
        builder.chat(ChatRequest.model_validate({**body, "ragkv": {"mode": "reuse"}}))
    assert e.value.code == "context_length_exceeded" and "mode `ape`" in str(e.value) and str(window) in str(e.value)


def test_chat_bench_repeats_the_edit_turn_from_the_same_cache_state(default_engine, tmp_path):
    """`ragkv bench chat` times each measured turn `repeats` times, the store restored in between: every run of the
    edit turn fuses the same turns and recomputes the same rows (the first run's stores must not help the next)."""
    from ragkv.bench.chat import ChatBenchConfig, run_chat_bench
    cfg = ChatBenchConfig(turns=4, edit_at=4, words=60, paths=("prefix", "blend:sel=sinks,sink=4"),
                          scenarios=("compacted",), repeats=2)
    result = run_chat_bench(default_engine, cfg, tmp_path, say=lambda *_: None)
    turns = result["scenarios"]["compacted"]
    assert "runs_ms" not in turns[0]["paths"]["prefix"] and len(turns[-1]["full_runs_ms"]) == 2
    edit = turns[-1]["paths"]["blend:sel=sinks,sink=4"]
    assert len(edit["runs_ms"]) == 2 and edit["history"]["fused_turns"] >= 1 and edit["kl"] >= 0
    assert (tmp_path / "chat.md").exists() and (tmp_path / "chat.json").exists()


@contextlib.contextmanager
def rows_through_layers(engine):
    """Counts the rows every decoder layer runs (token-layers), whatever path runs them."""
    count, layers = [0], engine.model.layers
    real = [layer.project_qkv for layer in layers]

    def counted(x, real):
        count[0] += x.shape[0] * x.shape[1]
        return real(x)
    for layer, r in zip(layers, real):
        layer.project_qkv = functools.partial(counted, real=r)
    try:
        yield count
    finally:
        for layer, r in zip(layers, real):
            layer.project_qkv = r


def test_a_long_tool_result_is_prefilled_once_and_admitted_at_that_cost(tiny_engine):
    """An agent's step: a short exchange, then a long tool result as the last message. Its prefill runs every row
    once, its admission cost says so (it counted the result three times: a block encoded, a stage 1 and a stage 2),
    and the settling after the reply encodes the new turns without prefilling the history again."""
    engine = tiny_engine("llama")
    L = engine.num_layers
    for seed, mode in enumerate(("blend", "auto", "reuse")):
        result = rand_ids(400, 730 + seed)
        segs = Segments(rand_ids(9, 700 + seed), [rand_ids(20, 710 + seed), rand_ids(15, 720 + seed)],
                        result + [1, 2], history=True, next_turn=result)  # the query: the result and the reply's start
        fusion = FusionOptions(mode=mode)
        assert engine.worst_token_layers(segs, fusion) == segs.num_tokens * L, mode
        with rows_through_layers(engine) as rows:
            _, stats = first_logits(engine, segs, mode=mode)
        assert rows[0] <= 1.1 * segs.num_tokens * L and stats.recomputed_token_layers == rows[0], mode
        with rows_through_layers(engine) as rows:
            settled = drain(engine.settle_history_steps(segs))
        # each turn encoded alone once, for a later edit to fuse; the history itself is not prefilled again
        assert settled == {"encoded_turns": 3, "prefilled_tokens": 0} and rows[0] <= 435 * L, (mode, settled)  # 20 + 15 + 400 rows
    # after an edit the stored turns are fused: the admission cost still bounds what the prefill runs
    turns = [rand_ids(150, 740), rand_ids(140, 741)]
    drain(engine.settle_history_steps(Segments(rand_ids(9, 742), turns, rand_ids(5, 743), history=True)))
    edited = Segments(rand_ids(9, 742), [rand_ids(12, 744)] + turns[1:], rand_ids(300, 745), history=True)
    for select in ("deviation", "query"):
        worst = engine.worst_token_layers(edited, FusionOptions(mode="blend", select=select))
        with rows_through_layers(engine) as rows:
            _, stats = first_logits(engine, edited, mode="blend", select=select)
        assert stats.extra["history"]["fused_turns"] == 1 and rows[0] <= worst, select
