"""Speculative decoding by prompt lookup (n-gram drafting): no draft model.

A decoding sequence whose last n tokens (n from ngram_max down to ngram_min) occurred earlier in its
own prompt and output proposes the tokens that followed that earlier occurrence: K draft tokens.
The step then computes the sequence's pending token and its drafts as one chunk of 1 + K rows, and
samples a token at every row as if the drafts before it had been accepted. A draft is accepted while
it equals the token sampled at its row; the first row where they differ gives its own sample (the
correction), and when all K are accepted the last row gives one more (the bonus). For a point-mass
draft this is the standard rejection rule (accept with probability p(draft), else sample from p with
the draft taken out), so the output distribution is unchanged; greedy output is identical.

A row with a grammar drafts only the leading tokens its grammar allows, and each of its draft rows
is masked by the grammar as it stands after the drafts before that row (grammar.py).

Example: tokens "... the cat sat on the mat . the cat" with ngram_max 2: "the cat" occurred before,
followed by "sat on the", so K=3 drafts are [sat, on, the]. If the model samples [sat, on, a, ...]
at the four rows, "sat" and "on" are accepted and "a" is the correction: three tokens this step.

Each sequence keeps its own K: it grows by one after a step that accepted every draft and shrinks
by one after a step that accepted none; at zero the sequence drafts again only after `RETRY_STEPS`
steps, so a workload where drafts never hit runs as plain decoding. And drafts must pay for the
compute they take: a draft token costs what a prompt token costs in a step, and k drafts kept at
the sequence's acceptance rate a are worth a + a^2 + ... + a^k tokens at what a token of the
batch costs now. A lone chat, waiting on memory, drafts freely; a large batch on a busy CPU only
where drafts hit often (the step costs come from the engine's measurements, step_costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence

RETRY_STEPS = 8  # decode steps a sequence whose drafts keep missing waits before drafting one again


@dataclass
class DraftState:
    """One sequence's adaptive draft length and what its drafts achieved."""

    k: int
    idle_steps: int = 0  # decode steps without drafting since k reached 0
    acceptance: float = 0.5  # drafts kept per draft verified, a moving average


class NgramProposer:
    """Proposes up to `max_k` tokens by prompt lookup, per sequence, adapting each one's K."""

    def __init__(self, max_k: int, ngram_min: int, ngram_max: int, cost_check: bool = True) -> None:
        self.max_k, self.ngram_min, self.ngram_max = max_k, ngram_min, ngram_max
        self.cost_check = cost_check

    def propose(self, seq: Sequence, limit: int, token_seconds: float = 1.0, draft_seconds: float = 0.0) -> list[int]:
        """At most `limit` drafts for `seq`'s next tokens: none when its K is 0 for now, and no more than
        pay for themselves when a token of the batch costs `token_seconds` and a draft `draft_seconds`."""
        if seq.draft is None:
            seq.draft = DraftState(self.max_k)
        state = seq.draft
        if state.k == 0:
            state.idle_steps += 1
            if state.idle_steps < RETRY_STEPS:
                return []
            state.k, state.idle_steps = 1, 0
        k = min(state.k, limit)
        while self.cost_check and k > 0 and worth(state.acceptance, k) * token_seconds < k * draft_seconds:
            k -= 1
        return lookup(seq.token_ids, k, self.ngram_min, self.ngram_max) if k > 0 else []

    @staticmethod
    def observe(seq: Sequence, proposed: int, accepted: int) -> None:
        """Adapt the sequence's K to how its last drafts fared."""
        state = seq.draft
        assert state is not None and proposed > 0
        state.acceptance = 0.8 * state.acceptance + 0.2 * accepted / proposed
        if accepted == proposed:
            state.k += 1
        elif accepted == 0:
            state.k -= 1


def worth(acceptance: float, k: int) -> float:
    """Tokens that k drafts are expected to add, each kept with probability `acceptance` if those before were."""
    return sum(acceptance**i for i in range(1, k + 1))


def lookup(token_ids: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The k tokens (or fewer, at the end) that followed the latest earlier occurrence of the longest
    suffix of `token_ids` of ngram_max down to ngram_min tokens; [] when none occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        # Starts of earlier occurrences: every window of n tokens that ends before the last token.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if len(starts):
            follow = int(starts[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []


@dataclass
class DraftCounts:
    """What one adapter's (or the base model's) drafts achieved."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    bonus: int = 0  # tokens sampled after every draft of a step was kept


@dataclass
class SpeculationStats:
    """Draft outcomes since the engine started, by adapter ("" for the base model)."""

    by_adapter: dict[str, DraftCounts] = field(default_factory=dict)

    def record(self, adapter: str | None, drafted: int, accepted: int) -> None:
        counts = self.by_adapter.setdefault(adapter or "", DraftCounts())
        counts.drafted += drafted
        counts.accepted += accepted
        counts.bonus += accepted == drafted


def accepted_prefix(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts hold: the leading drafts equal to the token sampled at their row."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == sampled[accepted]:
        accepted += 1
    return accepted


@dataclass(eq=False)
class DraftRow:
    """A sequence as it stands after the first `len(drafts)` of its drafts, for sampling one row of a
    speculative chunk: what the sampler and the token masks read of a sequence."""

    seq: Sequence
    drafts: list[int]

    @property
    def request(self) -> Request:
        return self.seq.request

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


SampledRow = Sequence | DraftRow  # who samples a row of a step: a sequence, or one as it stands after some drafts
