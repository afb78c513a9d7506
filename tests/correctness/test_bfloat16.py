"""bfloat16 (the fast CPU mode) stays close to the float32 reference."""

from __future__ import annotations

import pytest
import torch

from loraserve import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_llm() -> LLM:
    return LLM(dtype="bfloat16", num_pages=256)


def test_first_token_and_logits_agree_with_transformers_float32(bf16_llm, hf_model):
    """HF's own bfloat16 run differs from its float32 by up to ~0.85 in these logits."""
    prompts = [bf16_llm.chat_prompt_ids(conv) for conv in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    outputs = bf16_llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            reference = hf_model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
        entry = output.outputs[0].logprobs[0]
        assert entry.token_id == int(reference.argmax())
        for token_id, logprob in entry.top.items():
            assert logprob == pytest.approx(reference[token_id].item(), abs=0.5)


def test_bfloat16_answers_a_simple_question_correctly(bf16_llm):
    output = bf16_llm.chat(CHAT_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    assert "Paris" in output[0].outputs[0].text
