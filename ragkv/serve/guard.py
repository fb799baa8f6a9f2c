"""The first thing every request meets: keys (401 before anything is read), then the body size (413 before it is
read); the request's tenant goes into its state. Plain ASGI: Starlette's BaseHTTPMiddleware would hide client
disconnects."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragkv.serve.errors import ApiError
from ragkv.serve.playground import PAGE_PATHS, STATIC_PREFIX
from ragkv.settings import DEFAULT_TENANT

if TYPE_CHECKING:
    from ragkv.serve.server import Server

OPEN_PATHS = ("/health",) + PAGE_PATHS  # the playground page and its files; the API calls it makes need a key
OPEN_PREFIXES = (STATIC_PREFIX,)


class Guard:
    def __init__(self, app, server: "Server", open_paths: tuple[str, ...], open_prefixes: tuple[str, ...] = ()):
        self.app, self.server, self.open_paths, self.open_prefixes = app, server, open_paths, open_prefixes

    def is_open(self, path: str) -> bool:
        return path in self.open_paths or path.startswith(self.open_prefixes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        tenant, keys = DEFAULT_TENANT, self.server.keys
        if keys and not self.is_open(scope.get("path", "")):
            tenant = keys.tenant_of(headers.get("authorization"))
            if tenant is None:
                self.server.metrics.observe_request("auth", 401)
                return await ApiError(401, "a valid API key is required: send `Authorization: Bearer KEY`",
                                      "authentication_error", "invalid_api_key").response()(scope, receive, send)
        limit, size = self.server.limits.max_body_bytes, headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limit):
            return await ApiError(413, f"the request body has {size} bytes; the limit is {limit} (--max-body)",
                                  code="body_too_large").response()(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        return await self.app(scope, receive, send)
