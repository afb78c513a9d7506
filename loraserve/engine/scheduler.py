"""Iteration-level continuous batching (Orca) with chunked prefill and preemption by recompute.
Plain Python, no torch: tested without a model.

Every step: running sequences first (decodes before prompt chunks), then waiting ones while the token
budget, the sequence limit and the free KV blocks allow; a prompt longer than the budget left is
computed in chunks over several steps. When a running sequence cannot get a block, the most recently
admitted ones are preempted (blocks freed, recomputed later). An admitted sequence starts on its
longest cached prefix (block_manager.py), which takes nothing from the budget. A waiting sequence
whose adapter is loading is passed over. When it waits because every adapter slot is busy, one
resident adapter is drained: none of its new sequences is admitted until its running ones end, then
its idle slot goes to the waiting adapter; a hot adapter cannot starve a cold one.
With speculative decoding, a decoding sequence may compute its draft tokens with its pending one
(speculative.py); the budget counts them, and they get blocks only where its own token fits first.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from loraserve.config import SchedulerConfig
from loraserve.engine.admission import Admission
from loraserve.engine.batch import ScheduledBatch, ScheduledSequence, StepOutput
from loraserve.engine.block_manager import BlockCopy, BlockManager
from loraserve.engine.fair_share import FairShare
from loraserve.engine.grammar import advance as advance_grammar
from loraserve.engine.grammar import valid_drafts
from loraserve.engine.outputs import (
    ADAPTER_UNAVAILABLE,
    GRAMMAR_FAILED,
    OVERLOADED,
    STEP_FAILED,
    TIMED_OUT,
    RequestError,
    TokenLogprob,
)
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, Sequence, SequenceStatus
from loraserve.engine.speculative import NgramProposer, SpeculationStats, accepted_prefix
from loraserve.engine.step_costs import StepCosts
from loraserve.engine.stop_checker import StopChecker
from loraserve.lora.adapter_state import AdapterRecord, AdapterState
from loraserve.lora.residency import Acquired

logger = logging.getLogger(__name__)

_PROBE_PARAMS = SamplingParams(max_tokens=1)

# Free blocks kept back when admitting new work, so running sequences can grow a little.
WATERMARK_FRACTION = 0.01


class AdapterResidency(Protocol):
    """What the scheduler needs from the adapter manager."""

    def acquire(self, name: str) -> Acquired: ...  # ON_DEVICE counts one more running sequence

    def release(self, name: str) -> None: ...

    def record(self, name: str) -> AdapterRecord | None: ...  # its slot, content hash, failure

    def drain_candidate(self) -> str | None: ...  # the resident adapter to free a slot from


class Scheduler:
    """Owns the waiting and running queues and every sequence's status."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        stop_checker: StopChecker,
        adapters: AdapterResidency,
        clock: Callable[[], float] = time.monotonic,
        proposer: NgramProposer | None = None,
    ) -> None:
        self.config = config
        self.adapters = adapters
        self.block_manager = block_manager
        self.stop_checker = stop_checker
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0
        self.num_fair_share_preemptions = 0  # of those, to give a tenant under its share a slot
        self.prefix_cache_queried_tokens = 0  # tokens of the sequences admitted
        self.prefix_cache_hit_tokens = 0  # of those, found in the prefix cache
        self._seq_ids = itertools.count()
        self._watermark = int(block_manager.num_blocks * WATERMARK_FRACTION)
        self._failed: list[Request] = []
        self._failing: dict[Request, RequestError] = {}  # found by `schedule`, ended by `take_failed`
        self._draining: str | None = None  # admits no new sequence until drained (see the module doc)
        self.fair_share = FairShare()
        self.costs = StepCosts()  # the engine reports each step's time
        self.admission = Admission(config, self.costs, self.fair_share)
        self.num_timed_out = 0
        self.proposer = proposer
        self.speculation = SpeculationStats()

    def add_request(self, request: Request) -> None:
        """Queue the request behind those of its priority or better; OverloadedError if it would miss its target."""
        self.admission.check(request, self.running, self.waiting, self.clock())
        active = {seq.request.tenant for seq in itertools.chain(self.waiting, self.running)}
        if request.tenant not in active:
            self.fair_share.activate(request.tenant, active)
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=0,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            pending_forks=request.params.n - 1,
        )
        request.seqs.append(seq)
        behind = (i for i, other in enumerate(self.waiting) if other.request.priority > request.priority)
        self.waiting.insert(next(behind, len(self.waiting)), seq)

    def predicted_queue_seconds(self) -> float:
        """How long a new request of no prompt would wait for its first step now (for routers' metrics)."""
        probe = Request(request_id="", prompt=None, prompt_token_ids=[], params=_PROBE_PARAMS, arrival_time=0.0)
        return self.admission.first_token_delay(probe, self.running, self.waiting) if self.costs.is_ready else 0.0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self._drop_expired()
        self._refuse_late()
        budget = self.config.max_num_batched_tokens
        max_running = self.admission.running_cap
        self._yield_to_fair_share(max_running)
        chosen: list[tuple[Sequence, int]] = []
        copies: list[BlockCopy] = []
        drafts: dict[int, list[int]] = {}  # by seq_id
        # Decodes first: a long prompt chunk must not hold back the token of every other user.
        queue = deque(sorted(self.running, key=lambda s: s.num_uncomputed_tokens != 1))
        kept: list[Sequence] = []
        preempted = False
        while queue:
            seq = queue.popleft()
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0 or seq.request in self._failing:
                kept.append(seq)
                continue
            while not self.block_manager.make_room(seq, num_new) and queue:
                self._preempt(queue.pop())
                preempted = True
            if not self.block_manager.make_room(seq, num_new):
                self._preempt(seq)
                preempted = True
                continue
            if num_new == 1 and (proposed := self._drafts(seq, budget)):
                drafts[seq.seq_id] = proposed
                num_new += len(proposed)
            kept.append(seq)
            try:
                copies += self.block_manager.allocate(seq, num_new)
            except Exception as error:
                self._fail_after_step(seq, error)
                continue
            chosen.append((seq, num_new))
            budget -= num_new
        kept_ids = {seq.seq_id for seq in kept}
        self.running = [seq for seq in self.running if seq.seq_id in kept_ids]
        # Admitting new work right after preempting would only preempt again.
        if self._draining is not None and not any(seq.request.adapter == self._draining for seq in self.running):
            self._draining = None  # drained: its idle slot goes to the first waiting request that needs one
        for seq in self.fair_share.admission_order(self.waiting, self.running):
            if budget <= 0 or len(self.running) >= max_running or preempted:
                break
            if seq.request in self._failing:
                continue
            try:
                admitted = self._admit(seq, budget, chosen, copies)
            except Exception as error:
                self._fail_after_step(seq, error)
                continue
            if admitted is None:
                break
            budget -= admitted
        return self._build_batch(chosen, copies, drafts)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence: as many as the budget, its max_tokens and the context
        window leave after its pending token, and only where their blocks fit too."""
        if self.proposer is None or seq.num_output_tokens == 0:  # its prompt's last token: its forks sample there
            return []
        room = min(
            budget - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.stop_checker.max_model_len - seq.num_tokens - 1,
        )
        costs = self.costs.token_and_draft_seconds(len(self.running))
        proposed = self.proposer.propose(seq, room, *costs) if room > 0 else []
        proposed = valid_drafts(seq, proposed)  # a draft its grammar forbids could never be kept
        if proposed and not self.block_manager.make_room(seq, 1 + len(proposed)):
            return []
        return proposed

    def _admit(
        self, seq: Sequence, budget: int, chosen: list[tuple[Sequence, int]], copies: list[BlockCopy]
    ) -> int | None:
        """Start the waiting `seq` if it can: its tokens this step, 0 if it must wait, None to admit no more."""
        adapter = seq.request.adapter
        if adapter is not None:
            # The adapter first: once acquired it is busy, so finding KV room for this very
            # sequence cannot evict it (idle adapters give their pages to KV).
            if adapter == self._draining:
                return 0
            acquired = self.adapters.acquire(adapter)
            if acquired is Acquired.FAILED:
                reason = self._record(adapter).failure or "it could not be loaded"
                self._failing[seq.request] = RequestError(ADAPTER_UNAVAILABLE, reason)
                return 0
            if acquired is Acquired.NO_SLOT and self._draining is None:
                self._draining = self.adapters.drain_candidate()
            if acquired is not Acquired.ON_DEVICE:
                return 0
        try:
            if adapter is not None:
                record = self._record(adapter)
                seq.cache_salt, seq.lora_slot = record.content_hash.encode(), record.slot
            seq.num_computed_tokens = self.block_manager.attach_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.make_room(seq, num_new, reserve=self._watermark):
                self._release(seq)
                return None
            copies += self.block_manager.allocate(seq, num_new)
        except BaseException:
            self._release(seq)  # undo the half-done admission
            raise
        self.prefix_cache_queried_tokens += seq.num_tokens
        self.prefix_cache_hit_tokens += seq.num_computed_tokens
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.request.first_scheduled_time is None:
            self.fair_share.charge(seq.request.tenant, prompt_tokens=seq.num_prompt_tokens)
            seq.request.first_scheduled_time = self.clock()
            seq.request.num_cached_tokens = seq.num_computed_tokens
        self.running.append(seq)
        chosen.append((seq, num_new))
        return num_new

    def _yield_to_fair_share(self, max_running: int) -> None:
        """With the batch full, a tenant below its share of the slots takes one from the tenant
        furthest over its share (FairShare.slots_to_move), whose newest sequence goes back to
        waiting, to be recomputed (its prompt's blocks mostly stay in the prefix cache). Otherwise a
        newcomer waits for a sequence to end: a whole generation when a flood filled the batch at
        once. Only sequences that can start at once (no adapter to load first) take a slot so."""
        if len(self.running) < max_running:
            return
        running = Counter(seq.request.tenant for seq in self.running)
        startable = Counter(
            seq.request.tenant
            for seq in self.waiting
            if seq.request not in self._failing
            and (seq.request.adapter is None or self._record(seq.request.adapter).state is AdapterState.ON_DEVICE)
        )
        for _taker, holder in self.fair_share.slots_to_move(running, startable, max_running):
            victim = next(seq for seq in reversed(self.running) if seq.request.tenant == holder)
            self.running.remove(victim)
            self._preempt(victim)
            self.num_fair_share_preemptions += 1

    def _record(self, adapter: str) -> AdapterRecord:
        record = self.adapters.record(adapter)
        assert record is not None, f"adapter {adapter!r} of a queued request is not registered"
        return record

    def _drop_expired(self) -> None:
        """Requests still waiting for their start past their deadline end (after the step) with TIMED_OUT."""
        now = self.clock()
        for seq in self.waiting:
            request = seq.request
            expired = request.deadline is not None and now > request.deadline
            if expired and request.first_scheduled_time is None and request not in self._failing:
                waited = now - request.arrival_time
                self._failing[request] = RequestError(TIMED_OUT, f"dropped unserved after waiting {waited:.1f} s")
                self.num_timed_out += 1

    def _refuse_late(self) -> None:
        """Requests whose first token can no longer come within the TTFT target end (after the step) with
        OVERLOADED, before any token: a client told at once can go elsewhere; one served late is lost anyway."""
        if self.config.ttft_slo is None:
            return
        now = self.clock()
        pending = [seq for seq in self.waiting if seq.request not in self._failing]
        for request in list(self.admission.late_requests(now, self.running, pending)):
            self._failing[request] = RequestError(
                OVERLOADED,
                f"the server is at capacity: waited {now - request.arrival_time:.1f} s and its first token would "
                f"come past the {self.config.ttft_slo:g} s target; retry later or elsewhere",
                self.predicted_queue_seconds(),
            )

    def _fail_after_step(self, seq: Sequence, error: Exception) -> None:
        """One request's bad state must not stop the others' steps: it ends after this one (`take_failed`)."""
        logger.exception("scheduling request %r failed", seq.request.request_id)
        self._failing[seq.request] = RequestError(STEP_FAILED, f"scheduling it failed: {error!r}")

    def _release(self, seq: Sequence) -> None:
        """The sequence's blocks and its hold on the adapter go back; it starts over from its first token."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        if seq.request.adapter is not None:
            self.adapters.release(seq.request.adapter)

    def postprocess(self, batch: ScheduledBatch, output: StepOutput) -> list[Request]:
        """Record the step's tokens; finish sequences that are done. Returns the requests touched."""
        now = self.clock()
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
            if item.drafts:
                self._accept_drafts(item, tokens, logprobs, now, touched)
                continue
            for seq, token_id, logprob in zip(item.samplers, tokens, logprobs, strict=True):
                self._append(seq, token_id, logprob, now, touched)
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
            self.fail_request(seq.request, RequestError(GRAMMAR_FAILED, grammar_error))  # reported by take_failed
            touched.pop(seq.request.request_id, None)
            return False
        touched[seq.request.request_id] = seq.request
        reason = self.stop_checker.check(seq)
        if reason is not None:
            self.costs.observe_finished(seq.num_output_tokens)
            self._finish(seq, reason, now)
            return False
        return True

    def _accept_drafts(
        self,
        item: ScheduledSequence,
        sampled: list[int],
        logprobs: list[TokenLogprob | None],
        now: float,
        touched: dict[str, Request],
    ) -> None:
        """Keep the drafts that equal the tokens sampled at their rows, then the sample of the first row
        that differs (or the bonus row's); the cache holds the pending token's and the kept drafts' K/V
        only: blocks past them go back, and none of the rejected drafts' is ever published."""
        seq, start = item.seq, item.start
        if seq.status is SequenceStatus.FINISHED:  # aborted while the step ran
            return
        accepted = accepted_prefix(item.drafts, sampled)
        assert self.proposer is not None
        self.proposer.observe(seq, len(item.drafts), accepted)
        self.speculation.record(seq.request.adapter, len(item.drafts), accepted)
        seq.request.num_draft_tokens += len(item.drafts)
        seq.request.num_accepted_draft_tokens += accepted
        seq.num_computed_tokens = start + 1 + accepted
        for token_id, logprob in zip(sampled[: accepted + 1], logprobs[: accepted + 1], strict=True):
            if not self._append(seq, token_id, logprob, now, touched):
                return
        self.block_manager.publish_computed_blocks(seq, start)
        self.block_manager.trim(seq)

    def take_failed(self) -> list[Request]:
        """Requests ended with an error since the last call, the ones `schedule` found failing included. Call
        it after the step: a failing request's siblings (n > 1) in the step must keep their blocks until it has run."""
        for request, error in self._failing.items():
            self.fail_request(request, error)
        self._failing.clear()
        failed, self._failed = self._failed, []
        return failed

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop every sequence of the request now with finish_reason `reason` and free its blocks."""
        now = self.clock()
        for seq in request.seqs:
            seq.pending_forks = 0
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            if seq.status is not SequenceStatus.FINISHED:
                self._finish(seq, reason, now)

    def fail_request(self, request: Request, error: RequestError) -> None:
        """End every sequence of the request with finish_reason "error"; `take_failed` reports it once."""
        if request.is_finished:
            return
        request.error = error
        self.abort(request, "error")
        self._failed.append(request)

    def _build_batch(
        self, chosen: list[tuple[Sequence, int]], copies: list[BlockCopy], drafts: dict[int, list[int]]
    ) -> ScheduledBatch:
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []  # and sequences with drafts: a chunk of 1 + K tokens
        for seq, num_new in chosen:
            item = ScheduledSequence(seq, num_new, drafts=drafts.get(seq.seq_id, []))
            if item.drafts:
                item.samplers = [seq]
            elif seq.num_computed_tokens + num_new == seq.num_tokens:
                item.samplers = [seq, *self._fork_siblings(seq, num_new)]
            (decodes if num_new == 1 else prefills).append(item)
        return ScheduledBatch(decodes=decodes, prefills=prefills, block_copies=copies)

    def _fork_siblings(self, seq: Sequence, num_new: int) -> list[Sequence]:
        """n > 1: the other completions share the prompt's blocks and sample from its last row."""
        forks = []
        for _ in range(seq.pending_forks):
            child = seq.fork(next(self._seq_ids), index=len(seq.request.seqs))
            child.num_computed_tokens = seq.num_computed_tokens + num_new  # as the parent's after this step
            self.block_manager.fork(seq, child)
            if child.request.adapter is not None:
                self.adapters.acquire(child.request.adapter)  # resident: the parent is running with it
            seq.request.seqs.append(child)
            self.running.append(child)
            forks.append(child)
        seq.pending_forks = 0
        return forks

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
            if seq.request.adapter is not None:
                self.adapters.release(seq.request.adapter)
        if seq.request.is_finished:
            seq.request.finished_time = now
