"""SLO-aware admission without a model: learnt step costs, the running cap, refusals, priority, deadlines."""

from __future__ import annotations

import math

import pytest

from loraserve.config import SchedulerConfig
from loraserve.engine.admission import Admission
from loraserve.engine.fair_share import FairShare, Tenant
from loraserve.engine.outputs import OVERLOADED, TIMED_OUT
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, SequenceStatus
from loraserve.engine.step_costs import StepCosts
from loraserve.errors import OverloadedError
from loraserve.resources import SAMPLE_ADAPTERS
from tests.engine.helpers import make_sequence
from tests.engine.test_scheduler import add, make_scheduler, step, tokenizer  # noqa: F401 - fixture

SAMPLES = SAMPLE_ADAPTERS


def taught(costs: StepCosts, prompts: bool = True) -> StepCosts:
    """Feed the costs the steps of a machine where a step takes 10 ms + 2 ms a sequence + 0.5 ms a prompt token."""
    for num_seqs in (1, 2, 4, 8, 16, 8, 4):
        costs.observe(num_seqs, 0, 0.010 + 0.002 * num_seqs)
    if prompts:
        costs.observe(5, 100, 0.010 + 0.002 * 4 + 0.0005 * 100)
    return costs


def queue(scheduler, request_id: str, priority: int, deadline: float | None = None) -> Request:
    request = Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[100, 101, 102, 103],
        params=SamplingParams(max_tokens=4, temperature=0.0),
        arrival_time=0.0,
        priority=priority,
        deadline=deadline,
    )
    scheduler.add_request(request)
    return request


def test_step_costs_fit_the_fixed_and_per_sequence_cost_and_the_prompt_token_cost():
    costs = taught(StepCosts())
    assert costs.decode_seconds(10) == pytest.approx(0.030, rel=0.02)
    assert costs.prompt_seconds(200) == pytest.approx(0.1, rel=0.05)
    decode_only = taught(StepCosts(), prompts=False)
    assert decode_only.max_seqs_within(0.050, limit=128) == 20  # (50 - 10) / 2
    assert decode_only.max_seqs_within(0.050, limit=8) == 8
    assert costs.max_seqs_within(0.050, limit=128) < 20, "the prompts that ride along in the steps count too"


def test_step_costs_assume_a_per_sequence_cost_until_batch_sizes_vary():
    costs = StepCosts()
    for _ in range(5):
        costs.observe(1, 0, 0.017)
    assert costs.decode_seconds(16) == pytest.approx(0.032, rel=0.01)  # 16 ms fixed + 16 x 1 ms
    assert costs.max_seqs_within(0.1, limit=128) < 128, "no infinite batch from a single batch size"


def test_without_targets_every_request_is_admitted(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=8)
    taught(scheduler.costs)
    for i in range(40):
        add(scheduler, f"r{i}", prompt_len=8, max_tokens=64)
    assert scheduler.admission.running_cap == 8 and scheduler.admission.num_refused == 0


def test_the_batch_stays_within_the_tpot_cap_and_late_requests_are_refused(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, ttft_slo=0.5, tpot_slo=0.025)
    scheduler.clock = lambda: 0.0  # the steps take no time: only the predictions refuse
    taught(scheduler.costs, prompts=False)
    cap = scheduler.admission.running_cap
    assert cap == 5  # (0.8 x 25 ms - 10 ms) / 2 ms
    admitted, refusals = [], []
    for i in range(30):
        try:
            admitted.append(add(scheduler, f"r{i}", prompt_len=8, max_tokens=64))
        except OverloadedError as error:
            refusals.append(error)
        step(scheduler)
        assert len(scheduler.running) <= cap
    assert refusals and all(error.retry_after > 0 for error in refusals)
    assert len(admitted) >= cap
    assert scheduler.admission.num_refused == len(refusals)


def test_priority_orders_the_queue_and_a_deadline_drops_a_request_that_never_started(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=1)
    now = [0.0]
    scheduler.clock = lambda: now[0]
    running = add(scheduler, "running", prompt_len=4, max_tokens=8)
    step(scheduler)
    late = queue(scheduler, "late", priority=0, deadline=1.0)
    urgent = queue(scheduler, "urgent", priority=-1)
    assert [seq.request for seq in scheduler.waiting] == [urgent, late]
    now[0] = 2.0
    step(scheduler)
    (failed,) = scheduler.take_failed()
    assert failed is late and late.error is not None and late.error.code == TIMED_OUT
    assert late.seqs[0].status is SequenceStatus.FINISHED and scheduler.admission.num_timed_out == 1
    assert running.seqs[0].status is SequenceStatus.RUNNING, "a running request is never dropped"


