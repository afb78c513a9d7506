"""The `openai` package works unchanged against the server; errors follow the contract."""

from __future__ import annotations

import asyncio
import logging

import httpx
import openai
import pytest

from loraserve import SamplingParams
from tests.conftest import CHAT_PROMPTS
from tests.server.conftest import start_server, wait_until_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_health_and_model_list(server, client):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_equals_llm_generate(client, llm):
    prompt = "The three primary colors are"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    (expected,) = llm.generate(prompt, llm_params(24), use_tqdm=False)
    assert reply.choices[0].text == expected.outputs[0].text
    assert reply.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert reply.usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_completion_equals_llm_chat(client, llm):
    conv = CHAT_PROMPTS[4]
    reply = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=32, temperature=0)
    (expected,) = llm.chat(conv, llm_params(32), use_tqdm=False)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.outputs[0].text
    again = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=32, temperature=0)
    assert again.choices[0].message.content == expected.outputs[0].text
    block_size = 16
    full_blocks = (again.usage.prompt_tokens - 1) // block_size * block_size
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks, "the first answer's prompt is cached"


def test_streamed_chat_concatenates_to_the_full_answer_with_usage(client, llm):
    conv = CHAT_PROMPTS[1]
    stream = client.chat.completions.create(
        model=MODEL, messages=conv, max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (expected,) = llm.chat(conv, llm_params(32), use_tqdm=False)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.outputs[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_completion_with_a_stop_string_never_shows_the_stop_text(client, llm):
    prompt = "List the days of the week: Monday, Tuesday,"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    stop = full.split(",")[2] + ","  # the third item and its comma, e.g. " Thursday,"
    pieces = [
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=True
        )
    ]
    assert "".join(pieces) == full[: full.index(stop)]


def test_n_completions_with_a_seed_are_reproducible(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=2, seed=7)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    second = [c.text for c in client.completions.create(**kwargs).choices]
    assert first == second and len(first) == 2


def test_errors_are_json_with_the_documented_status(server):
    url = f"{server.url}/v1/completions"
    unknown = httpx.post(url, json={"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["type"] == "not_found_error"
    bad = httpx.post(url, json={"model": MODEL, "prompt": "hi", "temperature": -1})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "temperature"
    missing = httpx.post(url, json={"model": MODEL})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "prompt"
    assert "prompt" in missing.json()["error"]["message"]
    too_long = httpx.post(url, json={"model": MODEL, "prompt": "word " * 9000, "max_tokens": 4})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "prompt"
    wait_until_idle(server.engine)


# A document that cannot end early (the Responses API has no ignore_eos).
LONG_STORY = {"type": "object", "properties": {"story": {"type": "string", "minLength": 3000}}, "required": ["story"]}


def test_client_that_disconnects_aborts_its_request_and_frees_its_blocks(server, caplog):
    # Unaborted, 4000 tokens would run for minutes: wait_until_idle would time out.
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_until_idle(server.engine)
    manager = server.engine.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    # Not streamed: the client gives up waiting; its request ends there, without an error logged for it.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 4000,
            "ignore_eos": True}  # fmt: skip
    text_format = {"format": {"type": "json_schema", "name": "story", "schema": LONG_STORY}}
    story = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 4000, "text": text_format}
    for url, fields in ((f"{server.url}/v1/chat/completions", chat), (f"{server.url}/v1/responses", story)):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=fields, timeout=httpx.Timeout(5, read=1.5))
        wait_until_idle(server.engine)
        assert manager.num_free_blocks == manager.num_blocks
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def test_concurrent_streaming_clients_all_complete_with_the_greedy_answers(server, llm):
    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT_PROMPTS[i % len(CHAT_PROMPTS)], max_tokens=16, temperature=0, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
        return await asyncio.gather(*(one(client, i) for i in range(12)))

    answers = asyncio.run(run())
    expected = llm.chat([CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(12)], llm_params(16), use_tqdm=False)
    assert answers == [e.outputs[0].text for e in expected]
    manager = server.engine.engine.block_manager
    wait_until_idle(server.engine)
    assert manager.num_free_blocks == manager.num_blocks


def test_api_keys_guard_inference_routes(loaded_model, tmp_path):
    for running in start_server(loaded_model, tmp_path, api_keys=frozenset({"secret"})):
        assert httpx.get(f"{running.url}/health").status_code == 200
        refused = httpx.get(f"{running.url}/v1/models")
        assert refused.status_code == 401
        assert refused.json()["error"]["message"].startswith("missing or invalid API key")
        allowed = httpx.get(f"{running.url}/v1/models", headers={"Authorization": "Bearer secret"})
        assert allowed.status_code == 200


def llm_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)
