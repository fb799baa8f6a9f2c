"""LangChain and LlamaIndex (the real packages) against a real `ragkv serve` on 127.0.0.1 (default model, fp32):
documents travel as ragkv blocks, so asking twice over the same documents reads their KV from the cache."""

import asyncio
import subprocess
import sys

import httpx
import pytest

from ragkv.bench.serve import ServerProcess
from tiny import default_model_available

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not default_model_available(), reason="default model not converted")]

LIBRARY = [{"id": "orchard", "title": "Quillby Orchard",
            "text": "Quillby Orchard grows nineteen kinds of pear and is run by Tomas Vell since 1971."},
           {"id": "bridge", "title": "Harnmoor Bridge",
            "text": "Harnmoor Bridge spans the river Osk; it was designed by the engineer Ilse Brand in 1904."}]
MAX_TOKENS = 8


def needs(module: str, extra: str):
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install 'ragkv[{extra}]'")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(dtype="float32", device="cpu", store="memory:512MiB", startup_s=120,
                       cache_dir=tmp_path_factory.mktemp("integrations")) as s:
        r = httpx.post(s.url + "/v1/documents", json={"documents": LIBRARY}, timeout=600)
        assert r.status_code == 200, r.text
        yield s


def test_import_without_the_extra_says_what_to_install():
    for module, extra, blocked in (("langchain", "langchain", "langchain_core"),
                                   ("llamaindex", "llamaindex", "llama_index")):
        code = (f"import sys; sys.modules[{blocked!r}] = None\n"  # None in sys.modules: importing it fails
                f"try:\n    import ragkv.integrations.{module}\nexcept ImportError as e:\n    print(e)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
        assert f"pip install 'ragkv[{extra}]'" in out, out


def test_retrieve_endpoint_refuses_bad_input_naming_the_field(server):
    r = httpx.post(server.url + "/v1/retrieve", json={"query": "pears", "top_k": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
    r = httpx.post(server.url + "/v1/retrieve", json={"top_k": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "query"
    assert httpx.post(server.url + "/v1/retrieve", json={"query": "  "}, timeout=60).status_code == 400


# -- LangChain ----------------------------------------------------------------------------------------------------
def test_langchain_chat_model_second_ask_reads_the_blocks_from_the_cache(server):
    needs("langchain_core", "langchain")
    from langchain_core.documents import Document
    from ragkv.integrations.langchain import ChatRagkv

    docs = [Document("The Velmar lighthouse keeper feeds three grey cats every dawn.", metadata={"title": "Velmar"}),
            Document("Velmar harbour freezes over in February most years.", metadata={"title": "Harbour"})]
    llm = ChatRagkv(base_url=server.url, max_tokens=MAX_TOKENS)
    first = llm.invoke("How many cats does the keeper feed?", documents=docs)
    second = llm.bind(documents=docs).invoke("How many cats does the keeper feed?")
    stats = [m.response_metadata["ragkv"]["stats"] for m in (first, second)]
    # both documents are encoded the first time and read the second (the instruction prefix hits both times)
    assert stats[0]["cache_misses"] == 2 and stats[0]["encode_ms"] > 0
    assert stats[1]["cache_misses"] == 0 and stats[1]["encode_ms"] == 0
    assert stats[1]["cache_hits"] == stats[0]["cache_hits"] + 2
    # cache_read is OpenAI's cached_tokens: the prompt tokens found in the store (the server's default mode for
    # documents recomputes some of them, so it reuses fewer)
    assert second.usage_metadata["input_token_details"]["cache_read"] == stats[1]["cached_tokens"] > 0
    assert stats[1]["cached_tokens"] >= stats[1]["reused_tokens"] > 0
    assert first.content.strip() and second.content.strip()
    assert [s["title"] for s in second.response_metadata["ragkv"]["sources"]] == ["Velmar", "Harbour"]


def test_langchain_retriever_returns_library_chunks_with_metadata(server):
    needs("langchain_core", "langchain")
    from ragkv.integrations.langchain import RagkvRetriever

    docs = RagkvRetriever(base_url=server.url, top_k=1).invoke("Who designed Harnmoor Bridge?")
    assert len(docs) == 1 and "Ilse Brand" in docs[0].page_content
    meta = docs[0].metadata
    assert meta["title"] == "Harnmoor Bridge" and meta["doc_id"] == "bridge" and meta["chunk_id"] == docs[0].id
    assert 0 < meta["score"] <= 1


def test_langchain_retriever_chain_streams_over_precomputed_blocks(server):
    needs("langchain_core", "langchain")
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from ragkv.integrations.langchain import ChatRagkv, RagkvRetriever, create_blocks_chain

    llm = ChatRagkv(base_url=server.url, max_tokens=MAX_TOKENS, mode="reuse")
    chain = ({"context": RagkvRetriever(base_url=server.url, top_k=2), "question": RunnablePassthrough()}
             | create_blocks_chain(llm))
    whole = chain.invoke("Who runs Quillby Orchard?")
    chunks = list(chain.stream("Who runs Quillby Orchard?"))
    streamed = sum(chunks[1:], chunks[0])
    assert len(chunks) > 2 and streamed.content == whole.content and whole.content.strip()
    # the library precomputed each chunk's KV at ingest: even the first ask misses nothing
    assert whole.response_metadata["ragkv"]["stats"]["cache_misses"] == 0
    assert streamed.usage_metadata["input_token_details"]["cache_read"] > 0
    assert {s["title"] for s in streamed.response_metadata["ragkv"]["sources"]} == {d["title"] for d in LIBRARY}
    assert asyncio.run(chain.ainvoke("Who runs Quillby Orchard?")).content == whole.content
    with pytest.raises(ValueError, match="remove {context}"):
        create_blocks_chain(llm, ChatPromptTemplate.from_messages([("human", "{context}\n{question}")]))


def test_langchain_plain_chat_and_a_refusal_naming_the_field(server):
    needs("langchain_core", "langchain")
    from ragkv.integrations.client import RagkvServerError
    from ragkv.integrations.langchain import ChatRagkv

    plain = ChatRagkv(base_url=server.url, max_tokens=4).invoke([("system", "Be brief."), ("human", "Say hello.")])
    assert plain.content.strip() and plain.response_metadata["ragkv"]["sources"] == []
    assert plain.usage_metadata["output_tokens"] > 0
    with pytest.raises(RagkvServerError) as e:
        ChatRagkv(base_url=server.url, max_tokens=MAX_TOKENS, ragkv_options={"ratio": 3.0}).invoke(
            "Hi", documents=["a passage"], mode="blend")
    assert e.value.status == 400 and "ratio" in str(e.value)


# -- LlamaIndex ---------------------------------------------------------------------------------------------------
def test_llamaindex_query_engine_second_ask_reads_the_nodes_from_the_cache(server):
    needs("llama_index.core", "llamaindex")
    from llama_index.core import SummaryIndex
    from llama_index.core.schema import TextNode
    from ragkv.integrations.llamaindex import RagkvLLM, RagkvQueryEngine

    nodes = [TextNode(text="The Dunmere choir rehearses on Thursdays in the old mill.", metadata={"title": "Choir"}),
             TextNode(text="The old mill at Dunmere was converted into a hall in 1988.", metadata={"title": "Mill"})]
    engine = RagkvQueryEngine(retriever=SummaryIndex(nodes).as_retriever(),  # a real retriever: returns every node
                              llm=RagkvLLM(base_url=server.url, max_tokens=MAX_TOKENS))
    first, second = engine.query("When does the choir rehearse?"), engine.query("When does the choir rehearse?")
    stats = [r.metadata["stats"] for r in (first, second)]
    assert stats[0]["cache_misses"] == 2 and stats[1]["cache_misses"] == 0
    assert stats[1]["cache_hits"] == stats[0]["cache_hits"] + 2
    assert stats[0]["encode_ms"] > 0 and stats[1]["encode_ms"] == 0 and second.metadata["usage"]["reused_tokens"] > 0
    assert first.response.strip() and second.response == first.response
    assert [n.node.metadata["title"] for n in second.source_nodes] == ["Choir", "Mill"]


def test_llamaindex_streaming_with_the_library_retriever(server):
    needs("llama_index.core", "llamaindex")
    from llama_index.core.llms import ChatMessage
    from ragkv.integrations.llamaindex import RagkvLibraryRetriever, RagkvLLM, RagkvQueryEngine

    retriever = RagkvLibraryRetriever(base_url=server.url, top_k=1)
    found = retriever.retrieve("Who runs Quillby Orchard?")
    assert found[0].node.metadata["doc_id"] == "orchard" and found[0].score > 0
    llm = RagkvLLM(base_url=server.url, max_tokens=MAX_TOKENS, mode="reuse")
    response = RagkvQueryEngine(retriever=retriever, llm=llm, streaming=True).query("Who runs Quillby Orchard?")
    text = "".join(response.response_gen)
    assert text.strip() and response.metadata["stats"]["cache_misses"] == 0  # precomputed at ingest
    assert response.metadata["usage"]["reused_tokens"] > 0
    chat = llm.chat([ChatMessage(role="user", content="Who runs Quillby Orchard?")], documents=found)
    assert chat.message.content == text and chat.additional_kwargs["stats"]["cache_misses"] == 0


def test_a_langchain_tool_calling_loop_reuses_each_steps_prompt(server):
    """An agent's loop through LangChain: `bind_tools` offers a Python function, the model's call comes back as
    `tool_calls` (required: constrained to a valid call), the tool's result goes back as a ToolMessage, and each
    later step finds the earlier prompt cached (the conversation only grows)."""
    needs("langchain_core", "langchain")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from ragkv.integrations.langchain import ChatRagkv

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"18 C and sunny in {city}."

    llm = ChatRagkv(base_url=server.url, max_tokens=40)
    caller = llm.bind_tools([get_weather], tool_choice="any")
    messages = [HumanMessage("What is the weather in Paris?")]
    cached = []
    for _ in range(2):  # two steps of the loop: call, result, call again
        reply = caller.invoke(messages)
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather", reply
        call = reply.tool_calls[0]
        messages += [reply, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
        cached.append((reply.usage_metadata["input_token_details"]["cache_read"], reply.usage_metadata["input_tokens"]))
    final = llm.bind_tools([get_weather]).invoke(messages)  # auto: free to answer now
    cached.append((final.usage_metadata["input_token_details"]["cache_read"], final.usage_metadata["input_tokens"]))
    print("agent steps, cached of prompt tokens:", cached)
    assert all(read >= 0.5 * total for read, total in cached[1:]), cached  # steps after the first reuse their prompt
