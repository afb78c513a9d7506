"""The Responses API's `input` read into a chat conversation: text, or items (messages, earlier function calls and
their outputs); what the model cannot read (images, files, audio) and items that need stored state are refused
naming the item's field. INPUT_SCHEMA states to openapi.json what `read_input` accepts."""

from __future__ import annotations

from typing import Any

from loraserve.errors import InvalidRequestError
from loraserve.server.content_parts import part_texts

_PART_TEXT = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text's key
_ROLES = ("user", "assistant", "system", "developer")
_ITEM_KEYS = ("id", "status")  # what an earlier response's items carry besides their content: ignored

JsonDict = dict[str, Any]


def _part_schema(kind: str) -> JsonDict:
    key = _PART_TEXT[kind]
    return {
        "type": "object",
        "required": ["type", key],
        "properties": {"type": {"const": kind}, key: {"type": "string"}},
    }


_TEXT_OR_PARTS: JsonDict = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"anyOf": [_part_schema(kind) for kind in _PART_TEXT]}},
    ]
}


def _item_schema(required: list[str], **properties: JsonDict) -> JsonDict:
    """An item: its own keys, and an earlier response's `id` and `status` (ignored); no other."""
    return {
        "type": "object",
        "required": required,
        "properties": {**properties, **{key: {} for key in _ITEM_KEYS}},
        "additionalProperties": False,
    }


_ITEM_SCHEMAS: list[JsonDict] = [
    _item_schema(["role", "content"], type={"const": "message"}, role={"enum": list(_ROLES)}, content=_TEXT_OR_PARTS),
    _item_schema(
        ["type", "call_id", "name", "arguments"],
        type={"const": "function_call"},
        call_id={"type": "string", "minLength": 1},
        name={"type": "string", "minLength": 1},
        arguments={"type": "string"},
    ),
    _item_schema(
        ["type", "call_id", "output"],
        type={"const": "function_call_output"},
        call_id={"type": "string", "minLength": 1},
        output=_TEXT_OR_PARTS,
    ),
]
INPUT_SCHEMA: JsonDict = {
    "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"anyOf": _ITEM_SCHEMAS}}]
}


def read_input(value: Any, instructions: str | None) -> list[JsonDict]:
    """The conversation the input holds, `instructions` first as a system message."""
    conversation: list[JsonDict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        if not value:
            raise InvalidRequestError("input", "must not be empty")
        return [*conversation, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input", "must be text or a non-empty list of items")
    for i, item in enumerate(value):
        field = f"input.{i}"
        if not isinstance(item, dict):
            raise InvalidRequestError(field, f"must be an item (an object), got {type(item).__name__}")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{field}.type", f"must be a string, got {kind!r}")
        if kind == "message":
            _known_keys(item, field, "type", "role", "content")
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequestError(f"{field}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
            conversation.append({"role": role, "content": _text(item.get("content"), f"{field}.content")})
        elif kind == "function_call":
            _known_keys(item, field, "type", "call_id", "name", "arguments")
            call = {
                "id": _string(item, "call_id", field),
                "type": "function",
                "function": {"name": _string(item, "name", field), "arguments": _string(item, "arguments", field, "")},
            }
            last = conversation[-1] if conversation else None
            if last is not None and last["role"] == "assistant":  # the same turn's text, or its other calls
                last.setdefault("tool_calls", []).append(call)
            else:
                conversation.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            _known_keys(item, field, "type", "call_id", "output")
            content = _text(item.get("output"), f"{field}.output")
            conversation.append({"role": "tool", "tool_call_id": _string(item, "call_id", field), "content": content})
        else:
            raise InvalidRequestError(
                f"{field}.type", f"must be 'message', 'function_call' or 'function_call_output', got {kind!r}"
            )
    return conversation


def _text(content: Any, field: str) -> str:
    """A message's text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    return "\n".join(part_texts(content, field, _PART_TEXT, strict=False))


def _string(item: JsonDict, key: str, field: str, empty: str | None = None) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and empty is None):
        raise InvalidRequestError(
            f"{field}.{key}", "must be a non-empty string" if empty is None else "must be a string"
        )
    return value


def _known_keys(item: JsonDict, field: str, *keys: str) -> None:
    for key in item:
        if key not in keys and key not in _ITEM_KEYS:
            raise InvalidRequestError(f"{field}.{key}", "is not supported by loraserve")
