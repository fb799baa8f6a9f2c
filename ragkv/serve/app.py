"""The app factory: OpenAI-compatible endpoints over the engine, one router per concern (serve/routes/): chat and
completions, documents and ingestion jobs, tokens and embeddings, health and metrics; the playground page. The
Guard checks keys and body sizes first; every model call goes through the Server's scheduler (one worker,
continuous batching, bounded queue)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragkv.serve.errors import (ApiError, api_error_handler, http_error_handler, unexpected_error_handler,
                                validation_error_handler)
from ragkv.serve.guard import OPEN_PATHS, OPEN_PREFIXES, Guard
from ragkv.serve.openapi import publish_bodies
from ragkv.serve.playground import mount_playground
from ragkv.serve.routes import chat, documents, health, tokens
from ragkv.serve.server import Server


def create_app(server: Server, metrics_need_key: bool = False) -> FastAPI:
    app = FastAPI(title="ragkv", version="0.1.0")
    app.state.server = server
    open_paths = OPEN_PATHS + (() if metrics_need_key else ("/metrics",))
    app.add_middleware(Guard, server=server, open_paths=open_paths, open_prefixes=OPEN_PREFIXES)
    # every failure in the API's error body: the routes' own, the router's 404 and 405, anything unexpected
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(Exception, unexpected_error_handler)
    mount_playground(app)
    for routes in (chat, tokens, documents, health):
        app.include_router(routes.router)
    publish_bodies(app)
    server.metrics.watch(server.scheduler.stats, server.engine.store_stats, server.engine.pool_stats)
    return app
