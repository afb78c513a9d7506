"""64 streaming clients over 16 adapters (more than the 8 device slots) all complete with the right answers."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from loraserve import SamplingParams
from loraserve.resources import SAMPLE_ADAPTERS
from tests.conftest import CHAT_PROMPTS
from tests.server.conftest import ADMIN, start_server, wait_until_idle
from tests.server.test_admin_api import peft_files, upload

pytestmark = pytest.mark.slow

SAMPLES = SAMPLE_ADAPTERS
PERSONAS = ("pirate", "robot", "shakespeare", "french-tutor")
NUM_CLIENTS, MAX_TOKENS = 64, 12


def adapter_of(i: int) -> str:
    """16 adapters: each persona under 4 names (distinct adapters to the engine, known answers)."""
    return f"{PERSONAS[i % 4]}-{i // 4 % 4}"


def test_64_streaming_clients_over_16_adapters_complete_and_show_in_metrics(loaded_model, tmp_path, make_llm):
    conversations = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(NUM_CLIENTS)]
    offline = make_llm(max_loras=4)
    for persona in PERSONAS:
        offline.add_adapter(persona, SAMPLES / persona)
    expected = offline.chat(
        conversations,
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        adapters=[PERSONAS[i % 4] for i in range(NUM_CLIENTS)],
        use_tqdm=False,
    )

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=adapter_of(i), messages=conversations[i], max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all(url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    for running in start_server(loaded_model, tmp_path, max_loras=8):
        for i in range(16):
            assert upload(running, adapter_of(i), peft_files(SAMPLES / PERSONAS[i % 4])).status_code == 201
        answers = asyncio.run(run_all(running.url))
        assert answers == [e.outputs[0].text for e in expected]
        metrics = _samples(httpx.get(f"{running.url}/metrics").text)
        assert metrics["loraserve_time_to_first_token_seconds_count"] == NUM_CLIENTS
        assert metrics["loraserve_inter_token_latency_seconds_count"] > 0
        assert metrics["loraserve_adapter_evictions"] > 0, "16 adapters through 8 slots"
        prompt_tokens = sum(len(e.prompt_token_ids) for e in expected)
        assert metrics["loraserve_prefix_cache_queried_tokens"] >= prompt_tokens
        assert 0 <= metrics["loraserve_prefix_cache_hit_tokens"] < prompt_tokens
        finished = {
            name: sum(v for k, v in metrics.items() if k.startswith(f'loraserve_requests_total{{adapter="{name}"'))
            for name in map(adapter_of, range(16))
        }
        assert finished == dict.fromkeys(finished, 4)
        wait_until_idle(running.engine)
        pool = httpx.get(f"{running.url}/admin/pool", headers=ADMIN).json()
        assert pool["pages"]["kv"] == 0, "every KV block is free afterwards"
        assert pool["prefix_cache"]["hit_tokens"] == metrics["loraserve_prefix_cache_hit_tokens"]


def _samples(text: str) -> dict[str, float]:
    """Prometheus text -> {series: value} (comments dropped)."""
    lines = [line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")]
    return {series: float(value) for series, value in lines}
