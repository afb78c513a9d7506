"""The speculation budget: which draft tokens (speculative.py) a decoding sequence computes with its pending
token this step, and what is kept of them after. Plain Python.

Drafts go only to a sequence past its first output token (a prompt's last token is where its n > 1
siblings fork): as many as the step's token budget, its max_tokens and the context window leave after its
pending token, no more than pay for their compute at the step costs (step_costs.py), none its grammar
forbids (one could never be kept), and only where their blocks fit too, the sequence's own token first:
drafts never preempt anyone. The budget counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.engine.batch import ScheduledSequence
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.grammar import valid_drafts
from loraserve.engine.sequence import Sequence
from loraserve.engine.speculative import NgramProposer, SpeculationStats, accepted_prefix
from loraserve.engine.step_costs import StepCosts


@dataclass
class DraftBudget:
    """Owned by the scheduler: it asks `drafts` for each decoding sequence and hands `verify` each verified chunk."""

    proposer: NgramProposer | None  # None: no speculative decoding
    block_manager: BlockManager
    costs: StepCosts
    stats: SpeculationStats
    max_model_len: int

    def drafts(self, seq: Sequence, budget: int, num_running: int) -> list[int]:
        """Draft tokens for `seq`, whose pending token takes one of the step's `budget` tokens."""
        if self.proposer is None or seq.num_output_tokens == 0:
            return []
        room = min(
            budget - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        costs = self.costs.token_and_draft_seconds(num_running)
        proposed = valid_drafts(seq, self.proposer.propose(seq, room, *costs) if room > 0 else [])
        if proposed and not self.block_manager.make_room(seq, 1 + len(proposed)):
            return []
        return proposed

    def verify(self, item: ScheduledSequence, sampled: list[int]) -> int:
        """How many of `item`'s drafts hold (equal to the token sampled at their row); counts the pending token
        and those as computed, and records the outcome."""
        seq, num_drafts = item.seq, len(item.drafts)
        accepted = accepted_prefix(item.drafts, sampled)
        assert self.proposer is not None, "drafts without a proposer"
        self.proposer.observe(seq, num_drafts, accepted)
        self.stats.record(seq.request.adapter, num_drafts, accepted)
        seq.request.num_draft_tokens += num_drafts
        seq.request.num_accepted_draft_tokens += accepted
        seq.num_computed_tokens = item.start + 1 + accepted
        return accepted
