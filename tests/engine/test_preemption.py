"""Preemption by recompute, without a model: who gives way when KV blocks run out or a tenant is under its
share, and that a sequence preempted resumes and completes as if it never had been."""

from __future__ import annotations

from collections import deque

from loraserve.engine.batch import StepOutput
from loraserve.engine.fair_share import FairShare, Tenant
from loraserve.engine.preemption import block_victims, fair_share_victims
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.sequence import Request, Sequence
from tests.engine.helpers import make_sequence
from tests.engine.test_scheduler import make_scheduler, tokenizer  # noqa: F401 - fixture
from tests.lora.tiny_adapters import TINY_BLOCK_SIZE


def greedy_step(scheduler: Scheduler) -> None:
    """A step of a stand-in for a greedy model: each sequence's next token follows from its tokens so far."""
    batch = scheduler.schedule()
    tokens = [10 + sum(row.token_ids) % 50 for row in batch.sampling_rows]
    scheduler.postprocess(batch, StepOutput(tokens, [None] * len(tokens)))


def completions(scheduler: Scheduler, num_requests: int, running: list[int] | None = None) -> list[list[int]]:
    """Each request's output tokens; `running` gets how many sequences ran at each step."""
    requests = []
    for i in range(num_requests):
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        request = Request(f"r{i}", None, [100 + i] * 8, params, arrival_time=0.0)
        scheduler.add_request(request)
        requests.append(request)
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        greedy_step(scheduler)
        if running is not None:
            running.append(len(scheduler.running))
    assert all(request.is_finished for request in requests)
    return [request.seqs[0].output_token_ids for request in requests]


def test_a_preempted_sequence_resumes_and_completes_with_the_tokens_it_would_have_had(tokenizer):  # noqa: F811
    roomy = make_scheduler(tokenizer, num_blocks=64)
    expected = completions(roomy, 3)
    assert roomy.num_preemptions == 0
    pressed = make_scheduler(tokenizer, num_blocks=12)  # 3 x 20 tokens need 15 blocks of 4
    assert completions(pressed, 3) == expected
    assert pressed.num_preemptions > 0
    assert pressed.block_manager.num_free_blocks == 12, "every block back"


def test_with_a_sliding_window_more_run_together_and_a_preempted_one_resumes_as_before(tokenizer):  # noqa: F811
    expected = completions(make_scheduler(tokenizer, num_blocks=64), 3)
    without_window = make_scheduler(tokenizer, num_blocks=9)  # 3 x 20 tokens need 15 blocks of 4
    assert completions(without_window, 3) == expected and without_window.num_preemptions > 0
    # Behind a window of 8, a sequence holds at most 3 blocks: the two its next token's window reaches, and its own.
    windowed, running = make_scheduler(tokenizer, num_blocks=9, window=8), []
    assert completions(windowed, 3, running) == expected
    assert windowed.num_preemptions == 0 and running == [3] * 11 + [0], "all three together, each step"
    pressed = make_scheduler(tokenizer, num_blocks=6, window=8)
    assert completions(pressed, 3) == expected and pressed.num_preemptions > 0
    assert pressed.block_manager.num_released_behind_window > 0
    assert pressed.block_manager.num_free_blocks == 6, "every block back"


def test_out_of_blocks_the_newest_gives_way_first_and_the_one_asking_last(tokenizer):  # noqa: F811
    blocks = make_scheduler(tokenizer, num_blocks=6).block_manager
    oldest, middle, newest = (make_sequence(2 * TINY_BLOCK_SIZE, seq_id=i) for i in range(3))
    for seq in (oldest, middle, newest):
        blocks.allocate(seq, seq.num_tokens)  # two blocks each: the cache is full
        seq.num_computed_tokens = seq.num_tokens
    queue = deque([middle, newest])  # still to be scheduled this step, in admission order
    victims = []
    for victim in block_victims(blocks, oldest, 4 * TINY_BLOCK_SIZE, queue):
        victims.append(victim)
        blocks.free(victim)  # preempted: its blocks go back
    assert victims == [newest, middle], "four blocks more for the oldest: the newest gives way first, then the next"
    assert not queue
    victims = []
    for victim in block_victims(blocks, oldest, 10 * TINY_BLOCK_SIZE, deque()):
        victims.append(victim)
        blocks.free(victim)
    assert victims == [oldest], "nobody left to give way: it waits itself"


def running_of(*tenants: Tenant) -> list[Sequence]:
    seqs = []
    for i, tenant in enumerate(tenants):
        seq = make_sequence(4, seq_id=i)
        seq.request.tenant = tenant
        seqs.append(seq)
    return seqs


def test_a_tenant_under_its_share_takes_the_newest_slot_of_the_tenant_furthest_over_its_share():
    heavy, light, newcomer = Tenant("heavy"), Tenant("light"), Tenant("new")
    running = running_of(heavy, heavy, light, heavy)  # heavy holds 3 of 4 slots, light 1
    waiting = deque(running_of(newcomer))
    victims = fair_share_victims(FairShare(), running, waiting, 4, lambda seq: True)
    assert victims == [running[3]], "the heavy tenant's newest sequence, not the light one's"
    assert fair_share_victims(FairShare(), running, waiting, 4, lambda seq: False) == [], (
        "a newcomer that cannot start at once (its adapter still loading) takes no slot"
    )
    assert fair_share_victims(FairShare(), running[:3], waiting, 4, lambda seq: True) == [], "a free slot: none"
