"""System messages for chat templates without a system role (Gemma 2's raises on one; others drop it silently).

Whether a template has one is asked once per tokenizer and template, by rendering a probe whose system message holds
a sentinel. Where it has none, the system messages are folded into the first user message as Gemma 3's own template
does it: `[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]` ->
`[{"role": "user", "content": "Be brief.\n\nHi"}]`. Message content is text throughout loraserve (the server's
message models and `Conversation` allow nothing else), so no list of parts is handled here.
"""

from __future__ import annotations

import weakref
from typing import Any

from transformers import PreTrainedTokenizerBase

SYSTEM_ROLES = ("system", "developer")  # "developer" is OpenAI's newer name for a system message
_SENTINEL = "loraserve-system-probe-5b1e"

# Per tokenizer (weakly: a closed engine's goes with it), template text -> whether it shows a system message.
_has_system_role: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[str, bool]] = weakref.WeakKeyDictionary()


def has_system_role(tokenizer: PreTrainedTokenizerBase, template: str) -> bool:
    """Whether `template` shows a system message's text; False where it raises on one or drops it."""
    known = _has_system_role.setdefault(tokenizer, {})
    if template not in known:
        known[template] = _renders_sentinel(tokenizer, template)
    return known[template]


def _renders_sentinel(tokenizer: PreTrainedTokenizerBase, template: str) -> bool:
    probe = [{"role": "system", "content": _SENTINEL}, {"role": "user", "content": "Hi"}]
    try:
        text: Any = tokenizer.apply_chat_template(
            probe, chat_template=template, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # a template's raise_exception, or any refusal: the real render says why, if it fails too
        return False
    return _SENTINEL in text


def fold_system_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without system messages, their text (a blank line between two) opening the first user
    message after a blank line; with no user message, their text becomes one at the start."""
    system_texts = [message["content"] for message in conversation if message["role"] in SYSTEM_ROLES]
    if not system_texts:
        return conversation
    preamble = "\n\n".join(system_texts)
    folded = [message for message in conversation if message["role"] not in SYSTEM_ROLES]
    first_user = next((i for i, message in enumerate(folded) if message["role"] == "user"), None)
    if first_user is None:
        return [{"role": "user", "content": preamble}, *folded]
    user = folded[first_user]
    folded[first_user] = {**user, "content": f"{preamble}\n\n{user['content']}"}
    return folded
