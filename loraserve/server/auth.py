"""Bearer-token checks: the admin token on admin routes (always), API keys on inference once any exists."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import HTTPException, Request

from loraserve.registry import InferenceAuth
from loraserve.server.state import server_state
from loraserve.server.tenants import UNKEYED_ACCESS, TenantKey


def require_api_key(request: Request) -> None:
    """Find the request's tenant (`grant_of`); in the `keys` mode inference needs a key or the admin token."""
    state = server_state(request)
    token = _bearer(request)
    grant = state.tenants.key_of(token) if token else None
    if grant is None and state.tenants.keys_required and not _matches(token, state.admin_token):
        raise HTTPException(status_code=401, detail="missing or invalid API key (Authorization: Bearer <key>)")
    request.state.grant = grant or UNKEYED_ACCESS


def grant_of(request: Request) -> TenantKey:
    """What the request's key grants (found by require_api_key); the unkeyed tenant's when it has no key."""
    grant: TenantKey = getattr(request.state, "grant", UNKEYED_ACCESS)
    return grant


def require_admin_token(request: Request) -> None:
    check_admin_token(request, server_state(request).admin_token)


def check_admin_token(request: Request, admin_token: str) -> None:
    """Admin routes need `Authorization: Bearer <admin token>`: 401 without one, 403 with a wrong one."""
    if not request.headers.get("authorization"):
        raise HTTPException(status_code=401, detail="admin routes need Authorization: Bearer <admin token>")
    if not _matches(_bearer(request), admin_token):
        raise HTTPException(status_code=403, detail="invalid admin token")


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def _matches(token: str, secret: str) -> bool:
    return bool(token) and hmac.compare_digest(token.encode(), secret.encode())


def auth_notice(auth: InferenceAuth, host: str) -> str:
    """The start's line on who may infer: a loud warning when anyone on the network may."""
    if auth == InferenceAuth.KEYS:
        return "inference needs an API key (or the admin token): mode 'keys'"
    if _is_loopback(host):
        return "inference is open to any local client (mode 'open'); the first API key closes it"
    return (
        f"WARNING: inference is OPEN to anyone who can reach {host} (mode 'open'): create a key (POST /admin/keys, "
        "the admin page) or start with --require-api-key to close it"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
