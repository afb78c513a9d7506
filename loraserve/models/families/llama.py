"""Llama (2, 3.x with its rope scaling), Mistral (v0.1's sliding window included), Qwen2 and SmolLM:
the decoder as it is. Qwen2 alone has biases on q, k and v (and none on o)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families.hf_config import base_spec, require


def read(config: PretrainedConfig) -> DecoderSpec:
    require(config, "hidden_act", "silu")
    spec = base_spec(config)
    return replace(spec, qkv_bias=True, o_bias=False) if config.model_type == "qwen2" else spec
