"""Automatic tool choice and content parts over HTTP, with the `openai` client, on the embedded model (whose template
shows no tools: the fallback prompt shows them). Every call the model makes on the shipped prompts parses and
validates against its function's schema, a text reply holds no markup, a streamed reply adds up to the unstreamed
one; base and adapter rows share the batch."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TARGETS = (MODEL, "pirate")
SHIPPED = json.loads((Path(__file__).parents[2] / "benchmarks" / "data" / "tool_prompts.json").read_text())
TOOLS = SHIPPED["tools"]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MARKUP = ("<tool_call>", "</tool_call>", "<tools>")


def ask(prompt: str, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 120,
        **extra,
    }


def check_reply(choice) -> int:
    """The calls a reply made, each checked against its schema (a text reply: no markup); how many."""
    message = choice.message
    if not message.tool_calls:
        assert choice.finish_reason in ("stop", "length") and message.content is not None
        assert not any(mark in message.content for mark in MARKUP), message.content
        return 0
    assert choice.finish_reason in ("tool_calls", "length")  # a call may follow text that ran long
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return len(message.tool_calls)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_every_call_on_the_shipped_prompts_parses_and_validates_and_text_holds_no_markup(samples_server, tool_choice):
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{samples_server.url}/v1", api_key="unused") as openai_client:
            asked = [
                openai_client.chat.completions.create(model=t, **ask(p, tool_choice=tool_choice))
                for p in SHIPPED["prompts"]
                for t in TARGETS
            ]
            return await asyncio.gather(*asked)

    completions = asyncio.run(run())
    calls = [check_reply(completion.choices[0]) for completion in completions]
    assert len(calls) == 2 * len(SHIPPED["prompts"]) == 40
    if tool_choice == "required":
        assert min(calls) >= 1
    else:  # the embedded model calls a function on a few of these prompts and answers the others in text
        assert sum(calls) > 0 and calls.count(0) > 0


def test_a_streamed_reply_adds_up_to_the_unstreamed_one(openai_client):
    for prompt in SHIPPED["prompts"][:6]:
        whole = openai_client.chat.completions.create(model=MODEL, **ask(prompt)).choices[0]
        stream = openai_client.chat.completions.create(model=MODEL, stream=True, **ask(prompt))
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        content = "".join(chunk.delta.content or "" for chunk in chunks)
        names, arguments, ids = {}, {}, {}
        for chunk in chunks:
            for call in chunk.delta.tool_calls or []:
                if call.id:
                    assert call.index not in ids and call.function.name, "a call's id and name come once, first"
                    ids[call.index], names[call.index] = call.id, call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        made = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls or []]
        assert [(names[i], arguments[i]) for i in sorted(names)] == made
        assert content == (whole.message.content or ""), prompt
        assert not any(mark in content for mark in MARKUP)
        assert chunks[-1].finish_reason == whole.finish_reason


def test_required_calls_a_function_and_parallel_false_one_at_most(openai_client):
    prompt = SHIPPED["prompts"][16]  # weather and a reminder: two calls where allowed
    required = openai_client.chat.completions.create(model=MODEL, **ask(prompt, tool_choice="required")).choices[0]
    assert check_reply(required) >= 1
    single = openai_client.chat.completions.create(
        model=MODEL, **ask(prompt, tool_choice="required", parallel_tool_calls=False)
    ).choices[0]
    assert check_reply(single) == 1
    none = openai_client.chat.completions.create(model=MODEL, **ask(prompt, tool_choice="none")).choices[0]
    assert check_reply(none) == 0


def test_content_parts_read_as_their_joined_text_and_developer_as_system(openai_client):
    def reply(messages: list) -> str:
        completion = openai_client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
        return completion.choices[0].message.content

    parts = [{"type": "text", "text": "Name a color."}, {"type": "text", "text": "One word."}]
    assert reply([{"role": "user", "content": parts}]) == reply(
        [{"role": "user", "content": "Name a color.\nOne word."}]
    )
    system = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    developer = [{"role": "developer", "content": [{"type": "text", "text": "You are terse."}]}, system[1]]
    assert reply(developer) == reply(system)


@pytest.mark.parametrize(
    ("part", "field"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "messages.0.content.1.type"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "messages.0.content.1.type"),
        ({"type": "file", "file": {"file_id": "f"}}, "messages.0.content.1.type"),
        ({"type": "video", "text": "x"}, "messages.0.content.1.type"),
        ({"type": "text", "text": "x", "cache_control": {}}, "messages.0.content.1.cache_control"),
    ],
)
def test_parts_the_model_cannot_read_are_refused_by_name(samples_server, part, field):
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    response = httpx.post(f"{samples_server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == field, response.text


def test_an_earlier_call_and_its_result_go_back_to_the_model(openai_client):
    weather = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    messages = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [weather]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": -3, "sky": "snow"}'},
    ]
    choice = openai_client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=40
    ).choices[0]
    check_reply(choice)
