"""The agent frameworks people put in front of an OpenAI-compatible server, unchanged, against a real loraserve on a
free port with the embedded model: the `openai` SDK, LangChain (`langchain-openai`), the OpenAI Agents SDK and
`instructor`. Each call runs for the base model and an adapter at once, so both rows share the batch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import instructor
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.server.conftest import start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TARGETS = (MODEL, "pirate")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"], "additionalProperties": False},
    },
}  # fmt: skip


class Pirate(BaseModel):
    name: str = Field(max_length=20)  # bounded: a small model's strings run on otherwise
    ship: str = Field(max_length=20)
    age: int = Field(ge=1, le=120)


@pytest.fixture(scope="module")
def url(loaded_model, tmp_path_factory):
    for server in start_server(loaded_model, tmp_path_factory.mktemp("data"), num_blocks=2048, register_samples=True):
        yield f"{server.url}/v1"


def for_both(call: Callable[[str], Awaitable[Any]]) -> list[Any]:
    """`call` for the base model and an adapter, concurrently: one batch holds both."""

    async def both() -> list[Any]:
        return await asyncio.gather(*(call(target) for target in TARGETS))

    return asyncio.run(both())


def test_openai_sdk_chat_with_parts_and_auto_tools_streamed_or_not(url):
    async def chat(target: str) -> tuple[Any, str, list]:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
            parts = [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "Who are you?"}]
            reply = await client.chat.completions.create(model=target, max_tokens=24, temperature=0,
                                                         messages=[{"role": "user", "content": parts}])  # fmt: skip
            ask = {"model": target, "tools": [WEATHER], "max_tokens": 80, "temperature": 0,
                   "messages": [{"role": "user", "content": "What is the weather in Lisbon?"}]}  # fmt: skip
            whole = await client.chat.completions.create(**ask)
            stream = await client.chat.completions.create(**ask, stream=True)
            chunks = [chunk async for chunk in stream]
            return reply, whole, chunks

    for reply, whole, chunks in for_both(chat):
        assert reply.choices[0].message.content
        message = whole.choices[0].message
        streamed_calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or []]
        assert bool(message.tool_calls) == bool(streamed_calls)
        for call in message.tool_calls or []:
            assert json.loads(call.function.arguments)["city"]


def test_openai_sdk_responses_streamed_or_not(url):
    async def respond(target: str) -> tuple[Any, list]:
        async with openai.AsyncOpenAI(base_url=url, api_key="unused") as client:
            ask = {"model": target, "input": "Describe the sea in one sentence.", "max_output_tokens": 30,
                   "temperature": 0}  # fmt: skip
            whole = await client.responses.create(**ask)
            events = [event async for event in await client.responses.create(**ask, stream=True)]
            return whole, events

    for whole, events in for_both(respond):
        assert whole.output_text and events[-1].type == "response.completed"
        assert events[-1].response.output_text == whole.output_text


def test_langchain_bind_tools_and_with_structured_output(url):
    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return f"Sunny in {city}"

    async def run(target: str) -> tuple[AIMessage, Pirate]:
        model = ChatOpenAI(model=target, base_url=url, api_key="unused", temperature=0, max_tokens=120)
        with_tools = await model.bind_tools([get_weather]).ainvoke("What is the weather in Lisbon?")
        pirate = await model.with_structured_output(Pirate).ainvoke("Invent a pirate.")
        return with_tools, pirate

    for with_tools, pirate in for_both(run):
        assert isinstance(with_tools, AIMessage)
        for call in with_tools.tool_calls:
            assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
        assert isinstance(pirate, Pirate)


def test_agents_sdk_runs_an_agent_with_a_function_tool_to_a_final_answer(url):
    looked_up: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        looked_up.append(city)
        return f"Sunny and 21 degrees in {city}."

    async def run(target: str) -> Any:
        client = openai.AsyncOpenAI(base_url=url, api_key="unused")
        agent = Agent(
            name="Weather",
            instructions="Answer questions about the weather. Look it up first.",
            tools=[get_weather],
            # The first turn calls a tool (the SDK then resets the choice to auto: the model answers).
            model=OpenAIChatCompletionsModel(model=target, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
        )
        result = await Runner.run(agent, "What is the weather in Lisbon?", max_turns=4,
                                  run_config=RunConfig(tracing_disabled=True))  # fmt: skip
        await client.close()
        return result

    for result in for_both(run):
        assert isinstance(result.final_output, str) and result.final_output
    assert len(looked_up) >= 2  # each agent called the function


def test_instructor_returns_a_pydantic_response_model(url):
    async def extract(target: str) -> Pirate:
        client = instructor.from_openai(openai.AsyncOpenAI(base_url=url, api_key="unused"))
        return await client.chat.completions.create(
            model=target,
            response_model=Pirate,
            temperature=0,
            max_tokens=80,
            messages=[{"role": "user", "content": "Invent a pirate."}],
        )

    for pirate in for_both(extract):
        assert isinstance(pirate, Pirate)
