"""Chat prompts -> token ids, exactly as transformers' `apply_chat_template(..., tokenize=True)`, after shaping the
conversation to what the model's template shows (template_probes.py asks it):

- `developer` messages (OpenAI's newer name for system) as `system`, unless the template names a developer role;
- content given as a list of text parts passed as such to a template that renders parts, else joined by newlines;
- tools through the template where it shows them, else as the fallback prompt (tools/prompt.py);
- system messages folded into the first user message where the template has no system role (system_role.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from loraserve.engine.system_role import fold_system_messages
from loraserve.engine.template_probes import template_shows
from loraserve.errors import InvalidRequestError
from loraserve.tools.formats import FORMATS, ToolCallFormat
from loraserve.tools.functions import Function
from loraserve.tools.prompt import for_tool_template, with_fallback_tools

Conversation = list[dict[str, Any]]  # [{"role": "user", "content": "Hi"}, ...]


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    functions: Sequence[Function] = (),
    tool_format: ToolCallFormat = FORMATS["hermes"],
) -> list[int]:
    """The prompt's token ids with the assistant's turn opened; `functions` shown to the model, in `tool_format`
    where its template shows no tools."""
    tools: Any = [function.as_tool() for function in functions] or None  # transformers types it loosely
    try:
        template = tokenizer.get_chat_template(tools=tools)
        conversation, tools = _shaped(tokenizer, template, conversation, list(functions), tools, tool_format)
        encoded: Any = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tools=tools,
            tokenize=True,
            add_generation_prompt=True,
        )
    except Exception as error:  # the template raises on roles or orders it does not accept
        raise InvalidRequestError("messages", f"the chat template refused them: {error}") from error
    # transformers 5 returns a BatchEncoding; older versions a plain list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _shaped(
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    conversation: Conversation,
    functions: list[Function],
    tools: list[dict[str, Any]] | None,
    tool_format: ToolCallFormat,
) -> tuple[Conversation, list[dict[str, Any]] | None]:
    if "developer" not in template:
        conversation = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
    has_system_role = template_shows(tokenizer, template, "system_role")
    shows_tools = template_shows(tokenizer, template, "tools")
    fallback = not shows_tools and (functions or any(m["role"] == "tool" or m.get("tool_calls") for m in conversation))
    if fallback or not (has_system_role and template_shows(tokenizer, template, "content_parts")):
        conversation = [{**m, "content": joined_text(m["content"])} for m in conversation]  # the fallback adds text
    if shows_tools:
        conversation = for_tool_template(conversation)
    elif fallback:
        conversation, tools = with_fallback_tools(conversation, functions, tool_format), None
    if not has_system_role:
        conversation = fold_system_messages(conversation)
    return conversation, tools


def joined_text(content: Any) -> Any:
    """A message's text parts joined by newlines (as vLLM joins them); a string as it is."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content)
    return content
