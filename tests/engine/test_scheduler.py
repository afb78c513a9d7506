"""Scheduler: continuous batching, token budget, chunked prefill, preemption. No model needed."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loraserve.config import SchedulerConfig
from loraserve.engine.batch import StepOutput
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.sequence import Request, SequenceStatus
from loraserve.engine.stop_checker import StopChecker
from loraserve.lora.adapter_state import AdapterRecord
from tests.lora.tiny_adapters import TINY_BLOCK_SIZE, device_names, register_tiny, tiny_adapter_manager

EOS = 2


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def make_scheduler(tokenizer, num_blocks=64, adapters=None, window=None, **config) -> Scheduler:
    """KV blocks of 4 tokens, sharing `num_blocks` pages with the adapters (when none are given); `window`: every
    layer's sliding window."""
    adapters = adapters or tiny_adapter_manager(num_slots=1, num_pages=num_blocks)
    blocks = BlockManager(adapters.slots.pool.pages, TINY_BLOCK_SIZE, reclaim=adapters.reclaim_pages, window=window)
    stop_checker = StopChecker(tokenizer, frozenset({EOS}), max_model_len=1024)
    return Scheduler(SchedulerConfig(**config), blocks, stop_checker, adapters)


def add(
    scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4, adapter: str | None = None
) -> Request:
    request = Request(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[100 + i for i in range(prompt_len)],
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        arrival_time=0.0,
        adapter=adapter,
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler, token: int = 7):
    """One step with every sampling sequence receiving `token`."""
    batch = scheduler.schedule()
    scheduler.postprocess(batch, StepOutput([token] * len(batch.sampling_rows), [None] * len(batch.sampling_rows)))
    return batch


def test_new_request_joins_the_running_batch_at_the_next_step(tokenizer):
    scheduler = make_scheduler(tokenizer)
    first = add(scheduler, "a", prompt_len=5, max_tokens=10)
    batch = step(scheduler)
    assert [item.seq.request for item in batch.prefills] == [first]
    second = add(scheduler, "b", prompt_len=3)
    batch = step(scheduler)
    assert [item.seq.request for item in batch.decodes] == [first]
    assert [item.seq.request for item in batch.prefills] == [second]
    assert batch.num_tokens == 1 + 3


def test_finished_sequence_leaves_the_step_it_finishes_and_frees_its_blocks(tokenizer):
    scheduler = make_scheduler(tokenizer)
    short = add(scheduler, "short", prompt_len=4, max_tokens=1)
    long = add(scheduler, "long", prompt_len=4, max_tokens=5)
    step(scheduler)
    assert short.seqs[0].status is SequenceStatus.FINISHED
    assert short.seqs[0].finish_reason == "length"
    assert short.seqs[0].block_table == []
    assert scheduler.running == long.seqs
    batch = step(scheduler, token=EOS)
    assert long.seqs[0].finish_reason == "stop"
    assert [item.seq for item in batch.decodes] == long.seqs
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 64


def test_token_budget_chunks_a_long_prompt_and_samples_only_at_its_end(tokenizer):
    scheduler = make_scheduler(tokenizer, max_num_batched_tokens=8)
    request = add(scheduler, "long", prompt_len=20)
    chunks = []
    while not request.seqs[0].output_token_ids:
        batch = step(scheduler)
        chunks.append(batch.num_tokens)
        assert batch.num_tokens <= 8
    assert chunks == [8, 8, 4]
    assert request.seqs[0].num_computed_tokens == 20


def test_decodes_are_scheduled_before_a_prompt_chunk(tokenizer):
    scheduler = make_scheduler(tokenizer, max_num_batched_tokens=6)
    decoding = add(scheduler, "decoding", prompt_len=3, max_tokens=10)
    step(scheduler)
    long = add(scheduler, "long", prompt_len=30)
    for _ in range(3):
        batch = step(scheduler)
        assert [item.seq.request for item in batch.decodes] == [decoding]
        assert [(item.seq.request, item.num_new_tokens) for item in batch.prefills] == [(long, 5)]


