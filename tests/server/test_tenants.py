"""Each --api-key is a tenant with its fair share: with one key flooding 40 requests into a batch of 4,
another key's request starts at the first free slot, not behind the flood (FCFS would put it ~10
request durations back)."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator

import httpx
import pytest

from loraserve.config import SchedulerConfig
from tests.server.conftest import RunningServer, start_server

pytestmark = pytest.mark.slow

FLOODER, POLITE = "tenant-flooder-key-0123456789", "tenant-polite-key-0123456789"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def keyed_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    yield from start_server(
        loaded_model, tmp_path_factory.mktemp("data"), scheduler=SchedulerConfig(max_num_seqs=4),
        api_keys=frozenset({FLOODER, POLITE}),
    )  # fmt: skip


async def chat(client: httpx.AsyncClient, key: str, max_tokens: int) -> float:
    """Seconds to the first token of a streamed chat."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    sent = time.monotonic()
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        assert r.status_code == 200
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.monotonic() - sent
        assert first is not None
        return first


async def flood_then_polite(url: str) -> tuple[float, float]:
    """(one flooder request's duration alone, the polite request's TTFT with 40 flooder requests queued)."""
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        start = time.monotonic()
        await chat(client, FLOODER, 32)
        duration = time.monotonic() - start
        flood = [asyncio.create_task(chat(client, FLOODER, 32)) for _ in range(40)]
        await asyncio.sleep(1.0)  # the flood is queued and the batch full
        polite = await chat(client, POLITE, 4)
        await asyncio.gather(*flood)
        return duration, polite


def counter(metrics: str, name: str, key: str) -> float:
    tenant = "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    (line,) = [line for line in metrics.splitlines() if line.startswith(f'{name}{{tenant="{tenant}"}}')]
    return float(line.split()[1])


def test_a_flooding_key_does_not_hold_back_another_keys_request(keyed_server):
    duration, polite = asyncio.run(flood_then_polite(keyed_server.url))
    # Admitted at the first free slot: within about one flooder request (their batch runs slower).
    assert polite < 2 * duration + 0.5, (duration, polite)
    metrics = httpx.get(f"{keyed_server.url}/metrics", headers={"Authorization": f"Bearer {POLITE}"}).text
    assert counter(metrics, "loraserve_tenant_requests_total", FLOODER) == 41
    assert counter(metrics, "loraserve_tenant_generation_tokens_total", FLOODER) == 41 * 32
    assert counter(metrics, "loraserve_tenant_requests_total", POLITE) == 1
    assert counter(metrics, "loraserve_tenant_generation_tokens_total", POLITE) == 4
