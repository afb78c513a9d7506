"""Fair share between tenants (S-LoRA's VTC, weighted), on the scheduler alone: a tenant sending 10x
its share gets no more than its share while the other waits; weights 2:1 get service 2:1; one tenant is
first come, first served; a tenant coming back from idle banks nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from loraserve.engine.fair_share import FairShare, Tenant
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request
from tests.engine.test_scheduler import make_scheduler, step, tokenizer  # noqa: F401 - fixture

A, B = Tenant("a"), Tenant("b")


def queue(scheduler, request_id: str, tenant: Tenant, max_tokens: int = 8) -> Request:
    request = Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[100 + i for i in range(8)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        arrival_time=0.0,
        tenant=tenant,
    )
    scheduler.add_request(request)
    return request


def served_tokens(scheduler, steps: int) -> Counter[str]:
    """Tokens sampled per tenant over `steps` steps."""
    tokens: Counter[str] = Counter()
    for _ in range(steps):
        batch = step(scheduler)
        tokens.update(seq.request.tenant.name for seq in batch.sampling_rows)
    return tokens


@pytest.mark.parametrize(("weight_a", "expected_ratio"), [(1.0, 1.0), (2.0, 2.0)])
def test_under_saturation_service_follows_the_weights_however_much_one_tenant_sends(
    tokenizer,  # noqa: F811
    weight_a,
    expected_ratio,
):
    scheduler = make_scheduler(tokenizer, num_blocks=2048, max_num_seqs=12)
    heavy = Tenant("a", weight_a)
    lengths = [4 + i % 8 for i in range(1000)]  # 4 to 11 tokens: requests end at different steps
    for i in range(1000):  # ten times B's backlog, all queued first
        queue(scheduler, f"a{i}", heavy, lengths[i])
    for i in range(100):
        queue(scheduler, f"b{i}", B, lengths[i])
    tokens = served_tokens(scheduler, 96)  # B's 750 tokens outlast them: both keep a backlog throughout
    assert tokens["a"] + tokens["b"] == 12 * 96, "the batch stays full"
    assert tokens["a"] / tokens["b"] == pytest.approx(expected_ratio, rel=0.1), tokens


def test_one_tenant_is_served_first_come_first_served(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=2)
    requests = [queue(scheduler, f"r{i}", A, max_tokens=2) for i in range(6)]
    started = []
    for _ in range(20):
        step(scheduler)
        started += [r for r in requests if r.first_scheduled_time is not None and r not in started]
    assert started == requests


def test_a_tenant_back_from_idle_starts_at_the_lowest_active_counter():
    share = FairShare()
    share.charge(A, prompt_tokens=1000)
    share.activate(B, active=[A])
    assert share.counter(B) == share.counter(A), "B banked nothing while it sent nothing"
    share.charge(B, output_tokens=10)
    share.activate(B, active=[A])
    assert share.counter(B) == 1020, "a counter never goes down"
    heavy = Tenant("c", weight=4.0)
    share.charge(heavy, prompt_tokens=400)
    assert share.counter(heavy) == 100


def test_a_tenant_under_its_share_takes_a_slot_from_a_full_batch_at_once(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=4)
    flood = [queue(scheduler, f"a{i}", A, max_tokens=40) for i in range(8)]
    for _ in range(3):
        step(scheduler)
    assert {seq.request.request_id for seq in scheduler.running} == {"a0", "a1", "a2", "a3"}
    polite = queue(scheduler, "b0", B, max_tokens=4)
    step(scheduler)  # not after a flood request's 40 tokens: the next step
    assert polite.first_scheduled_time is not None
    assert scheduler.num_fair_share_preemptions == 1 and flood[3].seqs[0] in scheduler.waiting, "the newest yields"
    for _ in range(8):
        step(scheduler)
    assert polite.is_finished and scheduler.num_fair_share_preemptions == 1, "B within its share takes no more"
    while scheduler.has_unfinished():
        step(scheduler)
    assert all(len(r.seqs[0].token_ids) - r.seqs[0].num_prompt_tokens == 40 for r in flood), "recomputed, not lost"


def test_no_slot_is_taken_while_every_tenant_holds_its_share(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=4)
    for i in range(2):
        queue(scheduler, f"a{i}", A, max_tokens=40)
        queue(scheduler, f"b{i}", B, max_tokens=40)
    step(scheduler)
    queue(scheduler, "b-more", B, max_tokens=4)  # B has its 2 of 4 slots: it waits like anyone
    for _ in range(5):
        step(scheduler)
    assert scheduler.num_fair_share_preemptions == 0


def test_a_light_tenants_request_starts_before_a_heavy_tenants_backlog(tokenizer):  # noqa: F811
    scheduler = make_scheduler(tokenizer, num_blocks=512, max_num_seqs=2)
    backlog = [queue(scheduler, f"a{i}", A, max_tokens=4) for i in range(8)]
    step(scheduler)  # a0 and a1 run; a2 to a7 wait
    light = queue(scheduler, "b0", B, max_tokens=4)  # queued last, behind six of A's
    step(scheduler)
    assert light.first_scheduled_time is not None
    assert all(request.first_scheduled_time is None for request in backlog[2:]), "none of A's backlog went first"
