"""Registry fixtures: each test gets an empty database, SQLite or PostgreSQL, and a fresh file store.

PostgreSQL tests need a server on 127.0.0.1:5432 with a `test` database and trust auth
(user `postgres` or the current OS user); without one they are skipped, saying why.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loraserve.file_digest import sha256_of_files
from loraserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter
from loraserve.registry import FileStore, Registry, sqlite_url, upgrade_database
from tests.postgres_databases import empty_database
from tests.postgres_databases import postgres_admin_url as find_postgres

MakeAdapter = Callable[..., tuple[Path, LoraAdapter]]


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    return find_postgres()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty database, dropped after the test."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "data")
        return
    with empty_database(request.getfixturevalue("postgres_admin_url")) as url:
        yield url


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    return FileStore(tmp_path / "store")


@pytest.fixture
def registry(database_url: str, store: FileStore) -> Iterator[Registry]:
    upgrade_database(database_url)
    registry = Registry(database_url, store)
    yield registry
    registry.close()


@pytest.fixture
def make_adapter(tmp_path: Path) -> MakeAdapter:
    """Write a small PEFT adapter directory; equal `seed`s give byte-identical files."""

    def make(seed: int = 0, rank: int = 4, target_modules: tuple[str, ...] = ("q_proj",)) -> tuple[Path, LoraAdapter]:
        path = tmp_path / f"adapter-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(target_modules)}
        (path / CONFIG_FILE).write_text(json.dumps(config))
        weights = torch.randn(rank, 8, generator=torch.Generator().manual_seed(seed))
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": weights}, path / WEIGHTS_FILE)
        adapter = LoraAdapter(
            rank=rank,
            alpha=2.0 * rank,
            use_rslora=False,
            target_modules=target_modules,
            weights={},
            base_model_name=None,
            sha256=sha256_of_files(path / CONFIG_FILE, path / WEIGHTS_FILE),
            num_bytes=(path / WEIGHTS_FILE).stat().st_size,
        )
        return path, adapter

    return make
