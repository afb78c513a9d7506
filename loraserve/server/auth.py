"""Bearer-token checks: optional API keys on the inference routes."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request

from loraserve.server.state import server_state


def require_api_key(request: Request) -> None:
    """When API keys are configured, inference needs `Authorization: Bearer <key>`."""
    keys = server_state(request).api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, key) for key in keys):
        raise HTTPException(status_code=401, detail="missing or invalid API key (Authorization: Bearer <key>)")