def test_a_queued_request_whose_wait_grows_past_the_ttft_target_is_refused_before_its_first_step(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=1, ttft_slo=1.0)
    now = [0.0]
    scheduler.clock = lambda: now[0]
    taught(scheduler.costs)
    running = add(scheduler, "running", prompt_len=4, max_tokens=8)
    step(scheduler)
    queued = queue(scheduler, "queued", priority=0)  # predicted to start in time when it came
    assert scheduler.admission.num_refused == 0
    now[0] = 0.99  # the running request's steps went far slower than foreseen
    step(scheduler)
    (refused,) = scheduler.take_failed()
    assert refused is queued and queued.error is not None and queued.error.code == OVERLOADED
    assert queued.error.retry_after is not None and queued.error.retry_after > 0
    assert queued.first_scheduled_time is None, "refused before any token was computed for it"
    assert scheduler.admission.num_refused_late == 1
    assert running.seqs[0].status is SequenceStatus.RUNNING, "a started request is never refused"


def test_a_flooding_tenants_queue_refuses_its_own_requests_not_another_tenants(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, ttft_slo=0.5, tpot_slo=0.025)
    scheduler.clock = lambda: 0.0
    taught(scheduler.costs, prompts=False)
    flooder, polite = Tenant("flooder"), Tenant("polite")

    def send(tenant: Tenant, request_id: str) -> Request:
        params = SamplingParams(max_tokens=64, temperature=0.0)
        request = Request(request_id, None, [100] * 8, params, arrival_time=0.0, tenant=tenant)
        scheduler.add_request(request)
        return request

    admitted = 0
    with pytest.raises(OverloadedError):  # the flooder fills the batch and queues until its requests would be late
        for i in range(100):
            send(flooder, f"flood-{i}")
            admitted += 1
    assert admitted > scheduler.admission.running_cap
    send(polite, "polite-0")  # fair share starts it at the next free slot: predicted in time
    with pytest.raises(OverloadedError):
        send(flooder, "flood-late")


@pytest.mark.slow
def test_a_refused_request_leaves_nothing_behind(make_llm):
    """Once kept by the engine, refused requests piled up (memory) and held their adapter: deleted, it
    stayed "retiring" for good, its name never free again."""
    llm = make_llm(max_loras=2, ttft_slo=0.001, tpot_slo=1.0)
    engine = llm.engine
    engine.add_adapter("pirate", SAMPLES / "pirate")
    taught(engine.scheduler.costs)
    engine.add_request("first", [1, 2, 3], SamplingParams(max_tokens=4))  # waits for nobody: admitted
    with pytest.raises(OverloadedError):  # waiting for the first's prompt takes longer than the 1 ms target
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4), adapter="pirate")
    engine.abort_request("first")
    engine.remove_adapter("pirate")
    engine.add_adapter("pirate", SAMPLES / "pirate")  # the name is free: nothing of "r" holds it
    assert not engine.has_unfinished_requests()


