"""API keys in the registry, on SQLite and PostgreSQL: the key is returned once and only its hash is stored."""

from __future__ import annotations

from datetime import UTC

import pytest
from sqlalchemy import select, text

from loraserve.errors import ApiKeyNotFoundError, InvalidRequestError
from loraserve.registry import KeySpec, Registry, hash_key
from loraserve.registry.models import ApiKeyRow


def test_create_list_revoke(registry: Registry) -> None:
    spec = KeySpec("acme", weight=2.0, requests_per_minute=60, tokens_per_minute=10_000, allowed_models=("pirate",))
    info, key = registry.keys.create(spec)
    assert key.startswith("lsk-") and len(key) > 40
    assert (info.tenant, info.weight, info.requests_per_minute, info.tokens_per_minute) == ("acme", 2.0, 60, 10_000)
    assert info.allowed_models == ("pirate",) and info.created_at.tzinfo == UTC
    assert info.key_hash == hash_key(key) and key.startswith(info.key_prefix)
    other, other_key = registry.keys.create(KeySpec("beta"))
    assert other_key != key and other.allowed_models is None and other.requests_per_minute is None
    rotated, _ = registry.keys.create(KeySpec("acme", weight=2.0))  # a tenant may hold several keys
    assert [(k.tenant, k.id) for k in registry.keys.list()] == [
        ("acme", info.id),
        ("acme", rotated.id),
        ("beta", other.id),
    ]
    assert registry.keys.delete(info.id) == info
    assert [k.id for k in registry.keys.list()] == [rotated.id, other.id]
    with pytest.raises(ApiKeyNotFoundError):
        registry.keys.delete(info.id)


def test_the_key_itself_is_never_stored(registry: Registry) -> None:
    _, key = registry.keys.create(KeySpec("acme"))
    with registry._session("dump") as session:  # every column of the row, as the database holds it
        values = session.execute(text("SELECT * FROM api_keys")).one()
    assert not any(key in str(value) for value in values)
    assert key[10:] not in " ".join(str(value) for value in values)


def test_an_invalid_or_reserved_tenant_name_is_refused_and_nothing_stored(registry: Registry) -> None:
    first, _ = registry.keys.create(KeySpec("acme"))
    for name in ("unkeyed", "key-0123", "../x", "", "a" * 129):
        with pytest.raises(InvalidRequestError, match="tenant"):
            registry.keys.create(KeySpec(name))
    with registry._session("count") as session:
        assert session.scalars(select(ApiKeyRow.tenant)).all() == ["acme"]
    assert registry.keys.list() == [first]
