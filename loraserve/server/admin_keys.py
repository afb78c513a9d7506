"""Admin routes of tenants' API keys: create (the key is in this one answer), list, revoke; and the inference-auth
mode (registry/settings.py): read it, or set it (the one way to open inference again once it was closed).

Listing answers from the server's memory, so it works while the registry is down; creating and revoking keys and
setting the mode are registry writes (503 while it is down).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from loraserve.errors import InvalidRequestError
from loraserve.registry import InferenceAuth, KeySpec
from loraserve.registry.adapter_name import NAME_PATTERN, TENANT_PATTERN, is_valid_name
from loraserve.server.bounds import INTEGRAL
from loraserve.server.responses import KEY_SECRETS, AuthMode, KeyList, KeyRevoked, NewKey, record_json
from loraserve.server.state import ServerState, server_state

router = APIRouter()

MIN_WEIGHT, MAX_WEIGHT = 0.01, 1000.0  # a share 100,000 times another is plenty
MAX_ALLOWED_MODELS = 1000
MAX_KEY_ID = 2**31 - 1  # the id column's range


ModelId = Annotated[str, Field(min_length=1, json_schema_extra={"pattern": NAME_PATTERN})]  # checked: is_valid_name


class KeyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    tenant: str = Field(
        min_length=1,
        max_length=128,
        description="whose key: metrics use the name; a tenant may hold several",
        json_schema_extra={"pattern": TENANT_PATTERN},  # checked by validate_tenant_name, whose message says why
    )
    weight: float = Field(
        1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT, description="the tenant's share of the engine against others"
    )
    # Integers as JSON Schema counts them (bounds.INTEGRAL: 60.0 is one).
    requests_per_minute: Annotated[StrictInt, Field(ge=1, le=10**9), INTEGRAL] | None = None
    tokens_per_minute: Annotated[StrictInt, Field(ge=1, le=10**12), INTEGRAL] | None = Field(
        None, description="prompt and generated tokens"
    )
    allowed_models: list[ModelId] | None = Field(
        None, max_length=MAX_ALLOWED_MODELS, description="model ids it may use (adapters, the base model); null: all"
    )


@router.post("/admin/keys", status_code=201, response_model=NewKey)
async def create_key(body: KeyRequest, request: Request) -> JSONResponse:
    allowed = body.allowed_models
    for index, model in enumerate(allowed or []):
        if not is_valid_name(model):
            raise InvalidRequestError(f"allowed_models.{index}", f"{model[:64]!r} is not a model id")
    unique = None if allowed is None else tuple(dict.fromkeys(allowed))
    spec = KeySpec(**body.model_dump(exclude={"allowed_models"}), allowed_models=unique)
    record, key = await server_state(request).tenants.create(spec)
    return JSONResponse({**record_json(record, KEY_SECRETS), "key": key}, status_code=201)


@router.get("/admin/keys", response_model=KeyList)
async def list_keys(request: Request) -> dict[str, Any]:
    tenants = server_state(request).tenants
    data = [record_json(record, KEY_SECRETS) for record in tenants.records()]
    return {"object": "list", "data": data, "auth": tenants.auth.value}


@router.delete("/admin/keys/{key_id}", response_model=KeyRevoked)
async def revoke_key(key_id: Annotated[int, Path(ge=1, le=MAX_KEY_ID)], request: Request) -> dict[str, Any]:
    record = await server_state(request).tenants.revoke(key_id)
    return {"id": record.id, "tenant": record.tenant, "deleted": True}


class AuthModeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["open", "keys"] = Field(
        description="open: any client may infer; keys: an API key (or the admin token) is needed"
    )


@router.get("/admin/auth", response_model=AuthMode)
async def auth_mode(request: Request) -> dict[str, Any]:
    return _auth_view(server_state(request))


@router.put("/admin/auth", response_model=AuthMode)
async def set_auth_mode(body: AuthModeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    await state.tenants.set_auth(InferenceAuth(body.mode))
    return _auth_view(state)


def _auth_view(state: ServerState) -> dict[str, Any]:
    return {"mode": state.tenants.auth.value, "keys": len(state.tenants.records())}
