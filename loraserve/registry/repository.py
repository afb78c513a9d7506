"""The adapter registry: names -> records in the database, files in the content-addressed store; and the tenants' API
keys (`Registry.keys`, api_keys.py).

Every method runs its own short transaction and may be called from any thread. Creates and deletes hold one lock, so "do
other rows still use these files?" and the file change it decides never interleave with another create or delete (in
this process; processes sharing one database and store are not coordinated).

With `files_in_database`, each stored content's bytes are also a row of `adapter_files`, written in the transaction that
registers its first adapter and deleted with its last: a server sharing the database but not the disk (a cluster's
replica on another machine) copies them into its own store when it first needs them.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from loraserve.crash_points import crash_point
from loraserve.errors import AdapterExistsError, AdapterNotFoundError, RegistryError, VersionNotFoundError
from loraserve.registry.adapter_checks import AdapterChecks, record_check
from loraserve.registry.adapter_info import AdapterInfo, AdapterVersion
from loraserve.registry.adapter_name import validate_adapter_name
from loraserve.registry.api_keys import ApiKeys
from loraserve.registry.change_feed import announce, listen
from loraserve.registry.database import check_database, create_registry_engine, driver_message, masked_url
from loraserve.registry.file_store import FILES, FileStore
from loraserve.registry.models import AdapterFilesRow, AdapterRow, AdapterStatus, AdapterVersionRow, utc_now
from loraserve.registry.settings import ServerSettings

if TYPE_CHECKING:
    from loraserve.lora.adapter import LoraAdapter

logger = logging.getLogger(__name__)


@dataclass
class Usage:
    """Requests and tokens of one adapter, to add to its counters."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


class _Unset(Enum):
    """Marks an `update` argument left out (unchanged), as opposed to None (cleared)."""

    UNSET = "unset"


