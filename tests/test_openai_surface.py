"""The OpenAI surface as vLLM serves it, each feature through the official `openai` client against
one real `ragkv serve` on 127.0.0.1 (default model, fp32, CPU): log-probabilities (chat and legacy formats, streamed
too), top_k / min_p / penalties, n choices, response_format, top-level documents, cache_salt, embeddings,
tokenize / detokenize and served model names."""

import base64
import math

import httpx
import numpy as np
import pytest

from ragkv.bench.serve import ServerProcess
from tiny import default_model_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]
openai = pytest.importorskip("openai")

MAX_BATCH = 4
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --timeout: the first request waits behind the start-up profile, slow on a busy machine
    extra = ("--served-model-name", "smollm2", "--served-model-name", "gpt-3.5-turbo", "--max-batch", str(MAX_BATCH),
             "--timeout", "1200")
    with ServerProcess(dtype="float32", device="cpu", store="memory:256MiB", startup_s=300,
                       cache_dir=tmp_path_factory.mktemp("openai-surface"), extra=extra) as s:
        s.client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=1200)
        yield s


def chat(server, **kw):
    kw.setdefault("max_tokens", 6)
    return server.client.chat.completions.create(model="smollm2", messages=kw.pop("messages", CHAT), **kw)


def test_chat_logprobs_are_the_models_distribution_and_stream_the_same(server):
    r = chat(server, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # greedy: the chosen token is the most likely one, and its log-probability the top one
        assert t.token == t.top_logprobs[0].token and t.logprob == pytest.approx(tops[0], abs=1e-5)
        assert 0.0 < sum(math.exp(lp) for lp in tops) <= 1.0 + 1e-4
        assert t.bytes == list(t.token.encode("utf-8"))
    streamed = [t for c in chat(server, logprobs=True, top_logprobs=5, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    assert chat(server, logprobs=True).choices[0].logprobs.content[0].top_logprobs == []
    assert chat(server).choices[0].logprobs is None


def test_completions_legacy_logprobs_with_offsets_streamed_too(server):
    kw = dict(model="smollm2", prompt="The capital of France is", max_tokens=5, logprobs=3)
    r = server.client.completions.create(**kw)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy
    chunks = [c.choices[0].logprobs for c in server.client.completions.create(stream=True, **kw)
              if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == lp.tokens
    assert [o for c in chunks for o in c.text_offset] == lp.text_offset


def test_top_k_one_and_min_p_one_are_greedy_and_seeds_repeat(server):
    greedy = chat(server, max_tokens=8).choices[0].message.content
    assert chat(server, max_tokens=8, temperature=1.0, seed=3, extra_body={"top_k": 1}).choices[0].message.content \
        == greedy
    assert chat(server, max_tokens=8, temperature=1.5, seed=4, extra_body={"min_p": 1.0}).choices[0].message.content \
        == greedy
    sampled = [chat(server, max_tokens=8, temperature=1.0, seed=7, extra_body={"top_k": 40, "min_p": 0.02})
               .choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_penalties_change_a_repetitive_answer(server):
    def complete(**extra):
        return server.client.completions.create(model="smollm2", prompt="one one one one one one one one",
                                                max_tokens=8, extra_body=extra).choices[0].text
    plain = complete()
    assert complete(repetition_penalty=3.0) != plain
    assert complete(frequency_penalty=2.0) != plain
    assert complete(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0) == plain


def test_n_choices_share_one_prefill(server):
    r = chat(server, n=3, logprobs=True)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.message.content for c in r.choices}) == 1
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices) >= 3
    seeded = [c.message.content for c in chat(server, n=3, temperature=1.0, seed=11).choices]
    assert len(set(seeded)) > 1  # seed + i per choice
    streamed = {0: "", 1: "", 2: ""}
    for c in chat(server, n=3, temperature=1.0, seed=11, stream=True):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[i] for i in range(3)] == seeded  # the same seed repeats the same choices, streamed too


def test_response_format_json_schema_streamed_or_not_and_a_bad_schema_is_a_400(server):
    """Constrained decoding through the official client: the reply parses and follows the schema, streamed the same;
    an unusable schema or a missing one is a 400 naming the field."""
    import json

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    r = chat(server, response_format=fmt, max_tokens=40)
    value = json.loads(r.choices[0].message.content)
    assert value["color"] in ("red", "green", "blue") and 1 <= value["count"] <= 9
    assert set(value) == set(schema["properties"])
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(server, response_format=fmt, max_tokens=40,
                                                                         stream=True) if c.choices)
    assert streamed == r.choices[0].message.content
    assert isinstance(json.loads(chat(server, response_format={"type": "json_object"}, max_tokens=60)
                                 .choices[0].message.content), dict)
    assert chat(server, response_format={"type": "text"}).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema" and "bogus" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, response_format={"type": "json_schema"})
    assert e.value.body["param"] == "response_format.json_schema"


