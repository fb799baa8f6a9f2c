"""POST /v1/embeddings with the RAG library's sentence encoder (all-MiniLM-L6-v2): OpenAI's request and response."""

from __future__ import annotations

import base64

from ragkv.rag.embedding import MODEL_NAME as EMBEDDING_MODEL
from ragkv.serve.schemas import EmbeddingsRequest, FieldError

EMBEDDING_NAMES = (EMBEDDING_MODEL, EMBEDDING_MODEL.split("/")[-1])


def texts_of(req: EmbeddingsRequest) -> list[str]:
    inp = req.input
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise FieldError("input", "input is empty: send a string or a list of strings")
    if not isinstance(inp[0], str):
        # token ids only mean something to the tokenizer that made them, and clients make them with OpenAI's
        raise FieldError("input", "token arrays are not accepted: the embedding model has its own tokenizer; send "
                                  "strings (LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)")
    return list(inp)


def embed(embedder, req: EmbeddingsRequest) -> dict:
    """Unit vectors (float32) in input order, as numbers or, for encoding_format "base64", little-endian bytes."""
    texts = texts_of(req)
    if req.dimensions is not None and req.dimensions != embedder.dim:
        raise FieldError("dimensions", f"this embedding model gives {embedder.dim} dimensions and cannot shorten "
                                       f"them; leave dimensions out or send {embedder.dim}")
    vectors = embedder.encode(texts)  # [N, dim] float32
    if req.encoding_format == "base64":
        data = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        data = [v.tolist() for v in vectors]
    # word pieces the model read (its tokenizer truncates to its limit); the embedder has no public counter
    tokens = sum(sum(e.attention_mask) for e in embedder._tokenizer.encode_batch(texts))
    return {"object": "list", "model": req.model or EMBEDDING_MODEL,
            "data": [{"object": "embedding", "index": i, "embedding": d} for i, d in enumerate(data)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
