"""A snapshot of the engine's memory and queues, taken between steps for /admin/pool and /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    slot: int
    rank: int
    num_bytes: int  # of its weights in the file (float32 safetensors as uploaded)
    pinned: bool


@dataclass(frozen=True)
class EngineStats:
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    adapter_slots_total: int
    device_adapters: list[ResidentAdapter]  # in a slot
    host_adapters: list[str]  # in the host cache (CPU memory), not in a slot
    host_cache_bytes: int
    host_cache_capacity_bytes: int
    adapter_disk_reads: int
    adapter_loads: int
    adapter_evictions: int
    adapter_load_seconds_total: float
    running_sequences: int
    waiting_sequences: int
    preemptions: int
