"""Tenants' API keys in the registry: created with a weight and quotas, listed, revoked.

A key is 256 random bits, shown once when created; the database keeps its SHA-256 (a slow password hash buys nothing
against a key this long) and its first characters, so an admin can tell keys apart. A tenant may hold several keys (to
rotate one without downtime); its keys share its fair-share weight.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import secrets
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, fields
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from loraserve.errors import ApiKeyNotFoundError
from loraserve.registry.adapter_name import validate_tenant_name
from loraserve.registry.models import ApiKeyRow
from loraserve.registry.settings import InferenceAuth, store_auth

KEY_PREFIX = "lsk-"  # tells a loraserve key apart from other secrets (in logs, in secret scanners)
SHOWN_PREFIX_CHARS = 10


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeySpec:
    """What an admin asks for: whose key, the tenant's fair-share weight and the key's quotas."""

    tenant: str
    weight: float = 1.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt and generated tokens
    allowed_models: tuple[str, ...] | None = None  # model ids (adapters, the base model); None: all


@dataclass(frozen=True)
class ApiKeyInfo:
    """A stored key, without the key: immutable, safe to keep after its transaction."""

    id: int
    tenant: str
    key_hash: str
    key_prefix: str
    weight: float
    requests_per_minute: int | None
    tokens_per_minute: int | None
    allowed_models: tuple[str, ...] | None
    created_at: datetime  # UTC

    @classmethod
    def of(cls, row: ApiKeyRow) -> ApiKeyInfo:
        columns = {field.name: getattr(row, field.name) for field in fields(cls)}
        allowed = None if row.allowed_models is None else tuple(json.loads(row.allowed_models))
        return cls(**{**columns, "allowed_models": allowed})


class ApiKeys:
    """The api_keys table, through the registry's sessions (`session(action)` turns failures into RegistryError)."""

    def __init__(self, session: Callable[[str], AbstractContextManager[Session]]) -> None:
        self._session = session

    def create(self, spec: KeySpec) -> tuple[ApiKeyInfo, str]:
        """Store a new key for `spec` and close inference to keys (settings.py) in the same transaction; returns its
        record and the key itself, which is never stored."""
        validate_tenant_name(spec.tenant)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        allowed = None if spec.allowed_models is None else json.dumps(list(spec.allowed_models))
        row = ApiKeyRow(
            **{**asdict(spec), "allowed_models": allowed}, key_hash=hash_key(key), key_prefix=key[:SHOWN_PREFIX_CHARS]
        )
        with self._session(f"create an API key of tenant {spec.tenant!r}") as session:
            session.add(row)
            store_auth(session, InferenceAuth.KEYS)
            session.commit()
            return ApiKeyInfo.of(row), key

    def list(self) -> builtins.list[ApiKeyInfo]:
        """Every key, by tenant, oldest first."""
        with self._session("list API keys") as session:
            rows = session.scalars(select(ApiKeyRow).order_by(ApiKeyRow.tenant, ApiKeyRow.id))
            return [ApiKeyInfo.of(row) for row in rows]

    def delete(self, key_id: int) -> ApiKeyInfo:
        """Revoke key `key_id`; raises ApiKeyNotFoundError."""
        with self._session(f"revoke API key {key_id}") as session:
            row = session.get(ApiKeyRow, key_id)
            if row is None:
                raise ApiKeyNotFoundError(key_id)
            info = ApiKeyInfo.of(row)
            session.delete(row)
            session.commit()
            return info
