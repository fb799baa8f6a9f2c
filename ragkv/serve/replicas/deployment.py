"""The Ray Serve application of `ragkv serve --replicas N`: an `Ingress` behind Ray Serve's HTTP proxy and N
`EngineReplica`s, each a whole single server (its engine, scheduler, KV memory and the app `ragkv serve` runs).

The ingress reads the body, names the request's blocks (route_keys.py) and forwards the request through a handle
whose router (router.py) picks the replica; the replica answers it with its own app (forward.py) and says who it is
in `x-ragkv-replica`. A replica that dies with requests in flight fails only those, with a 503; Ray Serve starts
a new one in its place."""

# no `from __future__ import annotations`: FastAPI reads the route's parameter types at import
import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Callable

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig

from ragkv.net import is_loopback
from ragkv.serve.replicas.forward import call_asgi
from ragkv.serve.replicas.route_keys import RouteKeys
from ragkv.serve.replicas.router import ROUTE_KWARG, BlockAffinityRouter

log = logging.getLogger("ragkv.replicas")
REPLICA_HEADER = "x-ragkv-replica"
HELD_REPORTED = 4096  # block ids a replica reports per poll (its most recently used)
RETRIES, RETRY_PAUSE_S = 2, 0.5  # a request whose replica died before answering goes to another (Ray drops the dead)
HOP_HEADERS = {b"content-length", b"transfer-encoding", b"connection"}  # the proxy frames the body itself


# helpers first: serve.ingress copies the class when it is decorated, with the names defined by then
async def rest_of(stream, sse: bool):
    """The body's chunks; a replica dying mid-answer ends a stream with an error event (its headers are sent)."""
    try:
        async for chunk in stream:
            yield chunk
    except ray.exceptions.RayError as e:
        log.warning("a replica died mid-answer: %s", type(e).__name__)
        if sse:
            yield ("data: " + json.dumps({"error": failure_body(e)["error"]}) + "\n\n").encode()


def keep_replica_grpc_on_loopback() -> None:
    """Ray Serve binds each replica's inter-deployment gRPC server to every interface ("[::]:0", no option for it);
    on a node whose address is loopback (a local `--replicas` Ray), bind it there as Ray binds everything else.
    Called from a replica's constructor: Serve starts that server after it."""
    node = ray.util.get_node_ip_address()
    try:
        from ray.serve._private import replica as serve_replica
        bind = serve_replica.add_port_to_grpc_server
    except (ImportError, AttributeError):  # another Ray: the listening-socket test says what it binds
        log.warning("cannot keep Ray Serve's replica gRPC server on %s: it may listen on every interface", node)
        return
    if not is_loopback(node) or getattr(bind, "on_node", False):
        return

    def on_node(server, address: str):
        if address.startswith("[::]:"):
            address = f"{node}:{address.rsplit(':', 1)[1]}"
        return bind(server, address)
    on_node.on_node = True
    serve_replica.add_port_to_grpc_server = on_node


def failure_body(err: BaseException) -> dict:
    return {"error": {"message": f"the replica answering this request failed ({type(err).__name__}); it is being "
                                 "restarted: retry the request", "type": "service_unavailable", "param": None,
                      "code": "replica_failed"}}


def replica_failed(err: BaseException) -> JSONResponse:
    return JSONResponse(failure_body(err), status_code=503, headers={"retry-after": "1"})


