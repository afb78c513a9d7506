"""Request body limits, enforced while the body arrives (a lying or missing Content-Length included)."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.errors import PayloadTooLargeError
from loraserve.server.errors import error_body

UPLOAD_PATH = "/admin/adapters"


def body_limit(method: str, path: str, max_body_bytes: int, max_upload_bytes: int) -> tuple[int, str]:
    """The bytes a request's body may take, and the message refusing more: an upload (POST to UPLOAD_PATH, or new
    weights: PUT to UPLOAD_PATH/name) may send `max_upload_bytes`, every other request `max_body_bytes`."""
    name = path.removeprefix(UPLOAD_PATH + "/")
    is_upload = (method == "POST" and path == UPLOAD_PATH) or (method == "PUT" and name != path and "/" not in name)
    limit = max_upload_bytes if is_upload else max_body_bytes
    return limit, f"{'an adapter upload' if is_upload else 'a request body'} may be at most {limit} bytes"


class BodyLimitMiddleware:
    """Each request's body within `body_limit`."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_upload_bytes: int) -> None:
        self.app = app
        self.max_body_bytes, self.max_upload_bytes = max_body_bytes, max_upload_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, message = body_limit(scope["method"], scope["path"], self.max_body_bytes, self.max_upload_bytes)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _refuse(send, message)
            return
        received = 0
        exceeded = started = False

        async def counting_receive() -> Message:
            nonlocal received, exceeded
            event = await receive()
            if event["type"] == "http.request":
                received += len(event.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise PayloadTooLargeError(message)
            return event

        async def send_unless_exceeded(event: Message) -> None:
            # The app may turn the error it met reading the body into an answer of its own (FastAPI
            # answers 400 "error parsing the body"): once the limit was passed, the answer is 413.
            nonlocal started
            if exceeded:
                if not started:
                    started = True
                    await _refuse(send, message)
                return
            started = started or event["type"] == "http.response.start"
            await send(event)

        try:
            await self.app(scope, counting_receive, send_unless_exceeded)
        except PayloadTooLargeError:
            if started:
                raise
            await _refuse(send, message)


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", "payload_too_large")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
