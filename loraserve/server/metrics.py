"""Prometheus metrics: per-request counters and latency histograms, engine and pool gauges.

One CollectorRegistry per app, so several servers in one process (tests) never share counts. Request metrics are
recorded when a request finishes, the engine's statistics (in the series engine/stats.py defines) at each scrape.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from loraserve.config import LATENCY_BUCKETS
from loraserve.engine import RequestOutput
from loraserve.engine.stats import EngineStats, LoadTimes

disable_created_metrics()  # the *_created series only add noise to every scrape


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def latency(name: str, help_text: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"loraserve_{name}_seconds", help_text, labels, buckets=LATENCY_BUCKETS, registry=r)

        self.requests = Counter("loraserve_requests", "Finished requests", ["adapter", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("loraserve_prompt_tokens", "Prompt tokens computed", ["adapter"], registry=r)
        self.generation_tokens = Counter("loraserve_generation_tokens", "Tokens generated", ["adapter"], registry=r)
        self.ttft = latency("time_to_first_token", "Arrival to first token")
        self.inter_token = latency("inter_token_latency", "Between consecutive tokens")
        self.e2e = latency("request_latency", "Arrival to last token")
        self.queue_time = latency("queue_time", "Arrival to first scheduled")
        # Per tenant (each --api-key; "unkeyed" for the rest): what fair share gave each.
        self.tenant_requests = Counter("loraserve_tenant_requests", "Finished requests", ["tenant"], registry=r)
        self.tenant_tokens = Counter("loraserve_tenant_generation_tokens", "Tokens generated", ["tenant"], registry=r)
        self.tenant_ttft = latency("tenant_time_to_first_token", "Arrival to first token", ("tenant",))
        self._engine = EngineCollector()
        r.register(self._engine)

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
        self._engine.stats = stats
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engine's statistics as Prometheus series, as stats.py defines them: read at each scrape."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        for definition in fields(self.stats):
            name, help_text = definition.metadata["metric"], definition.metadata["help"]
            value = getattr(self.stats, definition.name)
            for vllm_name in definition.metadata["vllm"]:
                yield GaugeMetricFamily(vllm_name, help_text, value=value)
            if name is None:
                continue
            if isinstance(value, LoadTimes):
                cumulative = list(itertools.accumulate(value.counts))
                buckets = [(repr(float(b)), c) for b, c in zip(value.bounds, cumulative, strict=False)]
                yield HistogramMetricFamily(
                    f"loraserve_{name}", help_text, buckets=[*buckets, ("+Inf", cumulative[-1])],
                    sum_value=value.total_seconds,
                )  # fmt: skip
            else:
                yield GaugeMetricFamily(
                    f"loraserve_{name}", help_text, value=len(value) if isinstance(value, list) else value
                )
        yield lora_requests_info(self.stats)
        yield speculative_tokens_by_adapter(self.stats)


def speculative_tokens_by_adapter(stats: EngineStats) -> GaugeMetricFamily:
    """Speculative decoding's draft, kept and bonus tokens since start, per adapter ("" = the base model)."""
    family = GaugeMetricFamily(
        "loraserve_speculative_tokens", "Speculative draft tokens verified (drafted), kept (accepted) and bonus "
        "tokens since start, by adapter", labels=["adapter", "kind"],
    )  # fmt: skip
    for adapter in stats.speculative_by_adapter:
        for kind, value in (
            ("drafted", adapter.draft_tokens), ("accepted", adapter.accepted_tokens), ("bonus", adapter.bonus_tokens)
        ):  # fmt: skip
            family.add_metric([adapter.adapter, kind], value)
    return family


def lora_requests_info(stats: EngineStats) -> GaugeMetricFamily:
    """vLLM's vllm:lora_requests_info, which LoRA-affinity routers read (Gateway API inference extension, llm-d): the
    adapters of running and waiting requests as comma-separated labels, the adapter slots as max_lora, and as value the
    time the label set was read (routers take the newest series)."""
    info = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running and waiting adapters (vLLM's names)",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )  # fmt: skip
    labels = [str(stats.adapter_slots_total), ",".join(stats.running_adapters), ",".join(stats.waiting_adapters)]
    info.add_metric(labels, time.time())
    return info
