"""How long a step takes, learnt from the steps the engine runs: what SLO-aware admission predicts with.

A decode step reads every weight once (a fixed cost) and does work per sequence (attention
over its context, its adapter's rows): seconds ~ fixed + per_sequence x sequences, fitted by
least squares over the steps, older steps weighing less (`forget`). Prompt tokens in a step
add ~ per_prompt_token each, learnt from what steps took beyond the decode fit; how many
prompt tokens come per sequence-step is learnt from the traffic, for the batch cap. Speculative
draft tokens are learnt apart (a few rows each, beside decodes, they cost more than a long chunk's).
Until the steps seen say otherwise, a sequence is taken to cost 1/16 of the fixed cost and a
prompt token 1/32 (a 135M model on 2 cores: 15 ms fixed, 0.9 ms a sequence, ~0.3 ms a token).
Plain Python: the scheduler's side of the engine imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCosts:
    """Owned by the scheduler; the engine reports every step it ran (`observe`)."""

    forget: float = 0.98  # each new decode step weighs 1 / (1 - forget) = 50 steps' worth of memory
    _weight: float = 0.0  # decayed sums over the steps of 1, x, y, x*x, x*y: x sequences, y decode seconds
    _sum_x: float = 0.0
    _sum_y: float = 0.0
    _sum_xx: float = 0.0
    _sum_xy: float = 0.0
    _per_prompt_token: float | None = None
    _per_draft_token: float | None = None
    _output_tokens: float | None = None  # a finished request's output tokens, on average
    _prompt_tokens: float = 0.0  # decayed over every step: prompt tokens computed and sequences stepped
    _sequences: float = 0.0

    def observe(self, num_seqs: int, num_prompt_tokens: int, seconds: float, num_draft_tokens: int = 0) -> None:
        """One step ran: `num_seqs` sequences, `num_prompt_tokens` of them prompt tokens (and
        `num_draft_tokens` speculative drafts), in `seconds`.

        Under load nearly every step carries prompt tokens, so every step teaches both parts:
        its prompt tokens' share (what it took beyond the decode fit) and, with that share
        taken off, the decode fit. At first the share is unknown and the whole step counts as
        decode: the estimates start high, admitting too little rather than too much.
        """
        f = self.forget
        if num_draft_tokens and self.is_ready:
            beyond = seconds - self.decode_seconds(num_seqs) - self.prompt_seconds(num_prompt_tokens)
            beyond = max(0.0, beyond) / num_draft_tokens
            previous = self._per_draft_token
            self._per_draft_token = beyond if previous is None else 0.9 * previous + 0.1 * beyond
        seconds -= self.draft_seconds(num_draft_tokens)
        self._prompt_tokens = f * self._prompt_tokens + num_prompt_tokens
        self._sequences = f * self._sequences + num_seqs
        if num_prompt_tokens and self.is_ready:
            beyond = max(0.0, seconds - self.decode_seconds(num_seqs - 1)) / num_prompt_tokens
            previous = self._per_prompt_token
            self._per_prompt_token = beyond if previous is None else 0.9 * previous + 0.1 * beyond
        x, y = float(num_seqs), max(0.0, seconds - self.prompt_seconds(num_prompt_tokens))
        self._weight = f * self._weight + 1
        self._sum_x = f * self._sum_x + x
        self._sum_y = f * self._sum_y + y
        self._sum_xx = f * self._sum_xx + x * x
        self._sum_xy = f * self._sum_xy + x * y

    def observe_finished(self, num_output_tokens: int) -> None:
        previous = self._output_tokens
        self._output_tokens = num_output_tokens if previous is None else 0.95 * previous + 0.05 * num_output_tokens

    @property
    def is_ready(self) -> bool:
        """Some steps were seen: predictions mean something."""
        return self._weight >= 3

    def decode_seconds(self, num_seqs: int) -> float:
        fixed, per_seq = self._decode_fit()
        return fixed + per_seq * max(num_seqs, 1)

    def prompt_seconds(self, num_prompt_tokens: int) -> float:
        per_token = self._per_prompt_token
        if per_token is None:  # not learnt yet: 1/32 of the fixed cost (0 before any step)
            per_token = self._decode_fit()[0] / 32
        return per_token * num_prompt_tokens

    def draft_seconds(self, num_draft_tokens: int) -> float:
        """What drafts add to a step (as prompt tokens until measured)."""
        if self._per_draft_token is None:
            return self.prompt_seconds(num_draft_tokens)
        return self._per_draft_token * num_draft_tokens

    def token_and_draft_seconds(self, num_seqs: int) -> tuple[float, float]:
        """What a token of a decode step of `num_seqs` costs, and what a draft token adds (speculative.py)."""
        if not self.is_ready:
            return 1.0, 0.0  # nothing measured yet: drafts are free
        return self.decode_seconds(num_seqs) / max(num_seqs, 1), self.draft_seconds(1)

    def expected_output_tokens(self, max_tokens: int) -> float:
        return min(float(max_tokens), self._output_tokens or float(max_tokens))

    def step_seconds(self, num_seqs: int) -> float:
        """A step of `num_seqs` sequences on average, the prompt tokens that ride along included."""
        fixed, per_seq = self._per_seq_with_prompts()
        return fixed + per_seq * max(num_seqs, 1)

    def max_seqs_within(self, seconds: float, limit: int) -> int:
        """The most sequences a step may hold and still take `seconds` on average (1 at least)."""
        fixed, per_seq = self._per_seq_with_prompts()
        if per_seq <= 0:
            return limit
        return max(1, min(limit, int((seconds - fixed) / per_seq + 1e-9)))  # 19.999... is 20

    def half_throughput_seqs(self, limit: int) -> int:
        """The fewest sequences at which a step does half the work it could: as much per-sequence cost as fixed."""
        fixed, per_seq = self._per_seq_with_prompts()
        if per_seq <= 0:
            return limit
        return max(1, min(limit, int(fixed / per_seq + 1e-9)))

    def _per_seq_with_prompts(self) -> tuple[float, float]:
        """(fixed, per sequence) seconds of a step, each running sequence bringing its share of prompt
        tokens (those of the requests that replace the finishing ones): prompt tokens per sequence-step seen."""
        fixed, per_seq = self._decode_fit()
        if self._sequences:
            per_seq += self.prompt_seconds(1) * self._prompt_tokens / self._sequences
        return fixed, per_seq

    def _decode_fit(self) -> tuple[float, float]:
        """(fixed, per_sequence) seconds; a prior slope where the batch sizes seen vary too little to fit one."""
        w = self._weight
        if w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._sum_x / w, self._sum_y / w
        variance = self._sum_xx / w - mean_x * mean_x
        if variance >= 1.0:
            slope = (self._sum_xy / w - mean_x * mean_y) / variance
            if slope > 0:
                return max(0.0, mean_y - slope * mean_x), slope
        fixed = mean_y / (1 + mean_x / 16)  # mean_y = fixed + (fixed / 16) * mean_x
        return fixed, fixed / 16
