"""Adapters in three tiers: the registry's files on disk, a host cache in CPU memory, the device pool.

The scheduler calls `acquire` before it admits a sequence of an adapter. READY: the
adapter is in a slot, its rows in pages of the memory pool. Otherwise a load starts and
the sequence waits while the rest of the batch runs. A load needs a slot and as many
pages as the adapter's rows fill (known once it was read); idle adapters (no running
sequence, no pin) are evicted least recently used first to make room. Loads run on a
worker thread, off the step loop: disk -> host (read, validated, hash checked) -> a copy
into the reserved pages, which no step reads until the copy is done. `prefetch` starts
the disk read when a request is queued. The KV side may evict idle adapters too
(`reclaim_pages`): an idle adapter is a cache, a running sequence is not.
Example with 2 slots: A and B run; C waits until the last sequence of A or B ends.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.errors import AdapterError, UnknownAdapterError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.host_cache import HostCache
from loraserve.lora.residency import Residency
from loraserve.lora.slots import AdapterSlots
from loraserve.openmp import keep_serial

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSource:
    path: Path  # a PEFT directory
    sha256: str | None  # the content hash the files must have; None: not checked


@dataclass
class AdapterStats:
    """What the manager did since start; served by /metrics and /admin/pool."""

    loads: int = 0
    evictions: int = 0
    load_seconds_total: float = 0.0
    disk_reads: int = 0
    # Called with each load's duration (the server's latency histogram listens here).
    load_observers: list[Callable[[float], None]] = field(default_factory=list)


class AdapterManager:
    """Owns the tiers; the only code that moves adapter weights. Its lock guards all state."""

    def __init__(
        self, slots: AdapterSlots, read: Callable[[Path], LoraAdapter], host_cache_bytes: int = 4 << 30
    ) -> None:
        self.slots = slots
        self.stats = AdapterStats()
        self.host = HostCache(host_cache_bytes)
        self._read = read
        self._lock = threading.Lock()
        self._loaded = threading.Condition(self._lock)  # notified whenever a load ends
        self._sources: dict[str, AdapterSource] = {}
        self._failures: dict[str, str] = {}
        self._ranks: dict[str, tuple[int, int]] = {}  # name -> (rank, file bytes), known once read
        self._pages_needed: dict[str, int] = {}  # name -> pool pages it fills, known once read
        self._wanted: set[str] = set()  # acquired or pinned before its size was known: reserve once read
        self._running: Counter[str] = Counter()  # running sequences per adapter
        self._pinned: set[str] = set()
        self._last_used: dict[str, int] = {}
        self._clock = itertools.count()
        self._jobs: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._pending = 0  # queued or running jobs
        self._worker = threading.Thread(target=self._work, name="loraserve-adapter-loader", daemon=True)
        self._worker.start()
        slots.pool.pages.reclaimer = self.reclaim_pages

    def register(self, name: str, source: AdapterSource, adapter: LoraAdapter | None = None) -> None:
        """Offer an adapter; `adapter` when it was just read (an upload) goes straight to the host cache."""
        if self.slots.num_slots == 0:
            raise AdapterError("max_loras", "LoRA is disabled (max_loras=0); start with at least one adapter slot")
        with self._lock:
            if name in self._sources:
                raise AdapterError("name", f"adapter {name!r} is already loaded")
            self._sources[name] = source
            if adapter is not None:
                self._remember(name, adapter)

    def unregister(self, name: str) -> None:
        """Forget the adapter and free its slot; the caller made sure nothing runs with it."""
        with self._lock:
            if name not in self._sources:
                raise UnknownAdapterError(name)
            assert not self._running[name], f"adapter {name!r} still has running sequences"
            del self._sources[name]
            for table in (self._failures, self._ranks, self._pages_needed, self._last_used):
                table.pop(name, None)
            self._pinned.discard(name)
            self._wanted.discard(name)
            self.host.drop(name)
            if name in self.slots:
                self.slots.unload(name)
            # A reserved slot stays with its in-flight load, which sees the name gone and frees it.

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    @property
    def names(self) -> list[str]:
        return list(self._sources)

    def rank_and_bytes(self, name: str) -> tuple[int, int] | None:
        return self._ranks.get(name)

    def residency(self, name: str) -> str:
        """Where the weights are: "device" (a slot), "host" (CPU memory) or "disk"."""
        return "device" if name in self.slots else "host" if name in self.host else "disk"

    def prefetch(self, name: str) -> None:
        """A request for `name` was queued: read it from disk now unless it is in memory already."""
        with self._lock:
            if name not in self.slots and name not in self.host:
                self._enqueue(name)

    def acquire(self, name: str) -> Residency:
        """Called by the scheduler per sequence it would admit; READY counts one more running sequence."""
        with self._lock:
            if name in self.slots:
                self._running[name] += 1
                self._last_used[name] = next(self._clock)
                return Residency.READY
            if name in self._failures:
                return Residency.FAILED
            if self.slots.is_reserved(name):
                return Residency.LOADING
            return self._start_load(name)

    def content_hash(self, name: str) -> str:
        """The sha256 of the resident adapter's files: what its prefix-cache blocks are keyed by."""
        with self._lock:
            return self.slots.content_hash(name)

    def release(self, name: str) -> None:
        with self._lock:
            self._running[name] -= 1
            if not self._running[name]:
                del self._running[name]

    def drain_candidate(self) -> str | None:
        """The unpinned resident adapter that frees its slot soonest: fewest running sequences, then LRU."""
        with self._lock:
            candidates = [n for n in self.slots.names if n not in self._pinned]
            if not candidates:
                return None
            return min(candidates, key=lambda n: (self._running[n], self._last_used.get(n, -1)))

    def failure(self, name: str) -> str | None:
        return self._failures.get(name)

    def pin(self, name: str) -> None:
        """Keep the adapter in a slot from now on: loaded now if a slot can be had, never evicted."""
        with self._lock:
            if name not in self._sources:
                raise UnknownAdapterError(name)
            if name not in self._pinned and len(self._pinned) + 1 >= self.slots.num_slots:
                # One slot always stays unpinned, or no other adapter could ever run.
                limit = self.slots.num_slots - 1
                raise AdapterError("pin", f"at most {limit} of {self.slots.num_slots} slots may be pinned")
            self._pinned.add(name)
            if name not in self.slots and not self.slots.is_reserved(name):
                self._start_load(name)

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pinned.discard(name)

    def is_pinned(self, name: str) -> bool:
        return name in self._pinned

    def wait_for_load(self, timeout: float) -> None:
        """Block until some load ends (or `timeout`): a step with nothing to run waits here."""
        with self._loaded:
            if self._pending:
                self._loaded.wait(timeout)

    def wait_resident(self, name: str, timeout: float = 30) -> bool:
        """Until `name` is in a slot (True), or its load failed, found no room or `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        with self._loaded:
            while name not in self.slots and self._load_in_flight(name) and time.monotonic() < deadline:
                self._loaded.wait(deadline - time.monotonic())
            return name in self.slots

    def _load_in_flight(self, name: str) -> bool:
        return self.slots.is_reserved(name) or (name in self._wanted and name not in self._failures)

    def wait_idle(self, timeout: float = 30) -> bool:
        """Until no load is queued or running; True if so."""
        deadline = time.monotonic() + timeout
        with self._loaded:
            while self._pending and time.monotonic() < deadline:
                self._loaded.wait(deadline - time.monotonic())
            return not self._pending

    def _start_load(self, name: str) -> Residency:
        """Reserve room and queue the copy; or, size unknown, queue the read that reserves after it."""
        if name not in self._pages_needed:
            if name not in self._wanted:
                self._wanted.add(name)
                self._enqueue(name)
            return Residency.LOADING
        if not self._reserve(name):
            return Residency.NO_SLOT
        self._enqueue(name)
        return Residency.LOADING

    def _reserve(self, name: str, evict: bool = True) -> bool:
        """A slot and the adapter's pages, evicting idle adapters (least recently used first) for them."""
        need, pages = self._pages_needed[name], self.slots.pool.pages
        idle = sorted(self._idle(), key=lambda n: self._last_used.get(n, -1)) if evict else []
        reachable = pages.num_free + sum(self.slots.pages_of(n) for n in idle)
        if reachable < need or (self.slots.num_free == 0 and not idle):
            return False  # evicting would not make room: keep what is resident
        while (self.slots.num_free == 0 or pages.num_free < need) and idle:
            self._evict(idle.pop(0))
        return self.slots.reserve(name, need)

    def reclaim_pages(self, count: int) -> None:
        """The KV side is `count` pages short: evict idle adapters, least recently used first.

        Nothing is evicted when all of them together would not free enough.
        """
        with self._lock:
            idle = sorted(self._idle(), key=lambda n: self._last_used.get(n, -1))
            if sum(self.slots.pages_of(n) for n in idle) < count:
                return
            freed = 0
            for name in idle:
                if freed >= count:
                    break
                freed += self.slots.pages_of(name)
                self._evict(name)

    def _idle(self) -> list[str]:
        return [n for n in self.slots.names if not self._running[n] and n not in self._pinned]

    def _evict(self, name: str) -> None:
        self.slots.unload(name)
        self.stats.evictions += 1

    def _remember(self, name: str, adapter: LoraAdapter) -> None:
        self.host.put(name, adapter)
        self._ranks[name] = (adapter.rank, adapter.num_bytes)
        self._pages_needed[name] = self.slots.pages_needed(adapter)

    def _enqueue(self, name: str) -> None:
        self._pending += 1
        self._jobs.put(name)

    def _work(self) -> None:
        keep_serial()  # the step thread's OpenMP team must stay the only one (openmp.py)
        while (name := self._jobs.get()) is not None:
            try:
                self._load(name)
            except Exception:  # a bug: log it, free the slot, keep the worker alive for the others
                logger.exception("loading adapter %r failed", name)
                with self._lock:
                    self._failures[name] = "internal error while loading; see the server log"
            finally:
                with self._loaded:
                    if self.slots.is_reserved(name) and (name not in self._sources or name in self._failures):
                        self.slots.cancel(name)
                    self._pending -= 1
                    self._loaded.notify_all()

    def _load(self, name: str) -> None:
        started = time.perf_counter()
        with self._lock:
            source, adapter = self._sources.get(name), self.host.get(name)
        if source is None:
            return
        if adapter is None:
            try:
                adapter = self._read_checked(source)
            except (AdapterError, OSError) as error:
                with self._lock:
                    self._failures[name] = str(error)
                logger.error("adapter %r cannot be loaded: %s", name, error)
                return
            with self._lock:
                self.stats.disk_reads += 1
                if name in self._sources:
                    self._remember(name, adapter)
        with self._lock:
            if name in self._wanted and name in self._sources and name not in self.slots:
                self._wanted.discard(name)
                if not self.slots.is_reserved(name):
                    # Only free room: who gets an evicted adapter's place is the scheduler's call,
                    # made in queue order by its next acquire (which may answer NO_SLOT).
                    self._reserve(name, evict=False)
            reserved = self.slots.is_reserved(name) and name in self._sources
        if not reserved:
            return  # a prefetch: the host cache is warm
        self.slots.write(name, adapter)  # outside the lock: only this thread touches a reserved slot
        seconds = time.perf_counter() - started
        with self._lock:
            if name not in self._sources:
                return
            self.slots.activate(name)
            self.stats.loads += 1
            self.stats.load_seconds_total += seconds
        for observe in self.stats.load_observers:
            observe(seconds)

    def _read_checked(self, source: AdapterSource) -> LoraAdapter:
        adapter = self._read(source.path)
        if source.sha256 is not None and adapter.sha256 != source.sha256:
            raise AdapterError("sha256", f"stored files changed on disk: {adapter.sha256}, expected {source.sha256}")
        return adapter

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=30)
