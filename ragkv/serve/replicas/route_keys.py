"""The blocks a chat request will use, named as the engine names them (engine/blocks/encode.py `route_id`), computed
from the body with the tokenizer alone: what the ingress hands the router before any replica sees the request.

The segments are built by the functions the server's RequestBuilder uses (serve/requests.py `chat_turns`,
engine/request/segments.py), in the tenant's namespace, so the ids are the replica's own. Inline documents and a chat's
earlier turns are known here; retrieved passages are not (retrieval runs on the replica), and a body the server
would refuse routes without blocks (the replica answers its 4xx)."""

from __future__ import annotations

import json

from ragkv.engine.blocks.encode import block_route_id
from ragkv.engine.request.segments import PromptFormat, build_segments, history_segments
from ragkv.errors import RagkvError
from ragkv.serve.requests import as_passage, chat_turns, request_namespace
from ragkv.serve.schemas import ChatRequest
from ragkv.settings import DEFAULT_TENANT

ROUTED_PATHS = ("/v1/chat/completions",)


class RouteKeys:
    def __init__(self, tokenizer, prompt_format: PromptFormat, keys, default_namespace: str):
        self.tokenizer, self.prompt_format = tokenizer, prompt_format
        self.keys, self.default_namespace = keys, default_namespace

    def of(self, path: str, body: bytes, authorization: str | None) -> list[str]:
        """The route ids of the request's blocks, in prompt order; [] when it has none or is not a chat."""
        if path not in ROUTED_PATHS or not body:
            return []
        try:
            req = ChatRequest.model_validate(json.loads(body))
            tenant = self.keys.tenant_of(authorization) if self.keys else DEFAULT_TENANT
            if tenant is None:
                return []  # a wrong key: the replica answers 401
            namespace = request_namespace(self.keys, req.ragkv, tenant, req.cache_salt, self.default_namespace)
            system, turns, _ = chat_turns(req)
        except (ValueError, RagkvError):  # a malformed body (pydantic's errors are ValueErrors): the replica says why
            return []
        docs, _ = req.inline_documents()
        if docs:
            segs = build_segments(self.tokenizer, turns[-1]["content"], [as_passage(d) for d in docs],
                                  self.prompt_format, system, turns[:-1])
        else:
            segs = history_segments(self.tokenizer, turns, system)
        return [block_route_id(ids, namespace or self.default_namespace) for ids in segs.blocks]
