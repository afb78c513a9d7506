"""Phi-3, Phi-3.5 and Phi-4-mini: Llama whose checkpoint (and PEFT adapters) fuse q/k/v into
`qkv_proj` and gate/up into `gate_up_proj`; their LongRoPE and Phi-4-mini's partial rotary are the
rotary's (rope.py)."""

from __future__ import annotations

from transformers import PretrainedConfig

from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families.hf_config import base_spec, require

FUSED = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def read(config: PretrainedConfig) -> DecoderSpec:
    require(config, "hidden_act", "silu")
    return base_spec(config, fused_projections=FUSED)
