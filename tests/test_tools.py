"""Tool calls: the definitions in the system message and calls as <tool_call> blocks for any model
(serve/tools.py); `tool_choice` required or named constrains the answer to valid calls (their arguments follow
each function's schema); the answer's calls are parsed into OpenAI's `tool_calls`."""

import json

import jsonschema
import pytest
from tiny import default_model_available

from ragkv.engine.decode.constrained import Constraint, lark_grammar
from ragkv.engine.options import FusionOptions
from ragkv.serve.tools import call_grammar, parse_calls, render_calls, tag_tokens, tools_system
from ragkv.serve.schemas import ChatRequest, FieldError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def test_calls_are_parsed_from_tagged_blocks_or_a_bare_answer_and_repeats_count_once():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_calls(text)
    assert content == "Let me check." and len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    bare = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert parse_calls(bare, {"add"})[1][0]["function"]["name"] == "add"
    assert parse_calls(bare, {"get_weather"}) == (bare, [])  # not an offered function: plain text
    assert parse_calls("<tool_call>not json</tool_call>")[1] == []  # malformed: left as text
    assert parse_calls("no calls here") == ("no calls here", [])


def test_the_system_message_and_earlier_calls_are_rendered_as_qwen_does():
    system = tools_system("Be brief.", [WEATHER])
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in system and "<tool_call>" in system
    rendered = render_calls([{"id": "c", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    assert rendered == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_a_named_tool_choice_must_be_a_given_tool_and_needs_tools():
    with pytest.raises(FieldError) as e:
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                                    "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert e.value.param == "tool_choice" and "nope" in str(e.value) and "get_weather" in str(e.value)
    with pytest.raises(FieldError, match="needs `tools`"):
        ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})


@pytest.mark.model
@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_required_or_named_choice_gives_valid_calls_on_the_default_model(default_engine, choice):
    from ragkv.serve.requests import RequestBuilder
    from ragkv.serve.server import Limits

    assert tag_tokens(default_engine.tokenizer) == ('"<tool_call>"', '"</tool_call>"')  # SmolLM2: tags as text
    builder = RequestBuilder(default_engine, {}, Limits(), FusionOptions(), 8, library=None)
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "What is 2 plus 3?"}],
                                      "tools": [WEATHER, ADD], "tool_choice": choice, "max_tokens": 80})
    p = builder.chat(req)
    answer = default_engine.generate(p.segs, p.fusion, p.gen)
    _, calls = parse_calls(answer.text, set(p.tools))
    assert calls and answer.finish_reason == "stop", answer.text
    by_name = {"get_weather": WEATHER, "add": ADD}
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), by_name[c["function"]["name"]]["function"]
                            ["parameters"])
    if isinstance(choice, dict):
        assert {c["function"]["name"] for c in calls} == {"add"}


def _accepts(engine, grammar: str, text: str) -> bool:
    """Whether the call grammar takes `text` whole (fed as the default model's tokens)."""
    c = Constraint(grammar, engine.tokenizer, {engine.tokenizer.eos_token_id})
    for t in engine.tokenizer.encode(text, add_special_tokens=False):
        c.consume(t)
        if c.matcher.is_error():
            return False
    return c.accepting


def _calls(*calls) -> str:
    return render_calls([{"name": n, "arguments": a} for n, a in calls])


@pytest.mark.skipif(not default_model_available(), reason="default model not converted")
def test_the_call_grammar_takes_valid_calls_and_refuses_the_others(default_engine):
    # a function's local $refs point into its own parameters, wherever the grammar's body holds them
    refs = {"type": "function", "function": {"name": "route", "parameters": {
        "type": "object", "$defs": {"stop": {"type": "string", "maxLength": 20}},
        "properties": {"to": {"$ref": "#/$defs/stop"}, "via": {"$ref": "#"}}, "required": ["to"]}}}
    paris, two = ("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})
    cases = [  # tools, named choice, parallel; texts it takes; texts it refuses
        ([WEATHER], None, False, [_calls(paris)],
         [_calls(two), _calls(("get_weather", {})), _calls(paris, paris), "Paris"]),
        ([WEATHER, ADD], None, True, [_calls(paris), _calls(paris, two)],
         [_calls(("add", {"a": "x", "b": 3})), _calls(("add", {"a": 2, "b": 3, "c": 1}))]),
        ([WEATHER, ADD], "add", True, [_calls(two)], [_calls(paris)]),
        ([refs], None, False, [_calls(("route", {"to": "x", "via": {"to": "y"}}))],
         [_calls(("route", {"via": {"to": "y"}})), _calls(("route", {"to": "x" * 21}))]),
    ]
    for tools, name, parallel, good, bad in cases:
        grammar = lark_grammar(call_grammar(tools, name, parallel))
        for text in good:
            assert _accepts(default_engine, grammar, text), (name, text)
        for text in bad:
            assert not _accepts(default_engine, grammar, text), (name, text)


def test_a_call_is_read_by_a_json_decoder_so_the_closing_tag_inside_a_string_is_text():
    call = '{"name": "get_weather", "arguments": {"city": "]</tool_call>x"}}'
    content, calls = parse_calls(f"<tool_call>\n{call}\n</tool_call>\n", {"get_weather"})
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "]</tool_call>x"}]
    # a malformed block stays text and the next one is still read; an object the answer ends on needs no closing tag
    oslo = call.replace("]</tool_call>x", "Oslo")
    content, calls = parse_calls(f"<tool_call>oops</tool_call> then <tool_call>{call}</tool_call><tool_call>{oslo}")
    assert content == "<tool_call>oops</tool_call> then" and len(calls) == 2
    assert parse_calls(f"<tool_call>{call} and more text")[1] == []  # not a block: something follows the object


def test_a_required_call_that_does_not_parse_is_an_error_never_text_with_stop():
    from ragkv.serve.choices import Chunks, TokenText, with_tool_calls
    from ragkv.serve.errors import to_api_error
    from ragkv.serve.tools import ToolCallError

    def choice(text, reason):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": reason}

    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os\n</tool_call>'
    for reason in ("stop", "grammar_error"):
        with pytest.raises(ToolCallError):
            with_tool_calls(choice(broken, reason), ("get_weather",), required=True)
    with pytest.raises(ToolCallError):  # streamed: the same answer is held until done, then refused the same way
        Chunks("id", 0, "m", True, TokenText(None), False).tool_deltas(0, broken, ("get_weather",), "stop", True)
    err = to_api_error(ToolCallError("x"))
    assert err.status == 500 and err.code == "tool_call_unparsed"
    assert with_tool_calls(choice(broken, "length"), ("get_weather",), True)["finish_reason"] == "length"  # cut
    assert with_tool_calls(choice(broken, "stop"), ("get_weather",))["finish_reason"] == "stop"  # auto: text
