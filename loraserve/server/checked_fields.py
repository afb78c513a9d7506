"""The request fields a reader checks by hand (structured.py, lora/mix_spec.py), typed for openapi.json: each JSON
Schema states what its reader accepts, no more and no less, so a schema-valid value is served (but for rules no schema
can state: a grammar the engine cannot build, a name among another field's) and a schema-invalid one refused by name.
The readers keep the checks, as they name the sub-field at fault; the fuzz test (tests/server/test_api_fuzzing.py)
holds the two together."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import WithJsonSchema

from loraserve.engine.structured_output import MAX_CHOICES
from loraserve.lora.mix_spec import SIGN_METHODS, STRATEGIES

JsonDict = dict[str, Any]
_NULL: JsonDict = {"type": "null"}
# A JSON schema to follow: an object (a reader takes its JSON text as well, which a schema cannot tell from text).
_SCHEMA: JsonDict = {"type": "object"}


def _object(required: list[str], **properties: JsonDict) -> JsonDict:
    return {"type": "object", "required": required, "properties": properties}


def _nullable(schema: JsonDict) -> JsonDict:
    return {"anyOf": [schema, _NULL]}


# OpenAI's response_format (structured.from_response_format): other keys are ignored, as OpenAI's own are.
_RESPONSE_FORMAT: JsonDict = {
    "anyOf": [
        _object(["type"], type={"enum": ["text", "json_object"]}),
        _object(
            ["type", "json_schema"],
            type={"const": "json_schema"},
            json_schema=_object(["name", "schema"], name={"type": "string", "minLength": 1}, schema=_SCHEMA),
        ),
    ]
}
# vLLM's structured_outputs (structured.from_structured_outputs): exactly one key not null, the others null.
_STRUCTURED_KEYS: dict[str, JsonDict] = {
    "json": _SCHEMA,
    "regex": {"type": "string", "minLength": 1},
    "choice": {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}},
    "json_object": {"const": True},
}
_STRUCTURED_OUTPUTS: JsonDict = {
    "type": "object",
    "properties": {key: _nullable(schema) for key, schema in _STRUCTURED_KEYS.items()},
    "additionalProperties": _NULL,  # vLLM's other options, refused when set
    "oneOf": [_object([key], **{key: schema}) for key, schema in _STRUCTURED_KEYS.items()],
}
# LoRAX's parameters.response_format (structured.from_lorax_response_format): JSON, to the schema if given.
_LORAX_RESPONSE_FORMAT: JsonDict = _object(["type"], type={"const": "json_object"}, schema=_nullable(_SCHEMA))
# OpenAI's tools (tools/choice.py): functions, each taking an object of arguments (or none), named once each.
_TOOLS: JsonDict = {
    "type": "array",
    "minItems": 1,
    "items": _object(
        ["type", "function"],
        type={"const": "function"},
        function=_object(
            ["name"],
            name={"type": "string", "minLength": 1},
            parameters=_nullable(_SCHEMA),
            description=_nullable({"type": "string"}),
        ),
    ),
}
# "none", "auto", "required", or one function named (among tools: no schema can say so).
_TOOL_CHOICE: JsonDict = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        _object(["type", "function"], type={"const": "function"}, function=_object(["name"], name={"type": "string"})),
    ]
}
# LoRAX's merged_adapters (MixSpec.parse); as many weights as ids, which no schema can say.
_MERGED_ADAPTERS: JsonDict = {
    **_object(
        ["ids", "weights"],
        ids={"type": "array", "minItems": 1, "uniqueItems": True, "items": {"type": "string", "minLength": 1}},
        weights={"type": "array", "minItems": 1, "items": {"type": "number"}},
        merge_strategy={"enum": list(STRATEGIES)},
        density={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        majority_sign_method={"enum": list(SIGN_METHODS)},
    ),
    "additionalProperties": False,
}


# Each field null when not asked.
ResponseFormat = Annotated[Any, WithJsonSchema(_nullable(_RESPONSE_FORMAT))]
StructuredOutputs = Annotated[Any, WithJsonSchema(_nullable(_STRUCTURED_OUTPUTS))]
LoraxResponseFormat = Annotated[Any, WithJsonSchema(_nullable(_LORAX_RESPONSE_FORMAT))]
Tools = Annotated[Any, WithJsonSchema(_nullable(_TOOLS))]
ToolChoice = Annotated[Any, WithJsonSchema(_nullable(_TOOL_CHOICE))]
MergedAdapters = Annotated[Any, WithJsonSchema(_nullable(_MERGED_ADAPTERS))]


def given(field: str, schema: JsonDict) -> JsonDict:
    return {"required": [field], "properties": {field: schema}}


# The chat request's rules between fields, as OpenAI has them: tool_choice needs tools, top_logprobs needs logprobs.
CHAT_FIELD_RULES: JsonDict = {
    "allOf": [
        {"if": given("tool_choice", {"type": ["string", "object"]}), "then": given("tools", {"type": "array"})},
        {"if": given("top_logprobs", {"type": "integer"}), "then": given("logprobs", {"const": True})},
    ]
}