def test_max_num_seqs_bounds_the_running_batch(tokenizer):
    scheduler = make_scheduler(tokenizer, max_num_seqs=2)
    for i in range(4):
        add(scheduler, f"r{i}", prompt_len=2, max_tokens=3)
    batch = step(scheduler)
    assert len(batch.scheduled) == 2
    assert len(scheduler.waiting) == 2


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later(tokenizer):
    # 4 blocks of 4 tokens: two sequences of 8 prompt tokens fill the cache exactly.
    scheduler = make_scheduler(tokenizer, num_blocks=4)
    old = add(scheduler, "old", prompt_len=8, max_tokens=3)
    new = add(scheduler, "new", prompt_len=8, max_tokens=3)
    step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    batch = step(scheduler)  # both need a 3rd block for position 8: the newest gives way
    assert [item.seq.request for item in batch.scheduled] == [old]
    assert new.seqs[0].status is SequenceStatus.WAITING
    assert new.seqs[0].num_computed_tokens == 0 and new.seqs[0].block_table == []
    assert scheduler.waiting[0] is new.seqs[0]
    assert scheduler.num_preemptions == 1
    while scheduler.has_unfinished():
        step(scheduler)
    # The preempted one resumes from its prompt plus the token it had already generated.
    assert len(new.seqs[0].output_token_ids) == 3
    assert scheduler.block_manager.num_free_blocks == 4


def test_abort_frees_blocks_and_drops_the_request(tokenizer):
    scheduler = make_scheduler(tokenizer)
    running = add(scheduler, "running", prompt_len=5, max_tokens=10)
    step(scheduler)
    waiting = add(scheduler, "waiting", prompt_len=5)
    scheduler.abort(running)
    scheduler.abort(waiting)
    assert running.seqs[0].finish_reason == "abort" and waiting.seqs[0].finish_reason == "abort"
    assert not scheduler.has_unfinished()
    assert scheduler.block_manager.num_free_blocks == 64


def test_n_greater_than_one_forks_after_the_prompt(tokenizer):
    scheduler = make_scheduler(tokenizer)
    request = Request("n3", None, [5, 6, 7, 8, 9, 10], SamplingParams(n=3, max_tokens=2), arrival_time=0.0)
    scheduler.add_request(request)
    batch = step(scheduler)
    assert len(batch.sampling_rows) == 3
    assert [len(seq.output_token_ids) for seq in request.seqs] == [1, 1, 1]
    batch = step(scheduler)
    assert len(batch.block_copies) == 2  # two of the three write a private copy of the shared last block
    assert request.is_finished
    assert scheduler.block_manager.num_free_blocks == 64


def test_a_request_whose_adapter_has_no_free_slot_waits_while_later_ones_run(tokenizer):
    adapters = tiny_adapter_manager(num_slots=1)
    register_tiny(adapters, "a", seed=0)
    register_tiny(adapters, "b", seed=1)
    scheduler = make_scheduler(tokenizer, adapters=adapters)
    add(scheduler, "r-a", prompt_len=2, max_tokens=2, adapter="a")
    b = add(scheduler, "r-b", prompt_len=2, max_tokens=2, adapter="b")
    add(scheduler, "r-base", prompt_len=2, max_tokens=2)
    batch = step(scheduler)
    assert [item.seq.request.request_id for item in batch.scheduled] == ["r-base"], "a is loading, b has no slot"
    assert adapters.wait_idle()
    batch = step(scheduler)
    assert [item.seq.request.request_id for item in batch.scheduled] == ["r-base", "r-a"]  # decodes first
    step(scheduler)  # a's request finishes: its slot goes to b
    step(scheduler)
    assert adapters.wait_idle()
    batch = step(scheduler)
    assert [item.seq.request for item in batch.scheduled] == [b]
    assert device_names(adapters) == ["b"], "a was evicted once it had no running sequence"
    assert adapters.stats.evictions == 1


