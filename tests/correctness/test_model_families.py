"""Every model family served gives transformers' greedy tokens (base rows) and transformers + peft's
(adapter rows, a random LoRA and a DoRA on every projection as PEFT names them) in one mixed batch: tiny random
checkpoints saved with `save_pretrained`, float32, on the generic path and with 16-bit weights
(against transformers on the same rounded weights). Prompts and generations run past the sliding
windows, and past Phi's original context (LongRoPE's switch to its long factors)."""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
)

from loraserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_TOKENS = 20
WINDOW = 8
PROMPTS = [[5, 17, 300, 4000, 12, 7, 99, 1000, 31, 64, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 123, 77, 5, 6]]
SHAPES = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, initializer_range=0.5, max_position_embeddings=128,
)  # fmt: skip
SEPARATE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
# Gemma's sqrt(hidden)-scaled, tied embedding at N(0, 0.5) drowns every layer: each prompt's last token repeats.
GEMMA_SHAPES = {**SHAPES, "initializer_range": 0.02, "head_dim": 16}


@dataclass(frozen=True)
class Family:
    config: PretrainedConfig
    targets: list[str]  # the modules PEFT adapts, as the family names them


FAMILIES = {
    "qwen3": Family(Qwen3Config(**SHAPES, head_dim=16), SEPARATE),
    "gemma2": Family(
        Gemma2Config(
            **GEMMA_SHAPES, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=LAYER_TYPES,
            attn_logit_softcapping=0.5, final_logit_softcapping=0.2,
        ),
        SEPARATE,
    ),
    "gemma3": Family(
        Gemma3TextConfig(
            **GEMMA_SHAPES, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
        SEPARATE,
    ),
    "phi4-mini": Family(  # LongRoPE, partial rotary, every layer windowed, fused modules
        Phi3Config(
            **SHAPES, sliding_window=WINDOW, pad_token_id=0,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 16,
                "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 3.0], "long_factor": [1.0, 1.5, 2.0, 4.0, 8.0, 16.0],
            },
        ),
        ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    ),
    "granite": Family(
        GraniteConfig(
            **SHAPES, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
            logits_scaling=8.0,
        ),
        SEPARATE,
    ),
    "olmo2": Family(Olmo2Config(**SHAPES), SEPARATE),
    "mistral-v0.1": Family(MistralConfig(**SHAPES, sliding_window=WINDOW), SEPARATE),
    "llama-biases": Family(LlamaConfig(**SHAPES, attention_bias=True, mlp_bias=True), SEPARATE),
}  # fmt: skip


ADAPTERS = {"lora": dict(r=8, lora_alpha=16), "dora": dict(r=4, lora_alpha=8, use_rslora=True, use_dora=True)}


@dataclass
class Checkpoint:
    path: Path
    base: torch.nn.Module  # transformers' model
    adapters: dict[str, tuple[Path, torch.nn.Module]]  # name -> (its directory, peft's model)


def _checkpoint(family: Family, model_dir: Path, tmp_path: Path) -> Checkpoint:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(family.config, dtype=torch.float32).eval()
    path = tmp_path / "model"
    base.save_pretrained(path, max_shard_size="2MB")  # sharded, with model.safetensors.index.json
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    adapters = {}
    for name, settings in ADAPTERS.items():
        peft_base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        config = LoraConfig(target_modules=family.targets, init_lora_weights=False, **settings)
        adapted = get_peft_model(peft_base, config)
        with torch.no_grad():  # B as large as the base weights would drown them; DoRA's m moved off the norms
            for parameter_name, param in adapted.named_parameters():
                if "lora_B" in parameter_name:
                    param.mul_(0.3)
                if "lora_magnitude_vector" in parameter_name:
                    param.mul_(1 + 0.1 * torch.randn_like(param))
        adapters[name] = (tmp_path / name, adapted.eval())
        adapted.save_pretrained(tmp_path / name)
    return Checkpoint(path, base, adapters)


def _greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # the mask given: generate would mask out a prompt token equal to pad_token_id
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
            do_sample=False,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


ROWS = [None, *ADAPTERS]  # each prompt's rows: the base model, then each adapter


def _mixed_batch(llm: LLM, rows: list[str | None] = ROWS) -> list[list[int]]:
    """Each prompt as a base row and as each adapter's row, in one batch."""
    prompts = [prompt for prompt in PROMPTS for _ in rows]
    adapters = rows * len(PROMPTS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def _rounded(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every base weight rounded to bfloat16 and held in float32 again (adapters are
    served in float32 whatever holds the base weights)."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in rounded.named_parameters():
            if "lora_" not in name:
                parameter.copy_(parameter.bfloat16().float())
    return rounded


@pytest.mark.parametrize("name", FAMILIES)
def test_family_gives_transformers_and_peft_tokens_in_one_mixed_batch(name, model_dir, tmp_path):
    checkpoint = _checkpoint(FAMILIES[name], model_dir, tmp_path)
    models = [checkpoint.base, *(model for _, model in checkpoint.adapters.values())]
    expected = [_greedy(model, prompt) for prompt in PROMPTS for model in models]
    for row, adapter in enumerate(ROWS[1:], start=1):
        assert expected[row::3] != expected[::3], f"{adapter} changes no answer: the comparison would have no teeth"
    with LLM(str(checkpoint.path), dtype="float32", num_pages=64, max_lora_rank=8) as llm:
        for adapter, (path, _) in checkpoint.adapters.items():
            llm.add_adapter(adapter, path)
        assert _mixed_batch(llm) == expected
    # 16-bit weights: transformers + peft on the same rounded weights. DoRA's rows are left out: their
    # norms ||W + s B A|| take ||W|| from the weights as loaded, before rounding (lora/dora.py).
    rounded = [_rounded(model) for model in models[:2]]
    with LLM(str(checkpoint.path), dtype="float32", weights="bfloat16", num_pages=64, max_lora_rank=8) as llm:
        llm.add_adapter("lora", checkpoint.adapters["lora"][0])
        assert _mixed_batch(llm, ROWS[:2]) == [_greedy(model, prompt) for prompt in PROMPTS for model in rounded]
