"""Blocks behind a sliding window go back to the pool, end to end: a tiny random Mistral whose every layer
attends to the last 8 positions gives transformers' greedy tokens far past its window while the pages of
the blocks behind it are taken again by other sequences, and six sequences run together from first token
to last in pages that would hold one without the release."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from loraserve import LLM, SamplingParams
from loraserve.engine.stats import json_view
from loraserve.server.metrics import Metrics
from tests.correctness.test_model_families import TOKENIZER_FILES

pytestmark = pytest.mark.slow

WINDOW, BLOCK_SIZE, MAX_TOKENS = 8, 4, 60
PROMPTS = [
    [5, 17, 300, 4000, 12, 7, 99, 1000, 31, 64, 2],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 123],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [1234, 4321, 77, 88, 99, 11, 22, 33, 44, 55, 66],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
    [2000, 2001, 2002, 7, 7, 7, 300, 301, 302, 8, 9],
]
# A sequence holds at most 3 blocks of 4: the two its next token's window reaches, and the one it writes. Six
# fill the pages that one sequence's 71 tokens take without the release (the engine refuses a request whose
# tokens would not fit the pool: preempted, it is computed again from its first token). Full, the pool gives
# each block released to the next sequence that needs one at once: one released early would be overwritten.
NUM_PAGES = 3 * len(PROMPTS)


@pytest.fixture(scope="module")
def checkpoint(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A random Mistral v0.1 with sliding_window 8 on both layers, saved with the embedded model's tokenizer."""
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW,
        initializer_range=0.5,  # the default 0.02 repeats one token: a comparison without teeth
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("windowed") / "model"
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path, model


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_sequences_far_past_the_window_give_transformers_tokens_together_in_the_pages_of_one(checkpoint):
    path, model = checkpoint
    expected = [_greedy(model, prompt) for prompt in PROMPTS]
    assert all(len(set(tokens)) > 10 for tokens in expected), "repeating tokens: the comparison would have no teeth"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_pages=NUM_PAGES, block_size=BLOCK_SIZE) as llm:
        engine = llm.engine
        assert engine.block_manager.blocks_for_tokens(len(PROMPTS[0]) + MAX_TOKENS) == NUM_PAGES
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, params)
        outputs, running = {}, []
        while engine.has_unfinished_requests():
            outputs.update({out.request_id: out.outputs[0].token_ids for out in engine.step() if out.finished})
            running.append(engine.stats().running_sequences)
        stats = engine.stats()
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == expected
    assert running == [len(PROMPTS)] * (MAX_TOKENS - 1) + [0] and stats.preemptions == 0, "all together, each step"
    assert stats.released_behind_window > 0
    assert json_view(stats)["pages"]["released_behind_window"] == stats.released_behind_window  # /admin/pool
    metrics = Metrics().render(stats).decode()
    assert f"loraserve_kv_blocks_released_behind_window {float(stats.released_behind_window)}" in metrics
