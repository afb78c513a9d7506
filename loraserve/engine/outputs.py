"""What the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: dict[int, float]  # token id -> logprob, the `logprobs` most likely tokens


ADAPTER_UNAVAILABLE = "adapter_unavailable"  # its adapter could not be loaded
STEP_FAILED = "step_failed"  # scheduling or computing it raised; the other requests went on
GRAMMAR_FAILED = "grammar_failed"  # its grammar could not go on (the parser's limits): nothing fit the output
TIMED_OUT = "timed_out"  # it waited past its deadline without starting
OVERLOADED = "overloaded"  # let in, then its first token was foreseen past the TTFT target: refused before any


@dataclass(frozen=True)
class RequestError:
    """Why a request ended with finish_reason "error"."""

    code: str  # ADAPTER_UNAVAILABLE, STEP_FAILED, TIMED_OUT or OVERLOADED
    message: str
    retry_after: float | None = None  # OVERLOADED: seconds until the queue is predicted to drain


@dataclass
class RequestTimings:
    """Wall-clock latencies of one request, in seconds."""

    queue_time: float | None  # arrival -> first scheduled
    ttft: float | None  # arrival -> first token
    # Between consecutive tokens of completion 0; filled in the request's finished output.
    inter_token_latencies: list[float] = field(default_factory=list)
    e2e: float | None = None  # arrival -> finished
    # Speculative decoding: draft tokens its sequences verified, and how many of them were kept.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None  # with "stop": the stop token id or the stop string


@dataclass
class RequestOutput:
    """The state of one request after a step (final when `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    timings: RequestTimings
    error: RequestError | None = None  # set when it ended with finish_reason "error"
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache instead of computed
