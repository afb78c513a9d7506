"""Per-request adapter mixes (merged_adapters) as adapters of their own.

A mix is named by its content hash (its spec and its parts' content hashes, lora/merge.py), so the
same mix asked for twice is one adapter: materialised on its first request (off the engine thread),
kept in the host cache and swapped into slots like any adapter, its prefix-cache key that hash. Its
source is the spec and the parts' sources, so an evicted mix is made again from them. At most
`max_mixes` stay registered: beyond it the least recently asked-for idle ones are retired, and a
mix goes when any of its parts is removed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from loraserve.config import LoraConfig
from loraserve.errors import AdapterRetiringError, UnknownAdapterError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.adapter_state import AdapterSource
from loraserve.lora.manager import AdapterManager
from loraserve.lora.merge import merge_adapters
from loraserve.lora.mix_spec import FIELD, MixSpec

MIX_PREFIX = "mix-"


@dataclass(frozen=True)
class PreparedMix:
    name: str
    source: AdapterSource
    adapter: LoraAdapter | None  # materialised; None when it is registered already


class Mixes:
    def __init__(self, adapters: AdapterManager, config: LoraConfig) -> None:
        self.adapters, self.config = adapters, config
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, AdapterSource] = OrderedDict()  # registered mixes, least recently asked first

    def prepare(self, spec: MixSpec) -> PreparedMix:
        """Find or make the mix; no engine lock needed (reading and merging may take a while)."""
        parts = []
        for name in spec.ids:
            record = self.adapters.record(name)
            if record is None or record.draining or record.source.mix is not None:
                raise UnknownAdapterError(name, field=f"{FIELD}.ids")
            parts.append((name, record.source))
        sha256 = spec.content_hash([source.sha256 or f"{name}@{source.path}" for name, source in parts])
        source = AdapterSource(None, sha256, spec, tuple(parts))
        name = MIX_PREFIX + sha256[:32]
        record = self.adapters.record(name)
        if record is not None:
            if record.draining:
                raise AdapterRetiringError(name)
            return PreparedMix(name, source, None)
        return PreparedMix(name, source, self.read(source))

    def read(self, source: AdapterSource) -> LoraAdapter:
        """Materialise a mix from its parts (the host cache's copies where they are the same contents)."""
        assert source.mix is not None and source.sha256 is not None
        parts = [
            self.adapters.host_copy(name, part.sha256) or self.adapters.read_checked(part)
            for name, part in source.parts
        ]
        return merge_adapters(source.mix, parts, source.sha256, self.config.max_lora_rank)

    def serve(self, prepared: PreparedMix) -> None:
        """Register a prepared mix (call between steps) and retire the idle ones past the limit."""
        with self._lock:
            if prepared.name not in self.adapters:  # without the adapter (retired since): read when needed
                self.adapters.register(prepared.name, prepared.source, prepared.adapter)
            self._recent[prepared.name] = prepared.source
            self._recent.move_to_end(prepared.name)
            for name in list(self._recent)[: max(0, len(self._recent) - self.config.max_mixes)]:
                record = self.adapters.record(name)
                if record is None or not record.running:
                    self._retire(name)

    def retire_mixing(self, part: str) -> None:
        """`part` is removed: so are the mixes made of it."""
        with self._lock:
            for name, source in list(self._recent.items()):
                if any(part_name == part for part_name, _ in source.parts):
                    self._retire(name)

    def _retire(self, name: str) -> None:
        del self._recent[name]
        record = self.adapters.record(name)
        if record is not None and not record.draining:
            self.adapters.drain(name)
