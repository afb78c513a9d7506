"""The typed hand-offs of one engine step: scheduler -> model runner -> scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.engine.block_manager import BlockCopy
from loraserve.engine.outputs import TokenLogprob
from loraserve.engine.sequence import Sequence
from loraserve.engine.speculative import DraftRow, SampledRow


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens [num_computed_tokens, + num_new_tokens)."""

    seq: Sequence
    num_new_tokens: int
    # Sequences that sample their next token from this row's logits: empty mid-prompt,
    # [seq] at the end of its tokens, [seq, *forks] when n > 1 siblings fork off the prompt.
    samplers: list[Sequence] = field(default_factory=list)
    # Speculative decoding: tokens proposed after the sequence's pending one, computed with it in
    # this step (num_new_tokens = 1 + len(drafts)); a token is sampled at each of those rows.
    drafts: list[int] = field(default_factory=list)

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.seq.num_computed_tokens

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this step computes: the sequence's next ones, then its drafts."""
        end = self.start + self.num_new_tokens - len(self.drafts)
        return self.seq.token_ids[self.start : end] + self.drafts

    @property
    def sampling_rows(self) -> list[SampledRow]:
        """Who samples from each of its rows that gives logits: its samplers from its last row, or with
        drafts, the sequence from every row, as it stands after the drafts before that row."""
        if self.drafts:
            return [DraftRow(self.seq, self.drafts[:accepted]) for accepted in range(len(self.drafts) + 1)]
        return list(self.samplers)


@dataclass
class ScheduledBatch:
    """What to compute in one step. Decodes (one new token) come first, then prefill chunks."""

    decodes: list[ScheduledSequence]
    prefills: list[ScheduledSequence]
    block_copies: list[BlockCopy]  # copy-on-write copies to do before the forward pass

    @property
    def scheduled(self) -> list[ScheduledSequence]:
        return self.decodes + self.prefills

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(item.num_new_tokens for item in self.prefills)

    def subset(self, items: list[ScheduledSequence]) -> ScheduledBatch:
        """The same step for `items` alone (in this batch's order), without block copies: those are done."""
        wanted = {id(item) for item in items}
        return ScheduledBatch(
            decodes=[item for item in self.decodes if id(item) in wanted],
            prefills=[item for item in self.prefills if id(item) in wanted],
            block_copies=[],
        )

    @property
    def sampling_rows(self) -> list[SampledRow]:
        """Who samples each token of the step, in the order of `StepOutput`."""
        return [row for item in self.scheduled for row in item.sampling_rows]


@dataclass
class StepOutput:
    """The model runner's answer: one sampled token per `ScheduledBatch.sampling_rows` entry."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
