"""Granite (3.x): Llama with multipliers on the embedding, on each block's output as it joins the
stream and as the attention scale, and logits divided by `logits_scaling`."""

from __future__ import annotations

from transformers import PretrainedConfig

from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families.hf_config import base_spec, require


def read(config: PretrainedConfig) -> DecoderSpec:
    require(config, "hidden_act", "silu")
    return base_spec(
        config,
        attention_scale=config.attention_multiplier,
        embedding_scale=config.embedding_multiplier,
        residual_scale=config.residual_multiplier,
        logit_divisor=config.logits_scaling,
    )
