"""The registry: round trips, refusals that change nothing, failure injection, usage counters, verification."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC
from pathlib import Path

import pytest
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from loraserve.errors import AdapterError, AdapterExistsError, RegistryError, VersionNotFoundError
from loraserve.lora.adapter import WEIGHTS_FILE, LoraAdapter
from loraserve.registry import AdapterInfo, AdapterNotFoundError, AdapterStatus, FileStore, Registry, Usage
from tests.registry.conftest import MakeAdapter


def _stored(store: FileStore) -> list[str]:
    return sorted(path.name for path in store.root.iterdir())


def test_create_list_get_update_delete(registry: Registry, make_adapter: MakeAdapter) -> None:
    path, adapter = make_adapter(rank=8, target_modules=("q_proj", "v_proj"))
    info = registry.create("pirate", path, adapter, base_model="smol", system_prompt="Arr.", description=None)
    assert (info.name, info.rank, info.alpha, info.target_modules) == ("pirate", 8, 16.0, ("q_proj", "v_proj"))
    assert (info.sha256, info.size_bytes, info.status) == (adapter.sha256, adapter.num_bytes, AdapterStatus.READY)
    assert info.created_at.tzinfo == UTC and info.request_count == 0
    assert registry.get("pirate") == info
    assert registry.files_of(info) == registry.store.path_of(adapter.sha256)
    assert registry.store.verify(adapter.sha256) is None

    registry.create("another", *make_adapter(seed=1), base_model="smol")
    assert [a.name for a in registry.list()] == ["another", "pirate"]

    updated = registry.update("pirate", description="A pirate.")
    assert (updated.description, updated.system_prompt) == ("A pirate.", "Arr.")  # left out: unchanged
    assert updated.updated_at >= info.updated_at
    cleared = registry.update("pirate", system_prompt=None)
    assert (cleared.description, cleared.system_prompt) == ("A pirate.", None)
    assert registry.get("pirate") == cleared

    assert registry.delete("pirate") == cleared
    assert registry.get("pirate") is None
    assert adapter.sha256 not in _stored(registry.store)
    assert [a.name for a in registry.list()] == ["another"]


def test_unknown_names_raise_not_found(registry: Registry) -> None:
    for call in (
        lambda: registry.update("ghost", description="x"),
        lambda: registry.delete("ghost"),
        lambda: registry.mark_failed("ghost", "why"),
        lambda: registry.mark_ready("ghost"),
    ):
        with pytest.raises(AdapterNotFoundError, match="ghost"):
            call()
    registry.add_usage({"ghost": Usage(1, 2, 3)})  # a deleted adapter's late usage is dropped


def test_equal_content_shares_files_until_the_last_is_deleted(registry: Registry, make_adapter: MakeAdapter) -> None:
    first, second = make_adapter(seed=7), make_adapter(seed=7)
    registry.create("a", *first, base_model="smol")
    registry.create("b", *second, base_model="smol")
    assert _stored(registry.store) == [first[1].sha256]
    registry.delete("a")
    assert registry.store.verify(first[1].sha256) is None
    registry.delete("b")
    assert _stored(registry.store) == []


def test_duplicate_name_changes_nothing(registry: Registry, make_adapter: MakeAdapter) -> None:
    original = registry.create("pirate", *make_adapter(seed=0), base_model="smol")
    path, other = make_adapter(seed=1)
    with pytest.raises(AdapterExistsError):
        registry.create("pirate", path, other, base_model="smol")
    assert registry.list() == [original]
    assert _stored(registry.store) == [original.sha256]


@pytest.mark.parametrize("name", ["../x", "a/b", "a\\b", "", "x" * 200, ".hidden", "a..b", "with space"])
def test_bad_names_are_refused(registry: Registry, make_adapter: MakeAdapter, name: str) -> None:
    with pytest.raises(AdapterError) as caught:
        registry.create(name, *make_adapter(), base_model="smol")
    assert caught.value.field == "name"
    assert registry.list() == [] and _stored(registry.store) == []


def _failing_commit(error: BaseException) -> Callable[[Session], None]:
    def commit(self: Session) -> None:
        raise error

    return commit


def test_failed_commit_leaves_no_row_and_no_files(
    registry: Registry, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Session, "commit", _failing_commit(OperationalError("COMMIT", {}, Exception("disk I/O error"))))
    with pytest.raises(RegistryError, match="disk I/O error"):
        registry.create("pirate", *make_adapter(), base_model="smol")
    monkeypatch.undo()
    assert registry.list() == [] and _stored(registry.store) == []


def test_failed_commit_keeps_files_another_adapter_uses(
    registry: Registry, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = registry.create("a", *make_adapter(seed=3), base_model="smol")
    monkeypatch.setattr(Session, "commit", _failing_commit(RuntimeError("crash")))
    with pytest.raises(RuntimeError):
        registry.create("b", *make_adapter(seed=3), base_model="smol")
    monkeypatch.undo()
    assert registry.list() == [kept] and registry.store.verify(kept.sha256) is None


def test_failed_store_leaves_no_row(registry: Registry, make_adapter: MakeAdapter) -> None:
    path, adapter = make_adapter()
    (path / WEIGHTS_FILE).write_bytes(b"changed after it was read")
    with pytest.raises(AdapterError, match="changed"):
        registry.create("pirate", path, adapter, base_model="smol")
    assert registry.list() == [] and _stored(registry.store) == []


def test_name_taken_between_check_and_insert_is_still_a_conflict(
    registry: Registry, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = registry.create("pirate", *make_adapter(seed=0), base_model="smol")
    real_get, calls = Registry.get, []

    def get_missing_once(self: Registry, name: str) -> AdapterInfo | None:
        calls.append(name)
        return None if len(calls) == 1 else real_get(self, name)  # the check misses; the insert collides

    monkeypatch.setattr(Registry, "get", get_missing_once)
    with pytest.raises(AdapterExistsError):
        registry.create("pirate", *make_adapter(seed=1), base_model="smol")
    monkeypatch.undo()
    assert registry.list() == [first] and _stored(registry.store) == [first.sha256]


def test_racing_creates_of_one_name_register_it_once(registry: Registry, make_adapter: MakeAdapter) -> None:
    adapters = [make_adapter(seed=i) for i in range(6)]
    barrier, outcomes = threading.Barrier(len(adapters)), []

    def create(path: Path, adapter: LoraAdapter) -> None:
        barrier.wait()
        try:
            outcomes.append(registry.create("same", path, adapter, base_model="smol").sha256)
        except AdapterExistsError:
            outcomes.append("exists")

    threads = [threading.Thread(target=create, args=adapter) for adapter in adapters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [outcome for outcome in outcomes if outcome != "exists"]
    assert len(outcomes) == len(adapters) and len(winners) == 1
    assert _stored(registry.store) == winners


def test_usage_counters_add_up_across_threads(registry: Registry, make_adapter: MakeAdapter) -> None:
    registry.create("pirate", *make_adapter(), base_model="smol")
    threads = [threading.Thread(target=registry.add_usage, args=({"pirate": Usage(1, 10, 5)},)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    info = registry.get("pirate")
    assert info is not None
    assert (info.request_count, info.prompt_token_count, info.completion_token_count) == (8, 80, 40)


def test_verify_all_marks_tampered_adapters_failed(registry: Registry, make_adapter: MakeAdapter) -> None:
    good = registry.create("good", *make_adapter(seed=0), base_model="smol")
    bad = registry.create("bad", *make_adapter(seed=1), base_model="smol")
    (registry.files_of(bad) / WEIGHTS_FILE).write_bytes(b"tampered")
    by_name = {info.name: info for info in registry.verify_all()}
    assert by_name["good"] == good
    assert by_name["bad"].status is AdapterStatus.FAILED
    assert "changed on disk" in (by_name["bad"].status_reason or "")
    ready = registry.mark_ready("bad")
    assert (ready.status, ready.status_reason) == (AdapterStatus.READY, None)


def test_replace_keeps_every_version_and_rollback_returns_to_one(registry: Registry, make_adapter: MakeAdapter) -> None:
    path, first = make_adapter(seed=0, rank=4)
    created = registry.create("pirate", path, first, base_model="smol", uploaded_by="admin:aaaa")
    second_path, second = make_adapter(seed=1, rank=8, target_modules=("q_proj", "v_proj"))
    replaced = registry.replace("pirate", second_path, second, uploaded_by="admin:bbbb")
    assert (replaced.id, replaced.created_at) == (created.id, created.created_at)  # the same adapter, new weights
    assert (replaced.sha256, replaced.rank, replaced.target_modules) == (second.sha256, 8, ("q_proj", "v_proj"))
    versions = registry.versions("pirate")
    assert [(v.sha256, v.uploaded_by, v.current) for v in versions] == [
        (first.sha256, "admin:aaaa", False), (second.sha256, "admin:bbbb", True),
    ]  # fmt: skip
    assert versions[0].rank == 4 and versions[0].created_at <= versions[1].created_at
    assert _stored(registry.store) == sorted([first.sha256, second.sha256]), "a rollback needs the old files"

    back = registry.rollback("pirate", first.sha256)
    assert (back.sha256, back.rank, back.target_modules) == (first.sha256, 4, ("q_proj",))
    assert [v.current for v in registry.versions("pirate")] == [True, False]
    with pytest.raises(VersionNotFoundError, match="no version"):
        registry.rollback("pirate", "0" * 64)
    again = registry.replace("pirate", second_path, second)  # a content it had: that version, current again
    assert again.sha256 == second.sha256 and len(registry.versions("pirate")) == 2

    registry.delete("pirate")
    assert _stored(registry.store) == [], "the versions' files go with the adapter"
    with pytest.raises(AdapterNotFoundError):
        registry.versions("pirate")


def test_a_replacement_that_fails_changes_nothing(
    registry: Registry, make_adapter: MakeAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, first = make_adapter(seed=0)
    registry.create("pirate", path, first, base_model="smol")
    with pytest.raises(AdapterNotFoundError):
        registry.replace("ghost", *make_adapter(seed=1))
    failing_path, failing = make_adapter(seed=2)
    monkeypatch.setattr(Session, "commit", _failing_commit(OperationalError("COMMIT", {}, Exception("disk I/O error"))))
    with pytest.raises(RegistryError):
        registry.replace("pirate", failing_path, failing)
    monkeypatch.undo()
    assert registry.get("pirate").sha256 == first.sha256 and len(registry.versions("pirate")) == 1
    assert _stored(registry.store) == [first.sha256], "neither the failed nor the unknown name's files stay"


def test_files_another_adapter_s_version_names_stay(registry: Registry, make_adapter: MakeAdapter) -> None:
    shared_path, shared = make_adapter(seed=5)
    registry.create("a", shared_path, shared, base_model="smol")
    registry.create("b", *make_adapter(seed=6), base_model="smol")
    registry.replace("b", *make_adapter(seed=5))  # b's second version is a's content
    registry.replace("b", *make_adapter(seed=7))
    registry.delete("a")
    assert shared.sha256 in _stored(registry.store), "b may still roll back to it"
    assert registry.rollback("b", shared.sha256).sha256 == shared.sha256
