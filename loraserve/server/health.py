"""/health and /ready: what a supervisor (restart it?) and a load balancer (send it work?) ask."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraserve.errors import EngineDeadError, RegistryUnavailableError
from loraserve.server.errors import domain_error_response
from loraserve.server.state import ServerState, server_state

router = APIRouter()


@router.get("/health", response_model=None)
async def health(request: Request) -> dict[str, str] | JSONResponse:
    """200 while inference works (a registry that is away only degrades it); 503 once the engine has stopped."""
    state = server_state(request)
    if state.engine.error is not None:
        return domain_error_response(_engine_stopped(state), status="stopped", engine="stopped")
    available = state.catalog.calls.is_available
    return {
        "status": "ok" if available else "degraded",
        "engine": "running",
        "registry": "ok" if available else "unavailable",
        "model": state.model_name,
        "auth": state.tenants.auth.value,
        **state.engine.precision,
    }


@router.get("/ready", response_model=None)
async def ready(request: Request) -> dict[str, str] | JSONResponse:
    """200 when every request is taken, admin writes included; 503 while the registry or the engine is away."""
    state = server_state(request)
    if state.engine.error is not None:
        return domain_error_response(_engine_stopped(state))
    if not state.catalog.calls.is_available:
        return domain_error_response(
            RegistryUnavailableError("registry unavailable: admin changes cannot be taken now")
        )
    return {"status": "ready"}


def _engine_stopped(state: ServerState) -> EngineDeadError:
    return EngineDeadError(f"the engine stopped: {state.engine.error!r}")
