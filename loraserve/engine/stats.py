"""A snapshot of the engine's memory and queues, taken between steps for /admin/pool and /metrics.

Each statistic is defined here once: its help text, its Prometheus series (a gauge, or a
histogram for `LoadTimes`) and its place in /admin/pool's JSON; both are derived from
these definitions (`json_view` here, the server's metrics.py), never restated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraserve.engine.speculative import SpeculationStats


def stat(help_text: str, metric: str | None = None, json: str | None = None, vllm: tuple[str, ...] = ()) -> Any:
    """A statistic: exported as the Prometheus series loraserve_`metric` (a list: its length), under
    vLLM's names `vllm` too (what Kubernetes inference routers read), and at the dotted `json` path
    of /admin/pool, where given."""
    return field(metadata={"help": help_text, "metric": metric, "json": json, "vllm": vllm})


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    slot: int
    rank: int
    num_bytes: int  # of its weights in the file (float32 safetensors as uploaded)
    pages: int  # of the memory pool its rows fill
    pinned: bool


@dataclass(frozen=True)
class AdapterDrafts:
    """Speculative decoding's outcome for one adapter's sequences ("" for the base model's)."""

    adapter: str
    draft_tokens: int
    accepted_tokens: int
    bonus_tokens: int


@dataclass(frozen=True)
class LoadTimes:
    """A histogram of adapter load seconds: how many loads took at most each bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # per bound, then one past the last: not cumulative
    total_seconds: float


@dataclass(frozen=True)
class EngineStats:
    pool_pages: int = stat(
        "Pages of the memory pool (a page is one KV block or adapter rows)", "pool_pages", "pages.total"
    )
    kv_pages: int = stat("Pool pages holding tokens (KV blocks)", "pool_pages_kv", "pages.kv")
    adapter_pages: int = stat("Pool pages holding adapter weights", "pool_pages_adapters", "pages.adapters")
    free_pages: int = stat("Pool pages holding nothing", json="pages.free")
    page_bytes: int = stat("Bytes per pool page", "pool_page_bytes", "pages.page_bytes")
    block_size: int = stat("Tokens per KV block", json="pages.block_size")
    kv_capacity_pages: int = stat(
        "What KV could hold now: every page but the adapters' (idle adapters would still be evicted for KV)",
        json="pages.kv_capacity",
    )
    adapter_slots_total: int = stat("Device slots for adapters", "adapter_slots_total", "adapter_slots.total")
    adapter_slots_used: int = stat("Adapters in a device slot", "adapters_on_device", "adapter_slots.used")
    device_adapters: list[ResidentAdapter] = stat("The adapters in a device slot", json="device_adapters")
    host_adapters: list[str] = stat(
        "Adapters in CPU memory but not in a device slot", "adapters_in_host_cache", "host_adapters"
    )
    host_cache_bytes: int = stat("Adapter weights held in the host cache", "host_cache_bytes", "host_cache.bytes")
    host_cache_capacity_bytes: int = stat("The host cache's budget", json="host_cache.capacity_bytes")
    adapter_disk_reads: int = stat(
        "Adapters read from disk into the host cache since start", "adapter_disk_reads", "adapter_disk_reads"
    )
    adapter_loads: int = stat("Adapter loads into a device slot since start", "adapter_loads", "adapter_loads")
    adapter_evictions: int = stat(
        "Adapters evicted from a device slot since start", "adapter_evictions", "adapter_evictions"
    )
    adapter_load_seconds_total: float = stat(
        "Seconds spent loading adapters since start", json="adapter_load_seconds_total"
    )
    adapter_load_seconds: LoadTimes = stat("Reading and copying an adapter into a device slot", "adapter_load_seconds")
    running_sequences: int = stat("Sequences in the running batch", "running_sequences", "running_sequences")
    waiting_sequences: int = stat("Sequences waiting to be scheduled", "waiting_sequences", "waiting_sequences")
    running_requests: int = stat(
        "Requests with a sequence in the running batch", "running_requests", vllm=("vllm:num_requests_running",)
    )
    waiting_requests: int = stat(
        "Requests waiting to be scheduled", "waiting_requests", vllm=("vllm:num_requests_waiting",)
    )
    running_adapters: list[str] = stat("Adapters of the running sequences", json="running_adapters")
    waiting_adapters: list[str] = stat("Adapters of the waiting requests", json="waiting_adapters")
    kv_cache_usage: float = stat(
        "Share of the KV capacity (the pool but the adapters' pages) holding tokens; 1 means full",
        "kv_cache_usage", vllm=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the second: older routers
    )  # fmt: skip
    preemptions: int = stat("Sequences preempted since start", "preemptions")
    released_behind_window: int = stat(
        "KV blocks back in the pool since start because they fell behind every layer's sliding window",
        "kv_blocks_released_behind_window", "pages.released_behind_window",
    )  # fmt: skip
    prefix_cache_blocks: int = stat(
        "KV blocks findable by their prefix (in use or free)", "prefix_cache_blocks", "prefix_cache.blocks"
    )
    prefix_cache_queried_tokens: int = stat(
        "Tokens of the sequences admitted since start", "prefix_cache_queried_tokens", "prefix_cache.queried_tokens"
    )
    prefix_cache_hit_tokens: int = stat(
        "Admitted tokens found in the prefix cache since start", "prefix_cache_hit_tokens", "prefix_cache.hit_tokens"
    )
    speculative_draft_tokens: int = stat(
        "Speculative draft tokens verified since start", "speculative_draft_tokens", "speculation.draft_tokens"
    )
    speculative_accepted_tokens: int = stat(
        "Of those, kept", "speculative_accepted_tokens", "speculation.accepted_tokens"
    )
    speculative_bonus_tokens: int = stat(
        "Tokens sampled after every draft of a step was kept, since start", "speculative_bonus_tokens",
        "speculation.bonus_tokens",
    )  # fmt: skip
    speculative_acceptance_rate: float = stat(
        "Draft tokens kept per draft token verified since start (0 before any)", "speculative_acceptance_rate",
        "speculation.acceptance_rate",
    )  # fmt: skip
    speculative_by_adapter: list[AdapterDrafts] = stat("Speculative decoding by adapter", json="speculation.by_adapter")
    failed_steps: int = stat(
        "Steps in which computing a row raised since start (the other rows went on)", "failed_steps"
    )
    failed_requests: int = stat(
        "Requests ended with an error because computing them raised, since start", "failed_requests"
    )
    running_cap: int = stat(
        "The most sequences run at once (--max-num-seqs, or fewer for the TPOT target)", "running_cap"
    )
    admitted_requests: int = stat("Requests queued since start", "admitted_requests")
    refused_overloaded: int = stat(
        "Requests refused since start: they would have missed the TTFT target", "refused_overloaded"
    )
    refused_late: int = stat(
        "Of those, refused after queueing, before their first step: the wait grew past it", "refused_late"
    )
    dropped_timed_out: int = stat("Requests dropped since start: they waited past their timeout", "dropped_timed_out")
    predicted_queue_seconds: float = stat(
        "A new request's predicted wait for its first step", "predicted_queue_seconds"
    )


def json_view(stats: EngineStats) -> dict[str, Any]:
    """/admin/pool's body: each statistic with a `json` path, nested along it."""
    view: dict[str, Any] = {}
    for definition in fields(stats):
        path = definition.metadata["json"]
        if path is None:
            continue
        *parents, leaf = path.split(".")
        node = view
        for parent in parents:
            node = node.setdefault(parent, {})
        value = getattr(stats, definition.name)
        if isinstance(value, list):  # of records (ResidentAdapter) or names
            value = [asdict(item) if is_dataclass(item) and not isinstance(item, type) else item for item in value]
        node[leaf] = value
    return view


def speculation_stats(speculation: SpeculationStats) -> dict[str, Any]:
    """EngineStats' speculative fields from the scheduler's counts."""
    by_adapter = [
        AdapterDrafts(name, c.drafted, c.accepted, c.bonus) for name, c in sorted(speculation.by_adapter.items())
    ]
    drafted = sum(a.draft_tokens for a in by_adapter)
    accepted = sum(a.accepted_tokens for a in by_adapter)
    return {
        "speculative_draft_tokens": drafted,
        "speculative_accepted_tokens": accepted,
        "speculative_bonus_tokens": sum(a.bonus_tokens for a in by_adapter),
        "speculative_acceptance_rate": accepted / drafted if drafted else 0.0,
        "speculative_by_adapter": by_adapter,
    }
