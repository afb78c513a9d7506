"""The functions a request offers the model, and the JSON schema of one call of any of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}  # a function without `parameters`
_DEFINITIONS = ("$defs", "definitions")
# Where a JSON schema holds other schemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas", *_DEFINITIONS)
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_ARGUMENTS))
    description: str | None = None
    field: str = "tools"  # where the request gave it (its errors name this)

    def arguments_schema(self) -> dict[str, Any]:
        """What the call's arguments must match: `parameters`, each object closed to the properties it declares
        where it says nothing of others (as vLLM's default grammar engine, xgrammar in strict mode, holds them;
        pydantic's schemas, which `instructor` and the Agents SDK send, say nothing, and a small model left free
        invents properties until max_tokens)."""
        return closed(self.parameters)

    def as_tool(self) -> dict[str, Any]:
        """OpenAI's chat tool, as chat templates take it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def call_schema(functions: list[Function], arguments_key: str) -> dict[str, Any]:
    """A call of one of `functions`: `{"name": <its name>, "<arguments_key>": <its parameters>}`, name first.

    Each function's `$defs` (pydantic's nested models) move to the root under a prefix of the function's index, and
    its references with them: a `#/$defs/...` reference resolves against the root of the schema it sits in."""
    definitions: dict[str, Any] = {}
    branches = []
    for index, function in enumerate(functions):
        arguments = function.arguments_schema()
        parameters = {k: v for k, v in arguments.items() if k not in _DEFINITIONS}
        for key in _DEFINITIONS:
            for name, definition in arguments.get(key, {}).items():
                definitions[f"f{index}_{name}"] = _prefixed(definition, index)
        branches.append({
            "type": "object",
            "properties": {"name": {"const": function.name}, arguments_key: _prefixed(parameters, index)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })  # fmt: skip
    call: dict[str, Any] = {"anyOf": branches} if len(branches) > 1 else branches[0]
    return {**call, "$defs": definitions} if definitions else call


def _prefixed(schema: Any, index: int) -> Any:
    """`schema` with its local references renamed as call_schema moved their definitions."""
    if isinstance(schema, list):
        return [_prefixed(item, index) for item in schema]
    if not isinstance(schema, dict):
        return schema
    renamed = {key: _prefixed(value, index) for key, value in schema.items()}
    reference = schema.get("$ref")
    if isinstance(reference, str):
        for key in _DEFINITIONS:
            if reference.startswith(f"#/{key}/"):
                renamed["$ref"] = f"#/$defs/f{index}_{reference.removeprefix(f'#/{key}/')}"
    return renamed


def closed(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that declares properties and says nothing
    of others."""
    if not isinstance(schema, dict):
        return schema
    shaped = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            shaped[key] = {name: closed(value) for name, value in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            shaped[key] = [closed(value) for value in schema[key]]
    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), dict):
            shaped[key] = closed(schema[key])
    if isinstance(schema.get("properties"), dict) and not any(key in schema for key in _OPEN_KEYS):
        shaped["additionalProperties"] = False
    return shaped
