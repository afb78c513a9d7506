"""The decode step over the CUDA graphs' static buffers: rows padded to a bucket, padding writing to a
scratch block, each row's adapter slot in a static table. On the CPU it runs uncaptured, which checks
everything a graph replays but the capture; tests/correctness/test_cuda.py replays the graphs on a GPU."""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from loraserve.memory.page_allocator import PageUse
from loraserve.models.cuda.attention import paged_decode_attention
from loraserve.models.cuda.graphs import DecodeGraphs, batch_buckets
from loraserve.resources import SAMPLE_ADAPTERS
from tests.conftest import CHAT_PROMPTS

SAMPLES = SAMPLE_ADAPTERS
ADAPTERS = ["pirate", "robot"]


def test_buckets_are_powers_of_two_then_multiples_of_eight_up_to_the_largest_batch():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 24]


@pytest.mark.slow
def test_decode_steps_over_static_buffers_give_the_eager_engines_tokens(make_llm):
    """Three rows (bucket 4: one padding row) over two adapters and the base model; each row runs the Triton
    kernels in the interpreter, so few rows keep it short."""
    eager, static = make_llm(max_loras=4), make_llm(max_loras=4)
    runner = static.engine.model_runner
    scratch = runner.pool.pages.take(1, PageUse.KV)
    assert scratch is not None
    runner.fused_step = DecodeGraphs(
        runner.model, runner.pool.kv_caches, runner.adapter_slots, paged_decode_attention,
        max_rows=8, max_blocks=64, scratch_block=scratch[0],
    )  # fmt: skip
    for llm in (eager, static):
        for name in ADAPTERS:
            llm.add_adapter(name, SAMPLES / name)
    prompts = [eager.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[:3]]
    adapters = [*ADAPTERS, None]
    params = SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True
    )  # two decode steps: enough, and slow on a CPU
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, adapters=adapters, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in static.generate(prompts, params, adapters=adapters, use_tqdm=False)]
    assert got == expected
    scratch_kv = runner.pool.kv_cache[scratch[0]]
    assert scratch_kv.abs().sum() > 0, "the padding rows wrote to the scratch block, and nowhere else"
