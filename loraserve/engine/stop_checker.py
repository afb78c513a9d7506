"""Decides after each sampled token whether a sequence is done, and keeps its text up to date."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from loraserve.engine.detokenizer import IncrementalDetokenizer
from loraserve.engine.sequence import Sequence, SequenceStatus


class StopChecker:
    """EOS, stop token ids, stop strings, max_tokens and the context window, in that order."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self._tokenizer = tokenizer
        self._eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> str | None:
        """Call after appending a token; returns the finish reason, or None to go on."""
        params = seq.params
        token = seq.token_ids[-1]
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(
                self._tokenizer, seq.token_ids[: seq.num_prompt_tokens], params.skip_special_tokens
            )
        delta = seq.detokenizer.append(token)
        if (token in self._eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if delta:
            seq.output_text += delta
            # As vLLM: no stop string counts before min_tokens (the masks keep stop tokens out till then).
            reached_min = seq.num_output_tokens >= params.min_tokens
            if params.stop and reached_min and self._truncate_at_stop_string(seq, len(delta)):
                return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def text(self, seq: Sequence) -> str:
        """The text to report. Finished: exactly what decoding its tokens gives, unless cut at a stop string.

        Running: without a tail that may be the start of a stop string (streaming "EN" and then finding
        the stop string "END" would show text that the final answer does not contain).
        """
        if seq.status is SequenceStatus.FINISHED:
            if isinstance(seq.stop_reason, str):
                return seq.output_text
            return str(self._tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens))
        text = seq.output_text
        for stop in seq.params.stop:
            for length in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:length]):
                    text = text[:-length]
                    break
        return text

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence, delta_len: int) -> bool:
        # Only a match overlapping the new text is new; look back by the longest stop string.
        longest = max(len(s) for s in seq.params.stop)
        search_from = max(0, len(seq.output_text) - delta_len - longest + 1)
        hits = [(i, s) for s in seq.params.stop if (i := seq.output_text.find(s, search_from)) != -1]
        if not hits:
            return False
        position, stop_string = min(hits)
        seq.output_text = seq.output_text[:position]
        seq.stop_reason = stop_string
        return True
