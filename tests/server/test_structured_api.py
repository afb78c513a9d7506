"""Structured output over HTTP: OpenAI's response_format (the `openai` client's `parse` with a pydantic model
included), forced tool calls, vLLM's structured_outputs and LoRAX's response_format, streamed or not; what is not
implemented is refused naming the field; every field of OpenAI's requests is implemented, inert or refused."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from openai.types.responses import response_create_params
from pydantic import BaseModel, Field

from loraserve.server.responses_request import ResponsesRequest
from loraserve.server.schemas import FIELD_POLICY, ChatCompletionRequest, CompletionRequest
from tests.correctness.test_structured_output import PERSONAS, SCHEMAS, assert_valid

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TARGETS = [MODEL, *PERSONAS]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_every_schema_streams_a_valid_document_for_each_persona_beside_free_streams(samples_server, openai_client):
    free = [(target, "What is the capital of France?") for target in TARGETS]
    unary = [
        openai_client.chat.completions.create(
            model=t, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0
        )
        .choices[0]
        .message.content
        for t, q in free
    ]

    async def stream(target: str, question: str, schema: dict | None) -> str:
        extra = {"response_format": json_schema_format(schema), "max_tokens": 160} if schema else {"max_tokens": 24}
        chunks = await asyncio_client.chat.completions.create(
            model=target, messages=[{"role": "user", "content": question}], temperature=0, stream=True, **extra
        )
        return "".join([chunk.choices[0].delta.content or "" async for chunk in chunks if chunk.choices])

    async def everything() -> list[str]:
        jobs = [stream(t, e["prompt"], e["schema"]) for e in SCHEMAS for t in TARGETS]
        return await asyncio.gather(*jobs, *(stream(t, q, None) for t, q in free))

    asyncio_client = openai.AsyncOpenAI(
        base_url=f"{samples_server.url}/v1", api_key="unused", max_retries=0, timeout=600
    )
    texts = asyncio.run(everything())
    for (entry, target), text in zip([(e, t) for e in SCHEMAS for t in TARGETS], texts, strict=False):
        assert_valid(text, entry["schema"], f"{entry['name']} on {target}")
    assert texts[-len(free) :] == unary


class NonPlayerCharacter(BaseModel):
    name: str = Field(max_length=20)
    mood: Literal["happy", "grumpy", "tired"]
    gold: int = Field(ge=0, le=999)


def test_the_openai_clients_parse_returns_the_pydantic_model(openai_client):
    completion = openai_client.chat.completions.parse(
        model="pirate",
        messages=[{"role": "user", "content": "Describe the tavern keeper."}],
        response_format=NonPlayerCharacter,
        temperature=0,
        max_tokens=100,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, NonPlayerCharacter) and 0 <= parsed.gold <= 999


def test_a_forced_tool_call_returns_its_arguments_as_tool_calls_streamed_or_not(openai_client):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "temperature": 0,
        "max_tokens": 60,
    }
    choice = openai_client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert_valid(call.function.arguments, WEATHER_TOOL["function"]["parameters"], "get_weather's arguments")

    chunks = [c for c in openai_client.chat.completions.create(**body, stream=True) if c.choices]
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "get_weather" and {c.index for c in calls} == {0}
    assert {c.id for c in calls if c.id} == {calls[0].id}
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # The client runs the function and goes on with the conversation, as OpenAI's tool loop does.
    answer = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    follow_up = {**body, "messages": [*body["messages"], turn, answer], "tool_choice": "none"}
    reply = openai_client.chat.completions.create(**follow_up).choices[0]
    assert reply.message.content and reply.message.tool_calls is None


def test_a_message_without_content_is_refused_unless_it_called_a_tool(samples_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": None}]}
    response = httpx.post(f"{samples_server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "messages.0.content"


def test_structured_outputs_on_completions_and_json_mode_and_lorax(samples_server):
    prompt = {"model": MODEL, "prompt": "The answer is", "temperature": 0, "max_tokens": 30}
    for key, value, check in (
        ("regex", r"[0-9]{3}-[A-Z]{2}", lambda text: len(text) == 6 and text[3] == "-"),
        ("choice", ["red", "green", "blue"], lambda text: text in ("red", "green", "blue")),
        ("json", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
         lambda text: isinstance(json.loads(text)["n"], int)),
    ):  # fmt: skip
        response = httpx.post(
            f"{samples_server.url}/v1/completions", json={**prompt, "structured_outputs": {key: value}}
        )
        assert response.status_code == 200, response.text
        assert check(response.json()["choices"][0]["text"]), response.json()
    chat = {"model": "robot", "messages": [{"role": "user", "content": "Describe yourself as JSON."}], "temperature": 0}
    mode = httpx.post(
        f"{samples_server.url}/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}}
    )
    assert isinstance(json.loads(mode.json()["choices"][0]["message"]["content"]), dict)
    schema = SCHEMAS[0]["schema"]
    response_format = {"type": "json_object", "schema": schema}
    parameters = {"adapter_id": "pirate", "max_new_tokens": 100, "response_format": response_format}
    lorax = httpx.post(
        f"{samples_server.url}/generate", json={"inputs": "The tavern keeper says", "parameters": parameters}
    )
    assert_valid(lorax.json()["generated_text"], schema, "LoRAX's response_format")


@pytest.mark.parametrize(
    ("path", "fields", "code"),
    [
        ("/v1/chat/completions", {"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"response_format": {"type": "grammar"}}, "response_format.type"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ("/v1/completions", {"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
        ("/v1/completions", {"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs.grammar"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"json": {"type": "string", "maxLength": 5}}, "ignore_eos": True},
         "ignore_eos"),
        ("/v1/completions", {"structured_outputs": {"choice": ["x" * 70_000]}}, "structured_outputs.choice"),
        ("/v1/completions", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                  "function": {"name": "f"}}}, "tool_choice.function.name"),
        ("/v1/chat/completions", {"tools": [{"type": "custom"}], "tool_choice": "required"}, "tools.0.type"),
        ("/v1/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),  # the token whose bias is out of range
        ("/v1/completions", {"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ("/generate", {"response_format": {"type": "regex"}}, "parameters.response_format.type"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_naming_the_field(samples_server, path, fields, code):
    if path == "/generate":
        body = {"inputs": "Hi", "parameters": fields}
    elif path == "/v1/completions":
        body = {"model": MODEL, "prompt": "Hi", **fields}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}
    response = httpx.post(f"{samples_server.url}{path}", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code, response.json()


@pytest.mark.parametrize("route", sorted(FIELD_POLICY))
def test_every_field_of_openais_requests_is_implemented_inert_or_refused(samples_server, route):
    params, request_model, base = {
        "/v1/chat/completions": (
            chat_create_params.CompletionCreateParamsBase,
            ChatCompletionRequest,
            {"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        ),
        "/v1/completions": (
            completion_create_params.CompletionCreateParamsBase,
            CompletionRequest,
            {"max_tokens": 2, "prompt": "Hi"},
        ),
        "/v1/responses": (
            response_create_params.ResponseCreateParamsBase,
            ResponsesRequest,
            {"max_output_tokens": 2, "input": "Hi"},
        ),
    }[route]
    policy = FIELD_POLICY[route]
    openai_fields = set(params.__annotations__)
    assert openai_fields <= set(policy), f"not in the field policy: {openai_fields - set(policy)}"
    for field, how in policy.items():
        assert (field in request_model.model_fields) == (how != "refused"), field
    base |= {"model": MODEL}
    for field in [f for f, how in policy.items() if how != "implemented"]:
        response = httpx.post(f"{samples_server.url}{route}", json={**base, field: "x" if field != "store" else True})
        if policy[field] == "inert":
            assert response.status_code == 200, (field, response.text)
        else:
            assert response.status_code == 400 and response.json()["error"]["code"] == field, (field, response.text)
