"""Qwen3: Llama with q and k RMS-normalized per head before the rotary."""

from __future__ import annotations

from transformers import PretrainedConfig

from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families.hf_config import base_spec, require


def read(config: PretrainedConfig) -> DecoderSpec:
    require(config, "hidden_act", "silu")
    return base_spec(config, qk_norm="head")
