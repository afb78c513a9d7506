"""Registry calls that a hung database cannot turn into a hung server.

Each call runs on a daemon thread of its own (so the process can exit while one still waits), at most MAX_CONCURRENT at
once, never on a thread inference needs. The caller waits `timeout` seconds at most, then gets RegistryUnavailableError
(503), while the thread stays with the database until it answers: a stopped PostgreSQL (SIGSTOP, a failover, a full WAL
disk) answers nothing, and no driver timeout fires, since the kernel still acknowledges every packet. The outcome of
every call, and of a probe every PROBE_SECONDS, says whether the registry is available.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from loraserve.errors import RegistryError, RegistryUnavailableError
from loraserve.registry import Registry

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_CONCURRENT = 8
PROBE_SECONDS = 2.0


class RegistryCalls:
    """Owns the registry's threads and its availability; the only way the running server reaches the database."""

    def __init__(self, registry: Registry, timeout: float = 10.0) -> None:
        self.registry = registry
        self.timeout = timeout
        self.is_available = True
        self._slots = asyncio.Semaphore(MAX_CONCURRENT)  # binds to the event loop that first waits on it
        self._probe: asyncio.Future[Any] | None = None

    async def __call__(self, action: str, function: Callable[..., T], *args: Any, wait: bool = False) -> T:
        """`function(*args)` on a registry thread; RegistryUnavailableError naming `action` ("list adapters") past
        `timeout` unless `wait` (for background work: usage counts, changes that must complete once started)."""
        future = self._start(function, *args)
        try:
            return await self._wait(action, future, None if wait else self.timeout)
        except RegistryUnavailableError:
            future.cancel()  # not started yet: it never will be; running: its answer is dropped
            raise

    async def probe_forever(self) -> None:
        """Check the database every PROBE_SECONDS, so availability recovers without a request."""
        while True:
            if self._probe is None or self._probe.done():  # a hung probe is not piled upon
                self._probe = self._start(self.registry.ping)
            with contextlib.suppress(RegistryError):  # _wait and _finish note what it says of availability
                await self._wait("reach the registry database", self._probe, self.timeout)
            await asyncio.sleep(PROBE_SECONDS)

    def _start(self, function: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                outcome: tuple[Callable[[Any], None], Any] = (future.set_result, function(*args))
            except BaseException as error:
                outcome = (future.set_exception, error)
            with contextlib.suppress(RuntimeError):  # the loop closed while the database kept this thread
                loop.call_soon_threadsafe(self._finish, future, *outcome)

        async def when_a_slot_is_free() -> None:
            await self._slots.acquire()
            threading.Thread(target=run, name="loraserve-registry", daemon=True).start()

        # An exception nobody waits for any more is marked seen (asyncio would log it as lost).
        future.add_done_callback(lambda done: done.cancelled() or done.exception())
        starting = asyncio.ensure_future(when_a_slot_is_free())
        future.add_done_callback(lambda _: starting.cancel())  # cancelled before a slot came: never run it
        return future

    def _finish(self, future: asyncio.Future[Any], set_outcome: Callable[[Any], None], value: Any) -> None:
        self._slots.release()
        self._note(value)
        if not future.done():
            set_outcome(value)

    async def _wait(self, action: str, future: asyncio.Future[T], timeout: float | None) -> T:
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except TimeoutError:
            self._note(None, answered=False)
            raise RegistryUnavailableError(
                f"registry unavailable: the database did not answer within {timeout:g} s (to {action})"
            ) from None

    def _note(self, value: Any, answered: bool = True) -> None:
        available = answered and not isinstance(value, RegistryError)
        if available != self.is_available:
            logger.warning("registry %s", "available again" if available else f"unavailable: {value or 'no answer'}")
        self.is_available = available
