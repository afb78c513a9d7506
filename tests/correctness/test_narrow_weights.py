"""Weights narrower than the activations (--weights): bfloat16 weights with float32 compute give
transformers' greedy tokens on the same bfloat16-rounded weights upcast to float32, in the build for
this CPU and the AVX2 one; int8 stays close to float32."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.errors import ConfigError
from loraserve.models.cpu.linear import NarrowMatmul
from loraserve.models.dtypes import cpu_has_bf16_dot_products, resolve_weights
from sgmv_kernels.build import MARCH_VARIABLE
from tests.conftest import CHAT_PROMPTS, memoized_greedy
from tests.kernels.test_cpu_linear import MARCHES

MAX_TOKENS = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_bfloat16_greedy(hf_model) -> Callable[[list[int], int], list[int]]:
    """Greedy tokens of transformers' model with every weight rounded to bfloat16 and held in float32 again
    (memoized: every march compares with the same references)."""
    rounded = copy.deepcopy(hf_model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.bfloat16().float())
    return memoized_greedy(rounded)


@pytest.mark.parametrize("march", MARCHES)
def test_bfloat16_weights_give_transformers_tokens_on_the_rounded_weights(march, hf_bfloat16_greedy, monkeypatch):
    monkeypatch.setenv(MARCH_VARIABLE, march)
    llm = LLM(dtype="float32", weights="bfloat16", num_pages=256)
    assert llm.engine.loaded.weights == "bfloat16"
    narrow = llm.engine.loaded.model.lm_head.held
    assert isinstance(narrow, NarrowMatmul) and (march == "native" or narrow.kernel.int8_path == "avx2")
    prompts = [llm.chat_prompt_ids(conv) for conv in CHAT_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    llm.engine.close()
    assert [o.outputs[0].token_ids for o in outputs] == [hf_bfloat16_greedy(p, MAX_TOKENS) for p in prompts]


def test_auto_holds_bfloat16_weights_only_where_float32_compute_was_chosen_for_the_cpu():
    with_dot_products = "bfloat16-dot" if cpu_has_bf16_dot_products() else "bfloat16"
    assert resolve_weights("auto", "auto", torch.float32, "cpu") == with_dot_products
    assert resolve_weights("auto", "float32", torch.float32, "cpu") == "float32"  # asked for: exact
    assert resolve_weights("auto", "auto", torch.bfloat16, "cpu") == "bfloat16"
    assert resolve_weights("int8", "auto", torch.bfloat16, "cpu") == "int8"
    assert resolve_weights("bfloat16-dot", "bfloat16", torch.bfloat16, "cpu") == "bfloat16"  # the same products
    refused_here = [] if cpu_has_bf16_dot_products() else [("bfloat16-dot", torch.float32, "cpu")]
    for name, dtype, device in [
        ("float32", torch.bfloat16, "cpu"), ("int8", torch.bfloat16, "cuda"), ("int8", torch.float16, "cpu"),
        ("bfloat16-dot", torch.float16, "cpu"), *refused_here
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            resolve_weights(name, "auto", dtype, device)
        assert refused.value.field == "--weights"
