"""What a request lets the model do with its tools, read from OpenAI's fields (chat completions' and the Responses
API's shapes): `tool_choice` "none" (no call), "auto" (the default with tools: the model decides), "required" (at
least one call) or one function named (that call, its arguments the whole reply); `parallel_tool_calls` false for
one call at most. Errors name the field at fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from loraserve.engine.structured_output import StructuredOutput
from loraserve.errors import InvalidRequestError
from loraserve.tools.formats import ToolCallFormat
from loraserve.tools.functions import NO_ARGUMENTS, Function

Mode = Literal["none", "auto", "required", "named"]
_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    functions: list[Function]
    mode: Mode
    named: Function | None = None  # the function a named (or "required" with one tool) choice calls
    parallel: bool = True

    @property
    def shown(self) -> list[Function]:
        """The functions the prompt shows the model (none where it may not call one)."""
        return [] if self.mode == "none" else self.functions

    @property
    def reads_calls(self) -> bool:
        """Whether the reply is text and calls in the model's format, read back into calls (auto, required)."""
        return self.mode in ("auto", "required")

    def output(self, tokenizer: PreTrainedTokenizerBase, fmt: ToolCallFormat) -> StructuredOutput | None:
        """What the reply must match: the named call's arguments, or text and calls in `fmt` (None: free text)."""
        try:
            if self.named is not None:
                return StructuredOutput.json_schema(self.named.arguments_schema(), f"{self.named.field}.parameters")
            if self.mode == "none":
                return None
            grammar = fmt.grammar(tokenizer, self.functions, self.mode == "required", self.parallel)
        except RecursionError:  # a schema nested past Python's stack, walked to close its objects
            raise InvalidRequestError("tools", "hold a parameters schema that nests too deeply") from None
        return StructuredOutput.lark(grammar, "tools")


def chat_tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """/v1/chat/completions: tools as `{"type": "function", "function": {...}}`."""
    return _plan(tools, tool_choice, parallel_tool_calls, nested=True)


def responses_tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """/v1/responses: function tools as `{"type": "function", "name": ...}`."""
    return _plan(tools, tool_choice, parallel_tool_calls, nested=False)


def _plan(tools: Any, tool_choice: Any, parallel: Any, nested: bool) -> ToolPlan | None:
    if tools is None or (tools == [] and not nested):  # the Responses API's clients send an empty list for none
        if tool_choice is not None:
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools", "must be a non-empty list of functions")
    functions = [_function(tool, f"tools.{i}", nested) for i, tool in enumerate(tools)]
    names = [function.name for function in functions]
    if len(set(names)) < len(names):
        second = next(i for i, name in enumerate(names) if name in names[:i])
        raise InvalidRequestError(f"{functions[second].field}.name", "names a function that an earlier tool names")
    if parallel not in (None, True, False):
        raise InvalidRequestError("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    plan = ToolPlan(functions, "auto", parallel=parallel is not False)
    if tool_choice is None or tool_choice in _MODES:
        mode: Mode = tool_choice or "auto"
        if mode == "required" and len(functions) == 1:  # the one function it can call: named
            return ToolPlan(functions, "named", functions[0], plan.parallel)
        return ToolPlan(functions, mode, None, plan.parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = _object(tool_choice.get("function"), "tool_choice.function").get("name") if nested else (
            tool_choice.get("name"))  # fmt: skip
        field = "tool_choice.function.name" if nested else "tool_choice.name"
        if not isinstance(name, str) or name not in names:  # an object is no name (nor hashable)
            raise InvalidRequestError(field, f"names no function of tools: {name!r}")
        return ToolPlan(functions, "named", functions[names.index(name)], plan.parallel)
    raise InvalidRequestError(
        "tool_choice", f"must be 'none', 'auto', 'required' or a function to call, got {tool_choice!r}"
    )


def _function(tool: Any, field: str, nested: bool) -> Function:
    if _object(tool, field).get("type") != "function":
        raise InvalidRequestError(f"{field}.type", "must be 'function': loraserve serves function tools")
    function = _object(tool.get("function"), f"{field}.function") if nested else tool
    where = f"{field}.function" if nested else field
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name", "must be a non-empty string")
    parameters = function.get("parameters")
    if not isinstance(parameters, dict | None):
        raise InvalidRequestError(f"{where}.parameters", "must be a JSON schema (an object) or null")
    description = function.get("description")
    if not isinstance(description, str | None):
        raise InvalidRequestError(f"{where}.description", "must be a string")
    return Function(name, parameters or dict(NO_ARGUMENTS), description, where)


def _object(value: Any, field: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be an object, got {type(value).__name__}")
    return value
