"""SLO-aware admission without a model: learnt step costs, the running cap, refusals, priority, deadlines."""

from __future__ import annotations

import pytest

from loraserve.engine.fair_share import Tenant
from loraserve.engine.outputs import OVERLOADED, TIMED_OUT
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request, SequenceStatus
from loraserve.engine.step_costs import StepCosts
from loraserve.errors import OverloadedError
from loraserve.resources import SAMPLE_ADAPTERS
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
    assert late.seqs[0].status is SequenceStatus.FINISHED and scheduler.num_timed_out == 1
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
    with pytest.raises(OverloadedError):  # any first token takes longer than the 1 ms target
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4), adapter="pirate")
    engine.remove_adapter("pirate")
    engine.add_adapter("pirate", SAMPLES / "pirate")  # the name is free: nothing of "r" holds it
    assert not engine.has_unfinished_requests()
