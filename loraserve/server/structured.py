"""Each API's ways of asking for structured output, read into one StructuredOutput (or None: free text).

OpenAI: `response_format` (`text`, `json_object`, `json_schema`) and forced tool calls (`tools` with a
`tool_choice` naming one function); vLLM's extension `structured_outputs` (`json`, `regex`, `choice`,
`json_object`); LoRAX: `parameters.response_format` (`{"type": "json_object", "schema": ...}`). What is
not implemented is refused naming the field, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loraserve.engine.structured_output import ANY_JSON_OBJECT, StructuredOutput
from loraserve.errors import InvalidRequestError

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}  # a function that takes no arguments


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


@dataclass(frozen=True)
class ToolCall:
    """The function a request forces the reply to call; the reply is its arguments, as JSON."""

    name: str
    output: StructuredOutput


def forced_tool_call(tools: Any, tool_choice: Any) -> ToolCall | None:
    """The function `tool_choice` names among `tools` (None: `tool_choice` is "none", or no tools).

    loraserve does not let the model choose whether to call a tool: `tool_choice` must name one function
    ("required" with a single tool names it too), else 400 naming tool_choice.
    """
    if tools is None:
        if tool_choice is not None:
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools", "must be a non-empty list of functions")
    functions = {_function_name(tool, f"tools.{i}"): tool["function"] for i, tool in enumerate(tools)}
    if tool_choice == "none":
        return None
    name: Any
    if tool_choice == "required" and len(functions) == 1:
        name = next(iter(functions))
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = _object(tool_choice.get("function"), "tool_choice.function").get("name")
        if not isinstance(name, str) or name not in functions:  # an object is no name (nor hashable)
            raise InvalidRequestError("tool_choice.function.name", f"names no function of tools: {name!r}")
    else:
        raise InvalidRequestError(
            "tool_choice",
            'must name one function ({"type": "function", "function": {"name": ...}}), "required" with one tool, '
            f"or 'none': loraserve does not let the model choose whether to call a tool; got {tool_choice!r}",
        )
    field = f"tools.{list(functions).index(name)}.function.parameters"
    return ToolCall(name, StructuredOutput.json_schema(functions[name].get("parameters") or EMPTY_PARAMETERS, field))


def _function_name(tool: Any, field: str) -> str:
    if _object(tool, field).get("type") != "function":
        raise InvalidRequestError(f"{field}.type", "must be 'function'")
    function = _object(tool.get("function"), f"{field}.function")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{field}.function.name", "must be a non-empty string")
    if not isinstance(function.get("parameters"), dict | None):  # every tool's, as the template shows them all
        raise InvalidRequestError(f"{field}.function.parameters", "must be a JSON schema (an object) or null")
    return name


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be an object, got {type(value).__name__}")
    return value
