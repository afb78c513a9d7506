"""The cluster's ingress: every route of `loraserve serve`, each request forwarded to an engine replica.

A request naming an adapter (`model` on the OpenAI routes, `parameters.adapter_id` on LoRAX's) goes with that name as
Serve's multiplexed model id, so Serve picks a replica that already holds the adapter, else one with room to load it
(replica.py); base-model requests, admin calls and the page go to any replica. The answer streams back unchanged; a
client that leaves cancels the replica's call, which aborts its request. A replica that dies before answering gives a
503, one that dies mid-stream an error event, within seconds. The cluster-wide views (/admin/pool, the holders in
/admin/adapters/{name}, /metrics) come from the replicas' board posts (board.py, views.py).
"""

# No `from __future__ import annotations`: FastAPI must see the routes' `Request` annotations as classes, and Serve's
# ingress rewrites the methods where string annotations no longer resolve.

import json
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from loraserve.cluster.asgi_call import ForwardedRequest, ResponseStart
from loraserve.cluster.board import board
from loraserve.cluster.views import holders, merged_metrics, pool_view
from loraserve.errors import PayloadTooLargeError, ReplicaFailedError
from loraserve.server.app import PROMETHEUS_TEXT
from loraserve.server.auth import check_admin_token
from loraserve.server.body_limit import body_limit
from loraserve.server.errors import domain_error_response, install_error_handlers, stream_error_event

OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
LORAX_ROUTES = ("/generate", "/generate_stream", "/")
# Every method goes to a replica, so that one a path does not take gets the replica's 405 and its exact Allow.
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"]

logger = logging.getLogger(__name__)
app = FastAPI(title="loraserve cluster")
install_error_handlers(app)


def adapter_of(path: str, body: bytes, base_model: str | None) -> str:
    """The adapter an inference request names (`adapter_id` or `model` on the OpenAI routes, `parameters.adapter_id`
    on LoRAX's); "" for the base model, any other route, or a body the replica will refuse with its own 400."""
    if path not in OPENAI_ROUTES + LORAX_ROUTES:
        return ""
    try:
        payload = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    name = payload.get("adapter_id") or payload.get("model")  # vLLM's and LoRAX's extension field first
    if path in LORAX_ROUTES:
        parameters = payload.get("parameters")
        name = parameters.get("adapter_id") if isinstance(parameters, dict) else None
    return name if isinstance(name, str) and name != base_model else ""


async def _rest_of(answer: DeploymentResponseGenerator, start: ResponseStart) -> AsyncIterator[bytes]:
    """The body after `start`; a replica dying mid-stream ends an event stream with an error event."""
    try:
        async for chunk in answer:
            yield chunk
    except Exception as error:
        if not dict(start.headers).get(b"content-type", b"").startswith(b"text/event-stream"):
            raise  # a plain body cannot carry an error: the connection is cut, the client sees it unfinished
        logger.warning("a stream's replica failed: %s", error)
        yield stream_error_event(ReplicaFailedError(f"the replica failed mid-stream: {_what(error)}")).encode()
    finally:
        answer.cancel()  # the client left (or the stream ended): the replica aborts the request


async def _capped_body(request: Request, limit: int, message: str) -> bytes:
    """The body, read no further than `limit` bytes (a lying or missing Content-Length included): 413 past it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(message)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(message)
        chunks.append(chunk)
    return b"".join(chunks)


def _what(error: Exception) -> str:
    """An error's kind and last line: a Ray error's text carries the replica's whole traceback."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


def _with_headers(response: Response, start: ResponseStart) -> Response:
    response.raw_headers = [(name, value) for name, value in start.headers]
    return response


# Serve freezes the class as it decorates it: what its methods call is defined above.
@serve.ingress(app)
class Ingress:
    def __init__(
        self, replicas: DeploymentHandle, admin_token: str, body_limits: tuple[int, int], app_name: str,
        affinity: bool = True,
    ) -> None:  # fmt: skip
        self.replicas = replicas
        self.admin_token = admin_token
        self.body_limits = body_limits  # (max_body_bytes, max_upload_bytes): bodies are read whole here
        self.board = board(app_name)
        self.affinity = affinity  # False: any replica for any request (benchmarks compare the two)
        self.base_model: str | None = None  # the base model's id, as the first replica to post says

    async def snapshots(self) -> list[dict[str, Any]]:
        return await self.board.snapshots.remote()

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return PlainTextResponse(merged_metrics(await self.snapshots()), media_type=PROMETHEUS_TEXT)

    @app.get("/admin/pool")
    async def pool(self, request: Request) -> dict[str, Any]:
        check_admin_token(request, self.admin_token)
        return pool_view(await self.snapshots())

    @app.get("/admin/adapters/{name}")
    async def adapter(self, request: Request, name: str) -> Response:
        response = await self.forward(request)
        if response.status_code != 200:
            return response
        record = json.loads(bytes(response.body))
        record["replicas"] = holders(await self.snapshots(), name)
        return JSONResponse(record)

    @app.api_route("/{path:path}", methods=METHODS, include_in_schema=False)
    async def any_route(self, request: Request) -> Response:
        return await self.forward(request)

    async def forward(self, request: Request) -> Response:
        """The replica's answer to `request`, streamed; a JSON 503 if no replica could answer."""
        body = await _capped_body(request, *body_limit(request.method, request.url.path, *self.body_limits))
        if self.base_model is None:
            self.base_model = next((s["model"] for s in await self.snapshots()), None)
        adapter = adapter_of(request.url.path, body, self.base_model) if self.affinity else ""
        forwarded = ForwardedRequest(
            request.method, request.url.path, request.url.query.encode(), request.headers.raw, body,
            (request.client.host, request.client.port) if request.client else None,
        )  # fmt: skip
        routed = self.replicas.options(multiplexed_model_id=adapter, stream=True)
        answer = cast(DeploymentResponseGenerator, routed.forward.remote(forwarded))
        try:
            start = await answer.__anext__()
            assert isinstance(start, ResponseStart)
            if start.status != 200 or dict(start.headers).get(b"content-type", b"").startswith(b"application/json"):
                content = b"".join([chunk async for chunk in answer])  # small: answer it whole (a JSON body)
                return _with_headers(Response(content, start.status), start)
        except Exception as error:
            answer.cancel()
            logger.warning("%s %s: the replica failed: %s", request.method, request.url.path, error)
            return domain_error_response(ReplicaFailedError(f"the replica failed before answering: {_what(error)}"))
        return _with_headers(StreamingResponse(_rest_of(answer, start), start.status), start)
