"""The one place that maps exceptions to the wire: `{"error": {"message", "type", "code"}}`.

Routes raise domain errors (loraserve/errors.py); a stream that already started reports the same payload as its last
event. Anything unforeseen is a 500 of the same shape whose `request_id` the log line carries too.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

import loraserve.errors as domain
from loraserve.server.chat_messages import ROLES

logger = logging.getLogger(__name__)

# Most specific first: UnknownAdapterError is an InvalidRequestError.
_WIRE: list[tuple[type[Exception], int, str, str | None]] = [
    (domain.UnknownAdapterError, 404, "not_found_error", "adapter_not_found"),
    (domain.AdapterNotFoundError, 404, "not_found_error", "adapter_not_found"),
    (domain.VersionNotFoundError, 404, "not_found_error", "version_not_found"),
    (domain.ModelNotFoundError, 404, "not_found_error", "model_not_found"),
    (domain.ApiKeyNotFoundError, 404, "not_found_error", "api_key_not_found"),
    (domain.ModelNotAllowedError, 403, "permission_error", "model_not_allowed"),
    (domain.QuotaExceededError, 429, "rate_limit_error", None),  # code: the quota (requests_per_minute...)
    (domain.InvalidRequestError, 400, "invalid_request_error", None),  # code: the field
    (domain.AdapterError, 422, "invalid_adapter_error", None),  # code: the field or file
    (domain.AdapterExistsError, 409, "conflict_error", "adapter_exists"),
    (domain.AdapterRetiringError, 409, "conflict_error", "adapter_retiring"),
    (domain.TenantWeightError, 409, "conflict_error", "weight"),
    (domain.PayloadTooLargeError, 413, "invalid_request_error", "payload_too_large"),
    (domain.AdapterUnavailableError, 503, "server_error", "unavailable"),
    (domain.RegistryError, 503, "server_error", "registry_unavailable"),
    (domain.EngineDeadError, 503, "server_error", "engine_stopped"),
    (domain.ReplicaFailedError, 503, "server_error", "replica_failed"),
    (domain.QuotaUnavailableError, 503, "server_error", "quota_unavailable"),
    (domain.RequestFailedError, 500, "server_error", "request_failed"),
    (domain.OverloadedError, 503, "server_error", "overloaded"),
    (domain.RequestTimeoutError, 504, "server_error", "timeout"),
    (domain.ClientGoneError, 499, "invalid_request_error", "client_closed_request"),
    (domain.InsufficientStorageError, 507, "server_error", "insufficient_storage"),
]


class WireError(BaseModel):
    message: str
    type: str
    code: str | int  # the field at fault, or what went wrong (see _WIRE)
    request_id: str | None = None  # an unforeseen 500's, also in the server log


class ErrorResponse(BaseModel):
    """Every error the server answers, in OpenAI's shape: documented on every route (openapi.json)."""

    error: WireError


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "a field is invalid or not supported (code: the field)"),
        (401, "no or a wrong API key / admin token"),
        (403, "a wrong admin token, or a model this API key may not use"),
        (404, "unknown model, adapter, API key or route"),
        (409, "the adapter name is taken, the adapter is being removed, or the tenant's keys have another weight"),
        (413, "the body or the upload is too large"),
        (422, "the adapter cannot be accepted (code: the field or file)"),
        (429, "the API key's requests or tokens per minute are spent (Retry-After; code: the quota)"),
        (499, "the client closed the connection before its answer (nginx's code; no one reads it)"),
        (500, "computing the request failed, or an unforeseen error (with a request_id)"),
        (503, "adapter, registry, engine or a cluster's replica unavailable, or overloaded (Retry-After)"),
        (504, "the request's own timeout passed before it started"),
        (507, "the disk is full: the upload is not kept"),
    )
}


# Starlette's own refusals: a body it could not parse (too deeply nested JSON...), a route or method unknown.
_HTTP_CODES = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}
_HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE")


