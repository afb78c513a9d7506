"""Tools and tool turns shown to the model: through its chat template where the template shows tools, else through
the fallback below.

The fallback (documented in README, "Tools"): the format's instructions listing the functions (formats.py; Hermes'
`<tools>` block by default) close the system message, or open the conversation as one; an assistant turn's earlier
calls are written into its text as the format writes them; each tool result becomes a user turn
`<tool_response>\\n...\\n</tool_response>` (consecutive results in one turn), as Qwen's template shows them.
"""

from __future__ import annotations

import json
from typing import Any

from transformers import PreTrainedTokenizerBase

from loraserve.engine.system_role import SYSTEM_ROLES
from loraserve.engine.template_probes import PROBE_TOOL, template_shows
from loraserve.tools.formats import FORMATS, ToolCallFormat, format_of_template
from loraserve.tools.functions import Function

Message = dict[str, Any]


def for_tool_template(conversation: list[Message]) -> list[Message]:
    """The conversation as tool-aware templates take it: an earlier call's arguments as an object, not JSON text
    (Qwen's and Llama's templates write them with `tojson`)."""
    return [_with_argument_objects(message) if message.get("tool_calls") else message for message in conversation]


def with_fallback_tools(conversation: list[Message], functions: list[Function], fmt: ToolCallFormat) -> list[Message]:
    """The conversation (its content text, not parts) for a template that shows no tools: the functions in the system
    message, calls and results as text."""
    shown: list[Message] = []
    for i, message in enumerate(conversation):
        if message["role"] == "tool":
            result = f"<tool_response>\n{message['content']}\n</tool_response>"
            if i > 0 and conversation[i - 1]["role"] == "tool":  # the results of one turn's calls: one user turn
                shown[-1] = {**shown[-1], "content": f"{shown[-1]['content']}\n{result}"}
            else:
                shown.append({"role": "user", "content": result})
        elif message.get("tool_calls"):
            calls = [(call["function"]["name"], _arguments(call)) for call in message["tool_calls"]]
            text = "\n".join(part for part in (message.get("content") or "", fmt.written_calls(calls)) if part)
            shown.append({"role": "assistant", "content": text})
        else:
            shown.append(message)
    if not functions:
        return shown
    instructions = fmt.instructions(functions)
    if shown and shown[0]["role"] in SYSTEM_ROLES:
        return [{**shown[0], "content": f"{shown[0]['content']}\n\n{instructions}"}, *shown[1:]]
    return [{"role": "system", "content": instructions}, *shown]


def _with_argument_objects(message: Message) -> Message:
    calls = [
        {**call, "function": {**call["function"], "arguments": _arguments(call)}} for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _arguments(call: Message) -> Any:
    """A call's arguments as an object where its JSON text holds one (else the text as it was)."""
    text = call["function"]["arguments"]
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, dict) else text


def model_tool_format(tokenizer: PreTrainedTokenizerBase, override: str | None = None) -> ToolCallFormat:
    """The format the model's calls are held to and read in: `override` (--tool-call-parser), else the one its chat
    template shows (formats.format_of_template), else the fallback's (hermes)."""
    if override is not None:
        return FORMATS[override]
    template = tokenizer.get_chat_template(tools=[PROBE_TOOL])
    return format_of_template(template) if template_shows(tokenizer, template, "tools") else FORMATS["hermes"]
