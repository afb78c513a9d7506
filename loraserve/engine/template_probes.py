"""What a chat template shows, asked once per tokenizer and template by rendering a probe that holds a sentinel.

Templates differ in what they render: Gemma 2's raises on a system message where Llama's shows it; SmolLM2's joins
`message['content']` as a string where Gemma 3's iterates over a list of parts; Qwen's shows `tools`, SmolLM2's
drops them. Asking the template itself, rather than matching its text, holds for templates not seen before.
"""

from __future__ import annotations

import weakref
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

_SENTINEL = "loraserve-probe-5b1e"
PROBE_TOOL = {
    "type": "function",
    "function": {"name": _SENTINEL.replace("-", "_"), "description": "A probe.", "parameters": {"type": "object"}},
}
Feature = Literal["system_role", "content_parts", "tools"]
_PROBES: dict[Feature, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    # A system message's text shows: the template has a system role.
    "system_role": ([{"role": "system", "content": _SENTINEL}, {"role": "user", "content": "Hi"}], {}),
    # A user message given as a list of text parts shows its text (a template joining strings raises on a list).
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": _SENTINEL}]}], {}),
    # A tool's name shows: the template renders `tools`.
    "tools": ([{"role": "user", "content": "Hi"}], {"tools": [PROBE_TOOL]}),
}

# Per tokenizer (weakly: a closed engine's goes with it), (feature, template text) -> whether it shows.
_known: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[tuple[str, str], bool]] = weakref.WeakKeyDictionary()


def template_shows(tokenizer: PreTrainedTokenizerBase, template: str, feature: Feature) -> bool:
    """Whether `template` renders `feature`; False where it raises on the probe or drops what it holds."""
    known = _known.setdefault(tokenizer, {})
    if (feature, template) not in known:
        known[feature, template] = _renders_sentinel(tokenizer, template, *_PROBES[feature])
    return known[feature, template]


def _renders_sentinel(
    tokenizer: PreTrainedTokenizerBase, template: str, messages: list[dict[str, Any]], extra: dict[str, Any]
) -> bool:
    try:
        text: Any = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception:  # a template's raise_exception, or any refusal: the real render says why, if it fails too
        return False
    return _SENTINEL in text or _SENTINEL.replace("-", "_") in text
