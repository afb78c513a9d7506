"""The body of POST /v1/responses (openai_responses.py): OpenAI's Responses API fields that loraserve takes, each
typed for openapi.json; FIELD_POLICY says how every field of OpenAI's request is taken."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema

from loraserve.server.bounds import Count, Temperature, TopP
from loraserve.server.checked_fields import given
from loraserve.server.request_base import OpenAIRequest
from loraserve.server.responses_input import INPUT_SCHEMA

_FUNCTION_TOOL: dict[str, Any] = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "minLength": 1},
        "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "parameters": {"anyOf": [{"type": "object"}, {"type": "null"}]},
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
}
_TOOL_CHOICE: dict[str, Any] = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                         "name": {"type": "string"}}},
    ]
}  # fmt: skip
_TEXT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "format": {
            "anyOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                {
                    "type": "object",
                    "required": ["type", "name", "schema"],
                    "properties": {"type": {"const": "json_schema"}, "name": {"type": "string", "minLength": 1},
                                   "schema": {"type": "object"}},
                },
            ]
        }
    },
    "additionalProperties": False,
}  # fmt: skip


def _nullable(schema: dict[str, Any]) -> WithJsonSchema:
    return WithJsonSchema({"anyOf": [schema, {"type": "null"}]})


class ResponsesRequest(OpenAIRequest):
    """What /v1/responses takes; any other field is refused by name (400)."""

    # tool_choice needs tools, as OpenAI has it (tools/choice.py checks it, naming tool_choice).
    model_config = ConfigDict(
        json_schema_extra={
            "if": given("tool_choice", {"type": ["string", "object"]}),
            "then": given("tools", {"type": "array", "minItems": 1}),
        },
    )

    input: Annotated[Any, WithJsonSchema(INPUT_SCHEMA)]
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    tools: Annotated[Any, _nullable({"type": "array", "items": _FUNCTION_TOOL})] = None
    tool_choice: Annotated[Any, _nullable(_TOOL_CHOICE)] = None
    parallel_tool_calls: bool | None = None
    text: Annotated[Any, _nullable(_TEXT)] = None
    stream: bool = False
    # No server-side state: false (or left out) only; true is refused by name.
    store: Annotated[Any, WithJsonSchema({"enum": [False, None]})] = None
    include: Annotated[list[str], Field(max_length=0)] | None = None  # nothing extra to include
    truncation: Annotated[Any, WithJsonSchema({"enum": ["disabled", None]})] = None
    stream_options: Any = None  # inert: what it can hold changes nothing here


# How the route takes each field of OpenAI's request (the openai package's ResponseCreateParams): "implemented",
# "inert" (accepted; changes nothing in the answer) or "refused" (400 naming it).
FIELD_POLICY = {
    **dict.fromkeys(["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                     "tool_choice", "parallel_tool_calls", "text", "stream", "store", "include", "truncation"],
                    "implemented"),
    **dict.fromkeys(["metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                     "prompt_cache_options", "service_tier", "stream_options"], "inert"),
    **dict.fromkeys(["background", "context_management", "conversation", "max_tool_calls", "moderation",
                     "previous_response_id", "prompt", "reasoning", "top_logprobs"], "refused"),
}  # fmt: skip
