"""Requests and the sequences (completions) generated for them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loraserve.engine.fair_share import UNKEYED, Tenant
from loraserve.engine.outputs import RequestError, TokenLogprob
from loraserve.engine.sampling_params import SamplingParams
from loraserve.lora.residency import NO_ADAPTER

if TYPE_CHECKING:
    from loraserve.engine.grammar import CompiledGrammar
    from loraserve.engine.speculative import DraftState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A user's prompt, its sampling settings and the `n` sequences sampling it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    adapter: str | None = None  # the LoRA adapter's name; None = the base model
    priority: int = 0  # lower is scheduled first; equal priorities by fair share between tenants
    tenant: Tenant = UNKEYED  # whose share it is served from (fair_share.py)
    deadline: float | None = None  # monotonic time after which it is dropped if still waiting for its start
    # Whether its client sees the tokens as they come (then the first one is late past the TTFT target) or only the
    # whole answer (then its wait for a start counts, against the queue target): admission.py.
    is_streamed: bool = True
    seqs: list[Sequence] = field(default_factory=list)
    first_scheduled_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it was first scheduled
    finished_time: float | None = None
    error: RequestError | None = None  # why it ended with finish_reason "error"
    grammar: CompiledGrammar | None = None  # params.structured_output, built (grammar.py)
    num_draft_tokens: int = 0  # speculative drafts its sequences verified
    num_accepted_draft_tokens: int = 0  # of those, kept

    @property
    def is_finished(self) -> bool:
        # A parent with pending forks has siblings still to come.
        return all(seq.status is SequenceStatus.FINISHED and not seq.pending_forks for seq in self.seqs)


@dataclass(eq=False)
class Sequence:
    """One completion. The block manager alone changes `block_table` and `num_released_blocks`; the scheduler
    alone `status`."""

    seq_id: int
    request: Request
    index: int  # which of the request's n completions this is
    token_ids: list[int]  # prompt followed by the generated tokens
    num_prompt_tokens: int
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0  # leading entries given back from behind the sliding window (block_manager.py)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    cache_salt: bytes = b""  # the adapter's content hash: keys its prefix-cache blocks (prefix_cache.py)
    lora_slot: int = NO_ADAPTER  # the adapter's slot while it runs (the scheduler sets it at admission)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    pending_forks: int = 0  # siblings still to fork off once the prompt is computed (n > 1)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    output_text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # when each generated token arrived
    detokenizer: Any = None  # owned by the stop checker
    draft: DraftState | None = None  # its speculative draft length, owned by the proposer (speculative.py)
    matcher: Any = None  # where its output stands in the request's grammar (token_masks.py)

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A sibling that continues from the same tokens; the block manager shares the blocks."""
        return Sequence(
            seq_id=seq_id,
            request=self.request,
            index=index,
            token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            cache_salt=self.cache_salt,
            lora_slot=self.lora_slot,
            block_keys=list(self.block_keys),
        )
