"""Iteration-level continuous batching (Orca) with chunked prefill: the loop that asks the policies. Plain
Python, no torch: tested without a model.

Every step: running sequences first (decodes before prompt chunks), then waiting ones while the token
budget, the running cap and the free KV blocks allow; a prompt longer than the budget left is computed in
chunks over several steps, and an admitted sequence starts on its longest cached prefix (block_manager.py),
which takes nothing from the budget; after each step, the blocks that fell behind every layer's sliding
window go back (block_manager.py). Asked on the way: admission.py (SLO targets and deadlines: who is
refused or dropped, how many run), fair_share.py (which waiting sequence starts next), adapter_admission.py
(whether an adapter joins, which one drains for a slot), preemption.py (who gives way), draft_budget.py
(speculative drafts); token_recorder.py records what the step sampled.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from loraserve.config import SchedulerConfig
from loraserve.engine.adapter_admission import AdapterAdmission, AdapterResidency
from loraserve.engine.admission import Admission
from loraserve.engine.batch import ScheduledBatch, ScheduledSequence, StepOutput
from loraserve.engine.block_manager import BlockCopy, BlockManager
from loraserve.engine.draft_budget import DraftBudget
from loraserve.engine.fair_share import FairShare
from loraserve.engine.outputs import ADAPTER_UNAVAILABLE, STEP_FAILED, RequestError
from loraserve.engine.preemption import block_victims, fair_share_victims
from loraserve.engine.sequence import Request, Sequence, SequenceStatus
from loraserve.engine.speculative import NgramProposer, SpeculationStats
from loraserve.engine.step_costs import StepCosts
from loraserve.engine.stop_checker import StopChecker
from loraserve.engine.token_recorder import TokenRecorder
from loraserve.lora.residency import Acquired

logger = logging.getLogger(__name__)

# Free blocks kept back when admitting new work, so running sequences can grow a little.
WATERMARK_FRACTION = 0.01


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
        self.block_manager = block_manager
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
        self.fair_share = FairShare()
        self.costs = StepCosts()  # the engine reports each step's time
        self.admission = Admission(config, self.costs, self.fair_share)
        self.adapter_admission = AdapterAdmission(adapters)
        self.speculation = SpeculationStats()
        self.draft_budget = DraftBudget(
            proposer, block_manager, self.costs, self.speculation, stop_checker.max_model_len
        )
        self.recorder = TokenRecorder(
            block_manager, stop_checker, self.fair_share, self.costs, self.draft_budget, self._finish, self.fail_request
        )

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
        return self.admission.predicted_queue_seconds(self.running, self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        self._failing.update(self.admission.refusals(self.clock(), self.running, self.waiting, self._failing))
        budget = self.config.max_num_batched_tokens
        max_running = self.admission.running_cap
        for victim in fair_share_victims(self.fair_share, self.running, self.waiting, max_running, self._can_start_now):
            self._preempt(victim)
            self.num_fair_share_preemptions += 1
        chosen: list[ScheduledSequence] = []
        copies: list[BlockCopy] = []
        # Decodes first: a long prompt chunk must not hold back the token of every other user.
        queue = deque(sorted(self.running, key=lambda s: s.num_uncomputed_tokens != 1))
        num_running, preempted = len(self.running), False  # the batch's size for the drafts' cost: as it came
        while queue:
            seq = queue.popleft()
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0 or seq.request in self._failing:
                continue
            for victim in block_victims(self.block_manager, seq, num_new, queue):
                self._preempt(victim)
                preempted = True
            if seq.status is SequenceStatus.WAITING:  # it gave way itself
                continue
            drafts = self.draft_budget.drafts(seq, budget, num_running) if num_new == 1 else []
            num_new += len(drafts)
            try:
                copies += self.block_manager.allocate(seq, num_new)
            except Exception as error:
                self._fail_after_step(seq, error)
                continue
            chosen.append(ScheduledSequence(seq, num_new, drafts=drafts))
            budget -= num_new
        self.adapter_admission.end_drain(self.running)
        # Admitting new work right after preempting would only preempt again.
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
        return self._build_batch(chosen, copies)

    def _admit(
        self, seq: Sequence, budget: int, chosen: list[ScheduledSequence], copies: list[BlockCopy]
    ) -> int | None:
        """Start the waiting `seq` if it can: its tokens this step, 0 if it must wait, None to admit no more."""
        if seq.request.adapter is not None:
            # The adapter first: once acquired it is busy, so finding KV room for this very
            # sequence cannot evict it (idle adapters give their pages to KV).
            acquired = self.adapter_admission.acquire(seq)
            if acquired is Acquired.FAILED:
                self._failing[seq.request] = RequestError(ADAPTER_UNAVAILABLE, self.adapter_admission.failure(seq))
            if acquired is not Acquired.ON_DEVICE:
                return 0
        try:
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
        chosen.append(ScheduledSequence(seq, num_new))
        return num_new

    def _can_start_now(self, seq: Sequence) -> bool:
        return seq.request not in self._failing and self.adapter_admission.can_start_now(seq.request.adapter)

    def _fail_after_step(self, seq: Sequence, error: Exception) -> None:
        """One request's bad state must not stop the others' steps: it ends after this one (`take_failed`)."""
        logger.exception("scheduling request %r failed", seq.request.request_id)
        self._failing[seq.request] = RequestError(STEP_FAILED, f"scheduling it failed: {error!r}")

    def _release(self, seq: Sequence) -> None:
        """The sequence's blocks and its hold on the adapter go back; it starts over from its first token."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.adapter_admission.release(seq)

    def postprocess(self, batch: ScheduledBatch, output: StepOutput) -> list[Request]:
        """Record the step's tokens; finish sequences that are done. Returns the requests touched."""
        touched = self.recorder.record(batch, output, self.clock())
        for seq in self.running:  # computed further (forks too): what fell behind a window goes back
            self.block_manager.release_behind_window(seq)
        return touched

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

    def _build_batch(self, chosen: list[ScheduledSequence], copies: list[BlockCopy]) -> ScheduledBatch:
        for item in chosen:
            if item.drafts:
                item.samplers = [item.seq]
            elif item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens:
                item.samplers = [item.seq, *self._fork_siblings(item.seq, item.num_new_tokens)]
        decodes = [item for item in chosen if item.num_new_tokens == 1]
        prefills = [item for item in chosen if item.num_new_tokens != 1]  # and sequences with drafts: 1 + K tokens
        return ScheduledBatch(decodes=decodes, prefills=prefills, block_copies=copies)

    def _fork_siblings(self, seq: Sequence, num_new: int) -> list[Sequence]:
        """n > 1: the other completions share the prompt's blocks and sample from its last row."""
        forks = []
        for _ in range(seq.pending_forks):
            child = seq.fork(next(self._seq_ids), index=len(seq.request.seqs))
            child.num_computed_tokens = seq.num_computed_tokens + num_new  # as the parent's after this step
            self.block_manager.fork(seq, child)
            self.adapter_admission.fork(child)
            seq.request.seqs.append(child)
            self.running.append(child)
            forks.append(child)
        seq.pending_forks = 0
        return forks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
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
            self.adapter_admission.release(seq)
        if seq.request.is_finished:
            seq.request.finished_time = now
