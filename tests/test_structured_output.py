"""Structured output: `response_format` json_object / json_schema by constrained decoding
(engine/decode/constrained.py, llguidance): greedy answers of the default model on a set of JSON schemas are all valid
JSON that the schema accepts; a step with no allowed token ends cleanly; the server takes the OpenAI fields and
answers a bad schema with a 400 naming it."""

import json

import jsonschema
import pytest
from tiny import default_model_available

from ragkv.engine.decode.constrained import Constraint, json_grammar
from ragkv.engine.options import FusionOptions, GenerationOptions
from ragkv.errors import InvalidRequestError

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]

S = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
               "required": ["name", "age"], "additionalProperties": False},
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "number": {"type": "object", "properties": {"price": {"type": "number", "minimum": 0}}, "required": ["price"]},
    "bounded int": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
                    "required": ["n"], "additionalProperties": False},
    "nullable": {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 20}},
                 "required": ["note"]},
    "array of ints": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                              "minItems": 2, "maxItems": 4}},
                      "required": ["xs"], "additionalProperties": False},
    "array of strings": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"}, "name": S},
                 "required": ["id", "name"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "deeply nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer"}}, "required": ["c"]}}, "required": ["b"]}},
        "required": ["a"]},
    "array of objects": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "minItems": 1,
                                                                    "items": {"type": "object", "properties": {
                                                                        "sku": S, "qty": {"type": "integer",
                                                                                          "minimum": 1}},
                                                                        "required": ["sku", "qty"],
                                                                        "additionalProperties": False}}},
                         "required": ["items"]},
    "enum of numbers": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    "const": {"type": "object", "properties": {"version": {"const": "v1"}, "id": {"type": "integer"}},
              "required": ["version", "id"], "additionalProperties": False},
    "optional fields": {"type": "object", "properties": {"title": S, "year": {"type": "integer"}},
                        "required": ["title"], "additionalProperties": False},
    "string pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                       "required": ["code"], "additionalProperties": False},
    "anyOf": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
              "required": ["value"]},
    "two required lists": {"type": "object", "properties": {
        "pros": {"type": "array", "items": S, "maxItems": 2}, "cons": {"type": "array", "items": S, "maxItems": 2}},
        "required": ["pros", "cons"], "additionalProperties": False},
    "top-level integer": {"type": "integer", "minimum": -5, "maximum": 5},
    "top-level enum": {"enum": ["yes", "no"]},
    "boolean map": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"}},
                    "required": ["a", "b"], "additionalProperties": False},
    "matrix": {"type": "array", "minItems": 2, "maxItems": 2,
               "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer"}}},
    "address": {"type": "object", "properties": {"street": S, "city": S, "zip": {"type": "string",
                                                                                 "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "zip"], "additionalProperties": False},
}


def _closed(schema):
    """Every object closed (additionalProperties false, as OpenAI's strict mode requires) and every number bounded:
    an open object or an unbounded integer lets a 135M model go on until max_tokens (measured: 'enum' rambled into
    an address, 'nested' wrote an id of 80 digits). A bound is what a schema author gives such a field anyway."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        if out.get("type") in ("integer", "number"):
            out.setdefault("minimum", -10_000)
            out.setdefault("maximum", 10_000)
        return out
    return [_closed(v) for v in schema] if isinstance(schema, list) else schema


SCHEMAS = {name: _closed(schema) for name, schema in SCHEMAS.items()}


def test_every_greedy_answer_is_valid_json_the_schema_accepts(default_engine):
    invalid = {}
    for name, schema in SCHEMAS.items():
        segs = default_engine.chat_segments(f"Reply with JSON for this: {name}.")
        gen = GenerationOptions(max_new_tokens=120, grammar=json_grammar(schema))
        answer = default_engine.generate(segs, FusionOptions(mode="prefix"), gen)
        try:
            jsonschema.validate(json.loads(answer.text), schema)
            assert answer.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError, AssertionError) as e:
            invalid[name] = (answer.text[:300], answer.finish_reason, str(e)[:200])
    assert not invalid, invalid  # 100% of the set


def test_json_object_mode_gives_an_object_and_free_text_differs(default_engine):
    segs = default_engine.chat_segments("Describe a cat.")
    free = default_engine.generate(segs, FusionOptions(mode="prefix"), GenerationOptions(max_new_tokens=20))
    obj = default_engine.generate(segs, FusionOptions(mode="prefix"),
                                  GenerationOptions(max_new_tokens=80, grammar=json_grammar(None)))
    assert isinstance(json.loads(obj.text), dict) and obj.text != free.text


def test_a_step_no_token_can_take_ends_the_answer_with_grammar_error_not_nans(default_engine):
    segs = default_engine.chat_segments("Reply with JSON.")
    gen = GenerationOptions(max_new_tokens=10, grammar=json_grammar(SCHEMAS["flag"]))
    seq = default_engine.start(segs, FusionOptions(mode="prefix"), gen)
    seq.constraint.matcher.consume_token(seq.tokenizer.encode("zzz", add_special_tokens=False)[0])  # off-grammar
    assert seq.constraint.matcher.is_error()
    seq.advance()
    assert seq.finished and seq.out.finish_reason == "grammar_error" and seq.out.text == ""


def test_an_invalid_schema_is_refused_with_what_is_wrong():
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        json_grammar({"type": "objectx"})


def test_the_mask_keeps_only_what_the_grammar_allows(default_engine):
    import torch

    tok = default_engine.tokenizer
    c = Constraint(json_grammar(SCHEMAS["flag"]), tok, default_engine.eos_ids)
    logits = torch.zeros(default_engine.model.args.vocab_size)
    allowed = c.allow(logits)
    kept = [tok.decode([i]) for i in (allowed > float("-inf")).nonzero().squeeze(1).tolist()]
    assert kept and all(k.lstrip().startswith("{") for k in kept), kept


UNFINISHABLE = {  # schemas whose every value would nest itself without end
    "self": ({"$ref": "#"}, "`#`"),
    "a <-> b": ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
                "`#/$defs/a`, `#/$defs/b`"),
    "requires itself": ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "`#`"),
    "a non-empty array of itself": ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "`#`"),
    "every branch recurses": ({"$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "array", "minItems": 1,
                                                                                   "items": {"$ref": "#/$defs/n"}}]}},
                               "type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]},
                              "`#/$defs/n`"),
}
FINISHABLE = {  # recursion with a way out: served
    "linked list": {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"},
    "tree": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]},
    "optional self": {"type": "object", "properties": {"me": {"$ref": "#"}}},
    "nullable self": {"type": ["object", "null"], "properties": {"me": {"$ref": "#"}}, "required": ["me"]},
}


@pytest.mark.parametrize("name", list(UNFINISHABLE))
def test_a_schema_no_finite_value_follows_is_a_400_naming_it(name):
    from ragkv.serve.schemas import FieldError, ResponseFormat

    schema, where = UNFINISHABLE[name]
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(FieldError) as e:
        fmt.grammar()
    assert e.value.param == "response_format.json_schema.schema" and e.value.code == "invalid_response_format"
    assert "Unsatisfiable schema: no finite JSON value" in str(e.value) and where in str(e.value), str(e.value)


def test_recursive_schemas_with_a_way_out_are_served():
    for schema in FINISHABLE.values():
        assert json_grammar(schema)


def test_a_function_whose_parameters_recurse_without_end_is_refused_naming_it(default_engine):
    from ragkv.serve.requests import RequestBuilder
    from ragkv.serve.schemas import ChatRequest, FieldError
    from ragkv.serve.server import Limits

    loop = {"type": "function", "function": {"name": "loop", "parameters": {
        "type": "object", "properties": {"again": {"$ref": "#"}}, "required": ["again"]}}}
    ok = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    builder = RequestBuilder(default_engine, {}, Limits(), FusionOptions(), 8, library=None)
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": [ok, loop],
                                      "tool_choice": "required"})
    with pytest.raises(FieldError) as e:
        builder.chat(req)
    assert e.value.param == "tools[1].function.parameters" and "no finite JSON value" in str(e.value)


def test_eos_ends_a_constrained_answer_with_stop_only_where_the_grammar_accepts(default_engine):
    """llguidance offers only EOS where its grammar can go nowhere (`{"$ref": "#"}`, compiled here past the check):
    the answer then ends with grammar_error, never "stop" with text that does not parse."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"$ref": "#"}))
    segs = default_engine.chat_segments("Reply with JSON.")
    seq = default_engine.start(segs, FusionOptions(mode="prefix"), GenerationOptions(max_new_tokens=5, grammar=grammar))
    assert not seq.constraint.accepting
    seq.advance()
    assert seq.finished and seq.out.finish_reason == "grammar_error" and seq.out.text == ""
    seq = default_engine.start(segs, FusionOptions(mode="prefix"),
                               GenerationOptions(max_new_tokens=40, grammar=json_grammar(SCHEMAS["flag"])))
    while not seq.finished:
        seq.advance()
    assert seq.out.finish_reason == "stop" and seq.constraint.accepting and json.loads(seq.out.text) in (
        {"ok": True}, {"ok": False})


def test_malformed_schemas_are_refused_with_llguidances_reason_not_a_crash():
    for schema in ({"type": "object", "required": 5}, {"type": "object", "required": [{}]}, {"$ref": 5},
                   {"type": "array", "minItems": "x", "items": {"$ref": "#"}}, {"anyOf": "x"}, {"type": ["object", 3]}):
        with pytest.raises(InvalidRequestError, match="JSON schema cannot be used"):
            json_grammar(schema)
