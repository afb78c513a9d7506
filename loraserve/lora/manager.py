"""Adapters in three tiers: the registry's files on disk, a host cache in CPU memory, the device pool.

The scheduler calls `acquire` before it admits a sequence of an adapter: READY, it is in a slot (its
rows in pool pages); otherwise a load starts and the sequence waits while the batch runs. A load
needs a slot and the pages its rows fill (known once read); idle adapters (no running sequence, no
pin) are evicted least recently used first for room, by loads and by the KV side (`reclaim_pages`).
Loads run on a worker thread: disk -> host (read, validated, hash checked) -> a copy into reserved
pages no step reads until it is done. `prefetch` starts the disk read when a request is queued.
Example with 2 slots: A and B run; C waits until the last sequence of A or B ends.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.config import LATENCY_BUCKETS
from loraserve.errors import AdapterError, AdapterRetiringError, UnknownAdapterError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.adapter_state import AdapterRecord, AdapterSource, AdapterState
from loraserve.lora.host_cache import HostCache
from loraserve.lora.residency import NO_ADAPTER, Acquired, Residency
from loraserve.lora.slots import AdapterSlots
from loraserve.openmp import keep_serial

logger = logging.getLogger(__name__)

S = AdapterState


@dataclass
class AdapterStats:
    """What the manager did since start; served by /metrics and /admin/pool."""

    loads: int = 0
    evictions: int = 0
    load_seconds_total: float = 0.0
    disk_reads: int = 0
    # Loads per LATENCY_BUCKETS bound they took at most (one more: longer than all).
    load_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))


class AdapterManager:
    """Owns the tiers and every adapter's record (adapter_state.py); the only code that moves
    adapter weights. Its lock guards the records."""

    def __init__(
        self,
        slots: AdapterSlots,
        read: Callable[[AdapterSource], LoraAdapter],
        host_cache_bytes: int = 4 << 30,
    ) -> None:
        self.slots = slots
        self.stats = AdapterStats()
        self.host = HostCache(host_cache_bytes)
        self._read = read
        self._lock = threading.Lock()
        self._loaded = threading.Condition(self._lock)  # notified whenever a load ends
        self._records: dict[str, AdapterRecord] = {}
        # Indexes over the records, kept by _move, drain and unregister: eviction, draining and the
        # engine's clean-up look at these few, never at every one of thousands registered.
        self._resident: dict[str, AdapterRecord] = {}  # ON_DEVICE
        self._draining: set[str] = set()
        self._clock = itertools.count()
        self._set_aside = itertools.count(1)  # numbers the aliases of replaced versions still draining
        self._jobs: queue.SimpleQueue[AdapterRecord | None] = queue.SimpleQueue()
        self._pending = 0  # queued or running jobs
        self._worker = threading.Thread(target=self._work, name="loraserve-adapter-loader", daemon=True)
        self._worker.start()

    def register(self, name: str, source: AdapterSource, adapter: LoraAdapter | None = None) -> None:
        """Offer an adapter; `adapter` when it was just read (an upload) goes straight to the host cache."""
        if self.slots.num_slots == 0:
            raise AdapterError("max_loras", "LoRA is disabled (max_loras=0); start with at least one adapter slot")
        with self._lock:
            if name in self._records:
                if self._records[name].draining:
                    raise AdapterRetiringError(name)
                raise AdapterError("name", f"adapter {name!r} is already loaded")
            record = AdapterRecord(name, source)
            if adapter is not None:
                self._remember(record, adapter)
                record.state = S.ON_HOST
            self._records[name] = record

    def drain(self, name: str) -> None:
        """No new requests for the adapter; the engine unregisters it once its last one ends."""
        with self._lock:
            record = self._records.get(name)
            if record is None or record.draining:
                raise UnknownAdapterError(name)
            record.draining = True
            self._draining.add(name)

    def set_aside(self, name: str) -> str:
        """Give up `name` for new weights: the record goes on, draining and unpinned, as the returned alias, for the
        requests that started on it (the engine points them there). Raises UnknownAdapterError."""
        with self._lock:
            record = self._records.get(name)
            if record is None or record.draining:
                raise UnknownAdapterError(name)
            alias = f"{name}@{next(self._set_aside)}"
            del self._records[name]
            record.name, record.pinned, record.draining = alias, False, True
            self._records[alias] = record
            if self._resident.pop(name, None) is not None:
                self._resident[alias] = record
            self._draining.add(alias)
            self.host.drop(name)  # the name's next read is the new weights; the old ones still have their slot or files
            return alias

    def unregister(self, name: str) -> None:
        """Forget the adapter and free its slot; the caller made sure nothing runs with it."""
        with self._lock:
            record = self._records.pop(name, None)
            if record is None:
                raise UnknownAdapterError(name)
            assert not record.running, f"adapter {name!r} still has running sequences"
            self.host.drop(name)
            self._draining.discard(name)
            if record.state is S.ON_DEVICE:
                self._free_slot(record)
            # A reserved slot stays with its in-flight load, which sees the record deleted and frees it.
            self._move(record, S.DELETED)

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def record(self, name: str) -> AdapterRecord | None:
        return self._records.get(name)

    def records(self) -> list[AdapterRecord]:
        """Every registered adapter's record, in registration order."""
        with self._lock:
            return list(self._records.values())

    def draining(self) -> list[str]:
        """The adapters removed while requests still used them."""
        with self._lock:
            return list(self._draining)

    def residency(self, name: str) -> Residency:
        """Where the weights are: a slot, the host cache (a LOADING adapter's may be) or only the files."""
        record = self._records.get(name)
        if record is not None and record.state is S.ON_DEVICE:
            return Residency.DEVICE
        return Residency.HOST if name in self.host else Residency.DISK

    def prefetch(self, name: str) -> None:
        """A request for `name` was queued: read it from disk now unless it is in memory or on its way."""
        with self._lock:
            record = self._records.get(name)
            if record is not None and record.state is S.REGISTERED:
                self._move(record, S.READING)
                self._enqueue(record)

    def acquire(self, name: str) -> Acquired:
        """Called by the scheduler per sequence it would admit; ON_DEVICE counts one more running sequence."""
        with self._lock:
            record = self._records[name]
            if record.state is S.ON_DEVICE:
                record.running += 1
                record.last_used = next(self._clock)
                return Acquired.ON_DEVICE
            if record.state in (S.FAILED, S.LOADING):
                return Acquired.FAILED if record.state is S.FAILED else Acquired.LOADING
            return self._start_load(record)

    def pages_of(self, name: str) -> int:
        """Pool pages the adapter's rows take (reserved for them while loading); 0 without a slot."""
        slot = self._records[name].slot
        return 0 if slot == NO_ADAPTER else self.slots.pages_of(slot)

    def release(self, name: str) -> None:
        with self._lock:
            self._records[name].running -= 1

    def drain_candidate(self) -> str | None:
        """The unpinned resident adapter that frees its slot soonest: fewest running sequences, then LRU."""
        with self._lock:
            candidates = (r for r in self._resident.values() if not r.pinned)
            best = min(candidates, key=lambda r: (r.running, r.last_used), default=None)
            return None if best is None else best.name

    def set_pinned(self, name: str, pinned: bool) -> None:
        """Pinned: kept in a slot from now on, loaded now if a slot can be had, never evicted."""
        with self._lock:
            record = self._records.get(name)
            if record is None:
                raise UnknownAdapterError(name)
            num_pinned = sum(r.pinned for r in self._records.values())
            if pinned and not record.pinned and num_pinned + 1 >= self.slots.num_slots:
                # One slot always stays unpinned, or no other adapter could ever run.
                limit = self.slots.num_slots - 1
                raise AdapterError("pin", f"at most {limit} of {self.slots.num_slots} slots may be pinned")
            record.pinned = pinned
            if pinned and record.state in (S.REGISTERED, S.READING, S.ON_HOST):
                self._start_load(record)

    def wait_for_load(self, timeout: float) -> None:
        """Block until some load ends (or `timeout`): a step with nothing to run waits here."""
        with self._loaded:
            if self._pending:
                self._loaded.wait(timeout)

    def wait_resident(self, name: str, timeout: float = 30) -> bool:
        """Until `name` is in a slot (True), or its load failed, found no room or `timeout` passed (False)."""
        with self._loaded:
            record = self._records.get(name)
            self._loaded.wait_for(lambda: record is None or record.state is not S.LOADING, timeout)
            return record is not None and record.state is S.ON_DEVICE

    def wait_idle(self, timeout: float = 30) -> bool:
        """Until no load is queued or running; True if so."""
        with self._loaded:
            return self._loaded.wait_for(lambda: not self._pending, timeout)

    def _start_load(self, record: AdapterRecord) -> Acquired:
        """Reserve room and queue the copy; or, size unknown, queue the read that reserves after it."""
        queued = record.state is S.READING  # a prefetch's read is on its way: it loads on
        if record.pages_needed is None:
            self._move(record, S.LOADING)
        elif not self._reserve(record):
            return Acquired.NO_SLOT
        if not queued:
            self._enqueue(record)
        return Acquired.LOADING

    def _reserve(self, record: AdapterRecord, evict: bool = True) -> bool:
        """A slot and the adapter's pages, evicting idle adapters (least recently used first) for them."""
        assert record.pages_needed is not None, "reserved before its size was known"
        if not self._make_room(self._idle() if evict else [], record.pages_needed, need_slot=True):
            return False
        slot = self.slots.reserve(record.pages_needed)
        if slot is None:
            return False
        record.slot = slot
        if record.state is not S.LOADING:
            self._move(record, S.LOADING)
        return True

    def reclaim_pages(self, count: int) -> None:
        """The KV side is `count` pages short: evict idle adapters, least recently used first."""
        with self._lock:
            self._make_room(self._idle(), self.slots.pool.pages.num_free + count, need_slot=False)

    def _make_room(self, idle: list[AdapterRecord], num_pages: int, need_slot: bool) -> bool:
        """Evict `idle` in order until `num_pages` pages (and a slot if `need_slot`) are free; False if it cannot."""
        pages, slots = self.slots.pool.pages, self.slots
        reachable = pages.num_free + sum(slots.pages_of(r.slot) for r in idle)
        if reachable < num_pages or (need_slot and slots.num_free == 0 and not idle):
            return False  # evicting would not make room: keep what is resident, evict none
        while ((need_slot and slots.num_free == 0) or pages.num_free < num_pages) and idle:
            self._evict(idle.pop(0))
        return True

    def _idle(self) -> list[AdapterRecord]:
        """Resident adapters no sequence runs with and nobody pinned, least recently used first."""
        idle = [r for r in self._resident.values() if not r.running and not r.pinned]
        return sorted(idle, key=lambda r: r.last_used)

    def _evict(self, record: AdapterRecord) -> None:
        self._free_slot(record)
        self._move(record, S.ON_HOST if record.name in self.host else S.REGISTERED)
        self.stats.evictions += 1

    def _free_slot(self, record: AdapterRecord) -> None:
        (self.slots.unload if record.state is S.ON_DEVICE else self.slots.cancel)(record.slot)
        record.slot, record.content_hash = NO_ADAPTER, ""

    def _remember(self, record: AdapterRecord, adapter: LoraAdapter) -> None:
        """Keep the read adapter in the host cache; the ones it pushes out go back to disk only."""
        for dropped in self.host.put(record.name, adapter):
            other = self._records.get(dropped)
            if other is not None and other.state is S.ON_HOST:
                self._move(other, S.REGISTERED)
        record.rank, record.num_bytes = adapter.rank, adapter.num_bytes
        record.pages_needed = self.slots.pages_needed(adapter)

    def _move(self, record: AdapterRecord, to: AdapterState) -> None:
        record.move(to)
        if to is S.ON_DEVICE:
            self._resident[record.name] = record
        else:
            self._resident.pop(record.name, None)

    def _fail(self, record: AdapterRecord, reason: str) -> None:
        if record.state in (S.READING, S.LOADING):
            record.failure = reason
            self._move(record, S.FAILED)

    def _enqueue(self, record: AdapterRecord) -> None:
        self._pending += 1
        self._jobs.put(record)

    def _work(self) -> None:
        keep_serial()  # the step thread's OpenMP team must stay the only one (openmp.py)
        while (record := self._jobs.get()) is not None:
            try:
                self._load(record)
            except Exception:  # a bug: log it, free the slot, keep the worker alive for the others
                logger.exception("loading adapter %r failed", record.name)
                with self._lock:
                    self._fail(record, "internal error while loading; see the server log")
            finally:
                with self._loaded:
                    if record.state in (S.FAILED, S.DELETED) and record.slot != NO_ADAPTER:
                        self._free_slot(record)
                    self._pending -= 1
                    self._loaded.notify_all()

    def _load(self, record: AdapterRecord) -> None:
        started = time.perf_counter()
        with self._lock:
            if record.state is S.DELETED:
                return
            adapter = self.host.get(record.name)
        if adapter is None:
            try:
                adapter = self.read_checked(record.source)
            except (AdapterError, OSError) as error:
                with self._lock:
                    self._fail(record, str(error))
                logger.error("adapter %r cannot be loaded: %s", record.name, error)
                return
            with self._lock:
                self.stats.disk_reads += 1
                if record.state is not S.DELETED:
                    self._remember(record, adapter)
        with self._lock:
            if record.state is S.READING:
                self._move(record, S.ON_HOST)  # a prefetch: the host cache is warm
                return
            if record.state is not S.LOADING:
                return
            # Only free room: who gets an evicted adapter's place is the scheduler's call, made in
            # queue order by its next acquire (which may answer NO_SLOT); but a pin, which no request
            # may follow, takes an idle adapter's place now.
            if not record.reserved and not self._reserve(record, evict=record.pinned):
                self._move(record, S.ON_HOST)
                return
        self.slots.write(record.slot, adapter)  # outside the lock: no step reads a reserved slot
        seconds = time.perf_counter() - started
        with self._lock:
            if record.state is S.DELETED:
                return
            self.slots.activate(record.slot)
            record.content_hash = adapter.sha256
            self._move(record, S.ON_DEVICE)
            self.stats.loads += 1
            self.stats.load_seconds_total += seconds
            self.stats.load_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def host_copy(self, name: str, sha256: str | None) -> LoraAdapter | None:
        """The adapter from the host cache, if it holds these contents (the part of a mix being made)."""
        with self._lock:
            adapter = self.host.get(name)
        return adapter if adapter is not None and sha256 in (None, adapter.sha256) else None

    def read_checked(self, source: AdapterSource) -> LoraAdapter:
        """Read from the source; AdapterError when its contents are not the ones registered."""
        adapter = self._read(source)
        if source.sha256 is not None and adapter.sha256 != source.sha256:
            raise AdapterError("sha256", f"stored files changed on disk: {adapter.sha256}, expected {source.sha256}")
        return adapter

    def close(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=30)