def test_cache_salt_isolates_the_cache_and_cached_tokens_count_hits(server):
    """Plain chats use the prefix cache (32-token chunks), whose hits are exactly `cached_tokens`."""
    question = [{"role": "user", "content": "Describe a lighthouse on a rocky coast in one short sentence."}]

    def cached(salt):
        return chat(server, messages=question, max_tokens=1, extra_body={"cache_salt": salt}) \
            .usage.prompt_tokens_details.cached_tokens

    assert cached("salt-A") == 0     # a salt's namespace starts empty
    assert cached("salt-A") >= 32    # the same salt shares its chunks
    assert cached("salt-B") == 0     # another salt never sees them
    assert cached("salt-A") >= 32


def test_top_level_documents_with_cache_salt(server):
    docs = [{"title": "Quillmere", "text": "Quillmere Lighthouse was painted green in 1911 by Odile Farrant."}]
    question = [{"role": "user", "content": "Who painted Quillmere Lighthouse?"}]

    def block_hits(salt=None):
        body = {"documents": docs, **({"cache_salt": salt} if salt else {})}
        r = chat(server, messages=question, max_tokens=2, extra_body=body)
        assert r.model_extra["ragkv"]["sources"] == [{"title": "Quillmere", "source": "inline"}]
        stats = r.model_extra["ragkv"]["stats"]
        return stats["cache_hits"], stats["cache_misses"]

    assert block_hits("salt-A") == (0, 2)   # system prompt and document: both encoded now
    assert block_hits("salt-A") == (2, 0)
    assert block_hits("salt-B") == (0, 2)
    assert block_hits() == (0, 2)
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, messages=question, extra_body={"documents": docs, "ragkv": {"documents": docs}})
    assert e.value.body["param"] == "documents"


def test_embeddings(server):
    texts = ["The cat sat on the mat.", "The cat sat on the mat.", "Stock markets fell sharply today."]
    r = server.client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the client asks for base64
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, 384) and [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens > 0
    assert np.array_equal(vecs[0], vecs[1]) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert vecs[0] @ vecs[2] < 0.5
    raw = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "float"},
                     timeout=1200).json()
    assert raw["data"][0]["embedding"] == pytest.approx(vecs[0].tolist(), abs=1e-5)  # alone vs padded in a batch
    b64 = httpx.post(server.url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "base64"},
                     timeout=1200).json()["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), dtype="<f4"),
                          np.array(raw["data"][0]["embedding"], dtype=np.float32))
    with pytest.raises(openai.NotFoundError):
        server.client.embeddings.create(model="text-embedding-ada-002", input="x")
    with pytest.raises(openai.BadRequestError) as e:
        server.client.embeddings.create(model="all-MiniLM-L6-v2", input=[[101, 2023]])
    assert e.value.body["param"] == "input"


