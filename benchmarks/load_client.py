"""An open-loop load generator for any OpenAI-compatible server: each request is sent at its
arrival time whatever the server's state, streamed, and timed chunk by chunk."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the start
    prompt: list[int]
    model: str  # an adapter's name, or the base model's
    max_tokens: int
    fields: dict = field(default_factory=dict)  # more of the body, as this server names the adapter


@dataclass
class RequestResult:
    sent: float
    ttft: float | None = None  # seconds from sending to the first token
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None
    status: int | None = None  # the HTTP status; None when no answer came
    answered: float | None = None  # seconds from sending to the status line

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first."""
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between streamed chunks (one token each on both servers measured here)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    ttft: float  # seconds
    tpot: float  # seconds

    def met(self, result: RequestResult) -> bool:
        tpot = result.tpot
        return result.ok and result.ttft is not None and result.ttft <= self.ttft and (tpot or 0.0) <= self.tpot


@dataclass(frozen=True)
class LoadReport:
    """What one run at one rate measured."""

    rate: float
    duration: float
    results: list[RequestResult]
    slo: SLO

    @property
    def completed(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def failures(self) -> int:
        return len(self.results) - len(self.completed)

    @property
    def tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.completed) / self.duration

    @property
    def goodput(self) -> float:
        """Requests per second that met the SLO."""
        return sum(self.slo.met(r) for r in self.results) / self.duration

    @property
    def attainment(self) -> float:
        """Share of the requests that met the SLO."""
        return sum(self.slo.met(r) for r in self.results) / len(self.results)

    @property
    def refused(self) -> list[RequestResult]:
        """Turned away at once by an overloaded server (503, as TGI and loraserve's admission answer)."""
        return [r for r in self.results if r.status == 503]

    def percentiles(self, metric: str) -> tuple[float, float, float]:
        """p50, p90, p99 of "ttft", "tpot" or "itl", in seconds."""
        return tuple(percentile(self.samples(metric), q) for q in (50, 90, 99))  # type: ignore[return-value]

    def samples(self, metric: str) -> list[float]:
        if metric == "itl":
            return [gap for r in self.completed for gap in r.itls]
        values = (getattr(r, metric) for r in self.completed)
        return [v for v in values if v is not None]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


async def send_request(client: httpx.AsyncClient, request: Request, start: float) -> RequestResult:
    """Wait for the request's time, then stream it through `client` (its headers: the API key, if any)."""
    await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
    result = RequestResult(sent=time.perf_counter())
    body = {
        "model": request.model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **request.fields,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            result.status, result.answered = response.status_code, time.perf_counter() - result.sent
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    result.chunk_times.append(now)
                    if result.ttft is None:
                        result.ttft = now - result.sent
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    if result.output_tokens != request.max_tokens:
        result.error = f"{result.output_tokens} tokens streamed, {request.max_tokens} asked"
    return result


async def _run(url: str, requests: Sequence[Request]) -> tuple[list[RequestResult], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(send_request(client, r, start) for r in requests))
        return list(results), time.perf_counter() - start


def run_load(url: str, requests: Sequence[Request], rate: float, slo: SLO) -> LoadReport:
    """Send every request at its time; the duration runs from the start to the last answer."""
    results, duration = asyncio.run(_run(url, requests))
    return LoadReport(rate, duration, results, slo)
