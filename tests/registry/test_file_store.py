"""The content-addressed file store: atomic puts, verification, crash leftovers, damaged copies."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraserve.errors import AdapterError
from loraserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loraserve.registry import FileStore
from tests.registry.conftest import MakeAdapter


def test_put_verify_remove(store: FileStore, make_adapter: MakeAdapter) -> None:
    path, adapter = make_adapter()
    stored = store.put(path, adapter.sha256)
    assert stored == store.path_of(adapter.sha256) == store.root / adapter.sha256
    assert (stored / WEIGHTS_FILE).read_bytes() == (path / WEIGHTS_FILE).read_bytes()
    assert store.verify(adapter.sha256) is None
    assert store.put(path, adapter.sha256) == stored  # same content: reused
    store.remove(adapter.sha256)
    assert list(store.root.iterdir()) == []
    assert store.verify(adapter.sha256) == f"stored files missing: {CONFIG_FILE}, {WEIGHTS_FILE} in {stored}"


def test_verify_reports_changed_files_and_put_repairs_them(store: FileStore, make_adapter: MakeAdapter) -> None:
    path, adapter = make_adapter()
    stored = store.put(path, adapter.sha256)
    (stored / CONFIG_FILE).write_text("{}")
    reason = store.verify(adapter.sha256)
    assert reason is not None and reason.startswith("stored files changed on disk") and adapter.sha256 in reason
    store.put(path, adapter.sha256)
    assert store.verify(adapter.sha256) is None
    assert [p.name for p in store.root.iterdir()] == [adapter.sha256]


def test_put_refuses_files_that_do_not_match_their_hash(store: FileStore, make_adapter: MakeAdapter) -> None:
    path, adapter = make_adapter()
    (path / CONFIG_FILE).write_text('{"r": 99}')
    with pytest.raises(AdapterError, match="changed"):
        store.put(path, adapter.sha256)
    assert list(store.root.iterdir()) == []


def test_opening_removes_leftovers_of_a_crash(tmp_path: Path) -> None:
    (tmp_path / ".tmp-abc").mkdir()
    (tmp_path / ".tmp-abc" / WEIGHTS_FILE).write_bytes(b"half written")
    FileStore(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("sha256", ["../etc", "ABC", "0" * 63])
def test_only_hashes_name_directories(store: FileStore, sha256: str) -> None:
    with pytest.raises(ValueError, match="sha256"):
        store.path_of(sha256)
