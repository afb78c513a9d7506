"""Adapters read from disk, kept in CPU memory up to a byte budget; least recently used leave first."""

from __future__ import annotations

from collections import OrderedDict

from loraserve.lora.adapter import LoraAdapter


def host_bytes(adapter: LoraAdapter) -> int:
    """What the adapter's float32 weights (DoRA's vectors too) take in memory."""
    tensors = (t for w in adapter.weights.values() for t in (w.a, w.b, w.magnitude, w.dora_scale) if t is not None)
    return sum(t.numel() * t.element_size() for t in tensors)


class HostCache:
    """Not thread-safe on its own: the adapter manager's lock guards it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self.num_bytes = 0

    def get(self, name: str) -> LoraAdapter | None:
        adapter = self._adapters.get(name)
        if adapter is not None:
            self._adapters.move_to_end(name)
        return adapter

    def put(self, name: str, adapter: LoraAdapter) -> list[str]:
        """Keep `adapter`; older ones leave while the cache is over budget (the newest always stays).

        Returns the names that left."""
        self.drop(name)
        self._adapters[name] = adapter
        self.num_bytes += host_bytes(adapter)
        dropped = []
        while self.num_bytes > self.capacity_bytes and len(self._adapters) > 1:
            dropped.append(next(iter(self._adapters)))
            self.drop(dropped[-1])
        return dropped

    def drop(self, name: str) -> None:
        adapter = self._adapters.pop(name, None)
        if adapter is not None:
            self.num_bytes -= host_bytes(adapter)

    @property
    def names(self) -> list[str]:
        return list(self._adapters)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters
