"""A decode step in one native call (models/cpu/decode_step.py) gives the layer-by-layer step's
results bit for bit: the same tokens and the same log-probs, over a batch mixing adapters and
the base model, for every weights mode it serves (bfloat16 compute and weights where the kernel
has bfloat16 dot products), in the build for this CPU and the AVX2 one; with biases and Qwen3's q/k
norms; and a step it cannot serve (a DoRA adapter's row) runs layer by layer."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from loraserve import LLM, SamplingParams
from loraserve.models.cpu.decode_step import CpuDecodeStep
from loraserve.models.dtypes import cpu_has_bf16_dot_products
from loraserve.resources import SAMPLE_ADAPTERS
from sgmv_kernels.build import MARCH_VARIABLE
from tests.conftest import CHAT_PROMPTS
from tests.kernels.test_cpu_linear import MARCHES

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # our OpenMP kernels over their threads

ADAPTERS = ["pirate", None, "robot", "pirate"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


class CountingStep:
    """Counts the steps the native call served, and the adapter slots their rows used."""

    def __init__(self, step) -> None:
        self.step, self.served, self.slots = step, 0, set()

    def run(self, rows):
        hidden = self.step.run(rows)
        if hidden is not None:
            self.served += 1
            self.slots |= {slot for slot in rows.lora_slots if slot >= 0}
        return hidden


def both_ways(llm: LLM, prompts, adapters) -> tuple[list, list, CountingStep]:
    """(outputs with the native step, outputs layer by layer, what the native call served)."""
    runner = llm.engine.model_runner
    step = runner.fused_step
    assert isinstance(step, CpuDecodeStep), "this mode's decode steps should be one native call"
    # Adapters loaded first: a cold one's rows wait while the others decode, so a first run batches
    # differently, and AMX tiles (8 rows and more) sum in another order than a small batch's vectors.
    llm.generate(prompts, PARAMS, adapters=adapters, use_tqdm=False)
    counting = runner.fused_step = CountingStep(step)
    native = llm.generate(prompts, PARAMS, adapters=adapters, use_tqdm=False)
    runner.fused_step = None
    layered = llm.generate(prompts, PARAMS, adapters=adapters, use_tqdm=False)
    runner.fused_step = step
    return native, layered, counting


def tokens_and_logprobs(outputs) -> list:
    return [(c.token_ids, [(p.logprob, p.top) for p in c.logprobs]) for o in outputs for c in o.outputs]


@pytest.mark.parametrize(
    "dtype, weights, march",
    [("float32", "int8", m) for m in MARCHES] + [("float32", "bfloat16", m) for m in MARCHES]
    + [("bfloat16", "int8", "native")]
    + [pytest.param("bfloat16", "bfloat16", "native", marks=pytest.mark.skipif(
        not cpu_has_bf16_dot_products(), reason="bfloat16 weights go to our kernel with AVX512-BF16 (and AMX tiles)"
    ))]
    + [pytest.param("float32", "bfloat16-dot", "native", marks=pytest.mark.skipif(
        not cpu_has_bf16_dot_products(), reason="bfloat16 dot products need AVX512-BF16"
    ))],
)  # fmt: skip
def test_native_step_gives_the_layered_steps_bits_over_mixed_adapters(dtype, weights, march, monkeypatch):
    monkeypatch.setenv(MARCH_VARIABLE, march)
    llm = LLM(dtype=dtype, weights=weights, num_pages=256, max_loras=2, prefix_caching=False)
    for name in ("pirate", "robot"):
        llm.add_adapter(name, SAMPLE_ADAPTERS / name)
    prompts = [llm.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[: len(ADAPTERS)]]
    native, layered, served = both_ways(llm, prompts, ADAPTERS)
    llm.engine.close()
    assert served.served == PARAMS.max_tokens - 1  # every step after the prompts'
    assert tokens_and_logprobs(native) == tokens_and_logprobs(layered)


TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.5,
)  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [Qwen2Config(**TINY), Qwen3Config(**TINY, head_dim=16), LlamaConfig(**TINY, attention_bias=True, mlp_bias=True)],
    ids=["qwen2-qkv-biases", "qwen3-qk-norms", "llama-all-biases"],
)
def test_native_step_takes_the_families_it_covers(config, model_dir, tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, tmp_path / name)
    llm = LLM(str(tmp_path), dtype="float32", weights="bfloat16", num_pages=64)
    prompts = [[5, 17, 300, 4000, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 123]]
    native, layered, served = both_ways(llm, prompts, None)
    llm.engine.close()
    assert served.served == PARAMS.max_tokens - 1
    assert tokens_and_logprobs(native) == tokens_and_logprobs(layered)


def test_a_dora_row_sends_its_step_layer_by_layer(model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dora = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, dora).save_pretrained(tmp_path)
    llm = LLM(dtype="float32", weights="int8", num_pages=256, max_loras=2, prefix_caching=False)
    llm.add_adapter("dora", tmp_path)
    llm.add_adapter("pirate", SAMPLE_ADAPTERS / "pirate")
    prompts = [llm.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[:2]]
    native, layered, served = both_ways(llm, prompts, ["dora", "pirate"])
    dora_slot = llm.engine.adapters.record("dora").slot
    only_pirate = both_ways(llm, prompts[1:], ["pirate"])
    llm.engine.close()
    assert dora_slot not in served.slots, "a step with a DoRA row ran natively"
    assert tokens_and_logprobs(native) == tokens_and_logprobs(layered)
    assert only_pirate[2].served == PARAMS.max_tokens - 1  # the same adapters' tables, no DoRA row: native
