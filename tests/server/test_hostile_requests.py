"""Hostile inference requests: a JSON 400 naming the field, never a 5xx; and the service goes on.

After every hostile request a normal greedy chat still answers 200 with the same text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from loraserve.config import SchedulerConfig
from tests.hostile_values import hostile_fields
from tests.server.conftest import RunningServer, start_server, wait_until_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
SAMPLING = ["n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "ignore_eos", "stream", "stream_options", "adapter_id",
            "user", "response_format", "logit_bias", "structured_outputs", "min_tokens"]  # fmt: skip
CHAT_FIELDS = [*SAMPLING, "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
               "tool_choice"]  # fmt: skip
COMPLETION_FIELDS = [*SAMPLING, "prompt", "max_tokens", "logprobs"]
LORAX_FIELDS = ["adapter_id", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "seed", "stop",
                "repetition_penalty", "truncate", "return_k_alternatives", "details", "return_full_text",
                "ignore_eos_token", "best_of", "typical_p", "watermark", "decoder_input_details",
                "response_format"]  # fmt: skip
PROPERTY = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    """A short context and --max-n 4, so that a hostile request that is served ends soon."""
    scheduler = SchedulerConfig(max_model_len=96, max_n=4)
    yield from start_server(loaded_model, tmp_path_factory.mktemp("data"), scheduler=scheduler)


@pytest.fixture(scope="module")
def normal_answer(server) -> str:
    return _normal_answer(server)


def _normal_answer(server: RunningServer) -> str:
    response = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def send(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    # json.dumps writes NaN and Infinity as Python's json reads them: the server must face them too.
    content = json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=120)


def assert_refused_by_name_or_served(response: httpx.Response, fields: dict[str, Any]) -> None:
    if response.status_code == 404 and "adapter_id" in fields:
        return  # any adapter_id names no adapter of this server
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and isinstance(error["message"], str)
        # The code names the field sent, or a part of it: "parameters.response_format.type", "messages.0".
        named = isinstance(error["code"], str) and any(part in fields for part in error["code"].split("."))
        assert named or error["code"].split(".")[-1] in {"0", "1", "2", "3"}, (error, fields)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert '"error"' not in response.text, response.text
        assert response.text.rstrip().endswith("data: [DONE]") or "generated_text" in response.text


def test_a_top_k_past_int64_answers_400_and_the_next_chat_is_unchanged(server, normal_answer):
    response = send(server, "/v1/chat/completions", {**CHAT, "max_tokens": 3, "top_k": 10**20})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "top_k"
    assert _normal_answer(server) == normal_answer


def test_seeds_take_the_whole_int64_range_and_nothing_past_it(server):
    body = {**CHAT, "max_tokens": 4, "temperature": 1.0, "n": 2}
    for seed in (2**63 - 1, -(2**63)):
        first, second = (send(server, "/v1/chat/completions", {**body, "seed": seed}) for _ in range(2))
        assert first.status_code == 200, first.text
        assert first.json()["choices"] == second.json()["choices"], "same seed, same tokens"
    past = send(server, "/v1/chat/completions", {**body, "seed": 2**63})
    assert past.status_code == 400 and past.json()["error"]["code"] == "seed"


def test_unsupported_fields_are_refused_by_name(server):
    for field, value in (("suffix", "!"), ("best_of", 2), ("echo", True)):
        response = send(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", field: value})
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": f"{field}: is not supported by loraserve",
            "type": "invalid_request_error",
            "code": field,
        }


def test_invalid_fields_are_named_as_each_api_names_them(server):
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 0}}
    response = send(server, "/generate", body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parameters.max_new_tokens"
    chat = send(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0})
    assert chat.json()["error"]["code"] == "max_completion_tokens"
    alone = send(server, "/v1/chat/completions", {**CHAT, "top_logprobs": 2})
    assert alone.status_code == 400 and alone.json()["error"]["code"] == "top_logprobs"


@PROPERTY
@given(fields=hostile_fields(CHAT_FIELDS))
def test_any_chat_fields_are_refused_by_name_or_served(server, normal_answer, fields):
    assert_refused_by_name_or_served(send(server, "/v1/chat/completions", {**CHAT, **fields}), fields)
    wait_until_idle(server.engine)
    assert _normal_answer(server) == normal_answer


@PROPERTY
@given(fields=hostile_fields(COMPLETION_FIELDS))
def test_any_completion_fields_are_refused_by_name_or_served(server, normal_answer, fields):
    body = {"model": MODEL, "prompt": "The capital of France is", **fields}
    assert_refused_by_name_or_served(send(server, "/v1/completions", body), fields)
    wait_until_idle(server.engine)
    assert _normal_answer(server) == normal_answer


@PROPERTY
@given(fields=hostile_fields(LORAX_FIELDS))
def test_any_lorax_parameters_are_refused_by_name_or_served(server, normal_answer, fields):
    response = send(server, "/generate", {"inputs": "The capital of France is", "parameters": fields})
    assert_refused_by_name_or_served(response, fields)
    wait_until_idle(server.engine)
    assert _normal_answer(server) == normal_answer


def test_bodies_that_are_not_json_or_too_large_get_json_errors(server):
    url = f"{server.url}/v1/chat/completions"
    headers = {"content-type": "application/json"}
    broken = httpx.post(url, content=b'{"model": "x", "messages": [', headers=headers)
    assert broken.status_code == 400
    error = broken.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert error["message"].startswith("the body is not valid JSON: Expecting value at character")
    nested = httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, headers=headers)
    assert nested.status_code == 400 and nested.json()["error"]["type"] == "invalid_request_error"

    def chunks():  # 50 MB with no Content-Length: the limit must be found while it arrives
        for _ in range(50):
            yield b" " * (1 << 20)

    chunked = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    assert chunked.status_code == 413
    assert chunked.json()["error"]["code"] == "payload_too_large"
    unknown = httpx.get(f"{server.url}/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert _normal_answer(server)
