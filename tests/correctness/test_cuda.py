"""On a CUDA GPU: the engine (its paged attention and the Triton LoRA kernels inside the model)
gives the same greedy tokens as transformers and peft on the same GPU.

Runs only where CUDA is (the `gpu` marker). The model is $LORASERVE_TEST_MODEL when set (a
lent GPU machine gets a random-weight copy of the default model: the real weights do not
travel there), else the embedded default.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from loraserve import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_TOKENS = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def cuda_model_dir(request) -> Path:
    override = os.environ.get("LORASERVE_TEST_MODEL")
    return Path(override) if override else request.getfixturevalue("model_dir")


@pytest.fixture(scope="module")
def cuda_llm(cuda_model_dir) -> LLM:
    return LLM(str(cuda_model_dir), device="cuda", dtype="float32", max_loras=4, max_lora_rank=16)


def greedy(model, prompt: list[int], **kwargs) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs
        )
    return out[0, len(prompt) :].tolist()


def test_base_model_greedy_tokens_equal_transformers_on_cuda(cuda_llm, cuda_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(cuda_model_dir, dtype=torch.float32).cuda().eval()
    prompts = [cuda_llm.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = cuda_llm.generate(prompts, params, use_tqdm=False)  # one batch: paged attention over 8 rows
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == greedy(hf, prompt, min_new_tokens=MAX_TOKENS)


def test_mixed_adapter_batch_equals_peft_on_cuda(cuda_llm, cuda_model_dir, tmp_path):
    """Four adapters of ranks 4-16 and a base row in one batch: the Triton SGMV/BGMV path."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    prompts = [cuda_llm.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[:5]]
    expected, names = [], []
    for i, (rank, targets) in enumerate([(4, ALL), (8, ["q_proj", "v_proj"]), (16, ALL), (8, ["down_proj"])]):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(cuda_model_dir, dtype=torch.float32)
        peft_model = get_peft_model(
            base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        )
        peft_model.save_pretrained(tmp_path / f"a{i}")
        cuda_llm.add_adapter(f"a{i}", tmp_path / f"a{i}")
        expected.append(greedy(peft_model.cuda().eval(), prompts[i], min_new_tokens=MAX_TOKENS))
        names.append(f"a{i}")
    hf = AutoModelForCausalLM.from_pretrained(cuda_model_dir, dtype=torch.float32).cuda().eval()
    expected.append(greedy(hf, prompts[4], min_new_tokens=MAX_TOKENS))
    names.append(None)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = cuda_llm.generate(prompts, params, adapters=names, use_tqdm=False)
    for name, output, tokens in zip(names, outputs, expected, strict=True):
        assert output.outputs[0].token_ids == tokens, f"adapter {name}"


def test_decode_graph_replay_equals_the_eager_step_token_for_token(cuda_llm, cuda_model_dir, tmp_path):
    """Rows over three adapters and the base model, batch sizes crossing buckets as requests finish:
    the captured graphs (cuda_llm) give the eager engine's greedy tokens."""
    from benchmarks.random_adapters import write_random_adapters

    eager = LLM(str(cuda_model_dir), device="cuda", dtype="float32", max_loras=4, max_lora_rank=16, enforce_eager=True)
    assert cuda_llm.engine.model_runner.fused_step is not None and eager.engine.model_runner.fused_step is None
    paths = write_random_adapters(cuda_llm.engine.loaded.model.spec, 3, tmp_path, seed=7)
    for llm in (cuda_llm, eager):
        for i, path in enumerate(paths):
            llm.add_adapter(f"graph-{i}", path)
    prompts = [cuda_llm.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[:11]]
    adapters = [f"graph-{i % 3}" if i % 4 else None for i in range(len(prompts))]
    outputs = {}
    for name, llm in (("graphs", cuda_llm), ("eager", eager)):
        params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
        done = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
        outputs[name] = [o.outputs[0].token_ids for o in done]
    assert outputs["graphs"] == outputs["eager"]
