"""Each --api-key is a tenant with its fair share: with one key flooding 40 requests into a batch of 4,
another key's request starts at once, not behind the flood (FCFS would put it ~10 request durations
back); and a key sending 10x another's rate leaves the other's median TTFT within 2x of alone."""

from __future__ import annotations

import asyncio
import hashlib
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from loraserve.config import ModelConfig, SchedulerConfig
from loraserve.models.loader import load_model
from tests.server.conftest import RunningServer, start_server

pytestmark = [pytest.mark.slow, pytest.mark.serial]

FLOODER, POLITE = "tenant-flooder-key-0123456789", "tenant-polite-key-0123456789"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory) -> Iterator[RunningServer]:
    # The model as `make serve` holds it on this CPU (--dtype/--weights auto), not the suite's float32 one: fairness
    # is the scheduler's, but float32 weights on an AMD CPU go through MKL's generic path, whose step time grows with
    # the rows (the lm_head matmul: 6.7 ms for one row, 20 ms for three, on a Zen 5), so any flooded batch doubles a
    # polite request's prefill whatever the scheduler does.
    yield from start_server(
        load_model(ModelConfig()), tmp_path_factory.mktemp("data"), scheduler=SchedulerConfig(max_num_seqs=4),
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


async def paced(client: httpx.AsyncClient, key: str, rate: float, count: int) -> list[float]:
    """`count` chats of 8 tokens sent `rate` a second, each at its time whatever the others do; their TTFTs."""
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.create_task(chat(client, key, 8)))
        await asyncio.sleep(1 / rate)
    return list(await asyncio.gather(*tasks))


POLITE_RATE = 0.5  # requests/s; the flooder sends ten times that: a load the test machine sustains with room
POLITE_REQUESTS = 12
ALONE_RATE = 2.0  # alone, each request ends long before the next starts (8 tokens): the same TTFT as at 0.5/s


async def polite_ttfts(url: str, flood_rate: float) -> list[float]:
    """The polite key's TTFTs at POLITE_RATE beside the flooder at `flood_rate`; alone (0), at ALONE_RATE."""
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=256)) as client:
        await chat(client, POLITE, 8)  # warm: the first request of a server pays for lazy set-up
        if not flood_rate:
            return await paced(client, POLITE, ALONE_RATE, POLITE_REQUESTS)
        seconds = (POLITE_REQUESTS + 2) / POLITE_RATE  # the flood outlasts the polite requests
        flood = asyncio.create_task(paced(client, FLOODER, flood_rate, round(seconds * flood_rate)))
        ttfts = await paced(client, POLITE, POLITE_RATE, POLITE_REQUESTS)
        await flood
        return ttfts


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
    lines = [line for line in metrics.splitlines() if line.startswith(f'{name}{{tenant="{tenant}"}}')]
    return float(lines[0].split()[1]) if lines else 0.0  # no line before the tenant's first request


def tenant_counters(url: str) -> dict[tuple[str, str], float]:
    metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {POLITE}"}).text
    names = ("loraserve_tenant_requests_total", "loraserve_tenant_generation_tokens_total")
    return {(name, key): counter(metrics, name, key) for name in names for key in (FLOODER, POLITE)}


def test_a_flooding_key_does_not_hold_back_another_keys_request(keyed_server):
    before = tenant_counters(keyed_server.url)
    duration, polite = asyncio.run(flood_then_polite(keyed_server.url))
    # Admitted at once, taking a slot from the flood: within about one flooder request (their batch runs slower).
    assert polite < 2 * duration + 0.5, (duration, polite)
    after = tenant_counters(keyed_server.url)
    served = {name: after[name] - before[name] for name in after}
    assert served[("loraserve_tenant_requests_total", FLOODER)] == 41
    assert served[("loraserve_tenant_generation_tokens_total", FLOODER)] == 41 * 32
    assert served[("loraserve_tenant_requests_total", POLITE)] == 1
    assert served[("loraserve_tenant_generation_tokens_total", POLITE)] == 4


def test_a_key_sending_ten_times_the_rate_of_another_keeps_its_median_ttft_within_twice_alone(keyed_server):
    # Up to three rounds: on a shared 2-core CI machine another process can take a core for the length of one flood
    # (alone 44 ms, beside 140 ms in one CI run; 60 and 67 ms on a Zen 3 here). A scheduler that queues the polite
    # request behind the flood fails every round, not one.
    readings = []
    for _ in range(3):
        alone = statistics.median(asyncio.run(polite_ttfts(keyed_server.url, 0)))
        beside_flood = statistics.median(asyncio.run(polite_ttfts(keyed_server.url, 10 * POLITE_RATE)))
        print(f"polite median TTFT alone {alone * 1e3:.0f} ms, beside a 10x flood {beside_flood * 1e3:.0f} ms")
        readings.append((alone, beside_flood))
        if beside_flood <= 2 * alone:
            return
    pytest.fail(f"polite median TTFT beside the flood over twice alone in every round: {readings}")
