"""An agent's loop against `ragkv serve` through the official OpenAI client: each step sends the whole conversation
(the question, the model's earlier tool calls and the tools' results) and the server finds what it computed before
in its cache. Prints, per step, the prompt tokens and how many of them were cached.

    ragkv serve &                                   # the default model, http://127.0.0.1:8000
    python examples/agent_loop.py                   # or: --base-url http://HOST:PORT/v1 --api-key KEY

The tools run here, in the client: `search` looks the question up in a few built-in notes, `add` sums numbers.
The first steps are required to call a tool (`tool_choice: "required"`), the last may only answer (`"none"`)."""

from __future__ import annotations

import argparse
import json

NOTES = {
    "harbour": "The Quillby harbour tide table: high water at 06:12 and 18:40; the ferry leaves 40 minutes after.",
    "orchard": "Quillby Orchard is run by Mara Quill; it grows 14 kinds of apple and opens at 09:00.",
    "bridge": "The Quillby bridge has 3 spans of 42 metres each and was finished in 1893.",
}
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the town's notes for a topic; returns the best matching note.",
        "parameters": {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40}},
                       "required": ["topic"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add a list of numbers.",
        "parameters": {"type": "object", "properties": {
            "numbers": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 8}},
            "required": ["numbers"], "additionalProperties": False}}},
]


def run_tool(name: str, args: dict) -> str:
    if name == "search":
        topic = str(args.get("topic", "")).lower()
        hits = [text for key, text in NOTES.items() if key in topic or topic in key]
        return hits[0] if hits else "No note matches; the topics are: " + ", ".join(NOTES)
    if name == "add":
        return str(sum(float(x) for x in args.get("numbers", [])))
    return f"unknown tool {name!r}"


def agent(client, model: str, question: str, steps: int = 3, max_tokens: int = 120) -> list[dict]:
    """Runs the loop; returns one record per step: prompt and cached tokens, what the model did."""
    messages = [{"role": "user", "content": question}]
    records = []
    for step in range(steps + 1):
        choice = "required" if step < steps else "none"
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False,
                                           max_tokens=max_tokens, temperature=0)
        usage, message = r.usage, r.choices[0].message
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        calls = message.tool_calls or []
        records.append({"step": step + 1, "prompt_tokens": usage.prompt_tokens, "cached_tokens": cached,
                        "calls": [f"{c.function.name}({c.function.arguments})" for c in calls],
                        "answer": message.content})
        if not calls:
            break
        messages.append({"role": "assistant", "content": message.content,
                         "tool_calls": [c.model_dump() for c in calls]})
        for c in calls:
            messages.append({"role": "tool", "tool_call_id": c.id,
                             "content": run_tool(c.function.name, json.loads(c.function.arguments or "{}"))})
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the server's model")
    ap.add_argument("--steps", type=int, default=3, help="steps that must call a tool before the answer")
    ap.add_argument("--question", default="When does the ferry leave in the evening, and who runs the orchard?")
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    args = ap.parse_args(argv)
    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    records = agent(client, model, args.question, args.steps)
    if args.json:
        print(json.dumps(records))
        return
    for r in records:
        share = r["cached_tokens"] / max(1, r["prompt_tokens"])
        did = ", ".join(r["calls"]) or f"answered: {r['answer']!r}"
        print(f"step {r['step']}: {r['cached_tokens']:4d} of {r['prompt_tokens']:4d} prompt tokens cached "
              f"({share:4.0%}); {did}")


if __name__ == "__main__":
    main()
