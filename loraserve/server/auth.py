"""Bearer-token checks: the admin token on admin routes (always), optional API keys on inference."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from loraserve.server.state import server_state


def require_api_key(request: Request) -> None:
    """When API keys are configured, inference needs `Authorization: Bearer <key>` (or the admin token)."""
    state = server_state(request)
    keys = state.config.api_keys
    if keys and not any(_bearer_matches(request, key) for key in (*keys, state.admin_token)):
        raise HTTPException(status_code=401, detail="missing or invalid API key (Authorization: Bearer <key>)")


def require_admin_token(request: Request) -> None:
    """Admin routes need `Authorization: Bearer <admin token>`: 401 without one, 403 with a wrong one."""
    if not request.headers.get("authorization"):
        raise HTTPException(status_code=401, detail="admin routes need Authorization: Bearer <admin token>")
    if not _bearer_matches(request, server_state(request).admin_token):
        raise HTTPException(status_code=403, detail="invalid admin token")


def _bearer_matches(request: Request, secret: str) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), secret.encode())
