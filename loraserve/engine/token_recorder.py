"""What a step's sampled tokens do to their sequences: each is appended (with its time and logprob), charged
to its tenant's fair share, fed to its grammar and checked against its stops; a speculative chunk's drafts are
verified first (draft_budget.py), and the full blocks of what was computed are published to the prefix cache.
Plain Python.

Ending a sequence is the scheduler's, as it alone changes a status: the recorder calls back `finish` for one
that is done and `fail` for a request whose grammar cannot go on, at once, so that its siblings later in the
step take no more tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from loraserve.engine.batch import ScheduledBatch, StepOutput
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.draft_budget import DraftBudget
from loraserve.engine.fair_share import FairShare
from loraserve.engine.grammar import advance as advance_grammar
from loraserve.engine.outputs import GRAMMAR_FAILED, RequestError, TokenLogprob
from loraserve.engine.sequence import Request, Sequence, SequenceStatus
from loraserve.engine.step_costs import StepCosts
from loraserve.engine.stop_checker import StopChecker


@dataclass
class TokenRecorder:
    """Owned by the scheduler, which hands it every step's output (`Scheduler.postprocess`)."""

    block_manager: BlockManager
    stop_checker: StopChecker
    fair_share: FairShare
    costs: StepCosts  # learns how many tokens a finished request had
    draft_budget: DraftBudget
    finish: Callable[[Sequence, str, float], None]  # the sequence, its finish reason, now
    fail: Callable[[Request, RequestError], None]  # ends every sequence of the request

    def record(self, batch: ScheduledBatch, output: StepOutput, now: float) -> list[Request]:
        """Record the step's tokens; finish sequences that are done. Returns the requests touched."""
        for item in batch.scheduled:
            if item.drafts:
                continue  # computed up to its accepted drafts, known below
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.seq.status is not SequenceStatus.FINISHED:  # not aborted while the step ran
                self.block_manager.publish_computed_blocks(item.seq, item.seq.num_computed_tokens - item.num_new_tokens)
        touched: dict[str, Request] = {}
        first = 0
        for item in batch.scheduled:
            count = len(item.sampling_rows)
            tokens, logprobs = output.token_ids[first : first + count], output.logprobs[first : first + count]
            first += count
            if not item.drafts:
                for seq, token_id, logprob in zip(item.samplers, tokens, logprobs, strict=True):
                    self._append(seq, token_id, logprob, now, touched)
            elif item.seq.status is not SequenceStatus.FINISHED:  # not aborted while the step ran
                # The kept drafts, then the first differing row's sample (or the bonus row's), while it takes them;
                # the cache keeps their K/V only: no rejected draft's block is published, those past go back.
                seq, start = item.seq, item.start
                accepted = self.draft_budget.verify(item, tokens)
                kept = zip(tokens[: accepted + 1], logprobs[: accepted + 1], strict=True)
                if all(self._append(seq, token_id, logprob, now, touched) for token_id, logprob in kept):
                    self.block_manager.publish_computed_blocks(seq, start)
                    self.block_manager.trim(seq)
        assert first == len(output.token_ids), "a token per sampling row"
        return list(touched.values())

    def _append(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, now: float, touched: dict[str, Request]
    ) -> bool:
        """Give `seq` its next token; False when it takes no more (finished, failed or aborted)."""
        if seq.status is SequenceStatus.FINISHED:  # aborted while the step ran
            return False
        seq.token_ids.append(token_id)
        seq.token_times.append(now)
        self.fair_share.charge(seq.request.tenant, output_tokens=1)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if (grammar_error := advance_grammar(seq, token_id)) is not None:
            self.fail(seq.request, RequestError(GRAMMAR_FAILED, grammar_error))
            touched.pop(seq.request.request_id, None)
            return False
        touched[seq.request.request_id] = seq.request
        reason = self.stop_checker.check(seq)
        if reason is not None:
            self.costs.observe_finished(seq.num_output_tokens)
            self.finish(seq, reason, now)
            return False
        return True
