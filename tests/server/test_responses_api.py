"""POST /v1/responses with the `openai` client's `responses.create`, streamed or not: the same text as the chat route
for the same conversation, events that add up to the completed response, function tools and `text.format` as in chat;
what needs server-side state or reads more than text is refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.server.test_tool_calls_api import SCHEMAS, SHIPPED, TOOLS

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# The Responses API's function tools: the chat ones, flattened.
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]


@pytest.mark.parametrize("model", [MODEL, "pirate"])
def test_a_response_says_what_chat_says_for_the_same_conversation(openai_client, model):
    response = openai_client.responses.create(
        model=model, instructions="Answer briefly.", input="Where do pirates sail?", temperature=0, max_output_tokens=24
    )
    chat = openai_client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=24,
        messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where do pirates sail?"},
        ],
    )
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_add_up_to_the_completed_response(openai_client):
    events = list(
        openai_client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me about the sea."}]}],
            temperature=0,
            max_output_tokens=30,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text and text == final.output_text
    assert {"response.output_item.added", "response.output_text.done", "response.output_item.done"} <= set(kinds)
    whole = openai_client.responses.create(
        model=MODEL, input="Tell me about the sea.", temperature=0, max_output_tokens=30
    )
    assert whole.output_text == text


def test_function_calls_validate_and_stream_their_arguments(openai_client):
    for tool_choice in ("auto", "required"):
        response = openai_client.responses.create(
            model=MODEL,
            input=SHIPPED["prompts"][2],
            tools=FUNCTIONS,
            tool_choice=tool_choice,
            temperature=0,
            max_output_tokens=120,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls or tool_choice == "auto"
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.call_id.startswith("call_")
    stream = list(
        openai_client.responses.create(
            model=MODEL,
            input=SHIPPED["prompts"][2],
            tools=FUNCTIONS,
            tool_choice="required",
            temperature=0,
            max_output_tokens=120,
            stream=True,
        )
    )
    pieces = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
    done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    final_calls = [item for item in stream[-1].response.output if item.type == "function_call"]
    assert pieces == "".join(call.arguments for call in final_calls) and len(done) == len(final_calls) >= 1


def test_a_named_function_and_a_json_schema_format_hold_the_output(openai_client):
    response = openai_client.responses.create(
        model=MODEL,
        input="Weather in Rome?",
        tools=FUNCTIONS,
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    shaped = openai_client.responses.create(
        model=MODEL,
        input="Pick a color.",
        temperature=0,
        max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
    )
    jsonschema.validate(json.loads(shaped.output_text), schema)


def test_an_earlier_call_and_its_output_go_back_as_items(openai_client):
    items = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"celsius": -3}'},
    ]
    response = openai_client.responses.create(
        model=MODEL, input=items, tools=FUNCTIONS, temperature=0, max_output_tokens=40
    )
    assert response.status in ("completed", "incomplete") and response.output


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "fancy_text", "text": "hi"}]}]}, "input.0.content.0.type"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
    ],
)  # fmt: skip
def test_what_loraserve_does_not_keep_or_read_is_refused_by_name(samples_server, fields, named):
    body = {"model": MODEL, "input": "Hi", **fields}
    response = httpx.post(f"{samples_server.url}/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == named, response.text
