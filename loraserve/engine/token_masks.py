"""Which tokens each row of a step may sample: its grammar's mask, and no stop token before `min_tokens`.

The grammar masks of a step are computed on a thread of their own while the forward pass runs: every
matcher has taken its sequence's tokens by then (the scheduler advances them as tokens arrive), and
llguidance computes masks without the GIL. Rows without a grammar or `min_tokens` are not touched.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import torch

from loraserve.engine.grammar import matcher_after, matcher_of
from loraserve.engine.sequence import Sequence
from loraserve.engine.speculative import SampledRow

BITS = 32  # tokens per word of a bitmask


@dataclass
class StepMasks:
    """The masks of one step's sampling rows (row i is `seqs[i]` of the step)."""

    grammar_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None  # [len(grammar_rows), words] int32: bit t set = token t allowed
    banned: dict[int, list[int]] = field(default_factory=dict)  # row -> stop tokens it may not sample yet

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` ([rows, vocab] float32) with every token a row may not sample at -inf (a new tensor)."""
        logits, banned = logits.clone(), dict(self.banned)
        if self.bitmask is not None:
            allowed = allowed_tokens(self.bitmask, logits.shape[1])
            for i, row in enumerate(self.grammar_rows):
                if row in banned:
                    _ban_unless_nothing_left(allowed[i], banned.pop(row))
            rows = torch.tensor(self.grammar_rows, device=logits.device)
            logits[rows] = logits[rows].masked_fill(~allowed.to(logits.device), float("-inf"))
        for row, tokens in banned.items():
            logits[row, tokens] = float("-inf")
        return logits


class TokenMasks:
    """Builds each step's masks; grammar masks start before the forward pass and are awaited after it."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._executor = llguidance.LLExecutor(num_threads=1)  # beside the forward pass's threads, not among them
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="token-masks")

    def start(self, seqs: list[SampledRow]) -> Future[StepMasks] | None:
        """The step's masks, computing (None: no row is constrained)."""
        banned = {row: self._stop_tokens(seq) for row, seq in enumerate(seqs) if _before_min_tokens(seq)}
        grammar_rows = [row for row, seq in enumerate(seqs) if seq.request.grammar is not None]
        if not grammar_rows:
            if not banned:
                return None
            ready: Future[StepMasks] = Future()
            ready.set_result(StepMasks(banned=banned))
            return ready
        matchers = [_matcher(seqs[row]) for row in grammar_rows]
        return self._thread.submit(self._fill, grammar_rows, matchers, banned)

    def _fill(self, rows: list[int], matchers: list[llguidance.LLMatcher], banned: dict[int, list[int]]) -> StepMasks:
        # What llguidance.torch's fill_next_token_bitmask_par does; that module imports torch._dynamo (seconds).
        words = -(-self._vocab_size // BITS)
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        targets = [(matcher, i) for i, matcher in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(targets, bitmask.data_ptr(), words * bitmask.element_size(), len(rows))
        return StepMasks(rows, bitmask, banned)

    def _stop_tokens(self, seq: SampledRow) -> list[int]:
        return sorted({*self._eos_token_ids, *seq.params.stop_token_ids})

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _matcher(row: SampledRow) -> llguidance.LLMatcher:
    """A row's matcher: a draft row's stands after the drafts before it (drafts the grammar allows)."""
    return matcher_of(row) if isinstance(row, Sequence) else matcher_after(row.seq, row.drafts)


def _before_min_tokens(seq: SampledRow) -> bool:
    return seq.num_output_tokens < seq.params.min_tokens


_BITS = torch.ones(BITS, dtype=torch.int32) << torch.arange(BITS, dtype=torch.int32)  # bit 31 is int32's sign


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bitmask as llguidance and xgrammar write it, [rows, words] int32 -> [rows, vocab] bool."""
    return ((bitmask.unsqueeze(-1) & _BITS) != 0).flatten(1)[:, :vocab]


def _ban_unless_nothing_left(allowed: torch.Tensor, tokens: list[int]) -> None:
    """min_tokens gives way to a grammar that can only end: its document is complete."""
    if int(allowed.sum()) > int(allowed[tokens].sum()):
        allowed[tokens] = False
