"""Each API's ways of asking for structured output, read into one StructuredOutput (or None: free text).

OpenAI: `response_format` (`text`, `json_object`, `json_schema`; tool calls are tools/choice.py's); vLLM's
extension `structured_outputs` (`json`, `regex`, `choice`, `json_object`); LoRAX: `parameters.response_format`
(`{"type": "json_object", "schema": ...}`). What is not implemented is refused naming the field, never ignored.
"""

from __future__ import annotations

from typing import Any

from loraserve.engine.structured_output import ANY_JSON_OBJECT, StructuredOutput
from loraserve.errors import InvalidRequestError


def from_response_format(response_format: Any, field: str = "response_format") -> StructuredOutput | None:
    """OpenAI's response_format."""
    kind = _object(response_format, field).get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_schema(ANY_JSON_OBJECT, field)
    if kind == "json_schema":
        spec = _object(response_format.get("json_schema"), f"{field}.json_schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{field}.json_schema.name", "must be a non-empty string")
        if "schema" not in spec:
            raise InvalidRequestError(f"{field}.json_schema.schema", "is required: the JSON schema to follow")
        return StructuredOutput.json_schema(spec["schema"], f"{field}.json_schema.schema")
    raise InvalidRequestError(f"{field}.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def from_text_format(text: Any, field: str = "text") -> StructuredOutput | None:
    """The Responses API's `text` ({"format": ...}): as response_format, with json_schema's name and schema beside
    its type."""
    if text is None:
        return None
    unknown = sorted(set(_object(text, field)) - {"format"})
    if unknown:
        raise InvalidRequestError(f"{field}.{unknown[0]}", "is not supported by loraserve")
    text_format = text.get("format")
    if text_format is None:
        return None
    kind = _object(text_format, f"{field}.format").get("type")
    if kind != "json_schema":
        return from_response_format(text_format, f"{field}.format")
    nested = {"name": text_format.get("name"), "schema": text_format.get("schema")}
    nested = {key: value for key, value in nested.items() if key in text_format}
    try:
        return from_response_format({"type": kind, "json_schema": nested}, f"{field}.format")
    except InvalidRequestError as error:  # named as chat nests them: say where this API has them
        raise InvalidRequestError(error.field.replace(".json_schema", ""), error.message) from None


def from_lorax_response_format(response_format: Any, field: str = "parameters.response_format") -> StructuredOutput:
    """LoRAX's parameters.response_format: JSON, to the schema when one is given."""
    kind = _object(response_format, field).get("type")
    if kind != "json_object":
        raise InvalidRequestError(f"{field}.type", f"must be 'json_object', got {kind!r}")
    if response_format.get("schema") is None:
        return StructuredOutput.json_schema(ANY_JSON_OBJECT, field)
    return StructuredOutput.json_schema(response_format["schema"], f"{field}.schema")


# vLLM's StructuredOutputsParams keys that loraserve implements; the others are refused by name.
_STRUCTURED_OUTPUTS = {
    "json": StructuredOutput.json_schema,
    "regex": StructuredOutput.regex,
    "choice": StructuredOutput.choice,
}


def from_structured_outputs(options: Any, field: str = "structured_outputs") -> StructuredOutput:
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice or json_object (true)."""
    given = {key: value for key, value in _object(options, field).items() if value is not None}
    for key in given:
        if key not in (*_STRUCTURED_OUTPUTS, "json_object"):
            raise InvalidRequestError(f"{field}.{key}", "is not supported by loraserve")
    if len(given) != 1:
        raise InvalidRequestError(field, f"must give exactly one of {', '.join([*_STRUCTURED_OUTPUTS, 'json_object'])}")
    key, value = next(iter(given.items()))
    if key == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{field}.json_object", "must be true")
        return StructuredOutput.json_schema(ANY_JSON_OBJECT, f"{field}.json_object")
    return _STRUCTURED_OUTPUTS[key](value, f"{field}.{key}")


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be an object, got {type(value).__name__}")
    return value
