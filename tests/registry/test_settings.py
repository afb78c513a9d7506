"""The inference-auth mode in the registry: closed by the first key in the key's own transaction, never opened by
revoking keys, opened only when set so."""

from __future__ import annotations

from sqlalchemy import text

from loraserve.registry import InferenceAuth, KeySpec, Registry
from loraserve.registry.database import create_registry_engine


def test_a_new_registry_is_open_and_the_first_key_closes_it_for_good(registry: Registry) -> None:
    assert registry.settings.auth() == InferenceAuth.OPEN
    record, _ = registry.keys.create(KeySpec("acme"))
    assert registry.settings.auth() == InferenceAuth.KEYS
    registry.keys.delete(record.id)
    assert registry.keys.list() == [] and registry.settings.auth() == InferenceAuth.KEYS
    registry.settings.set_auth(InferenceAuth.OPEN)
    assert registry.settings.auth() == InferenceAuth.OPEN
    registry.keys.create(KeySpec("acme"))
    assert registry.settings.auth() == InferenceAuth.KEYS


def test_a_missing_or_unknown_mode_reads_as_closed(registry: Registry, database_url: str) -> None:
    engine = create_registry_engine(database_url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE settings SET value = 'OPEN ' WHERE name = 'inference_auth'"))
        assert registry.settings.auth() == InferenceAuth.KEYS
        with engine.begin() as connection:
            connection.execute(text("DELETE FROM settings"))
        assert registry.settings.auth() == InferenceAuth.KEYS
        registry.settings.set_auth(InferenceAuth.OPEN)  # the row is written again
        assert registry.settings.auth() == InferenceAuth.OPEN
    finally:
        engine.dispose()
