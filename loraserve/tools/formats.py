"""How a model writes tool calls: the grammar that holds a reply to it, and the reading of a reply back into calls.

Three formats, as model families were trained on them:

- `hermes` (Hermes, Qwen 2.5 and 3, SmolLM2): text, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>` per call;
- `llama3_json` (Llama 3.1 to 3.3): the whole reply is `{"name": ..., "parameters": {...}}` (calls joined by `; `);
- `mistral` (Mistral's v3 tokenizer): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

A grammar lets the reply be free text until the model opens a call (llguidance's lazy lexemes), then holds the call to
one of the request's functions and its arguments to that function's `parameters` schema: an automatic call always
parses and validates, a text reply stays unconstrained (but for the call's opening, which it cannot contain).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from loraserve.tools.functions import Function, call_schema
from loraserve.tools.reply import ReplySoFar, held_back, objects_so_far

# JSON without free whitespace, as structured output has it (engine/grammar.py): a small model left free to write
# spaces may write them forever.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    arguments_key: str  # the call object's key for the arguments

    def grammar(
        self, tokenizer: PreTrainedTokenizerBase, functions: list[Function], required: bool, parallel: bool
    ) -> str:
        """A llguidance (Lark) grammar of a reply: free text or calls of `functions` (at least one if `required`;
        at most one unless `parallel`)."""
        raise NotImplementedError

    def read(self, text: str, final: bool) -> ReplySoFar:
        """The reply's content and calls; while not `final`, content that could still open a call is held back."""
        raise NotImplementedError

    def instructions(self, functions: list[Function]) -> str:
        """The system prompt's part that shows the functions, for a chat template that does not show tools."""
        raise NotImplementedError

    def written_calls(self, calls: list[tuple[str, Any]]) -> str:
        """An earlier turn's calls ((name, arguments) pairs), as this format writes them."""
        raise NotImplementedError

    def _call(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)


@dataclass(frozen=True)
class HermesFormat(ToolCallFormat):
    opening: str = "<tool_call>"
    closing: str = "</tool_call>"

    def grammar(
        self, tokenizer: PreTrainedTokenizerBase, functions: list[Function], required: bool, parallel: bool
    ) -> str:
        first = "call" if required else "TEXT | head rest"  # a call at once, or text that may open one
        more = ' ("\\n" call)* "\\n"?' if parallel else ' "\\n"?'
        return "\n".join([
            "%llguidance {}",
            # Text, or calls (text before the first) one per line and then the end: the turn is over once they are
            # made (nothing lets a small model ramble after them).
            f"start: {first}{more}",
            f'call: "{self.opening}" rest',
            f'rest: "\\n" body "\\n" "{self.closing}"',
            # Text up to a call's opening (lazily: the opening ends it), and text that never opens one.
            f"head[lazy]: /(.|\\n)*{self.opening}/",
            f"TEXT: /(.|\\n)*/ & ~/(?s:.*)<\\/?{self.opening[1:-1]}>(?s:.*)/",
            f"body: {_json_rule(call_schema(functions, self.arguments_key))}",
        ])  # fmt: skip

    def read(self, text: str, final: bool) -> ReplySoFar:
        reply, position = ReplySoFar(""), 0
        while (start := text.find(self.opening, position)) >= 0:
            reply.content += text[position:start]
            end = text.find(self.closing, start)
            body = text[start + len(self.opening) : end if end >= 0 else len(text)]
            reply.calls.extend(objects_so_far(body, self.arguments_key, "")[:1])
            if end < 0:
                return reply
            position = end + len(self.closing)
        rest = text[position:]
        reply.content += rest if final else rest[: len(rest) - held_back(rest, self.opening)]
        return reply

    def instructions(self, functions: list[Function]) -> str:
        signatures = "\n".join(json.dumps(function.as_tool(), ensure_ascii=False) for function in functions)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            f"{self.opening}{self.closing} XML tags:\n{self.opening}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n'
            f"{self.closing}"
        )

    def written_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.opening}\n{self._call(name, arguments)}\n{self.closing}" for name, arguments in calls)


@dataclass(frozen=True)
class Llama3JsonFormat(ToolCallFormat):
    def grammar(
        self, tokenizer: PreTrainedTokenizerBase, functions: list[Function], required: bool, parallel: bool
    ) -> str:
        calls = 'body ("; " body)*' if parallel else "body"
        return "\n".join([
            "%llguidance {}",
            "start: calls" if required else "start: TEXT | calls",
            f"calls: {calls}",
            "TEXT: /([^{](.|\\n)*)?/",  # text never opens with a brace: that is a call
            f"body: {_json_rule(call_schema(functions, self.arguments_key))}",
        ])  # fmt: skip

    def read(self, text: str, final: bool) -> ReplySoFar:
        if text.startswith("{"):
            return ReplySoFar("", objects_so_far(text, self.arguments_key, ";"))
        return ReplySoFar(text)

    def instructions(self, functions: list[Function]) -> str:
        signatures = "\n\n".join(json.dumps(function.as_tool(), indent=4, ensure_ascii=False) for function in functions)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            f"value}}. Do not use variables.\n\n{signatures}"
        )

    def written_calls(self, calls: list[tuple[str, Any]]) -> str:
        return "; ".join(self._call(name, arguments) for name, arguments in calls)


@dataclass(frozen=True)
class MistralFormat(ToolCallFormat):
    marker: str = "[TOOL_CALLS]"

    def grammar(
        self, tokenizer: PreTrainedTokenizerBase, functions: list[Function], required: bool, parallel: bool
    ) -> str:
        token_id = tokenizer.get_vocab().get(self.marker)
        special = token_id is not None and token_id in tokenizer.all_special_ids
        marker = f"<[{token_id}]>" if special else json.dumps(self.marker)  # a control token is no text
        array = {"type": "array", "minItems": 1, "items": call_schema(functions, self.arguments_key)}
        if not parallel:
            array["maxItems"] = 1
        return "\n".join([
            "%llguidance {}",
            "start: calls" if required else "start: TEXT | calls",
            f"calls: {marker} body",
            "TEXT: /(.|\\n)*/ & ~/\\[(\\{|TOOL_CALLS\\])(?s:.*)/",  # what a call opens with (its marker decoded or not)
            f"body: {_json_rule(array)}",
        ])  # fmt: skip

    def read(self, text: str, final: bool) -> ReplySoFar:
        calls = text.removeprefix(self.marker)  # the marker is gone where it is a control token (skipped in text)
        if calls.startswith("["):
            return ReplySoFar("", objects_so_far(calls[1:], self.arguments_key, ","))
        if not final and (self.marker.startswith(text) or text == "["):
            return ReplySoFar("")
        return ReplySoFar(text)

    def instructions(self, functions: list[Function]) -> str:
        tools = json.dumps([function.as_tool() for function in functions], ensure_ascii=False)
        return (
            f"[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\nTo call functions, reply with {self.marker} followed by "
            'a JSON list of calls: [{"name": <function-name>, "arguments": <args-json-object>}]'
        )

    def written_calls(self, calls: list[tuple[str, Any]]) -> str:
        return self.marker + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": HermesFormat("hermes", "arguments"),
    "llama3_json": Llama3JsonFormat("llama3_json", "parameters"),
    "mistral": MistralFormat("mistral", "arguments"),
}


def format_of_template(template: str) -> ToolCallFormat:
    """The format a chat template shows its model (hermes where it shows none: the fallback prompt's)."""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" not in template and ('"parameters"' in template or "<|python_tag|>" in template):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]