class Registry:
    """Registered adapters: rows in the database at `url`, files in `store`. Owns both."""

    def __init__(self, url: str, store: FileStore, files_in_database: bool = False) -> None:
        self.store = store
        self.files_in_database = files_in_database
        self._url = masked_url(url)
        self._unmasked_url = url
        self._engine = create_registry_engine(url)
        try:
            check_database(self._engine)
        except RegistryError:
            self._engine.dispose()
            raise
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._files_lock = threading.Lock()
        self.keys = ApiKeys(self._session)
        self.checks = AdapterChecks(self._session)
        self.settings = ServerSettings(self._session)

    def close(self) -> None:
        """Close the database connections."""
        self._engine.dispose()

    @property
    def announces_changes(self) -> bool:
        """Whether other servers sharing the database hear of adapter changes (change_feed.py): PostgreSQL."""
        return self._engine.dialect.name == "postgresql"

    def follow(self, deliver: Callable[[str | None], None], stop: threading.Event) -> None:
        """`deliver(name)` per adapter any server changes, `deliver(None)` for "look at all"; blocks until `stop`."""
        listen(self._unmasked_url, deliver, stop)

    def create(
        self,
        name: str,
        source_dir: Path,
        adapter: LoraAdapter,
        base_model: str,
        system_prompt: str | None = None,
        description: str | None = None,
        uploaded_by: str | None = None,
    ) -> AdapterInfo:
        """Register the validated adapter read from `source_dir` under `name`, its first version uploaded by
        `uploaded_by` (an admin token's id) and recorded checked; on failure nothing is kept."""
        validate_adapter_name(name)
        if self.get(name) is not None:
            raise AdapterExistsError(name)
        row = AdapterRow(
            name=name,
            base_model=base_model,
            rank=adapter.rank,
            alpha=adapter.alpha,
            target_modules=",".join(adapter.target_modules),
            size_bytes=adapter.num_bytes,
            sha256=adapter.sha256,
            system_prompt=system_prompt,
            description=description,
        )  # status, timestamps and counters take the column defaults, filled in on insert
        with self._stored(source_dir, adapter.sha256):
            self._insert(row, self.store.path_of(adapter.sha256) if self.files_in_database else None, uploaded_by)
            crash_point("registry.inserted")
        return AdapterInfo.of(row)

    def replace(self, name: str, source_dir: Path, adapter: LoraAdapter, uploaded_by: str | None = None) -> AdapterInfo:
        """New weights under an existing name, validated: a new version (or an older one with the same content again),
        recorded checked, becomes current; the others stay for a rollback. On failure nothing changes."""
        with self._stored(source_dir, adapter.sha256), self._session(f"replace adapter {name!r}") as session:
            row = self._row(session, name)
            self._add_files(session, adapter.sha256)
            version = self._version(session, row.id, adapter.sha256)
            if version is None:
                version = AdapterVersionRow(
                    adapter_id=row.id, sha256=adapter.sha256, rank=adapter.rank, alpha=adapter.alpha,
                    target_modules=",".join(adapter.target_modules), size_bytes=adapter.num_bytes,
                    uploaded_by=uploaded_by,
                )  # fmt: skip
                session.add(version)
                session.flush()
            record_check(session, adapter.sha256, None)
            return self._make_current(session, row, version)

    def versions(self, name: str) -> builtins.list[AdapterVersion]:
        """Every version of the adapter, oldest first; raises AdapterNotFoundError."""
        with self._session(f"read the versions of adapter {name!r}") as session:
            row = self._row(session, name, lock=False)
            query = select(AdapterVersionRow).where(AdapterVersionRow.adapter_id == row.id)
            rows = session.scalars(query.order_by(AdapterVersionRow.created_at, AdapterVersionRow.id))
            return [AdapterVersion.of(version, row.sha256) for version in rows]

    def rollback(self, name: str, sha256: str) -> AdapterInfo:
        """Make the version with content `sha256` current again; AdapterNotFoundError for an unknown adapter,
        VersionNotFoundError for a content it never had."""
        with self._session(f"roll adapter {name!r} back") as session:
            row = self._row(session, name)
            version = self._version(session, row.id, sha256)
            if version is None:
                raise VersionNotFoundError(name, sha256)
            return self._make_current(session, row, version)

    def stored_hashes(self) -> set[str]:
        """The content hashes some adapter or version names: the stored files that must stay."""
        with self._session("list the stored contents") as session:
            return set(session.scalars(select(AdapterRow.sha256))) | set(
                session.scalars(select(AdapterVersionRow.sha256))
            )

    def list(self) -> builtins.list[AdapterInfo]:
        """Every adapter, ordered by name."""
        with self._session("list adapters") as session:
            return [AdapterInfo.of(row) for row in session.scalars(select(AdapterRow).order_by(AdapterRow.name))]

    def get(self, name: str) -> AdapterInfo | None:
        """The adapter named `name`, or None."""
        with self._session(f"read adapter {name!r}") as session:
            row = session.scalar(select(AdapterRow).where(AdapterRow.name == name))
            return None if row is None else AdapterInfo.of(row)

    def update(
        self,
        name: str,
        *,
        description: str | _Unset | None = _Unset.UNSET,
        system_prompt: str | _Unset | None = _Unset.UNSET,
    ) -> AdapterInfo:
        """Change the given fields (None clears one, a left-out one stays); raises AdapterNotFoundError."""
        changes = {"description": description, "system_prompt": system_prompt}
        return self._change(name, **{key: value for key, value in changes.items() if value is not _Unset.UNSET})

    def mark_failed(self, name: str, reason: str) -> AdapterInfo:
        """Stop serving the adapter, recording why; raises AdapterNotFoundError."""
        return self._change(name, status=AdapterStatus.FAILED.value, status_reason=reason)

    def mark_ready(self, name: str) -> AdapterInfo:
        """Serve the adapter again; raises AdapterNotFoundError."""
        return self._change(name, status=AdapterStatus.READY.value, status_reason=None)

    def set_pinned(self, name: str, pinned: bool) -> AdapterInfo:
        """Keep the adapter in a device slot on every server (or not); raises AdapterNotFoundError."""
        return self._change(name, pinned=pinned)

    def delete(self, name: str) -> AdapterInfo:
        """Unregister the adapter and its versions; their files go too unless another adapter uses the same content."""
        with self._files_lock:
            with self._session(f"delete adapter {name!r}") as session:
                row = self._row(session, name)
                info = AdapterInfo.of(row)
                query = select(AdapterVersionRow).where(AdapterVersionRow.adapter_id == row.id)
                versions = list(session.scalars(query))
                contents = {info.sha256} | {version.sha256 for version in versions}
                for version in versions:
                    session.delete(version)
                # The versions' DELETEs first: after the row's, its ON DELETE CASCADE would leave them none to match.
                session.flush()
                session.delete(row)
                announce(session, name)
                session.flush()
                unused = [sha256 for sha256 in sorted(contents) if not self._num_users(session, sha256)]
                for sha256 in unused:
                    if (files := session.get(AdapterFilesRow, sha256)) is not None:
                        session.delete(files)
                session.commit()
            for sha256 in unused:
                self._remove_files(sha256)
        return info

    def remove_unused_files(self, sha256: str) -> None:
        """Remove this server's copy of `sha256`'s files if no adapter or version names them (another server
        deleted the last)."""
        with self._files_lock, self._session(f"count the adapters of {sha256}") as session:
            if not self._num_users(session, sha256):
                self._remove_files(sha256)

    @staticmethod
    def _num_users(session: Session, sha256: str) -> int:
        adapters = session.scalar(select(func.count()).where(AdapterRow.sha256 == sha256)) or 0
        versions = session.scalar(select(func.count()).where(AdapterVersionRow.sha256 == sha256)) or 0
        return adapters + versions

    def _remove_files(self, sha256: str) -> None:
        try:
            self.store.remove(sha256)
        except OSError as error:  # no row names them: orphaned files are only wasted space
            logger.warning("files %s no adapter names stay on disk: %s", sha256, error)

    def add_usage(self, usage: dict[str, Usage]) -> None:
        """Add to each adapter's counters in one transaction; usage of adapters deleted meanwhile is dropped."""
        with self._session(f"count usage of {len(usage)} adapters") as session:
            for name, counts in usage.items():
                session.execute(
                    update(AdapterRow)
                    .where(AdapterRow.name == name)
                    .values(
                        request_count=AdapterRow.request_count + counts.requests,
                        prompt_token_count=AdapterRow.prompt_token_count + counts.prompt_tokens,
                        completion_token_count=AdapterRow.completion_token_count + counts.completion_tokens,
                    )
                )
            session.commit()

    def ping(self) -> None:
        """One round trip to the database; RegistryError if it fails."""
        with self._session("reach the registry database") as session:
            session.execute(select(1))

    def verify_all(self) -> builtins.list[AdapterInfo]:
        """Re-hash every ready adapter's stored files, mark those missing or changed failed; returns all adapters."""
        verify = functools.cache(self.local_files_problem)  # once per shared directory
        for info in self.list():
            if info.status is AdapterStatus.READY and (reason := verify(info.sha256)) is not None:
                logger.warning("adapter %r marked failed: %s", info.name, reason)
                with contextlib.suppress(AdapterNotFoundError):  # deleted meanwhile
                    self.mark_failed(info.name, reason)
        return self.list()

    def files_of(self, info: AdapterInfo) -> Path:
        """The directory holding the adapter's adapter_config.json and adapter_model.safetensors (with
        `files_in_database`, copied from the database first if this server's store lacks them)."""
        self.local_files_problem(info.sha256)
        return self.store.path_of(info.sha256)

    def local_files_problem(self, sha256: str) -> str | None:
        """None when this server's store holds the files of `sha256` intact, else why not; with `files_in_database`,
        missing or damaged files are first copied from the database."""
        problem = self.store.verify(sha256)
        if problem is None or not self.files_in_database:
            return problem
        with self._session(f"read the files of {sha256}") as session:
            files = session.get(AdapterFilesRow, sha256)
            if files is None:
                return f"{problem}; the database holds no copy"
            contents = (files.config, files.weights)
        fetched = self.store.staging_dir()
        try:
            for name, content in zip(FILES, contents, strict=True):
                (fetched / name).write_bytes(content)
            self.store.put(fetched, sha256)  # AdapterError if the copy does not hash to sha256
        finally:
            shutil.rmtree(fetched, ignore_errors=True)
        return None

    @contextlib.contextmanager
    def _stored(self, source_dir: Path, sha256: str) -> Iterator[None]:
        """The files in the store for the block's database change; removed again if it fails and they were new."""
        with self._files_lock:
            # Under the lock, files present before `put` belong to other rows (or to none yet).
            had_files = self.store.path_of(sha256).is_dir()
            self.store.put(source_dir, sha256)
            try:
                yield
            except BaseException:
                if not had_files:
                    self.store.remove(sha256)
                raise

    def _add_files(self, session: Session, sha256: str) -> None:
        """With `files_in_database`: the content's bytes, unless the database has them."""
        if self.files_in_database and session.get(AdapterFilesRow, sha256) is None:
            files = self.store.path_of(sha256)
            contents = [(files / name).read_bytes() for name in FILES]
            session.add(AdapterFilesRow(sha256=sha256, config=contents[0], weights=contents[1]))

    @staticmethod
    def _version(session: Session, adapter_id: int, sha256: str) -> AdapterVersionRow | None:
        query = select(AdapterVersionRow).where(
            AdapterVersionRow.adapter_id == adapter_id, AdapterVersionRow.sha256 == sha256
        )
        return session.scalar(query)

    @staticmethod
    def _make_current(session: Session, row: AdapterRow, version: AdapterVersionRow) -> AdapterInfo:
        for column in ("sha256", "rank", "alpha", "target_modules", "size_bytes"):
            setattr(row, column, getattr(version, column))
        row.status, row.status_reason, row.updated_at = AdapterStatus.READY.value, None, utc_now()
        announce(session, row.name)
        session.commit()
        return AdapterInfo.of(row)

    def _insert(self, row: AdapterRow, files: Path | None, uploaded_by: str | None) -> None:
        """Add the row and its first version (and, given the stored directory `files`, its content's bytes unless
        the database has them)."""
        with self._session(f"register adapter {row.name!r}") as session:
            if files is not None:
                self._add_files(session, row.sha256)
            session.add(row)
            try:
                announce(session, row.name)
                session.flush()  # the row's id for its version; a taken name raises here
                session.add(AdapterVersionRow(
                    adapter_id=row.id, sha256=row.sha256, rank=row.rank, alpha=row.alpha,
                    target_modules=row.target_modules, size_bytes=row.size_bytes, created_at=row.created_at,
                    uploaded_by=uploaded_by,
                ))  # fmt: skip
                record_check(session, row.sha256, None)
                session.commit()
            except IntegrityError as error:
                session.rollback()
                if self.get(row.name) is not None:  # created by another caller since the check
                    raise AdapterExistsError(row.name) from error
                if files is None:
                    raise
                self._insert(AdapterRow(**_columns(row)), None, uploaded_by)  # another server stored these bytes

    def _change(self, name: str, **values: object) -> AdapterInfo:
        with self._session(f"update adapter {name!r}") as session:
            row = self._row(session, name)
            for key, value in values.items():
                setattr(row, key, value)
            row.updated_at = utc_now()
            announce(session, name)
            session.commit()
            return AdapterInfo.of(row)

    @staticmethod
    def _row(session: Session, name: str, lock: bool = True) -> AdapterRow:
        query = select(AdapterRow).where(AdapterRow.name == name)
        row = session.scalar(query.with_for_update() if lock else query)
        if row is None:
            raise AdapterNotFoundError(name)
        return row

    @contextlib.contextmanager
    def _session(self, action: str) -> Iterator[Session]:
        """A session whose database failures surface as RegistryError naming `action` and the URL."""
        try:
            with self._sessions() as session:
                yield session
        except SQLAlchemyError as error:
            raise RegistryError(
                f"cannot {action}: registry database {self._url} failed: {driver_message(error)}"
            ) from error


def _columns(row: AdapterRow) -> dict[str, object]:
    """A row's column values but its id (a fresh row of them can be added again after a rollback)."""
    return {column.key: getattr(row, column.key) for column in AdapterRow.__table__.columns if column.key != "id"}
