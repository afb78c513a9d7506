"""Incremental detokenization: each new token's text without re-decoding the whole output.

Decoding a token alone can be wrong (a byte-level BPE token may hold half a UTF-8
character; SentencePiece drops a leading space), so each step decodes a small window:
the text of tokens [prefix_offset, read_offset) is already emitted, the text of
[prefix_offset, end) minus it is new, unless it ends in an incomplete character.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as context so the first generated token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, a delta per step."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special))
