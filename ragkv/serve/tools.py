"""Tool calls as text, for any model: the tool definitions go into the system message and calls come back as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format of Qwen2.5's own chat template
(Hermes-style), written by ragkv itself so that a template without tool support (SmolLM2's) works the same way.
Earlier calls and tool results are rendered as text turns too, so they become blocks like any turn (chat history
as blocks: exact while the conversation only grows).

`tool_choice` "required" or a named function constrains the answer to call blocks (engine/decode/constrained.py grammar,
each call's arguments following its function's JSON schema); "auto" lets the model choose, and the answer is
parsed afterwards."""

from __future__ import annotations

import json
import uuid

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")
MAX_PARALLEL = 4  # calls one constrained answer may hold


def tools_system(system: str | None, tools: list[dict]) -> str:
    """The system message with the tool definitions (OpenAI's `tools` entries, one JSON line each) appended."""
    block = TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER
    return f"{system}\n\n{block}" if system else block


def render_calls(calls: list[dict]) -> str:
    """An assistant turn's calls (OpenAI's `tool_calls`, arguments as a JSON string or an object) as text."""
    out = []
    for c in calls:
        fn = c.get("function", c)
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # kept as the string the client sent
        out.append("<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
                   + "\n</tool_call>")
    return "\n".join(out)


def render_result(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def tag_tokens(tokenizer) -> tuple[str, str]:
    """How the grammar writes the two tags: as the tokenizer's own single tokens where it has them (Qwen2.5:
    `<tool_call>` is one added token, which llguidance matches only by id), else as text."""
    out = []
    for tag in ("<tool_call>", "</tool_call>"):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        out.append(f"<[{ids[0]}]>" if len(ids) == 1 and tokenizer.decode(ids) == tag else json.dumps(tag))
    return out[0], out[1]


def closed(schema):
    """The schema with every object that does not say otherwise closed (`additionalProperties: false`, as OpenAI's
    strict function calling does): with an open object a small model invents arguments until max_tokens (measured:
    SmolLM2 added a "properties" object to get_weather's `city`)."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    return [closed(v) for v in schema] if isinstance(schema, list) else schema


def rebased(schema, at: str):
    """`schema` with its local `$ref`s ("#", "#/$defs/x") pointing where it sits in the call grammar's body (`at`):
    they are read against the whole body, not against the function's parameters."""
    if isinstance(schema, dict):
        return {k: at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebased(v, at)
                for k, v in schema.items()}
    return [rebased(v, at) for v in schema] if isinstance(schema, list) else schema


def call_grammar(tools: list[dict], name: str | None, parallel: bool,
                 tags: tuple[str, str] = ('"<tool_call>"', '"</tool_call>"')) -> str:
    """llguidance's Lark grammar for an answer of call blocks only (`tool_choice` required, or `name` alone), each
    call's arguments following its function's parameters schema; `tags` from `tag_tokens`."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    where = ["#/properties/arguments"] if len(fns) == 1 else [f"#/anyOf/{i}/properties/arguments" for i in range(len(fns))]
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": rebased(
                    closed(f.get("parameters") or {"type": "object"}), at)},
                "required": ["name", "arguments"], "additionalProperties": False} for f, at in zip(fns, where)]
    body = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    # one line, spaced as render_calls (and Qwen2.5's template) writes a call: the next turn then sends back the very
    # tokens decoded, and finds them in the prefix cache (Engine.start_steps keeps a chat answer's KV)
    body["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    # parallel: up to one call per function offered (at most MAX_PARALLEL): a small model otherwise repeats its
    # call until max_tokens
    most = min(len(fns), MAX_PARALLEL) if parallel else 1
    starts = " | ".join(" ".join(["call"] * k) for k in range(1, most + 1))
    return (f'start: {starts}\ncall: {tags[0]} "\\n" body "\\n" {tags[1]} "\\n"?\n'
            f"body: %json {json.dumps(body)}\n")


class ToolCallError(Exception):
    """A `tool_choice` required or named answer that holds no parsable call: the server's failure, not text."""


DECODER = json.JSONDecoder()
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _tagged_calls(text: str) -> list[tuple[int, int, object]]:
    """Each `<tool_call>` block as (start, end, the JSON value after the tag). The value is read by a JSON decoder,
    so a `</tool_call>` inside one of its strings is text; the closing tag is looked for after it (or the end of the
    answer: a model may stop right after the object). A block that does not parse is skipped (it stays text)."""
    out, at = [], 0
    while (start := text.find(OPEN, at)) >= 0:
        at = start + len(OPEN)
        body = len(text) - len(text[at:].lstrip())
        try:
            value, end = DECODER.raw_decode(text, body)
        except ValueError:
            continue
        rest = len(text) - len(text[end:].lstrip())
        if text.startswith(CLOSE, rest):
            end = rest + len(CLOSE)
        elif rest < len(text):
            continue  # something else follows the object: not a call block
        out.append((start, end, value))
        at = end
    return out


def _bare_calls(text: str, names: set[str]) -> list[tuple[int, int, object]]:
    """A whole answer of bare JSON calls, one per line, each naming an offered function (small models drop the
    tags: Qwen2.5-Coder-0.5B answers `{"name": "get_weather", "arguments": {...}}`), as `_tagged_calls` gives them;
    else none."""
    out, at = [], 0
    for line in text.splitlines(keepends=True):
        start, at = at, at + len(line)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return []
        if not isinstance(obj, dict) or obj.get("name") not in names or "arguments" not in obj:
            return []
        out.append((start, at, obj))
    return out


def parse_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict]]:
    """(the text outside the call blocks, or None when empty; OpenAI `tool_calls` entries). A block that is not a
    JSON object with a name stays in the text. With `names` (the functions offered), an answer made only of bare
    JSON calls to them counts as calls too."""
    calls, kept, last, seen = [], [], 0, set()
    found = _tagged_calls(text)
    if not found and names:
        found = _bare_calls(text, names)
    for start, end, obj in found:
        try:
            name, args = obj["name"], obj.get("arguments", {})
        except (KeyError, TypeError, AttributeError):
            continue
        if not isinstance(name, str):
            continue
        kept.append(text[last:start])
        last = end
        same = json.dumps([name, args], sort_keys=True)
        if same in seen:  # a repeated call (small models repeat themselves) is one call
            continue
        seen.add(same)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str) else
                                   json.dumps(args, ensure_ascii=False)}})
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls
