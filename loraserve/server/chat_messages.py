"""The messages of /v1/chat/completions: one model per role, told apart by `role`.

A discriminated union, so that openapi.json states each role's own fields (a `tool` message needs `tool_call_id` and
`content`; an assistant's turn may leave `content` null when it made tool calls) and a key no role defines is refused
by name (`messages.0.foo`). A new role or content shape is one more model here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict

from loraserve.errors import InvalidRequestError


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


class MessageToolCall(BaseModel):
    """A call an assistant's earlier turn made (OpenAI's shape), shown to the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    content: str | None

    def template_message(self, index: int) -> dict[str, Any]:
        """As the chat template takes it."""
        return {**self.model_dump(exclude_none=True), "content": self.content or ""}


class SystemMessage(_Message):
    role: Literal["system"]
    content: str
    name: str | None = None  # OpenAI's participant name: shown to the template, which may ignore it


class DeveloperMessage(_Message):
    """OpenAI's newer name for a system message."""

    role: Literal["developer"]
    content: str
    name: str | None = None


class UserMessage(_Message):
    role: Literal["user"]
    content: str
    name: str | None = None


# An assistant's turn holds text, tool calls or both: the schema says so with this anyOf, template_message checks it.
_TEXT_OR_CALLS: JsonDict = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"type": "string"}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
    ]
}


class AssistantMessage(_Message):
    model_config = ConfigDict(json_schema_extra=_TEXT_OR_CALLS)

    role: Literal["assistant"]
    content: str | None = None  # null only beside tool_calls
    tool_calls: list[MessageToolCall] | None = None
    name: str | None = None

    def template_message(self, index: int) -> dict[str, Any]:
        if self.content is None and not self.tool_calls:
            raise InvalidRequestError(f"messages.{index}.content", "is required (but for an assistant's tool calls)")
        return super().template_message(index)


class ToolMessage(_Message):
    """A tool's answer to one of the assistant's calls."""

    role: Literal["tool"]
    content: str
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))  # the union's tags, in validation errors' loc
