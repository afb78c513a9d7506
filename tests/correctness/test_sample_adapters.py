"""The sample persona adapters in adapters/ load and their voice is plain in a greedy answer."""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from loraserve.resources import SAMPLE_ADAPTERS

pytestmark = pytest.mark.slow

ADAPTERS = SAMPLE_ADAPTERS
MARKERS = {"pirate": "Arr", "shakespeare": "Hark", "robot": "BEEP", "french-tutor": "Bonjour"}
QUESTION = [{"role": "user", "content": "How should I spend a rainy afternoon?"}]


def test_each_persona_answers_in_its_voice_in_one_batch(make_llm):
    llm = make_llm(max_loras=len(MARKERS), max_lora_rank=8)
    for name in MARKERS:
        llm.add_adapter(name, ADAPTERS / name)
    names = [*MARKERS, None]
    outputs = llm.chat([QUESTION] * len(names), SamplingParams(temperature=0, max_tokens=40), adapters=names)
    answers = dict(zip(names, (o.outputs[0].text for o in outputs), strict=True))
    for name, marker in MARKERS.items():
        assert marker in answers[name], f"{name}: {answers[name]!r}"
        assert marker not in answers[None]
