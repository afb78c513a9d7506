"""The messages of /v1/chat/completions: one model per role, told apart by `role`.

A discriminated union, so that openapi.json states each role's own fields (a `tool` message needs `tool_call_id` and
`content`; an assistant's turn may leave `content` null when it made tool calls) and a key no role defines is refused
by name (`messages.0.foo`). A new role or content shape is one more model here.

Content is text, or (what LangChain, the Agents SDK and most front-ends send) a list of parts, of which the model
reads text parts (and an assistant's earlier `refusal` parts, as text); an image, audio or file part is refused naming
it (`messages.0.content.1.type`), as is any part type OpenAI does not define.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.config import JsonDict

from loraserve.errors import InvalidRequestError
from loraserve.server.content_parts import part_texts


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


def _part(kind: str, text_key: str) -> JsonDict:
    return {
        "type": "object",
        "required": ["type", text_key],
        "properties": {"type": {"const": kind}, text_key: {"type": "string"}},
        "additionalProperties": False,
    }


def _content_schema(*parts: JsonDict) -> JsonDict:
    return {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"anyOf": list(parts)}}]}


# The reader (text_parts) checks what these state, naming the part at fault.
TextContent = Annotated[Any, WithJsonSchema(_content_schema(_part("text", "text")))]
AssistantContent = Annotated[
    Any,
    WithJsonSchema({"anyOf": [_content_schema(_part("text", "text"), _part("refusal", "refusal")), {"type": "null"}]}),
]


def text_parts(content: Any, field: str, refusals: bool = False) -> str | list[dict[str, str]]:
    """A message's content: its text, or its parts as text parts; 400 naming what the model cannot read."""
    if isinstance(content, str):
        return content
    keys = {"text": "text", "refusal": "refusal"} if refusals else {"text": "text"}
    return [{"type": "text", "text": text} for text in part_texts(content, field, keys, strict=True)]


def content_chars(content: Any) -> int:
    """Characters of text a message holds (its parts' together), to bound a prompt before tokenizing it."""
    if isinstance(content, list):
        return sum(
            len(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return len(content) if isinstance(content, str) else 0


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    content: Any

    def template_message(self, index: int) -> dict[str, Any]:
        """As the chat template takes it."""
        content = text_parts(self.content, f"messages.{index}.content", self.takes_refusals)
        return {**self.model_dump(exclude_none=True), "content": content}

    takes_refusals: ClassVar[bool] = False  # whether refusal parts are the role's (an assistant's)


class SystemMessage(_Message):
    role: Literal["system"]
    content: TextContent
    name: str | None = None  # OpenAI's participant name: shown to the template, which may ignore it


class DeveloperMessage(_Message):
    """OpenAI's newer name for a system message."""

    role: Literal["developer"]
    content: TextContent
    name: str | None = None


class UserMessage(_Message):
    role: Literal["user"]
    content: TextContent
    name: str | None = None


# An assistant's turn holds text, tool calls or both: the schema says so with this anyOf, template_message checks it.
_TEXT_OR_CALLS: JsonDict = {
    "anyOf": [
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
    ]
}


class AssistantMessage(_Message):
    model_config = ConfigDict(json_schema_extra=_TEXT_OR_CALLS)

    role: Literal["assistant"]
    content: AssistantContent = None  # null only beside tool_calls
    tool_calls: list[MessageToolCall] | None = None
    name: str | None = None

    def template_message(self, index: int) -> dict[str, Any]:
        if self.content is None:
            if not self.tool_calls:
                raise InvalidRequestError(f"messages.{index}.content", "is required (but beside tool calls)")
            return {**self.model_dump(exclude_none=True), "content": ""}
        return super().template_message(index)

    takes_refusals: ClassVar[bool] = True


class ToolMessage(_Message):
    """A tool's answer to one of the assistant's calls."""

    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]
ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))  # the union's tags, in validation errors' loc
