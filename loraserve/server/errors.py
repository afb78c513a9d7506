"""The one place that maps exceptions to the wire: `{"error": {"message", "type", "code"}}`."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraserve.engine.async_engine import EngineDeadError
from loraserve.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterUnavailableError,
    InvalidRequestError,
    PayloadTooLargeError,
    RegistryError,
    UnknownAdapterError,
)


class NotFoundError(Exception):
    """An unknown model name."""


def error_response(status: int, message: str, error_type: str, code: str | int | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": error_type, "code": code if code is not None else status}},
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, error: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(error), "invalid_request_error", error.field)

    @app.exception_handler(UnknownAdapterError)
    @app.exception_handler(AdapterNotFoundError)
    async def unknown_adapter(_: Request, error: Exception) -> JSONResponse:
        return error_response(404, str(error), "not_found_error", "adapter_not_found")

    @app.exception_handler(AdapterError)
    async def bad_adapter(_: Request, error: AdapterError) -> JSONResponse:
        return error_response(422, str(error), "invalid_adapter_error", error.field)

    @app.exception_handler(AdapterExistsError)
    async def adapter_exists(_: Request, error: AdapterExistsError) -> JSONResponse:
        return error_response(409, str(error), "conflict_error", "adapter_exists")

    @app.exception_handler(PayloadTooLargeError)
    async def too_large(_: Request, error: PayloadTooLargeError) -> JSONResponse:
        return error_response(413, str(error), "invalid_request_error", 413)

    @app.exception_handler(AdapterUnavailableError)
    @app.exception_handler(RegistryError)
    async def unavailable(_: Request, error: Exception) -> JSONResponse:
        return error_response(503, str(error), "server_error", "unavailable")

    @app.exception_handler(NotFoundError)
    async def not_found(_: Request, error: NotFoundError) -> JSONResponse:
        return error_response(404, str(error), "not_found_error", "model_not_found")

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return error_response(422, f"{where}: {first['msg']}", "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), "http_error")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError) -> JSONResponse:
        return error_response(503, str(error), "server_error")
