"""Bearer-token checks: the admin token on admin routes (always), optional API keys on inference."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import HTTPException, Request

from loraserve.engine.fair_share import UNKEYED, Tenant
from loraserve.server.state import server_state


def require_api_key(request: Request) -> None:
    """When API keys are configured, inference needs `Authorization: Bearer <key>` (or the admin token)."""
    state = server_state(request)
    keys = state.config.api_keys
    if keys and not any(_bearer_matches(request, key) for key in (*keys, state.admin_token)):
        raise HTTPException(status_code=401, detail="missing or invalid API key (Authorization: Bearer <key>)")


def tenant_of(request: Request) -> Tenant:
    """Each --api-key is a tenant of its own (named by a hash of the key, never the key); every request
    without one, or with the admin token, shares one tenant. Weights are equal."""
    for key in server_state(request).config.api_keys:
        if _bearer_matches(request, key):
            return Tenant(name="key-" + hashlib.sha256(key.encode()).hexdigest()[:12])
    return UNKEYED


def require_admin_token(request: Request) -> None:
    """Admin routes need `Authorization: Bearer <admin token>`: 401 without one, 403 with a wrong one."""
    if not request.headers.get("authorization"):
        raise HTTPException(status_code=401, detail="admin routes need Authorization: Bearer <admin token>")
    if not _bearer_matches(request, server_state(request).admin_token):
        raise HTTPException(status_code=403, detail="invalid admin token")


def _bearer_matches(request: Request, secret: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), secret.encode())
