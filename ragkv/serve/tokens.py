"""vLLM's POST /tokenize and POST /detokenize: the token ids this server would feed the model, and back."""

from __future__ import annotations

from ragkv.serve.schemas import DetokenizeRequest, FieldError, TokenizeRequest


def tokenize(engine, req: TokenizeRequest) -> dict:
    """A prompt as /v1/completions reads it (`add_special_tokens` adds the tokenizer's BOS/EOS, which this server
    does not), or chat messages as /v1/chat/completions renders them without documents."""
    if req.messages is not None:
        system = next((m.text() for m in req.messages if m.role in ("system", "developer")), None)
        turns = [{"role": m.role, "content": m.text()} for m in req.messages if m.role in ("user", "assistant")]
        if not turns:
            raise FieldError("messages", "messages need at least one user or assistant turn")
        ids = engine.chat_segments(turns, system).query
    elif req.add_special_tokens:
        ids = list(engine.tokenizer(req.prompt, add_special_tokens=True)["input_ids"])
    else:
        ids = engine.tokenize(req.prompt)
    out = {"count": len(ids), "max_model_len": engine.max_positions, "tokens": ids, "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(engine, req: DetokenizeRequest) -> dict:
    vocab = len(engine.tokenizer)
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise FieldError("tokens", f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    return {"prompt": engine.tokenizer.decode(req.tokens)}
