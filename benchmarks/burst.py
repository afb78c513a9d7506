"""An offline batch client's burst: N non-streamed completions sent at once from the official `openai` client
with its defaults (two retries, each after the server's Retry-After when it gives one of at most 60-120 s,
else its own backoff of 0.5-8 s; a 600 s timeout). What counts is whether every request completes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import openai

from benchmarks.load_client import percentile
from benchmarks.servers import RunningServer


@dataclass
class BurstReport:
    num_requests: int
    seconds: float = 0.0  # from sending the burst to the last answer
    latencies: list[float] = field(default_factory=list)  # of the completed, retries included
    errors: list[str] = field(default_factory=list)  # of those the client gave up on
    num_refusals: int = 0  # 503s the server answered, retried ones included (its /metrics)

    @property
    def num_completed(self) -> int:
        return len(self.latencies)

    def latency(self, q: float) -> float:
        return percentile(self.latencies, q)


def refused_so_far(url: str) -> int:
    """loraserve's count of requests refused as overloaded."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    (line,) = [line for line in text.splitlines() if line.startswith("loraserve_refused_overloaded ")]
    return int(float(line.split()[1]))


async def _send_all(server: RunningServer, prompts: list[list[int]], max_tokens: int, report: BurstReport) -> None:
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")  # every default kept
    async with client:

        async def one(prompt: list[int]) -> None:
            sent = time.perf_counter()
            try:
                await client.completions.create(
                    model=server.base_model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                    extra_body={"ignore_eos": True},
                )  # fmt: skip
            except openai.OpenAIError as error:
                report.errors.append(f"{type(error).__name__}: {str(error)[:120]}")
                return
            report.latencies.append(time.perf_counter() - sent)

        start = time.perf_counter()
        await asyncio.gather(*(one(prompt) for prompt in prompts))
        report.seconds = time.perf_counter() - start


def run_burst(server: RunningServer, prompts: list[list[int]], max_tokens: int) -> BurstReport:
    """Every prompt at once as its own non-streamed completion of `max_tokens` (EOS ignored)."""
    report = BurstReport(len(prompts))
    refused_before = refused_so_far(server.url)
    asyncio.run(_send_all(server, prompts, max_tokens, report))
    report.num_refusals = refused_so_far(server.url) - refused_before
    return report
