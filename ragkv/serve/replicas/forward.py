"""One HTTP request answered by an ASGI app in this process, as a stream: the response's start (status, headers),
then its body's chunks. A replica answers what the ingress forwards through the very app `ragkv serve` runs, so
keys, tenants, limits and errors are the single server's."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

DISCONNECT_GRACE_S = 5.0  # how long an app may take to end an answer its caller left


async def call_asgi(app, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                    client: tuple[str, int] | None = None, extra_headers: list[tuple[bytes, bytes]] = ()
                    ) -> AsyncIterator[tuple[int, list[tuple[bytes, bytes]]] | bytes]:
    """Yields (status, headers) once, then body chunks. Closing the iterator early tells the app the client left
    (an `http.disconnect`), as a closed connection would."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": list(headers), "client": client, "server": ("ragkv-replica", 0)}
    out: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()  # the app asks again only to learn of a disconnect: answer when the caller goes
        return {"type": "http.disconnect"}

    async def send(message):
        await out.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)  # the app is done (or failed): no more messages

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield message["status"], list(message.get("headers", [])) + list(extra_headers)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        await task  # the app's own failure, if any, surfaces here
    finally:
        left.set()  # the caller left (or read everything): the app hears a disconnect and ends its answer itself
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
            except BaseException:  # it did not end in time (or this task is being cancelled): stop it
                task.cancel()
