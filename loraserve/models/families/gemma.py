"""Gemma 2 and Gemma 3 (text): a norm before and after each block, norm weights stored as w - 1, the
embedding scaled by sqrt(hidden), GeGLU, the attention scaled by query_pre_attn_scalar^-1/2, and
sliding-window layers between global ones (layer_types). Gemma 2 soft-caps attention scores and
logits; Gemma 3 normalizes q and k per head and gives its local layers their own rotary base."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families.hf_config import base_spec, require


def read_gemma2(config: PretrainedConfig) -> DecoderSpec:
    return _gemma(config)


def read_gemma3(config: PretrainedConfig) -> DecoderSpec:
    # The rotary tables are named by the layer types rope_parameters is keyed by.
    return _gemma(config, qk_norm="head", layer_ropes=tuple(config.layer_types))


def _gemma(config: PretrainedConfig, **departures: Any) -> DecoderSpec:
    require(config, "hidden_activation", "gelu_pytorch_tanh")
    require(config, "use_bidirectional_attention", False, None)  # the embedding models' bidirectional mask
    return base_spec(
        config,
        norms="sandwich",
        norm_weight_offset=1.0,
        activation="gelu_tanh",
        attention_scale=config.query_pre_attn_scalar**-0.5,
        embedding_scale=config.hidden_size**0.5,
        attention_softcap=config.attn_logit_softcapping,
        logit_softcap=config.final_logit_softcapping,
        **departures,
    )
