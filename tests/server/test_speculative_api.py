"""Speculative decoding through the HTTP API: a stream whose chunks may carry several tokens joins to the unary
answer (a stop string included), and /metrics, /admin/pool and the request's usage report the drafts."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.config import SpeculativeConfig
from loraserve.server.responses import Pool
from tests.server.conftest import ADMIN_TOKEN, start_server

pytestmark = pytest.mark.slow

QUOTE = "Repeat exactly: The quick brown fox jumps over the lazy dog near the quiet river bank at dawn."
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def server(loaded_model, tmp_path_factory):
    speculation = SpeculativeConfig("ngram", speculative_tokens=4, speculative_cost_check=False)  # drafts at once
    yield from start_server(
        loaded_model, tmp_path_factory.mktemp("data"), register_samples=True, speculation=speculation
    )


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", "pirate"])
@pytest.mark.parametrize("stop", [None, ["river"]], ids=["no-stop", "stop-string"])
def test_a_stream_of_several_tokens_a_chunk_joins_to_the_unary_answer(client, model, stop):
    messages = [{"role": "user", "content": QUOTE}]
    settings = {"model": model, "messages": messages, "max_tokens": 40, "temperature": 0, "stop": stop}
    unary = client.chat.completions.create(**settings)
    chunks = list(client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    content_chunks = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert content_chunks < unary.usage.completion_tokens  # some steps gave several tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [unary.choices[0].finish_reason]


def test_metrics_and_the_pool_report_drafts_by_adapter(server, client):
    client.chat.completions.create(model="pirate", messages=[{"role": "user", "content": QUOTE}], max_tokens=32)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    samples = {
        (s.labels["adapter"], s.labels["kind"]): s.value for s in families["loraserve_speculative_tokens"].samples
    }
    assert samples[("pirate", "drafted")] >= samples[("pirate", "accepted")] > 0
    assert 0 < families["loraserve_speculative_acceptance_rate"].samples[0].value <= 1
    pool = httpx.get(f"{server.url}/admin/pool", headers=ADMIN).json()
    Pool.model_validate(pool)
    by_adapter = {entry["adapter"]: entry for entry in pool["speculation"]["by_adapter"]}
    assert by_adapter["pirate"]["accepted_tokens"] == samples[("pirate", "accepted")]
    assert pool["speculation"]["draft_tokens"] >= by_adapter["pirate"]["draft_tokens"]
