"""Stored adapter files no check has recorded, checked in the child process before this process reads them.

Files written before uploads were checked in a child (adapter_sandbox.py), or put in the store by hand, are found at
start (registry/adapter_checks.py), checked in the child once per content hash, and the verdict recorded, so a restart
checks nothing again. The server does not wait for them: it serves the adapters already checked at once, and each of the
others once its check passed; a request for one meanwhile gets 503 `unavailable`, and its check goes to the front.
Refused files fail their adapters, with the reason, in the verdict's own transaction. A check that cannot finish (the
registry away, no process to fork) is tried again RETRY_SECONDS later; one content's check never holds up another's
beyond its own wall-time limit (SandboxLimits).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.errors import AdapterError
from loraserve.registry import Registry
from loraserve.registry.adapter_checks import PendingCheck, failure_reason
from loraserve.server.registry_calls import RegistryCalls

logger = logging.getLogger(__name__)

# Children are niced below the engine; on two cores one at a time leaves a core to serving.
CONCURRENT_CHECKS = max(1, min(4, (os.cpu_count() or 1) // 2))
RETRY_SECONDS = 30.0


class StoredChecks:
    """Owns the contents waiting for their check and the checks under way (one per content, whoever asks)."""

    def __init__(self, registry: Registry, calls: RegistryCalls, engine: AsyncLLMEngine) -> None:
        self.registry = registry
        self.calls = calls
        self.engine = engine
        self._queue: list[PendingCheck] = []
        self._waiting: set[str] = set()  # adapters served once their content's check passed
        self._wanted: set[str] = set()  # of those, asked for by a request: checked first
        self._checking: dict[str, asyncio.Future[str | None]] = {}

    def load(self) -> set[str]:
        """At start (before serving): the contents to check; returns the adapters that wait for them."""
        self._queue = self.registry.checks.pending()
        self._waiting = {name for pending in self._queue for name in pending.names}
        if self._queue:
            logger.warning(
                "%d stored adapter contents (adapters: %d) have no recorded check: checking each once in a child "
                "process; those adapters are served once theirs passed",
                len(self._queue), len(self._waiting),
            )  # fmt: skip
        return set(self._waiting)

    def is_waiting(self, name: str) -> bool:
        """Whether `name` waits for its check; asking moves that check to the front."""
        if name not in self._waiting:
            return False
        self._wanted.add(name)
        return True

    async def run(self, serve: Callable[[str], Awaitable[None]]) -> None:
        """Check every content found at start, CONCURRENT_CHECKS at a time; `serve(name)` each adapter waiting for
        one once its verdict is recorded (it serves the adapter as its record now says: ready, or failed)."""
        started, total = time.monotonic(), len(self._queue)
        while self._queue:
            retry: list[PendingCheck] = []
            await asyncio.gather(*(self._work(serve, retry) for _ in range(CONCURRENT_CHECKS)))
            if retry:
                await asyncio.sleep(RETRY_SECONDS)
                self._queue.extend(retry)
        if total:
            logger.info(
                "checked the %d stored adapter contents found at start in %.1f s", total, time.monotonic() - started
            )

    async def _work(self, serve: Callable[[str], Awaitable[None]], retry: list[PendingCheck]) -> None:
        while self._queue:
            pending = self._take()
            try:
                await self.problem(pending.sha256)
                for name in pending.names:
                    await serve(name)
                    self._waiting.discard(name)
            except Exception as error:  # the registry away, no child forked: not a verdict on the files
                logger.warning("stored adapter files %s not checked yet (again in %g s): %s", pending.sha256,
                               RETRY_SECONDS, error)  # fmt: skip
                retry.append(pending)

    def _take(self) -> PendingCheck:
        """The next content to check: one an asked-for adapter waits for, else the first."""
        index = next((i for i, p in enumerate(self._queue) if self._wanted.intersection(p.names)), 0)
        return self._queue.pop(index)

    async def problem(self, sha256: str) -> str | None:
        """Why the stored files of `sha256` may not be served, as an adapter's status reason: refused by their check
        (recorded, or run now and recorded), or missing or changed here (not a verdict: nothing was checked); None
        when they passed."""
        if (checking := self._checking.get(sha256)) is None:
            checking = self._checking[sha256] = asyncio.ensure_future(self._check(sha256))
            checking.add_done_callback(lambda _: self._checking.pop(sha256, None))
        return await asyncio.shield(checking)

    async def _check(self, sha256: str) -> str | None:
        verdict = await self.calls(f"read the check of {sha256}", self.registry.checks.verdict, sha256, wait=True)
        if verdict is not None:
            return None if verdict.error is None else failure_reason(verdict.error)
        # Hashed again (copied from the database first, with files_in_database): the check is of the named bytes.
        missing = await self.calls(f"verify the files {sha256}", self.registry.local_files_problem, sha256, wait=True)
        if missing is not None:
            logger.warning("stored adapter files %s cannot be checked: %s", sha256, missing)
            return missing
        try:  # off the event loop and the engine thread; the work itself in a child
            await asyncio.to_thread(self.engine.check_adapter, self.registry.store.path_of(sha256))
            error = None
        except AdapterError as refused:
            error = str(refused)  # "field: why"
        failed = await self.calls(
            f"record the check of {sha256}", self.registry.checks.record, sha256, error, wait=True
        )
        if error is None:
            return None
        logger.error("stored adapter files %s refused by their check (adapters failed: %s): %s", sha256,
                     ", ".join(failed) or "none", error)  # fmt: skip
        return failure_reason(error)
