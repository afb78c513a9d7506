"""A row that raises inside a step ends only its own request; the batch and the engine go on.

The other rows' greedy tokens still equal transformers', the failed request's blocks are
freed, and the same prompt computed afterwards is unharmed by what the failed step wrote.
"""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from loraserve.engine import LLMEngine, RequestOutput
from loraserve.engine.outputs import STEP_FAILED
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 40  # as the base-model equivalence tests: their transformers references are reused
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return [llm.chat_prompt_ids(conv) for conv in CHAT_PROMPTS]


@pytest.fixture(scope="module")
def references(prompts, hf_greedy) -> list[list[int]]:
    return [hf_greedy(prompt, MAX_TOKENS) for prompt in prompts]


def run(engine: LLMEngine, requests: dict[str, list[int]], params: SamplingParams, fail: str, after_steps: int):
    """Run every request to the end; from step `after_steps` on, computing request `fail` raises."""
    for request_id, prompt in requests.items():
        engine.add_request(request_id, prompt, params)
    finished: dict[str, RequestOutput] = {}
    steps = 0
    try:
        while engine.has_unfinished_requests():
            if steps == after_steps:
                engine.model_runner.faults.failing_request_ids.add(fail)
            finished |= {o.request_id: o for o in engine.step() if o.finished}
            steps += 1
    finally:
        engine.model_runner.faults.failing_request_ids.clear()
    return finished


@pytest.mark.parametrize("after_steps", [0, 3], ids=["in-its-prompt-step", "mid-decode"])
def test_a_row_that_raises_ends_its_request_and_the_other_15_finish_exactly(make_llm, prompts, references, after_steps):
    engine = make_llm().engine
    requests = {f"r{i}": prompt for i, prompt in enumerate(prompts)}
    finished = run(engine, requests, GREEDY, fail="r5", after_steps=after_steps)

    failed = finished.pop("r5")
    assert failed.error is not None and failed.error.code == STEP_FAILED
    assert "fault injected for request 'r5'" in failed.error.message
    assert [c.finish_reason for c in failed.outputs] == ["error"]
    expected = {f"r{i}": reference for i, reference in enumerate(references) if i != 5}
    assert {rid: o.outputs[0].token_ids for rid, o in finished.items()} == expected
    stats = engine.stats()
    assert stats.failed_requests == 1 and stats.failed_steps >= 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "every block came back"

    # What the failed step wrote to the cache harms nobody: the same prompt again is exact.
    (again,) = run(engine, {"again": prompts[5]}, GREEDY, fail="none", after_steps=0).values()
    assert again.outputs[0].token_ids == references[5]


def test_a_failing_request_with_n_completions_ends_whole_and_its_neighbours_go_on(make_llm, prompts, references):
    engine = make_llm().engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=3)
    finished = run(engine, {"forked": prompts[0], "plain": prompts[1]}, params, fail="forked", after_steps=2)
    assert [c.finish_reason for c in finished["forked"].outputs] == ["error"] * 3
    assert [c.token_ids for c in finished["plain"].outputs] == [references[1]] * 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
