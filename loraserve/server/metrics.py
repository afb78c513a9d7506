"""Prometheus metrics: per-request counters and latency histograms, engine and pool gauges.

One CollectorRegistry per app, so several servers in one process (tests) never share counts.
Request metrics are recorded when a request finishes; gauges are refreshed at each scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from loraserve.engine import RequestOutput
from loraserve.engine.stats import EngineStats

disable_created_metrics()  # the *_created series only add noise to every scrape

# Seconds; decode steps on a CPU take tens of milliseconds, prompts and loads up to seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("loraserve_requests", "Finished requests", ["adapter", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("loraserve_prompt_tokens", "Prompt tokens computed", ["adapter"], registry=r)
        self.generation_tokens = Counter("loraserve_generation_tokens", "Tokens generated", ["adapter"], registry=r)
        self.ttft = Histogram(
            "loraserve_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "loraserve_inter_token_latency_seconds", "Between consecutive tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "loraserve_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "loraserve_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY_BUCKETS, registry=r
        )
        # Per tenant (each --api-key; "unkeyed" for the rest): what fair share gave each.
        self.tenant_requests = Counter("loraserve_tenant_requests", "Finished requests", ["tenant"], registry=r)
        self.tenant_tokens = Counter("loraserve_tenant_generation_tokens", "Tokens generated", ["tenant"], registry=r)
        self.tenant_ttft = Histogram(
            "loraserve_tenant_time_to_first_token_seconds", "Arrival to first token", ["tenant"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.adapter_load = Histogram(
            "loraserve_adapter_load_seconds", "Copying an adapter into a device slot", buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self._gauges = {
            name: Gauge(f"loraserve_{name}", help_text, registry=r)
            for name, help_text in (
                ("pool_pages", "Pages of the memory pool (a page is one KV block or adapter rows)"),
                ("pool_pages_kv", "Pool pages holding tokens (KV blocks)"),
                ("pool_pages_adapters", "Pool pages holding adapter weights"),
                ("pool_page_bytes", "Bytes per pool page"),
                ("adapter_slots_total", "Device slots for adapters"),
                ("adapters_on_device", "Adapters in a device slot"),
                ("adapters_in_host_cache", "Adapters in CPU memory but not in a device slot"),
                ("adapter_loads", "Adapter loads into a device slot since start"),
                ("adapter_evictions", "Adapters evicted from a device slot since start"),
                ("adapter_disk_reads", "Adapters read from disk into the host cache since start"),
                ("host_cache_bytes", "Adapter weights held in the host cache"),
                ("running_sequences", "Sequences in the running batch"),
                ("waiting_sequences", "Sequences waiting to be scheduled"),
                ("preemptions", "Sequences preempted since start"),
                ("prefix_cache_blocks", "KV blocks findable by their prefix (in use or free)"),
                ("prefix_cache_queried_tokens", "Tokens of the sequences admitted since start"),
                ("prefix_cache_hit_tokens", "Admitted tokens found in the prefix cache since start"),
                ("failed_steps", "Steps in which computing a row raised since start (the other rows went on)"),
                ("failed_requests", "Requests ended with an error because computing them raised, since start"),
                ("running_cap", "The most sequences run at once (--max-num-seqs, or fewer for the TPOT target)"),
                ("admitted_requests", "Requests queued since start"),
                ("refused_overloaded", "Requests refused since start: they would have missed the TTFT target"),
                ("refused_late", "Of those, refused after queueing, before their first step: the wait grew past it"),
                ("dropped_timed_out", "Requests dropped since start: they waited past their timeout"),
                ("predicted_queue_seconds", "A new request's predicted wait for its first step"),
            )
        }

    def record_request(self, adapter: str, output: RequestOutput, tenant: str) -> None:
        timings = output.timings
        tenant = tenant or "unkeyed"
        self.tenant_requests.labels(tenant).inc()
        if timings.ttft is not None:
            self.tenant_ttft.labels(tenant).observe(timings.ttft)
        for completion in output.outputs:
            self.requests.labels(adapter, completion.finish_reason or "unknown").inc()
            self.generation_tokens.labels(adapter).inc(len(completion.token_ids))
            self.tenant_tokens.labels(tenant).inc(len(completion.token_ids))
        self.prompt_tokens.labels(adapter).inc(len(output.prompt_token_ids))
        latencies = ((self.ttft, timings.ttft), (self.e2e, timings.e2e), (self.queue_time, timings.queue_time))
        for histogram, value in latencies:
            if value is not None:
                histogram.observe(value)
        for gap in timings.inter_token_latencies:
            self.inter_token.observe(gap)

    def render(self, stats: EngineStats) -> bytes:
        values = {
            "pool_pages": stats.pool_pages,
            "pool_pages_kv": stats.kv_pages,
            "pool_pages_adapters": stats.adapter_pages,
            "pool_page_bytes": stats.page_bytes,
            "adapter_slots_total": stats.adapter_slots_total,
            "adapters_on_device": len(stats.device_adapters),
            "adapters_in_host_cache": len(stats.host_adapters),
            "adapter_loads": stats.adapter_loads,
            "adapter_evictions": stats.adapter_evictions,
            "adapter_disk_reads": stats.adapter_disk_reads,
            "host_cache_bytes": stats.host_cache_bytes,
            "running_sequences": stats.running_sequences,
            "waiting_sequences": stats.waiting_sequences,
            "preemptions": stats.preemptions,
            "prefix_cache_blocks": stats.prefix_cache_blocks,
            "prefix_cache_queried_tokens": stats.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
            "failed_steps": stats.failed_steps,
            "failed_requests": stats.failed_requests,
            "running_cap": stats.running_cap,
            "admitted_requests": stats.admitted_requests,
            "refused_overloaded": stats.refused_overloaded,
            "refused_late": stats.refused_late,
            "dropped_timed_out": stats.dropped_timed_out,
            "predicted_queue_seconds": stats.predicted_queue_seconds,
        }
        for name, value in values.items():
            self._gauges[name].set(value)
        return generate_latest(self.registry)
