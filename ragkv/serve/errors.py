"""Failures as HTTP answers: OpenAI's error body (`{"error": {message, type, param, code}}`), and the one place
where domain errors (ragkv.errors, the scheduler's, the library's) become status codes."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragkv.serve.scheduling import Cancelled, JobTimeout, LongPrefillsBusy, QueueFull, ShuttingDown
from ragkv.serve.budget import TenantOverBudget
from ragkv.errors import PromptTooLongError, RagkvError
from ragkv.rag.redis_catalog import LibraryUnavailableError
from ragkv.serve.requests import NamespaceForbidden
from ragkv.serve.tools import ToolCallError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        if status == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def to_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, PromptTooLongError):
        return ApiError(400, str(e), code="context_length_exceeded")
    if isinstance(e, LibraryUnavailableError):  # the shared library's Redis is down: not the client's fault
        return ApiError(503, str(e), "server_error", "library_unavailable", retry_after=5)
    if isinstance(e, NamespaceForbidden):
        return ApiError(403, str(e), "permission_error", e.code, e.param)
    if isinstance(e, RagkvError):  # FieldError and every other input error: a 400 naming the field
        return ApiError(400, str(e), code=getattr(e, "code", None), param=getattr(e, "param", None))
    if isinstance(e, TenantOverBudget):
        return ApiError(429, str(e), "rate_limit_error", "tenant_budget_exceeded", retry_after=e.retry_after_s)
    if isinstance(e, LongPrefillsBusy):
        return ApiError(429, str(e), "rate_limit_error", "long_prefills_busy", retry_after=e.retry_after_s)
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), "rate_limit_error", "queue_full", retry_after=QueueFull.retry_after_s)
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), "server_error", "shutting_down", retry_after=1)
    if isinstance(e, Cancelled):
        return ApiError(409, f"the job was cancelled: {e}", code="cancelled")
    if isinstance(e, ToolCallError):  # the model's answer, not the request, is at fault
        log.warning("%s", e)
        return ApiError(500, str(e), "server_error", "tool_call_unparsed")
    if isinstance(e, (JobTimeout, asyncio.TimeoutError, TimeoutError)):
        return ApiError(504, f"request timed out: {e}", "timeout_error", "timeout")
    log.exception("internal error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def api_error_handler(request: Request, e: ApiError) -> JSONResponse:
    """The app's handler for an ApiError a route raises without answering it itself."""
    return e.response()


HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def http_error_handler(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """What the router itself answers (no such path: 404, a path without that method: 405), in the API's error
    body like every other failure, keeping the router's headers (405's `Allow`)."""
    if e.status_code == 404 and e.detail == "Not Found":
        message = f"no route {request.method} {request.url.path}; see /docs for the endpoints"
    elif e.status_code == 405:
        allowed = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow")
        message = f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
    else:
        message = str(e.detail)
    err = ApiError(e.status_code, message, "invalid_request_error" if e.status_code < 500 else "server_error",
                   HTTP_CODES.get(e.status_code))
    err.headers.update(e.headers or {})
    return err.response()


async def validation_error_handler(request: Request, e: RequestValidationError) -> JSONResponse:
    """A path or query parameter FastAPI itself refused: a 400 naming it (bodies are parsed by serve/http.py)."""
    first = (e.errors() or [{}])[0]
    where = ".".join(str(x) for x in first.get("loc", ()) if x not in ("path", "query"))
    return ApiError(400, f"invalid request: {where}: {first.get('msg')}", param=where or None).response()


async def unexpected_error_handler(request: Request, e: Exception) -> JSONResponse:
    """Anything a route let escape: a 500 in the API's error body (logged by to_api_error), not plain text."""
    return to_api_error(e).response()