def test_tokenize_detokenize_round_trip(server):
    text = "Lintwick Tower was built in 1893."
    t = httpx.post(server.url + "/tokenize", json={"model": "smollm2", "prompt": text,
                                                   "return_token_strs": True}, timeout=60).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) > 0 and t["max_model_len"] == 8192
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}, timeout=60).json()["prompt"] == text
    # chat messages count exactly the prompt tokens a chat completion reports
    counted = httpx.post(server.url + "/tokenize", json={"messages": CHAT}, timeout=60).json()["count"]
    assert counted == chat(server, max_tokens=1).usage.prompt_tokens
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_served_model_names(server):
    assert [m.id for m in server.client.models.list()] == ["smollm2", "gpt-3.5-turbo"]
    r = server.client.chat.completions.create(model="gpt-3.5-turbo", messages=CHAT, max_tokens=2)
    assert r.choices[0].message.content and r.model == "smollm2"
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4", messages=CHAT, max_tokens=2)
    assert e.value.body["param"] == "model"


def test_min_tokens_makes_an_answer_that_long(server):
    r = chat(server, max_tokens=12, extra_body={"min_tokens": 12})
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert chat(server, max_tokens=40).usage.completion_tokens < 40  # free, it ends on its own


@pytest.mark.parametrize("path,body,field", [
    ("/v1/chat/completions", {"top_k": -5}, "top_k"),
    ("/v1/chat/completions", {"min_p": 2}, "min_p"),
    ("/v1/chat/completions", {"min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"n": MAX_BATCH + 1}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
])
def test_bad_values_are_400s_naming_the_field(server, path, body, field):
    if path == "/v1/chat/completions":
        body = {"model": "smollm2", "messages": CHAT, "max_tokens": 1, **body}
    r = httpx.post(server.url + path, json=body, timeout=1200)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in f"{err['param']} {err['message']}", err


def test_tool_calls_through_the_official_client_and_an_agents_next_step_reuses_its_prompt(server):
    """`tools` with tool_choice required: message.tool_calls (arguments a JSON string following the schema) and
    finish_reason "tool_calls", streamed as OpenAI's tool_calls deltas; the agent's next step (the call and the
    tool's result appended) finds most of its prompt cached."""
    import json

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False}}}
    question = [{"role": "user", "content": "What is the weather in Paris today?"}]
    r = chat(server, messages=question, tools=[weather], tool_choice="required", max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert set(json.loads(call.function.arguments)) == {"city"}
    streamed = [c for c in chat(server, messages=question, tools=[weather], tool_choice="required", max_tokens=60,
                                stream=True) if c.choices]
    deltas = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather" and streamed[-1].choices[0].finish_reason == "tool_calls"
    step2 = question + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny."}]
    r2 = chat(server, messages=step2, tools=[weather], max_tokens=20)
    cached, prompt = r2.usage.prompt_tokens_details.cached_tokens, r2.usage.prompt_tokens
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the tools and the question, from the first step (measured: 192 of 256; the call and the result are new)
    assert cached >= 0.5 * prompt, (cached, prompt)
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, messages=question, tools=[weather], tool_choice={"type": "function", "function": {"name": "x"}})
    assert e.value.body["param"] == "tool_choice"


def test_the_agent_example_reuses_each_steps_prompt_and_its_own_calls(server):
    """examples/agent_loop.py as a user runs it: every step after the first finds the earlier steps in the cache,
    the model's own calls included (a chat answer computed exactly leaves its KV for the next turn). Before that,
    steps 2-3 of LangChain's loop cached 65% and 73% of their prompts."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "examples/agent_loop.py", "--base-url", server.url + "/v1", "--model",
                          "smollm2", "--steps", "3", "--json", "--question",
                          "How long is the bridge in total, and when was it finished?"],
                         capture_output=True, text=True, timeout=600, check=True)
    steps = json.loads(out.stdout)
    assert len(steps) == 4 and all(s["calls"] for s in steps[:3]), steps  # three calls, then an answer
    shares = [s["cached_tokens"] / s["prompt_tokens"] for s in steps[1:]]
    print("agent example, cached of prompt tokens:", [(s["cached_tokens"], s["prompt_tokens"]) for s in steps])
    # each later prompt is the last one plus a call and a result: the call is found where the decoded tokens are
    # those the template writes back (a constrained answer may spell a name in other pieces, "s" + "earch": the
    # next step's cache then stops there). Measured: 352/403, 448/502, 544/601 (87%, 89%, 91%)
    assert min(shares) >= 0.75 and sum(shares) / len(shares) >= 0.8, steps
