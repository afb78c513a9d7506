"""SLO-aware admission: a running batch small enough for the TPOT target, and no request let in that
cannot be served in time (past capacity, admitting everything makes every token slow and every first
token late). Without targets nothing changes. Plain Python.

"In time" depends on what the client sees. A streamed request's user sees the first token: it must
come within the TTFT target. A non-streamed request's client sees nothing before the end and waits
for it (the `openai` client ten minutes): it may queue up to the queue target, and one refused is
told in Retry-After when the queue will have room for it, each its own time (retry_schedule.py), so
a burst of a batch client's requests is served in full as its retries come back.

The scheduler runs at most `running_cap` sequences: the most whose decode step the learnt costs
(step_costs.py) put within TPOT_HEADROOM of the TPOT target, leaving room for prompt chunks. A new
request's first-token delay is predicted from what is ahead of it: the waiting requests that start
before it (their prompts; fair share puts only some of other tenants' queues ahead, `admitted_before`)
and, with the batch full, the running sequences that must finish to make room. One whose wait for
those (its own prompt's steps aside: `wait_for_others`) is predicted past TTFT_HEADROOM of the target
is refused at once (OverloadedError: 503, Retry-After), before any token,
so admitted streams keep their SLO and the client can go elsewhere. Predictions err (a cold start, a
burst of long prompts): every step the waiting requests are predicted again, and one now past the
target is refused then (`refusals`), still before any token. A non-streamed request admitted is
never refused later: its client waits for it, and a late refusal would only cost it a retry. A request
still waiting for its start past its own deadline is dropped (TIMED_OUT).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Container, Iterable
from dataclasses import dataclass, field

from loraserve.config import SchedulerConfig
from loraserve.engine.fair_share import FairShare, Tenant
from loraserve.engine.outputs import OVERLOADED, TIMED_OUT, RequestError
from loraserve.engine.retry_schedule import RetrySchedule
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.step_costs import StepCosts
from loraserve.errors import OverloadedError

TPOT_HEADROOM = 0.8  # share of the TPOT target a decode step may take; the rest is for prompt chunks
# Share of the TTFT target a predicted first-token delay may take: predictions err both ways, and a
# request admitted late costs its stream the SLO while one refused early can go elsewhere at once.
TTFT_HEADROOM = 0.8
# Where a refused non-streamed request is told to come back: when its wait will be this share of the
# queue target, so a return still gets in when the queue drained up to a tenth slower than foreseen.
RETURN_HEADROOM = 0.9
_PROBE_PARAMS = SamplingParams(max_tokens=1)


@dataclass
class Admission:
    """Owned by the scheduler, which asks it before queueing a request and before growing the batch."""

    config: SchedulerConfig
    costs: StepCosts
    fair_share: FairShare
    num_admitted: int = 0
    num_refused: int = 0
    num_refused_late: int = 0  # of those admitted, refused before their first step (`refusals`)
    num_timed_out: int = 0  # of those admitted, dropped past their deadline before their first step
    retries: RetrySchedule = field(default_factory=RetrySchedule)  # when refused non-streamed requests come back

    @property
    def running_cap(self) -> int:
        """The most sequences to run at once: --max-num-seqs, or fewer to meet the TPOT target, but never fewer than
        a step needs to do half the work it could. Below that the machine cannot meet the target (a larger model,
        other processes on its cores), and a smaller batch would only cut throughput, make the queue longer and
        every wait with it: a default target must not turn a slow machine into one serving a sequence at a time."""
        limit, target = self.config.max_num_seqs, self.config.tpot_slo
        if target is None or not self.costs.is_ready:
            return limit
        return max(self.costs.max_seqs_within(TPOT_HEADROOM * target, limit), self.costs.half_throughput_seqs(limit))

    def first_token_delay(self, request: Request, running: list[Sequence], waiting: Iterable[Sequence]) -> float:
        """Predicted seconds from now to `request`'s first token, were it queued now."""
        waiting = list(waiting)
        ahead = admitted_before(request, waiting, self.fair_share)
        prompt_tokens = sum(seq.num_uncomputed_tokens for seq in ahead) + len(request.prompt_token_ids)
        cap = self.running_cap
        step = self.costs.step_seconds(min(len(running) + 1, cap))
        slots_needed = len(ahead) + 1 - (cap - len(running))
        wait = 0.0
        if slots_needed > 0 and not within_share(request.tenant, cap, running, waiting):
            remaining = sorted(
                max(1.0, self.costs.expected_output_tokens(seq.params.max_tokens) - seq.num_output_tokens)
                for seq in running
            )
            if slots_needed <= len(remaining):
                wait = remaining[slots_needed - 1] * step
            else:  # more waves than the running batch frees at once
                wait = slots_needed / cap * self.costs.expected_output_tokens(request.params.max_tokens) * step
        prompt_steps = math.ceil(prompt_tokens / self.config.max_num_batched_tokens)
        return wait + prompt_steps * step + self.costs.prompt_seconds(prompt_tokens)

    def predicted_queue_seconds(self, running: list[Sequence], waiting: Iterable[Sequence]) -> float:
        """How long a new request of no prompt would wait for its first step now (for routers' metrics)."""
        probe = Request(request_id="", prompt=None, prompt_token_ids=[], params=_PROBE_PARAMS, arrival_time=0.0)
        return self.first_token_delay(probe, running, waiting) if self.costs.is_ready else 0.0

    def queue_seconds(self, request: Request) -> float:
        """What `request` adds to the predicted wait of those queued behind it, the batch full: its prompt's
        compute and its share of a wave of the running batch (as `first_token_delay` counts them)."""
        cap = self.running_cap
        step = self.costs.step_seconds(cap)
        num_prompt_tokens = len(request.prompt_token_ids)
        prompt = (
            self.costs.prompt_seconds(num_prompt_tokens) + num_prompt_tokens / self.config.max_num_batched_tokens * step
        )
        return prompt + self.costs.expected_output_tokens(request.params.max_tokens) * step / cap

    def check(self, request: Request, running: list[Sequence], waiting: Iterable[Sequence], now: float) -> None:
        """Refuse `request` (OverloadedError) if it cannot be served in time: streamed, its first token within
        the TTFT target; else its start within the queue target, keeping the promises made to those refused."""
        if request.is_streamed:
            self._check_first_token(request, running, waiting)
        else:
            self._check_queue(request, running, waiting, now)
        self.num_admitted += 1

    def own_seconds(self, request: Request) -> float:
        """`request`'s first-token delay with nothing ahead of it or beside it: its own prompt's steps."""
        num_prompt_tokens = len(request.prompt_token_ids)
        prompt_steps = math.ceil(num_prompt_tokens / self.config.max_num_batched_tokens)
        return prompt_steps * self.costs.step_seconds(1) + self.costs.prompt_seconds(num_prompt_tokens)

    def wait_for_others(self, request: Request, running: list[Sequence], waiting: Iterable[Sequence]) -> float:
        """What the TTFT target bounds: the first-token delay the other requests add to `request`'s own. Its own
        compute does not count, so a machine too slow for the target still serves (at its own pace) the requests
        that wait for nobody, and keeps learning its step costs: refusing those would refuse everything, for good."""
        return self.first_token_delay(request, running, waiting) - self.own_seconds(request)

    def _check_first_token(self, request: Request, running: list[Sequence], waiting: Iterable[Sequence]) -> None:
        target = self.config.ttft_slo
        wait = self.wait_for_others(request, running, waiting) if target and self.costs.is_ready else 0.0
        if target is not None and wait > TTFT_HEADROOM * target:
            self.num_refused += 1
            raise OverloadedError(
                f"the server is at capacity: the first token would wait about {wait:.1f} s for other requests, too "
                f"close to the {target:g} s target; retry later or elsewhere",
                retry_after=wait - TTFT_HEADROOM * target,
            )

    def _check_queue(self, request: Request, running: list[Sequence], waiting: Iterable[Sequence], now: float) -> None:
        target = self.config.queue_slo
        if target is None or not self.costs.is_ready:
            return
        wait = self.first_token_delay(request, running, waiting)
        if wait <= target + min(0.0, self.retries.room(now)):
            return
        self.num_refused += 1
        retry_after = self.retries.promise(now, wait, self.queue_seconds(request), RETURN_HEADROOM * target)
        raise OverloadedError(
            f"the server is at capacity: this request would wait about {wait:.0f} s to start, past the {target:g} s "
            f"target, or behind requests told to come back first; retry in {math.ceil(retry_after)} s",
            retry_after=retry_after,
        )

    def refusals(
        self, now: float, running: list[Sequence], waiting: Collection[Sequence], ended: Container[Request]
    ) -> dict[Request, RequestError]:
        """The waiting requests to end before any token, beside those `ended` already: past their deadline
        (TIMED_OUT); then, in queue order, the streamed ones whose first token is now predicted past the TTFT
        target, as the steps went slower than foreseen when they were let in (OVERLOADED): a client told at once
        can go elsewhere; one served late is lost anyway."""
        refused: dict[Request, RequestError] = {}
        for seq in waiting:
            request = seq.request
            expired = request.deadline is not None and now > request.deadline and request.first_scheduled_time is None
            if expired and request not in ended and request not in refused:
                waited = now - request.arrival_time
                refused[request] = RequestError(TIMED_OUT, f"dropped unserved after waiting {waited:.1f} s")
                self.num_timed_out += 1
        target = self.config.ttft_slo
        if target is None or not self.costs.is_ready:
            return refused
        ahead: list[Sequence] = []
        for seq in (seq for seq in waiting if seq.request not in ended and seq.request not in refused):
            request = seq.request
            if (
                request.is_streamed
                and request.first_scheduled_time is None
                and now + self.wait_for_others(request, running, ahead) > request.arrival_time + target
            ):
                self.num_refused_late += 1
                refused[request] = RequestError(
                    OVERLOADED,
                    f"the server is at capacity: waited {now - request.arrival_time:.1f} s and its first token "
                    f"would come past the {target:g} s target; retry later or elsewhere",
                    self.predicted_queue_seconds(running, waiting),
                )
            else:
                ahead.append(seq)
        return refused


