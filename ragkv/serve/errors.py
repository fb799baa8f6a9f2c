"""Failures as HTTP answers: OpenAI's error body (`{"error": {message, type, param, code}}`), and the one place
where domain errors (ragkv.errors, the scheduler's, the library's) become status codes."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from ragkv.engine.scheduler import Cancelled, JobTimeout, QueueFull, ShuttingDown
from ragkv.errors import PromptTooLongError, RagkvError
from ragkv.rag.redis_catalog import LibraryUnavailableError
from ragkv.serve.requests import NamespaceForbidden

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
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), "rate_limit_error", "queue_full", retry_after=QueueFull.retry_after_s)
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), "server_error", "shutting_down", retry_after=1)
    if isinstance(e, Cancelled):
        return ApiError(409, f"the job was cancelled: {e}", code="cancelled")
    if isinstance(e, (JobTimeout, asyncio.TimeoutError, TimeoutError)):
        return ApiError(504, f"request timed out: {e}", "timeout_error", "timeout")
    log.exception("internal error", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


async def api_error_handler(request: Request, e: ApiError) -> JSONResponse:
    """The app's handler for an ApiError a route raises without answering it itself."""
    return e.response()