def test_a_flood_for_one_adapter_cannot_starve_another(tokenizer):
    """Bound: with every slot busy, a cold adapter's request starts once the sequences running when it
    arrived have finished (at most max_tokens steps) plus its load; no later request overtakes it."""
    max_tokens = 4
    adapters = tiny_adapter_manager(num_slots=1, num_pages=256)
    register_tiny(adapters, "hot", seed=0)
    register_tiny(adapters, "cold", seed=1)
    scheduler = make_scheduler(tokenizer, adapters=adapters)
    early = [add(scheduler, f"hot-{i}", 2, max_tokens, adapter="hot") for i in range(6)]
    cold = add(scheduler, "cold", 2, max_tokens, adapter="cold")
    late = [add(scheduler, f"hot-late-{i}", 2, max_tokens, adapter="hot") for i in range(6)]
    first_step: dict[str, int] = {}
    for index in range(40):
        for item in step(scheduler).scheduled:
            first_step.setdefault(item.seq.request.request_id, index)
        adapters.wait_idle()
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished(), "everything completes"
    hot_started = max(first_step[r.request_id] for r in early)
    assert first_step["cold"] <= hot_started + max_tokens + 2
    assert all(first_step[r.request_id] > first_step["cold"] for r in late), "nobody overtakes the cold request"
    assert cold.first_scheduled_time is not None


def test_a_cached_prefix_is_not_computed_again_and_takes_nothing_from_the_budget(tokenizer):
    scheduler = make_scheduler(tokenizer, max_num_batched_tokens=8)
    add(scheduler, "first", prompt_len=13, max_tokens=1)
    while scheduler.has_unfinished():
        step(scheduler)
    second = add(scheduler, "second", prompt_len=13, max_tokens=1)  # the same 13 prompt tokens
    batch = step(scheduler)
    (item,) = batch.scheduled
    assert item.num_new_tokens == 1, "the last token alone is computed"
    assert second.num_cached_tokens == 12, "three cached blocks of 4"
    assert (scheduler.prefix_cache_queried_tokens, scheduler.prefix_cache_hit_tokens) == (26, 12)
    assert second.seqs[0].status is SequenceStatus.FINISHED


def test_a_request_whose_scheduling_raises_ends_after_the_step_and_the_others_run(tokenizer):
    adapters = tiny_adapter_manager(num_slots=2)
    register_tiny(adapters, "good", seed=0)
    register_tiny(adapters, "broken", seed=1)
    scheduler = make_scheduler(tokenizer, adapters=adapters)
    for name in ("good", "broken"):
        add(scheduler, f"warm-{name}", prompt_len=2, max_tokens=1, adapter=name)
    step(scheduler)
    assert adapters.wait_idle()
    step(scheduler)  # both adapters resident, their first requests done
    assert scheduler.take_failed() == []

    real_record = adapters.record

    def record(name: str) -> AdapterRecord | None:  # a bug that strikes one adapter's sequences, once resident
        if name == "broken" and adapters.residency(name) == "device":
            raise RuntimeError("corrupt slot table")
        return real_record(name)

    adapters.record = record  # type: ignore[method-assign]
    broken = add(scheduler, "r-broken", prompt_len=6, adapter="broken")
    good = add(scheduler, "r-good", prompt_len=6, adapter="good")
    base = add(scheduler, "r-base", prompt_len=6)
    free_before = scheduler.block_manager.num_free_blocks
    batch = step(scheduler)
    assert [item.seq.request for item in batch.scheduled] == [good, base]
    assert scheduler.take_failed() == [broken]
    assert broken.error is not None and broken.error.code == "step_failed"
    assert "corrupt slot table" in broken.error.message
    assert real_record("broken").running == 0, "its hold on the adapter was released"
    while scheduler.has_unfinished():
        step(scheduler)
    assert good.is_finished and base.is_finished and good.error is None
    assert scheduler.block_manager.num_free_blocks == free_before
