"""Real engine objects for model-free tests (no mocks: the scheduler is plain Python)."""

from __future__ import annotations

from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence


def make_sequence(num_prompt_tokens: int, params: SamplingParams | None = None, seq_id: int = 0) -> Sequence:
    request = Request(
        request_id=f"r{seq_id}",
        prompt=None,
        prompt_token_ids=list(range(1, num_prompt_tokens + 1)),
        params=params or SamplingParams(),
        arrival_time=0.0,
    )
    seq = Sequence(
        seq_id=seq_id,
        request=request,
        index=0,
        token_ids=list(request.prompt_token_ids),
        num_prompt_tokens=num_prompt_tokens,
    )
    request.seqs.append(seq)
    return seq
