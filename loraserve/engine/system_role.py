"""System messages for chat templates without a system role (Gemma 2's raises on one; others drop it silently).

Whether a template has one is asked of the template (template_probes.py). Where it has none, the system messages are
folded into the first user message as Gemma 3's own template does it: `[{"role": "system", "content": "Be brief."},
{"role": "user", "content": "Hi"}]` -> `[{"role": "user", "content": "Be brief.\n\nHi"}]`. Message content is text
here: a list of parts is joined before (chat.py) unless the template takes lists and has a system role.
"""

from __future__ import annotations

from typing import Any

SYSTEM_ROLES = ("system", "developer")  # "developer" is OpenAI's newer name for a system message


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
