"""Recorded adapter checks: uploads are written checked, rows from before the migration are not, a verdict is shared
by every version of one content and a refusal fails the adapters serving it."""

from __future__ import annotations

from sqlalchemy import select

from loraserve.registry import AdapterStatus, FileStore, Registry, downgrade_database, upgrade_database
from loraserve.registry.adapter_checks import CheckVerdict, PendingCheck, failure_reason
from loraserve.registry.database import create_registry_engine
from loraserve.registry.models import AdapterVersionRow
from tests.registry.conftest import MakeAdapter

MODEL = "smol"


def checked_at(url: str) -> dict[str, object]:
    """sha256 -> checked_at of each version row (rows of one content agree, which the tests check by a set)."""
    engine = create_registry_engine(url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(select(AdapterVersionRow.sha256, AdapterVersionRow.checked_at)).all()
    finally:
        engine.dispose()
    by_content: dict[str, set[object]] = {}
    for sha256, when in rows:
        by_content.setdefault(sha256, set()).add(when)
    assert all(len(times) == 1 for times in by_content.values()), by_content
    return {sha256: times.pop() for sha256, times in by_content.items()}


def legacy(url: str, store: FileStore, fill: MakeAdapter) -> tuple[str, str, str]:
    """A registry as loraserve wrote it before checks were recorded: 'a' and 'b' share content one, 'b' once had
    content two; 'c' serves content three. Returns the three hashes."""
    registry = Registry(url, store)
    try:
        one, two, three = (fill(seed=seed) for seed in (1, 2, 3))
        registry.create("a", *one, MODEL)
        registry.create("b", *two, MODEL)
        registry.replace("b", *one)
        registry.create("c", *three, MODEL)
    finally:
        registry.close()
    downgrade_database(url, "0005")
    upgrade_database(url)
    return one[1].sha256, two[1].sha256, three[1].sha256


def test_an_upload_is_recorded_checked(registry: Registry, make_adapter: MakeAdapter) -> None:
    path, adapter = make_adapter()
    registry.create("a", path, adapter, MODEL)
    assert registry.checks.pending() == []
    assert registry.checks.verdict(adapter.sha256) == CheckVerdict(error=None)
    assert registry.checks.verdict("0" * 64) is None


def test_rows_from_before_the_migration_are_pending_once_per_content_served_ones_first(
    database_url: str, store: FileStore, make_adapter: MakeAdapter
) -> None:
    upgrade_database(database_url)
    one, two, three = legacy(database_url, store, make_adapter)
    registry = Registry(database_url, store)
    try:
        pending = registry.checks.pending()
        assert sorted(pending[:2], key=lambda p: p.names) == [
            PendingCheck(one, ("a", "b")),
            PendingCheck(three, ("c",)),
        ]
        assert pending[2:] == [PendingCheck(two, ())]  # only an older version names it: checked last
        assert {sha256: registry.checks.verdict(sha256) for sha256 in (one, two, three)} == dict.fromkeys(
            (one, two, three)
        )
    finally:
        registry.close()


def test_a_verdict_is_recorded_on_every_version_of_its_content_and_a_refusal_fails_its_adapters(
    database_url: str, store: FileStore, make_adapter: MakeAdapter
) -> None:
    upgrade_database(database_url)
    one, two, three = legacy(database_url, store, make_adapter)
    registry = Registry(database_url, store)
    try:
        assert registry.checks.record(one, "adapter_model.safetensors: lies about its tensors") == ["a", "b"]
        assert registry.checks.record(two, None) == []
        assert registry.checks.pending() == [PendingCheck(three, ("c",))]
        assert registry.checks.verdict(one) == CheckVerdict("adapter_model.safetensors: lies about its tensors")
        assert registry.checks.verdict(two) == CheckVerdict(None)
        for name in ("a", "b"):
            info = registry.get(name)
            assert info is not None and info.status is AdapterStatus.FAILED
            assert info.status_reason == failure_reason("adapter_model.safetensors: lies about its tensors")
        c = registry.get("c")
        assert c is not None and c.status is AdapterStatus.READY
        times = checked_at(database_url)
        assert times[one] is not None and times[two] is not None and times[three] is None
    finally:
        registry.close()


def test_uploading_a_pending_content_again_records_it_checked_on_every_version(
    database_url: str, store: FileStore, make_adapter: MakeAdapter
) -> None:
    upgrade_database(database_url)
    one, _, three = legacy(database_url, store, make_adapter)
    registry = Registry(database_url, store)
    try:
        path, adapter = make_adapter(seed=3)  # content three, byte for byte
        registry.replace("a", path, adapter)
        assert adapter.sha256 == three
        assert [p.sha256 for p in registry.checks.pending()][:1] == [one]
        assert three not in {p.sha256 for p in registry.checks.pending()}
        assert checked_at(database_url)[three] is not None  # 'c''s row too, written before the migration
    finally:
        registry.close()
