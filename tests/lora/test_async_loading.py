"""A slow adapter load never stops the running batch: decodes continue while it is in flight."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loraserve import SamplingParams
from loraserve.lora.adapter import LoraAdapter
from loraserve.resources import SAMPLE_ADAPTERS

pytestmark = pytest.mark.slow

SAMPLES = SAMPLE_ADAPTERS


def test_decode_steps_continue_while_an_adapter_loads_and_the_late_answer_is_right(make_llm):
    reference = make_llm(max_loras=1)
    reference.add_adapter("robot", SAMPLES / "robot")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (expected,) = reference.generate("Hello robot,", greedy, adapters=["robot"], use_tqdm=False)

    engine = make_llm(max_loras=1).engine
    release = threading.Event()
    read = engine.adapters._read

    def slow_read(path: Path) -> LoraAdapter:
        release.wait(timeout=60)
        return read(path)

    engine.adapters._read = slow_read
    engine.register_adapter("robot", SAMPLES / "robot", sha256=None)
    engine.add_request("base", "Once upon a time", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()  # the base prompt
    engine.add_request("adapted", "Hello robot,", greedy, adapter="robot")
    base_tokens = []
    for _ in range(5):
        for output in engine.step():
            assert output.request_id == "base", "the adapted request waits for its weights"
            base_tokens.append(len(output.outputs[0].token_ids))
    assert base_tokens == [2, 3, 4, 5, 6], "one decode step after another while the load is in flight"
    assert engine.adapters.residency("robot") == "disk"
    release.set()
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["adapted"].outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.stats().adapter_loads == 1
