"""What every route shares: its Server, reading and validating a body (each way it can be wrong is a 400 naming
the field), the served model names, and `observed` (the route's answers counted in /metrics, every failure turned
into an OpenAI-style error body)."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import TYPE_CHECKING, Callable

from fastapi import Request
from pydantic import ValidationError

from ragkv.serve.errors import ApiError, to_api_error

if TYPE_CHECKING:
    from ragkv.serve.server import Server


def server_of(request: Request) -> "Server":
    return request.app.state.server


async def read_body(request: Request, limit: int) -> bytes:
    """The body, stopping at the limit (a chunked upload has no Content-Length to check up front)."""
    parts, n = [], 0
    async for part in request.stream():
        n += len(part)
        if n > limit:
            raise ApiError(413, f"the request body exceeds {limit} bytes (--max-body)", code="body_too_large")
        parts.append(part)
    return b"".join(parts)


def _no_constants(name: str):
    raise ApiError(400, f"the request body contains {name}, which is not a JSON number; send a finite number")


MAX_INT_DIGITS = 40  # more than any field takes (a seed is < 2**63: 19 digits); checked before converting


def _bounded_int(text: str) -> int:
    """A JSON integer, refused before conversion when it is longer than any field could take (Python would convert
    a 4,300-digit one for seconds, and refuse a longer one with a ValueError)."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(400, f"the request body contains an integer of {len(text.lstrip('-'))} digits; no field "
                            f"takes more than {MAX_INT_DIGITS}")
    return int(text)


def field_path(loc) -> str:
    """A pydantic error location as the field's path, list positions in brackets: `documents[2].id`. A union's
    member names (`str`, `list[int]`, a model's class name such as `DocumentIn`) are pydantic's, not fields: left out
    (fields are lower case)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or part in ("str", "int", "list", "dict") or part[:1].isupper()):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_body(raw: bytes, schema):
    """A request body -> the schema's model; every way it can be wrong is a 400 naming the field."""
    try:
        data = json.loads(raw, parse_constant=_no_constants, parse_int=_bounded_int)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # an unpaired surrogate (\\ud800) cannot be text
    except ApiError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body contains an unpaired UTF-16 surrogate (like \\ud800); send valid "
                            "Unicode text")
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply")
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(data).__name__}")
    unsupported = schema.unsupported(data) if hasattr(schema, "unsupported") else []
    if unsupported:
        raise ApiError(400, f"unsupported field(s) {', '.join(unsupported)}: this server does not implement them "
                            "yet; leave them out", param=unsupported[0], code="unsupported_field")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        # the deepest error: of a union (a document as text or as an object), the member that got furthest
        first = max(e.errors(), key=lambda err: len(field_path(err.get("loc", ()))))
        where = field_path(first.get("loc", ()))
        raise ApiError(400, f"invalid request: {where}: {first.get('msg')}", param=where or None)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply")


async def parse(request: Request, schema):
    return parse_body(await read_body(request, server_of(request).limits.max_body_bytes), schema)


def check_model(server: "Server", name: str | None) -> None:
    if name and name not in server.accepted_names:
        raise ApiError(404, f"model {name!r} is not served here; this server runs "
                            f"{', '.join(map(repr, server.model_names))}", code="model_not_found", param="model")


def observed(endpoint: str):
    """A route whose answers /metrics counts under `endpoint` (by status); any failure becomes an error body."""
    def wrap(handler):
        @functools.wraps(handler)
        async def route(request: Request, *args, **kwargs):
            metrics = server_of(request).metrics
            try:
                resp = await handler(request, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-style error body
                err = to_api_error(e)
                metrics.observe_request(endpoint, err.status)
                return err.response()
            metrics.observe_request(endpoint, getattr(resp, "status_code", 200))
            return resp
        return route
    return wrap


async def answer_off_loop(request: Request, schema, answer: Callable):
    """A request that does not generate: parsed, then answered on a worker thread (off the event loop)."""
    req = await parse(request, schema)
    return await asyncio.to_thread(answer, req)
