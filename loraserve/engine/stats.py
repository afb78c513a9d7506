"""A snapshot of the engine's memory and queues, taken between steps for /admin/pool and /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    slot: int
    rank: int
    num_bytes: int  # of its weights in the file (float32 safetensors as uploaded)
    pages: int  # of the memory pool its rows fill
    pinned: bool


@dataclass(frozen=True)
class EngineStats:
    pool_pages: int  # pages of the memory pool; a page is one KV block or adapter rows
    page_bytes: int
    kv_pages: int  # holding tokens
    adapter_pages: int  # holding adapter rows
    block_size: int  # tokens per KV block
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
    prefix_cache_blocks: int  # KV blocks findable by their prefix, in use or free
    prefix_cache_queried_tokens: int  # tokens of the sequences admitted since start
    prefix_cache_hit_tokens: int  # of those, found in the prefix cache instead of computed
    failed_steps: int  # steps in which a row raised; the other rows went on (step_isolation.py)
    failed_requests: int  # requests such rows ended with an error
    running_cap: int  # the most sequences run at once (--max-num-seqs, or fewer for the TPOT target)
    admitted_requests: int  # requests queued since start
    refused_overloaded: int  # requests refused since start: they would have missed the TTFT target
    refused_late: int  # of those, refused after queueing (before their first step): the wait grew past it
    dropped_timed_out: int  # requests dropped since start: they waited past their timeout
    predicted_queue_seconds: float  # a new request's predicted wait for its first step

    @property
    def free_pages(self) -> int:
        return self.pool_pages - self.kv_pages - self.adapter_pages

    @property
    def kv_capacity_pages(self) -> int:
        """What KV could hold now: every page but the adapters' (idle adapters would still be evicted for KV)."""
        return self.pool_pages - self.adapter_pages
