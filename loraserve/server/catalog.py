"""The adapters the server offers: the registry's records kept in step with the engine.

Every change goes registry first, engine second, and is undone in the registry when the engine refuses it, so a restart
always sees what was served. Changes to one name are serialized (an upload and a delete of it cannot interleave); a
change once started goes on when its client stops waiting for a hung database, and is applied, or fails, whole once the
database answers. Request-path reads (name -> record, for routing and personas) come from the catalog's own map, set
on the event loop as soon as the engine took each change (the engine keeps no server data). Usage counts gather in
memory and reach the database in the background, only through RegistryCalls, never on a thread inference needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import weakref
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

from loraserve.crash_points import crash_point
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.errors import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterRetiringError,
    AdapterUnavailableError,
    RegistryUnavailableError,
    UnknownAdapterError,
    VersionNotFoundError,
)
from loraserve.lora.adapter import CONFIG_FILE, LoraAdapter
from loraserve.registry import AdapterInfo, AdapterStatus, Registry
from loraserve.registry.adapter_info import AdapterVersion
from loraserve.registry.consistency import check_registry
from loraserve.server.registry_calls import RegistryCalls
from loraserve.server.stored_checks import StoredChecks
from loraserve.server.usage_buffer import UsageBuffer

logger = logging.getLogger(__name__)

T = TypeVar("T")

USAGE_FLUSH_SECONDS = 2.0
FULL_SYNC_SECONDS = 30.0


class AdapterCatalog:
    def __init__(self, registry: Registry, engine: AsyncLLMEngine, calls: RegistryCalls) -> None:
        self.registry = registry  # used directly only before the server serves (load_registered, samples)
        self.calls = calls
        self.engine = engine
        self.base_model = engine.model_name
        self.usage = UsageBuffer()  # finished requests' counts, for the next flush
        self.checks = StoredChecks(registry, calls, engine)  # stored files no check has recorded
        self._served: dict[str, AdapterInfo] = {}  # name -> the registry's record the engine serves it as
        self._name_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._changes: set[asyncio.Task[object]] = set()  # referenced until done, or they may vanish

    def load_registered(self, min_orphan_age: float) -> None:
        """At start (before the engine thread runs): check the registry against its files, removing the orphans of a
        crash mid-upload (consistency.py), and serve the sound adapters whose files were checked (the others once
        `check_stored` checked them)."""
        report = check_registry(self.registry, repair=True, min_orphan_age=min_orphan_age)
        waiting = self.checks.load()
        for info in report.adapters:
            if info.status is not AdapterStatus.READY:
                logger.warning("adapter %r not served: %s", info.name, info.status_reason)
                continue
            if info.name in waiting:
                continue
            # Read at its first request (the hash was just checked); thousands may be registered.
            self.engine.register_adapter(info.name, self.registry.files_of(info), info.sha256)
            self._now_serving(info)

    def register_samples(self, directory: Path) -> None:
        """Register each PEFT directory under `directory` by its directory name (those not registered yet)."""
        for path in sorted(p for p in directory.glob("*") if (p / CONFIG_FILE).is_file()):
            if self.registry.get(path.name) is not None:
                continue
            adapter = self.engine.read_adapter(path)
            readme = path / "README.md"
            # The persona line: the first paragraph after the README's title.
            lines = [line for line in readme.read_text().splitlines()[1:] if line.strip()] if readme.exists() else []
            with contextlib.suppress(AdapterExistsError):  # another server sharing the database was first
                self.registry.create(path.name, path, adapter, self.base_model, None, lines[0] if lines else None)

    async def check_stored(self) -> None:
        """Check in the child the stored files found unchecked at start, serving each adapter once its check passed."""
        await self.checks.run(self.sync)

    def get(self, name: str) -> AdapterInfo:
        """The ready adapter called `name`; AdapterUnavailableError (503) while its stored files are checked,
        UnknownAdapterError (404) otherwise."""
        if (info := self._served.get(name)) is not None:
            return info
        if self.checks.is_waiting(name):
            raise AdapterUnavailableError(f"adapter {name!r} is served once its stored files are checked: try again")
        raise UnknownAdapterError(name)

    def serves(self, name: str) -> bool:
        return name in self._served

    @property
    def ready(self) -> list[AdapterInfo]:
        return sorted(self._served.values(), key=lambda info: info.name)

    async def records(self) -> list[AdapterInfo]:
        """Every registered adapter, from the database (with its counters)."""
        return await self.calls("list adapters", self.registry.list)

    async def record(self, name: str) -> AdapterInfo | None:
        return await self.calls(f"read adapter {name!r}", self.registry.get, name)

    async def add(
        self, name: str, source_dir: Path, system_prompt: str | None, description: str | None,
        uploaded_by: str | None = None,
    ) -> AdapterInfo:  # fmt: skip
        """Validate the PEFT directory against the base model, store it, serve it. All or nothing."""
        if name == self.base_model:
            raise AdapterError("name", f"{name!r} is the base model's id")
        # Out of this process and off the engine thread: a hostile file stalls no request (adapter_sandbox.py).
        adapter = await asyncio.to_thread(self.engine.read_adapter, source_dir, False)
        crash_point("upload.validated")

        async def change() -> AdapterInfo:  # AdapterExistsError (409) from `create` if the name is taken
            info = await self.calls(
                f"register adapter {name!r}", self.registry.create, name, source_dir, adapter, self.base_model,
                system_prompt, description, uploaded_by, wait=True,
            )  # fmt: skip
            stored = await self.calls(f"verify the files of adapter {name!r}", self.registry.files_of, info, wait=True)
            try:
                await self.engine.call(lambda engine: engine.register_adapter(name, stored, info.sha256, adapter))
            except BaseException:
                await self.calls(f"delete adapter {name!r}", self.registry.delete, name, wait=True)
                raise
            self._served[name] = info
            crash_point("upload.served")
            return info

        return await self._change(name, change())

    async def replace(self, name: str, source_dir: Path, uploaded_by: str | None) -> AdapterInfo:
        """New weights for an adapter: validated, stored as its new version, served to the requests that have not
        started (the others finish on the old). All or nothing."""
        adapter = await asyncio.to_thread(self.engine.read_adapter, source_dir, False)

        async def change() -> AdapterInfo:
            before = await self.record(name)
            info = await self.calls(
                f"replace adapter {name!r}", self.registry.replace, name, source_dir, adapter, uploaded_by, wait=True
            )  # AdapterNotFoundError (404) for a name not registered
            try:
                await self._serve_version(info, adapter)
            except BaseException:
                if before is not None:
                    restore = self.registry.rollback
                    await self.calls(f"restore adapter {name!r}", restore, name, before.sha256, wait=True)
                raise
            return info

        return await self._change(name, change())

    async def rollback(self, name: str, sha256: str) -> AdapterInfo:
        """Serve an earlier version again (VersionNotFoundError, 404, for a content it never had; AdapterError, 422,
        for one whose check refused its files)."""

        async def change() -> AdapterInfo:
            if sha256 not in {version.sha256 for version in await self.versions(name)}:
                raise VersionNotFoundError(name, sha256)
            # Its check's verdict: recorded, or run now (the start's checks have not come to it yet).
            if (problem := await self.checks.problem(sha256)) is not None:
                raise AdapterError("sha256", f"version {sha256} cannot be served: {problem}")
            info = await self.calls(f"roll adapter {name!r} back", self.registry.rollback, name, sha256, wait=True)
            await self._serve_version(info, None)
            return info

        return await self._change(name, change())

    async def versions(self, name: str) -> list[AdapterVersion]:
        return await self.calls(f"read the versions of adapter {name!r}", self.registry.versions, name)

    async def _serve_version(self, info: AdapterInfo, adapter: LoraAdapter | None) -> None:
        """Serve the registry's current version of `info.name` here: in place of the one served (its started requests
        finish on it), or anew; `adapter` when just read, else read at its first request."""
        files = await self.calls(f"copy the files of adapter {info.name!r}", self.registry.files_of, info, wait=True)
        if self.serves(info.name):
            await self.engine.call(lambda engine: engine.replace_adapter(info.name, files, info.sha256, adapter))
        else:
            await self.engine.call(lambda engine: engine.register_adapter(info.name, files, info.sha256, adapter))
        self._now_serving(info)

    async def update(self, name: str, **changes: str | None) -> AdapterInfo:
        async def change() -> AdapterInfo:
            info = await self.calls(
                f"update adapter {name!r}", lambda: self.registry.update(name, **changes), wait=True
            )
            if self.serves(name):
                self._served[name] = info
            return info

        return await self._change(name, change())

    async def set_pinned(self, name: str, pinned: bool) -> AdapterInfo:
        """Kept in a device slot (or not) here now, and by every server sharing the registry and after restarts."""

        async def change() -> AdapterInfo:
            self.engine.set_pinned(name, pinned)  # AdapterError (no slot would stay unpinned) before the registry
            try:
                return await self.calls(f"pin adapter {name!r}", self.registry.set_pinned, name, pinned, wait=True)
            except BaseException:
                self.engine.set_pinned(name, not pinned)
                raise

        return await self._change(name, change())

    async def remove(self, name: str) -> AdapterInfo:
        """Forget the adapter: new requests get 404 at once, the ones running finish."""

        async def change() -> AdapterInfo:
            info = await self.calls(f"delete adapter {name!r}", self.registry.delete, name, wait=True)
            await self._stop_serving(name)
            return info

        return await self._change(name, change())

    async def mark_failed(self, name: str, reason: str) -> None:
        """The engine could not load a stored adapter: stop offering it now; the registry learns why later."""
        if not await self._stop_serving(name):
            return
        logger.error("adapter %r failed: %s", name, reason)
        self._in_background(
            self.calls(f"mark adapter {name!r} failed", self.registry.mark_failed, name, reason, wait=True)
        )

    async def _stop_serving(self, name: str) -> bool:
        """New requests for `name` get 404; the engine drains it. False if it was not served."""
        self._served.pop(name, None)
        try:
            await self.engine.call(lambda engine: engine.remove_adapter(name))
        except UnknownAdapterError:
            return False
        return True

    async def follow_registry_forever(self) -> None:
        """Serve what other servers sharing the registry database add, edit, fail and delete (change_feed.py); and,
        every FULL_SYNC_SECONDS, look at every adapter, for a change that could not be applied when it came."""
        if not self.registry.announces_changes:
            return
        loop, names = asyncio.get_running_loop(), asyncio.Queue[str | None]()
        stop = threading.Event()

        def deliver(name: str | None) -> None:  # on the listener's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                loop.call_soon_threadsafe(names.put_nowait, name)

        feed = threading.Thread(target=self.registry.follow, args=(deliver, stop), name="loraserve-registry-feed")
        feed.daemon = True
        feed.start()
        try:
            while True:
                try:
                    name = await asyncio.wait_for(names.get(), FULL_SYNC_SECONDS)
                except TimeoutError:
                    name = None
                try:
                    await (self.sync_all() if name is None else self.sync(name))
                except Exception as error:  # the registry down: the next full look retries
                    logger.warning("registry changes not applied yet: %s", error)
        finally:
            stop.set()

    async def sync_all(self) -> None:
        """`sync` each adapter whose registry record differs from the one served (missing, edited, replaced)."""
        listed = {info.name: _version(info) for info in await self.records()}
        served = {info.name: _version(info) for info in self.ready}
        for name in sorted(name for name in listed.keys() | served.keys() if listed.get(name) != served.get(name)):
            await self.sync(name)

    async def sync(self, name: str) -> None:
        """Serve `name` as its registry record now says: ready with these files, or not at all."""

        async def change() -> None:
            info = await self.record(name)  # read under the name's lock: no change of this server's overtakes it
            served = self._served.get(name)
            info = await self._checked(info, served)
            if info is None or info.status is not AdapterStatus.READY:
                if served is not None:  # deleted or failed: its requests finish first
                    await self._stop_serving(name)
                    await self.calls("remove unused files", self.registry.remove_unused_files, served.sha256, wait=True)
            elif served is not None and served.sha256 != info.sha256:  # replaced or rolled back: its started requests
                await self._serve_version(info, None)  # finish on the version they began with
                await self.calls("remove unused files", self.registry.remove_unused_files, served.sha256, wait=True)
            elif served is not None:
                self._now_serving(info)
            else:  # new here: its files may first come from the database (Registry.files_in_database)
                files = await self.calls(f"copy the files of adapter {name!r}", self.registry.files_of, info, wait=True)
                with contextlib.suppress(AdapterRetiringError):  # its old version still drains: the next full look
                    await self.engine.call(lambda engine: engine.register_adapter(name, files, info.sha256))
                    self._now_serving(info)

        await self._change(name, change())

    async def _checked(self, info: AdapterInfo | None, served: AdapterInfo | None) -> AdapterInfo | None:
        """The record `info`, or, when it names ready files this server does not serve yet that may not be served
        (their check refused them, or they are missing), it marked failed (None: deleted meanwhile)."""
        if info is None or info.status is not AdapterStatus.READY or (served and served.sha256 == info.sha256):
            return info
        if (problem := await self.checks.problem(info.sha256)) is None:
            return info
        with contextlib.suppress(AdapterNotFoundError):
            mark_failed = self.registry.mark_failed
            return await self.calls(f"mark adapter {info.name!r} failed", mark_failed, info.name, problem, wait=True)
        return None

    def _now_serving(self, info: AdapterInfo) -> None:
        """The engine serves `info.name` as `info` from now on: requests read it here; its pin is applied."""
        self._served[info.name] = info
        if info.pinned == self.engine.is_pinned(info.name):
            return
        try:
            self.engine.set_pinned(info.name, info.pinned)
        except AdapterError as error:  # this server has fewer slots than the one that pinned it
            logger.warning("adapter %r is pinned in the registry but not here: %s", info.name, error)

    async def flush_usage(self) -> None:
        """Write the gathered counts; on failure they go back into the buffer for the next flush."""
        counts = self.usage.take()
        if not counts:
            return
        try:
            await self.calls("record usage", self.registry.add_usage, counts, wait=True)
        except BaseException:
            self.usage.put_back(counts)
            raise

    async def flush_usage_forever(self) -> None:
        while True:
            await asyncio.sleep(USAGE_FLUSH_SECONDS)
            try:
                await self.flush_usage()
            except Exception as error:  # kept for the next flush; counters never fail a request
                logger.warning("usage of %d adapters not recorded yet: %s", len(self.usage), error)

    async def _change(self, name: str, change: Awaitable[T]) -> T:
        """Run `change` alone among the changes to `name`; past `calls.timeout` its client gets a 503; it goes on."""
        lock = self._name_locks.setdefault(name, asyncio.Lock())

        async def locked() -> T:
            async with lock:
                return await change

        task = self._in_background(locked())
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.calls.timeout)
        except TimeoutError:
            raise RegistryUnavailableError(
                f"registry unavailable: the database did not answer within {self.calls.timeout:g} s; the change to "
                f"adapter {name!r} goes on, and is applied if the database answers later "
                f"(GET /admin/adapters/{name} tells; an upload's files are gone by then, so send it again)"
            ) from None

    def _in_background(self, work: Awaitable[T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(work)
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # its client saw any error
        return task

    async def close(self, timeout: float) -> None:
        """At shutdown: wait for changes under way and write the last usage counts, `timeout` seconds at most."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._changes, self.flush_usage(), return_exceptions=True), timeout)
        if len(self.usage):
            logger.warning("usage of %d adapters not recorded: the registry did not answer", len(self.usage))


def _version(info: AdapterInfo) -> tuple[str, str, object]:
    """What tells two records of an adapter apart but its usage counters (every change sets updated_at)."""
    return info.sha256, info.status, info.updated_at
