"""The request bodies in the server's OpenAPI document (/openapi.json). The routes parse their bodies themselves
(serve/http.py `parse`: a 400 naming the field, never FastAPI's 422), so FastAPI cannot see them; this adds each
route's pydantic model as its JSON request body, for clients, and for the property-based fuzzer that checks that no
input yields a 5xx (tests/test_fuzz_api.py)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from ragkv.serve.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, DocumentsRequest,
                                 EmbeddingsRequest, TokenizeRequest)

BODIES = {("/v1/chat/completions", "post"): ChatRequest, ("/v1/completions", "post"): CompletionRequest,
          ("/tokenize", "post"): TokenizeRequest, ("/detokenize", "post"): DetokenizeRequest,
          ("/v1/embeddings", "post"): EmbeddingsRequest, ("/v1/documents", "post"): DocumentsRequest}


def publish_bodies(app: FastAPI) -> None:
    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            shared = doc.setdefault("components", {}).setdefault("schemas", {})
            for (path, method), model in BODIES.items():
                op = doc.get("paths", {}).get(path, {}).get(method)
                if op is None:
                    continue
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
                shared.update(schema.pop("$defs", {}))
                shared[model.__name__] = schema
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