def batch_request(request_id: str, arrival_time: float, max_tokens: int = 8) -> Request:
    """A non-streamed request: its client sees nothing before the end."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(request_id, None, [100, 101, 102, 103], params, arrival_time=arrival_time, is_streamed=False)


def test_a_non_streamed_request_queues_to_the_queue_target_where_a_streamed_one_is_refused(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=4, ttft_slo=0.5, queue_slo=30.0)
    scheduler.clock = lambda: 0.0
    taught(scheduler.costs)
    for i in range(40):  # ten waves of 4, 8 tokens of ~20 ms each: seconds of queue, within 30 s
        scheduler.add_request(batch_request(f"batch-{i}", 0.0))
    with pytest.raises(OverloadedError):  # its user would see the first token seconds from now
        add(scheduler, "stream", prompt_len=4, max_tokens=8)
    assert scheduler.admission.num_refused == 1 and scheduler.admission.num_admitted == 40


def test_refused_non_streamed_requests_are_told_times_one_after_another(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=4, queue_slo=1.0)
    scheduler.clock = lambda: 0.0
    taught(scheduler.costs)
    retry_afters = []
    for i in range(60):
        try:
            scheduler.add_request(batch_request(f"batch-{i}", 0.0))
        except OverloadedError as error:
            retry_afters.append(error.retry_after)
    assert len(retry_afters) > 10
    assert retry_afters == sorted(retry_afters) and len(set(retry_afters)) == len(retry_afters), "no herd"
    per_request = scheduler.admission.queue_seconds(batch_request("probe", 0.0))
    assert retry_afters[-1] - retry_afters[0] == pytest.approx((len(retry_afters) - 1) * per_request)


def test_a_non_streamed_request_once_queued_is_never_refused_late(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=1, ttft_slo=1.0, queue_slo=5.0)
    now = [0.0]
    scheduler.clock = lambda: now[0]
    taught(scheduler.costs)
    add(scheduler, "running", prompt_len=4, max_tokens=8)
    step(scheduler)
    queued = batch_request("queued", 0.0)
    scheduler.add_request(queued)
    now[0] = 3.0  # far slower than foreseen: a streamed request would be refused now
    step(scheduler)
    assert not scheduler.take_failed() and queued.error is None


def test_a_burst_from_clients_that_retry_twice_as_told_is_served_in_full(tokenizer):  # noqa: F811
    """The `openai` client's default: two retries, each after the Retry-After it was told. Time runs with the
    steps, each taking what `taught` says; 300 requests at once into a queue target of a tenth of their time."""
    scheduler = make_scheduler(tokenizer, num_blocks=1024, max_num_seqs=16, queue_slo=0.6)
    now = [0.0]
    scheduler.clock = lambda: now[0]
    taught(scheduler.costs)
    arrivals = [(0.0, i, 2) for i in range(300)]  # (time, request, retries left)
    requests, failed, refusals = [], [], 0
    while arrivals or scheduler.has_unfinished():
        arrivals.sort()
        while arrivals and arrivals[0][0] <= now[0]:
            _, i, retries = arrivals.pop(0)
            request = batch_request(f"batch-{i}", now[0])
            try:
                scheduler.add_request(request)
                requests.append(request)
            except OverloadedError as error:
                refusals += 1
                if retries:
                    arrivals.append((now[0] + math.ceil(error.retry_after), i, retries - 1))
                else:
                    failed.append(i)
        if not scheduler.has_unfinished():
            now[0] = arrivals[0][0]
            continue
        batch = step(scheduler)
        prompt_tokens = sum(item.num_new_tokens for item in batch.prefills)
        seconds = 0.010 + 0.002 * len(batch.scheduled) + 0.0005 * prompt_tokens
        scheduler.costs.observe(len(batch.scheduled), prompt_tokens, seconds)
        now[0] += seconds
    assert refusals > 100, "the burst is well past the queue target"
    assert not failed and len(requests) == 300 and all(request.is_finished for request in requests)


def test_a_tpot_target_the_machine_cannot_meet_leaves_the_batch_at_half_throughput_not_one_sequence(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, tpot_slo=0.1)
    for num_seqs in (1, 2, 4, 8, 16, 8, 4):  # a loaded machine: 90 ms a step and 3 ms a sequence
        scheduler.costs.observe(num_seqs, 0, 0.090 + 0.003 * num_seqs)
    assert scheduler.costs.max_seqs_within(0.8 * 0.1, limit=128) == 1, "no batch meets the target"
    assert scheduler.admission.running_cap == 30  # 90 ms / 3 ms: a step does half the work it could


def test_a_machine_too_slow_for_the_ttft_target_still_serves_the_requests_that_wait_for_nobody(tokenizer):  # noqa: F811
    """Once every request was refused on a machine whose own prompt steps took longer than the target: then
    no step ran, the step costs were never learnt again, and the server refused everything for good."""
    scheduler = make_scheduler(tokenizer, num_blocks=512, ttft_slo=0.5)
    scheduler.clock = lambda: 0.0
    for num_seqs in (1, 2, 4, 8, 16, 8, 4):  # 600 ms a step: a first token takes more than the 0.5 s target alone
        scheduler.costs.observe(num_seqs, 0, 0.600 + 0.010 * num_seqs)
    alone = add(scheduler, "alone", prompt_len=8, max_tokens=64)
    assert scheduler.admission.own_seconds(alone) > 0.5
    step(scheduler)
    with pytest.raises(OverloadedError):  # the prompts queued ahead soon make one wait past the target
        for i in range(8):
            add(scheduler, f"behind-{i}", prompt_len=8, max_tokens=64)


def test_a_request_whose_ttft_target_cannot_be_met_is_refused_at_once_and_leaves_the_queue_as_it_was(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=2, ttft_slo=0.2)
    scheduler.clock = lambda: 0.0
    taught(scheduler.costs)
    for i in range(2):  # the batch full of long generations: a slot frees in about 64 steps of ~15 ms
        add(scheduler, f"long-{i}", prompt_len=4, max_tokens=64)
    step(scheduler)
    waiting = list(scheduler.waiting)
    with pytest.raises(OverloadedError) as refused:
        add(scheduler, "late", prompt_len=4, max_tokens=8)
    assert refused.value.retry_after > 0
    assert list(scheduler.waiting) == waiting and scheduler.admission.num_refused == 1


def test_a_request_past_its_deadline_is_dropped_once_and_a_started_one_never():
    admission = Admission(SchedulerConfig(), StepCosts(), FairShare())
    expired, ending, started = (make_sequence(4, seq_id=i) for i in range(3))
    for seq in (expired, ending, started):
        seq.request.deadline = 1.0
    started.request.first_scheduled_time = 0.5  # preempted since: it waits again, but its client has tokens
    refused = admission.refusals(2.0, [], [expired, ending, started], ended={ending.request})
    assert list(refused) == [expired.request] and refused[expired.request].code == TIMED_OUT
    assert admission.num_timed_out == 1
