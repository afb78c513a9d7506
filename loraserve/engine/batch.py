"""The typed hand-offs of one engine step: scheduler -> model runner -> scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.engine.block_manager import BlockCopy
from loraserve.engine.outputs import TokenLogprob
from loraserve.engine.sequence import Sequence


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: tokens [num_computed_tokens, + num_new_tokens)."""

    seq: Sequence
    num_new_tokens: int
    # Sequences that sample their next token from this row's logits: empty mid-prompt,
    # [seq] at the end of its tokens, [seq, *forks] when n > 1 siblings fork off the prompt.
    samplers: list[Sequence] = field(default_factory=list)

    @property
    def start(self) -> int:
        """Position of the first token computed this step."""
        return self.seq.num_computed_tokens


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
    def sampling_seqs(self) -> list[Sequence]:
        """Every sequence that gets a token this step, in the order of `StepOutput`."""
        return [sampler for item in self.scheduled for sampler in item.samplers]


@dataclass
class StepOutput:
    """The model runner's answer: one sampled token per `ScheduledBatch.sampling_seqs` entry."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