def error_response(status: int, message: str, error_type: str, code: str | int) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, error_type, code))


def error_body(message: str, error_type: str, code: str | int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "code": code}}


def domain_error(error: domain.LoraserveError) -> tuple[int, dict[str, Any]]:
    """The status and body of a domain error."""
    for cls, status, error_type, code in _WIRE:
        if isinstance(error, cls):
            field = getattr(error, "field", None)
            return status, error_body(str(error), error_type, code or field or str(status))
    return 500, error_body(str(error), "server_error", "internal_error")


def domain_error_response(error: domain.LoraserveError, **fields: Any) -> JSONResponse:
    """The answer to a domain error, after `fields` of the route's own."""
    status, body = domain_error(error)
    headers = {}
    if isinstance(error, domain.OverloadedError | domain.QuotaExceededError):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after)))  # when to come back (or go elsewhere)
    return JSONResponse(status_code=status, content={**fields, **body}, headers=headers)


def stream_error_event(error: domain.LoraserveError) -> str:
    """A stream's last event when its request fails after the response started (OpenAI's and vLLM's shape)."""
    return f"data: {json.dumps(domain_error(error)[1], ensure_ascii=False)}\n\n"


def field_path(error: dict[str, Any]) -> str:
    """A validation error's location as the client wrote the field (`messages.0.content`): without the "body" it sits
    in, nor the labels pydantic adds for unions: a message's role after its index (`messages.0.tool.content`), a
    branch's type (`prompt.constrained-str`). An unknown key is named as sent, whatever it holds."""
    loc = [part for part in error["loc"] if part != "body"]
    kept = [
        part
        for i, part in enumerate(loc)
        if not (part in ROLES and i > 0 and isinstance(loc[i - 1], int))
        and not (isinstance(part, str) and (part.startswith("constrained-") or "[" in part))
    ]
    if error["type"] == "extra_forbidden" and loc and kept[-1:] != loc[-1:]:
        kept.append(loc[-1])
    return ".".join(str(part) for part in kept)


def allowed_methods(request: Request) -> list[str]:
    """Every method the request's path takes (a 405's Allow, RFC 9110). Starlette's own Allow names only the first
    route that matched the path, while FastAPI makes one route per method: GET and POST /admin/keys are two. Asked of
    the routes with each method in turn, as included routers do not list their routes."""
    routes = request.app.router.routes
    return [
        method
        for method in _HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] == Match.FULL for route in routes)
    ]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(domain.LoraserveError)
    async def known(_: Request, error: domain.LoraserveError) -> JSONResponse:
        return domain_error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            position = first["loc"][-1]
            reason = first.get("ctx", {}).get("error", "JSON decode error")
            return error_response(400, f"the body is not valid JSON: {reason} at character {position}",
                                  "invalid_request_error", "invalid_json")  # fmt: skip
        where = field_path(first)
        problem = "is not supported by loraserve" if first["type"] == "extra_forbidden" else first["msg"]
        return error_response(400, f"{where}: {problem}", "invalid_request_error", where or "body")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(error.status_code, str(error.status_code))
        error_type = "invalid_request_error" if error.status_code < 500 else "server_error"
        response = error_response(error.status_code, str(error.detail), error_type, code)
        response.headers.update(error.headers or {})
        if error.status_code == 405:
            response.headers["Allow"] = ", ".join(allowed_methods(request))
        return response

    @app.exception_handler(Exception)
    async def unforeseen(request: Request, error: Exception) -> JSONResponse:
        request_id = uuid.uuid4().hex
        logger.error("request %s (%s %s) failed", request_id, request.method, request.url.path, exc_info=error)
        message = f"internal error (request id {request_id}; the server log has the details)"
        body = error_body(message, "server_error", "internal_error")
        body["error"]["request_id"] = request_id
        return JSONResponse(status_code=500, content=body)
