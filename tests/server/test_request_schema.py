"""What openapi.json says about request bodies is what the server enforces: unknown keys refused by name (LoRAX
`parameters`, chat messages), each message role with its own required fields, empty strings refused where the schema
says so, and 405 with `Allow` for a method a path does not take."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# What lorax-client 0.6.3 sends when asked for nothing: every parameter, null or its default.
LORAX_CLIENT_DEFAULTS = {
    "adapter_id": None, "adapter_source": None, "merged_adapters": None, "api_token": None, "do_sample": False,
    "max_new_tokens": 2, "ignore_eos_token": False, "repetition_penalty": None, "return_full_text": False, "stop": [],
    "seed": None, "temperature": None, "top_k": None, "top_p": None, "truncate": None, "typical_p": None,
    "best_of": None, "watermark": False, "details": False, "decoder_input_details": False,
    "return_k_alternatives": None, "response_format": None,
}  # fmt: skip


def chat(server: Any, *messages: dict[str, Any], **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": list(messages), "max_tokens": 2, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def refused_as(response: httpx.Response, code: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code, response.text


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/"])
def test_lorax_parameters_take_what_lorax_client_sends_and_refuse_other_keys_by_name(server, path):
    accepted = httpx.post(f"{server.url}{path}", json={"inputs": "Hi", "parameters": LORAX_CLIENT_DEFAULTS}, timeout=60)
    assert accepted.status_code == 200, accepted.text
    unknown = {"inputs": "Hi", "parameters": {**LORAX_CLIENT_DEFAULTS, "frequency_penalty": 0.5}}
    refused_as(httpx.post(f"{server.url}{path}", json=unknown), "parameters.frequency_penalty")
    set_unsupported = {"inputs": "Hi", "parameters": {**LORAX_CLIENT_DEFAULTS, "watermark": True}}
    refused_as(httpx.post(f"{server.url}{path}", json=set_unsupported), "parameters.watermark")
    refused_as(httpx.post(f"{server.url}{path}", json={"inputs": ""}), "inputs")


def test_chat_messages_refuse_keys_their_role_does_not_define(server):
    refused_as(chat(server, {"role": "user", "content": "Hi", "audio": {"id": "a"}}), "messages.0.audio")
    refused_as(chat(server, {"role": "user", "content": "Hi"}, {"role": "user", "content": "x", "foo": 1}),
               "messages.1.foo")  # fmt: skip
    refused_as(chat(server, {"role": "user", "content": "Hi", "tool_call_id": "c"}), "messages.0.tool_call_id")
    refused_as(chat(server, {"role": "narrator", "content": "Hi"}), "messages.0")


def test_each_role_requires_its_own_fields(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    refused_as(chat(server, {"role": "tool", "content": "42"}), "messages.0.tool_call_id")
    refused_as(chat(server, {"role": "tool", "tool_call_id": "call_1"}), "messages.0.content")
    refused_as(chat(server, {"role": "user"}), "messages.0.content")
    refused_as(chat(server, {"role": "assistant"}), "messages.0.content")
    refused_as(chat(server, {"role": "assistant", "content": None, "tool_calls": []}), "messages.0.content")
    turns = [
        {"role": "user", "content": "What is 6 x 7?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    assert chat(server, *turns).status_code == 200


def test_empty_strings_and_non_integer_token_ids_are_refused_as_the_schema_says(server):
    refused_as(chat(server, {"role": "user", "content": "Hi"}, model=""), "model")
    for prompt in ("", [], [True]):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        refused_as(httpx.post(f"{server.url}/v1/completions", json=body), "prompt")


def test_the_schema_states_each_roles_required_fields(server):
    schemas = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]
    assert messages["discriminator"]["propertyName"] == "role"
    assert set(messages["discriminator"]["mapping"]) == {"system", "developer", "user", "assistant", "tool"}
    assert set(schemas["ToolMessage"]["required"]) == {"role", "content", "tool_call_id"}
    assert schemas["ToolMessage"]["additionalProperties"] is False
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["minLength"] == 1
    assert schemas["GenerateParameters"]["additionalProperties"] is False


METHOD_CASES = [
    ("TRACE", "/v1/models", "GET"),
    ("PUT", "/health", "GET"),
    ("GET", "/v1/chat/completions", "POST"),
    ("OPTIONS", "/admin/keys", "GET, POST"),
    ("TRACE", "/admin/adapters/x", "DELETE, GET, PATCH, PUT"),
]


@pytest.mark.parametrize(("method", "path", "allowed"), METHOD_CASES)
def test_a_method_a_path_does_not_take_is_a_405_with_allow(server, method, path, allowed):
    response = httpx.request(method, f"{server.url}{path}")
    assert response.status_code == 405
    assert response.headers["allow"] == allowed
    assert response.json()["error"]["code"] == "method_not_allowed"