# a stopping replica finishes (or fails) its answers within seconds: `ragkv serve` stops promptly on SIGTERM
@serve.deployment(graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.5)
class EngineReplica:
    """One engine and its scheduler: the single server's whole app, answering forwarded requests."""

    def __init__(self, make_server: Callable, threads: int, metrics_need_key: bool):
        import torch

        from ragkv.engine.kv.kvbudget import freeze_long_lived
        from ragkv.serve.app import create_app

        keep_replica_grpc_on_loopback()
        torch.set_num_threads(threads)
        self.name = serve.get_replica_context().replica_id.unique_id
        self.server = make_server()  # its scheduler runs on its own thread: the actor's loop stays free
        self.app = create_app(self.server, metrics_need_key)
        freeze_long_lived()
        log.info("replica %s ready (%d threads)", self.name, threads)

    def facts(self) -> dict:
        """What the ingress needs to name blocks as this replica does (all replicas serve the same model)."""
        engine = self.server.engine
        return {"model_path": str(engine.model_path), "prompt_format": engine.prompt_format,
                "namespace": engine.namespace, "keys": self.server.keys}

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes, client=None,
                      **routing):
        """The request answered by this replica's app: (status, headers) first, then the body's chunks.
        `routing` (the request's block ids) is for the router; the app names its blocks itself."""
        async for item in call_asgi(self.app, method, path, query, headers, body, client,
                                    [(REPLICA_HEADER.encode(), self.name.encode())]):
            yield item

    def record_routing_stats(self) -> dict:
        """Polled by Ray Serve for the router: the blocks this replica holds in memory."""
        return {"blocks": self.server.engine.held_blocks(HELD_REPORTED)}

    def check_health(self) -> None:
        if not self.server.scheduler.alive():
            raise RuntimeError(f"replica {self.name}: its model thread stopped")

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.scheduler.stop()
            server.engine.flush_store()


api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)  # the replicas' app publishes /openapi.json


@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=5, graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(api)
class Ingress:
    def __init__(self, replicas):
        keep_replica_grpc_on_loopback()
        self.replicas = replicas
        self.route = None  # RouteKeys, on the first request

    async def route_keys(self) -> "RouteKeys":
        if self.route is None:  # on the first request: a replica says how to name blocks as it does
            from ragkv.models.loader import load_tokenizer

            facts = await self.replicas.facts.remote()
            self.route = RouteKeys(load_tokenizer(Path(facts["model_path"])), facts["prompt_format"], facts["keys"],
                                   facts["namespace"])
        return self.route

    @api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    async def forward(self, path: str, request: Request):
        body = await request.body()
        path = "/" + path
        try:
            blocks = (await self.route_keys()).of(path, body, request.headers.get("authorization"))
        except ray.exceptions.RayError as e:
            return replica_failed(e)
        client = tuple(request.client) if request.client else None
        for attempt in range(RETRIES + 1):
            # a replica that fails before its answer starts sent nothing yet: another may answer (each endpoint is
            # safe to repeat: answers are computed, documents keyed by content). One mid-answer cannot be retried.
            stream = self.replicas.options(stream=True).forward.remote(
                request.method, path, request.scope.get("query_string", b""), list(request.scope["headers"]), body,
                client, **{ROUTE_KWARG: blocks})
            try:
                status, headers = await stream.__anext__()
                break
            except (ray.exceptions.RayError, StopAsyncIteration) as e:
                log.warning("a replica failed before answering (attempt %d): %s", attempt + 1, type(e).__name__)
                if attempt == RETRIES:
                    return replica_failed(e)
                await asyncio.sleep(RETRY_PAUSE_S)
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k.lower() not in HOP_HEADERS}
        sse = kept.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(rest_of(stream, sse), status_code=status, headers=kept)


def build_app(make_server: Callable, replicas: int, threads: int, router: str, slack: int, max_ongoing: int,
              metrics_need_key: bool = False):
    """The application: the ingress bound to N engine replicas behind the cache-aware router."""
    routing = RequestRouterConfig(request_router_class=BlockAffinityRouter,
                                  request_router_kwargs={"policy": router, "slack": slack},
                                  request_routing_stats_period_s=float(os.environ.get("RAGKV_ROUTING_STATS_S", 2)))
    engines = EngineReplica.options(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                                    ray_actor_options={"num_cpus": threads},
                                    request_router_config=routing).bind(make_server, threads, metrics_need_key)
    return Ingress.bind(engines)
