"""One HTTP request, given as plain values, answered by an ASGI app in this process, the answer streamed back.

How a cluster replica serves what the ingress forwards: the replica's own `loraserve serve` app answers, unchanged,
so a cluster speaks exactly the single server's HTTP contract. The first item yielded is the response's start
(`ResponseStart`), the rest its body chunks as the app sends them (an SSE stream stays a stream). Closing the generator
early (the client went away) tells the app the client disconnected, so a stream's request is aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message

APP_EXIT_SECONDS = 5.0  # after a disconnect, how long the app may take to wind the request down


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


async def call_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """The app's answer to `request`: a ResponseStart, then body chunks."""
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},  # spec 2.0: Starlette's streams watch `receive` for the disconnect
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }
    messages: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()  # the response ended or its client left
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    app_task = asyncio.ensure_future(app(scope, receive, messages.put))
    next_message: asyncio.Future[Message] | None = None
    try:
        while True:
            next_message = asyncio.ensure_future(messages.get())
            await asyncio.wait({next_message, app_task}, return_when=asyncio.FIRST_COMPLETED)
            if not next_message.done():  # the app returned (or raised) with its response unfinished
                next_message.cancel()
                app_task.result()
                raise RuntimeError(f"{request.method} {request.path}: the app ended without a complete response")
            message = next_message.result()
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        if next_message is not None:
            next_message.cancel()
        gone.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(app_task), APP_EXIT_SECONDS)
        app_task.cancel()
