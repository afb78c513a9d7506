"""Alembic migrations: up, down and up again on both backends; models and migrations agree; clear errors."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from loraserve.errors import RegistryError
from loraserve.registry import FileStore, InferenceAuth, KeySpec, Registry, downgrade_database, upgrade_database
from loraserve.registry.database import create_registry_engine
from loraserve.registry.models import Base


def _tables(url: str) -> set[str]:
    engine = create_registry_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url: str) -> None:
    upgrade_database(database_url)
    assert {"adapters", "alembic_version"} <= _tables(database_url)
    upgrade_database(database_url)  # already at head: nothing to do
    downgrade_database(database_url)
    assert "adapters" not in _tables(database_url)
    upgrade_database(database_url)
    assert "adapters" in _tables(database_url)


def test_models_match_migrations(database_url: str) -> None:
    upgrade_database(database_url)
    engine = create_registry_engine(database_url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    engine.dispose()


def test_database_from_a_newer_loraserve_is_refused(database_url: str) -> None:
    upgrade_database(database_url)
    engine = create_registry_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(RegistryError, match="newer loraserve"):
        upgrade_database(database_url)


def test_registry_refuses_an_unmigrated_database(database_url: str, tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="upgrade_database"):
        Registry(database_url, FileStore(tmp_path / "store"))


def test_unreachable_server_names_the_url_without_its_password() -> None:
    with pytest.raises(RegistryError) as caught:
        upgrade_database("postgresql://someone:hunter2@127.0.0.1:1/nothing")
    assert "postgresql://someone:***@127.0.0.1:1/nothing" in str(caught.value)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("url", ["not a url", "nosuchdb://x/y"])
def test_bad_url_is_refused(url: str) -> None:
    with pytest.raises(RegistryError, match="--db"):
        upgrade_database(url)


def test_versions_migration_gives_each_existing_adapter_its_current_weights_as_first_version(
    database_url: str, tmp_path: Path
) -> None:
    upgrade_database(database_url)
    downgrade_database(database_url, "0003")  # today's schema before versions, with adapters in it
    engine = create_registry_engine(database_url)
    rows = [("pirate", "a" * 64, 8), ("robot", "b" * 64, 16)]
    with engine.begin() as connection:
        for name, sha256, rank in rows:
            connection.execute(
                text(
                    "INSERT INTO adapters (name, base_model, rank, alpha, target_modules, size_bytes, sha256, status,"
                    " created_at, updated_at, request_count, prompt_token_count, completion_token_count, pinned)"
                    " VALUES (:name, 'smol', :rank, 16.0, 'q_proj,v_proj', 1024, :sha256, 'ready', :now, :now,"
                    " 3, 4, 5, false)"
                ),
                {"name": name, "sha256": sha256, "rank": rank, "now": datetime(2026, 11, 1, tzinfo=UTC)},
            )
    engine.dispose()
    upgrade_database(database_url)
    registry = Registry(database_url, FileStore(tmp_path / "store"))
    try:
        for name, sha256, rank in rows:
            (version,) = registry.versions(name)
            assert (version.sha256, version.rank, version.target_modules) == (sha256, rank, ("q_proj", "v_proj"))
            assert version.current and version.uploaded_by is None
            assert version.created_at == datetime(2026, 11, 1, tzinfo=UTC)
            assert registry.get(name).request_count == 3  # the adapter's own row is untouched
    finally:
        registry.close()
    downgrade_database(database_url, "0003")
    assert "adapter_versions" not in _tables(database_url) and "adapters" in _tables(database_url)


@pytest.mark.parametrize("with_keys", [False, True], ids=["no-keys", "keys"])
def test_settings_migration_closes_inference_where_keys_already_exist(
    database_url: str, tmp_path: Path, with_keys: bool
) -> None:
    upgrade_database(database_url)
    registry = Registry(database_url, FileStore(tmp_path / "store"))
    try:
        if with_keys:
            registry.keys.create(KeySpec("acme"))
    finally:
        registry.close()
    downgrade_database(database_url, "0004")  # the schema before the mode, served open until the first key
    assert "settings" not in _tables(database_url)
    upgrade_database(database_url)
    registry = Registry(database_url, FileStore(tmp_path / "store"))
    try:
        assert registry.settings.auth() == (InferenceAuth.KEYS if with_keys else InferenceAuth.OPEN)
    finally:
        registry.close()
