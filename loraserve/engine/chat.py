"""Chat prompts -> token ids, exactly as transformers' `apply_chat_template(..., tokenize=True)`; for a template
without a system role, after folding the system messages into the first user message (system_role.py)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from loraserve.engine.system_role import fold_system_messages, has_system_role
from loraserve.errors import InvalidRequestError

Conversation = list[dict[str, str]]  # [{"role": "user", "content": "Hi"}, ...]


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, tools: list[Any] | None = None
) -> list[int]:
    """The prompt's token ids with the assistant's turn opened; `tools` (OpenAI's) for a template that shows them."""
    try:
        if not has_system_role(tokenizer, tokenizer.get_chat_template(tools=tools)):
            conversation = fold_system_messages(conversation)
        encoded: Any = tokenizer.apply_chat_template(
            conversation, tools=tools, tokenize=True, add_generation_prompt=True
        )
    except Exception as error:  # the template raises on roles or orders it does not accept
        raise InvalidRequestError("messages", f"the chat template refused them: {error}") from error
    # transformers 5 returns a BatchEncoding; older versions a plain list.
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