def admitted_before(request: Request, waiting: Iterable[Sequence], fair_share: FairShare) -> list[Sequence]:
    """The waiting sequences that would start before `request` (the scheduler's admission order):
    those of better priority; of its priority, its own tenant's, and of each other tenant as many
    as fair share admits while `request`'s tenant takes its turns: turns in proportion to the
    weights, one fewer for a tenant already served more (its counter higher). So a tenant
    flooding the queue delays its own requests, not another tenant's."""
    first: list[Sequence] = []
    queues: dict[Tenant, list[Sequence]] = {}
    for seq in waiting:
        other = seq.request
        if other.priority < request.priority:
            first.append(seq)
        elif other.priority == request.priority:
            queues.setdefault(other.tenant, []).append(seq)
    tenant = request.tenant
    own = queues.pop(tenant, [])
    turns = len(own) + 1
    others = []
    for other_tenant, seqs in queues.items():
        behind = fair_share.counter(other_tenant) > fair_share.counter(tenant)
        others += seqs[: max(0, math.ceil(turns * other_tenant.weight / tenant.weight) - behind)]
    return first + own + others


def within_share(tenant: Tenant, cap: int, running: list[Sequence], waiting: list[Sequence]) -> bool:
    """Whether one more sequence of `tenant` stays within its share of the `cap` slots (by weight,
    among the tenants running or waiting): the scheduler then gives it a slot at once, taken from
    a tenant over its share (preemption.py), instead of waiting for one to end."""
    seqs = [*running, *waiting]
    total_weight = sum(other.weight for other in {seq.request.tenant for seq in seqs} | {tenant})
    own = sum(seq.request.tenant == tenant for seq in seqs)
    return own + 1 <= cap * tenant.weight / total_weight
