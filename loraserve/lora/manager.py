"""Which adapters are registered (a host copy each) and which sit in a device slot.

The scheduler asks `acquire` before it admits a sequence of an adapter and calls
`release` when that sequence stops running; an adapter with no running sequence and
no pin may be evicted, least recently used first, to make room for another. Loads
run inside the step for now (the asynchronous tiers of issue 5 replace this).
Example with 2 slots: A and B run; C waits until A's or B's last sequence ends.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.errors import AdapterError, UnknownAdapterError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.slots import AdapterSlots


@dataclass
class AdapterStats:
    """What the manager did since start; served by /metrics and /admin/pool."""

    loads: int = 0
    evictions: int = 0
    load_seconds_total: float = 0.0
    # Called with each load's duration (the server's latency histogram listens here).
    load_observers: list[Callable[[float], None]] = field(default_factory=list)


class AdapterManager:
    """Owns the host copies and the slot residency; the only code that loads or unloads slots."""

    def __init__(self, slots: AdapterSlots) -> None:
        self.slots = slots
        self.stats = AdapterStats()
        self._host: dict[str, LoraAdapter] = {}
        self._running: Counter[str] = Counter()  # running sequences per adapter
        self._pinned: set[str] = set()
        self._last_used: dict[str, int] = {}
        self._clock = itertools.count()

    def register(self, name: str, adapter: LoraAdapter) -> None:
        if self.slots.num_slots == 0:
            raise AdapterError("max_loras", "LoRA is disabled (max_loras=0); start with at least one adapter slot")
        if name in self._host:
            raise AdapterError("name", f"adapter {name!r} is already loaded")
        self._host[name] = adapter

    def unregister(self, name: str) -> None:
        """Forget the adapter and free its slot; the caller made sure nothing runs with it."""
        if name not in self._host:
            raise UnknownAdapterError(name)
        assert not self._running[name], f"adapter {name!r} still has running sequences"
        del self._host[name]
        self._pinned.discard(name)
        self._last_used.pop(name, None)
        if name in self.slots:
            self.slots.unload(name)

    def __contains__(self, name: str) -> bool:
        return name in self._host

    @property
    def names(self) -> list[str]:
        return list(self._host)

    def adapter(self, name: str) -> LoraAdapter:
        return self._host[name]

    def residency(self, name: str) -> str:
        """ "device" when in a slot, else "host"."""
        return "device" if name in self.slots else "host"

    def pin(self, name: str) -> None:
        """Keep the adapter in a slot from now on: loaded now if a slot can be freed, never evicted."""
        if name not in self._host:
            raise UnknownAdapterError(name)
        if name not in self._pinned and len(self._pinned) + 1 >= self.slots.num_slots:
            # One slot always stays unpinned, or no other adapter could ever run.
            limit = self.slots.num_slots - 1
            raise AdapterError("pin", f"at most {limit} of {self.slots.num_slots} slots may be pinned")
        self._pinned.add(name)
        if name not in self.slots and self._make_room():
            self._load(name)

    def unpin(self, name: str) -> None:
        self._pinned.discard(name)

    def is_pinned(self, name: str) -> bool:
        return name in self._pinned

    def acquire(self, name: str) -> bool:
        """Make the adapter resident for one more running sequence; False when no slot can be freed now."""
        if name not in self.slots and not self._make_room():
            return False
        if name not in self.slots:
            self._load(name)
        self._running[name] += 1
        self._last_used[name] = next(self._clock)
        return True

    def release(self, name: str) -> None:
        self._running[name] -= 1
        if not self._running[name]:
            del self._running[name]

    def _load(self, name: str) -> None:
        started = time.perf_counter()
        self.slots.load(name, self._host[name])
        seconds = time.perf_counter() - started
        self.stats.loads += 1
        self.stats.load_seconds_total += seconds
        for observe in self.stats.load_observers:
            observe(seconds)

    def _make_room(self) -> bool:
        if len(self.slots.names) < self.slots.num_slots:
            return True
        idle = [n for n in self.slots.names if not self._running[n] and n not in self._pinned]
        if not idle:
            return False
        victim = min(idle, key=lambda n: self._last_used.get(n, -1))
        self.slots.unload(victim)
        self.stats.evictions += 1
        return True
