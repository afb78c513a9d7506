"""Which stored adapter versions were checked in the child process (adapter_sandbox.py), and the verdicts.

Uploads are checked before they are stored, so their versions are written checked. Versions written before checks were
recorded (migration 0006), or whose files were put in the store by hand, are not: the server checks them at start. A
verdict is about the files, so every version of one content hash shares it: recorded on all of them at once, a content
is checked once however many adapters or versions name it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from loraserve.registry.change_feed import announce
from loraserve.registry.models import AdapterRow, AdapterStatus, AdapterVersionRow, utc_now


@dataclass(frozen=True)
class PendingCheck:
    """A content hash no check has recorded, and the adapters whose current version it is (none: only older
    versions name it)."""

    sha256: str
    names: tuple[str, ...]


@dataclass(frozen=True)
class CheckVerdict:
    error: str | None  # why the child refused the files; None: they passed


def record_check(session: Session, sha256: str, error: str | None) -> None:
    """In the caller's transaction: the verdict on every version of this content."""
    versions = update(AdapterVersionRow).where(AdapterVersionRow.sha256 == sha256)
    session.execute(versions.values(checked_at=utc_now(), check_error=error))


class AdapterChecks:
    """The check columns of adapter_versions, through the registry's sessions (`session(action)` turns failures into
    RegistryError)."""

    def __init__(self, session: Callable[[str], AbstractContextManager[Session]]) -> None:
        self._session = session

    def pending(self) -> list[PendingCheck]:
        """Every content some version names and no check has recorded; the ones adapters serve now first."""
        with self._session("list the adapter versions not checked yet") as session:
            query = select(AdapterVersionRow.sha256).where(AdapterVersionRow.checked_at.is_(None)).distinct()
            hashes = sorted(session.scalars(query))
            current = session.execute(
                select(AdapterRow.sha256, AdapterRow.name)
                .where(AdapterRow.sha256.in_(hashes))
                .order_by(AdapterRow.name)
            )
            names: dict[str, list[str]] = {sha256: [] for sha256 in hashes}
            for sha256, name in current:
                names[sha256].append(name)
        pending = [PendingCheck(sha256, tuple(names[sha256])) for sha256 in hashes]
        return sorted(pending, key=lambda check: not check.names)  # stable: served contents first, then the others

    def verdict(self, sha256: str) -> CheckVerdict | None:
        """The recorded verdict on this content; None when no check has recorded one (or no version names it)."""
        with self._session(f"read the check of {sha256}") as session:
            query = select(AdapterVersionRow.check_error).where(
                AdapterVersionRow.sha256 == sha256, AdapterVersionRow.checked_at.is_not(None)
            )
            checked = session.execute(query.limit(1)).first()
            return None if checked is None else CheckVerdict(checked.check_error)

    def record(self, sha256: str, error: str | None) -> list[str]:
        """Record the verdict on every version of this content; refused, the ready adapters whose current version it
        is are marked failed with the reason, in the same transaction. Returns the names so marked."""
        with self._session(f"record the check of {sha256}") as session:
            record_check(session, sha256, error)
            failed: list[str] = []
            if error is not None:
                query = select(AdapterRow).where(
                    AdapterRow.sha256 == sha256, AdapterRow.status == AdapterStatus.READY.value
                )
                for row in session.scalars(query.with_for_update()):
                    row.status, row.status_reason = AdapterStatus.FAILED.value, failure_reason(error)
                    row.updated_at = utc_now()
                    announce(session, row.name)
                    failed.append(row.name)
            session.commit()
            return failed


def failure_reason(error: str) -> str:
    """The status reason of an adapter whose files the check refused."""
    return f"its stored files failed the check: {error}"
