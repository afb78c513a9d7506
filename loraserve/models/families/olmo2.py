"""OLMo 2: the blocks read the residual stream itself and their outputs are normalized before they
join it (no norm before a block); q and k RMS-normalized over all heads together."""

from __future__ import annotations

from transformers import PretrainedConfig

from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families.hf_config import base_spec, require


def read(config: PretrainedConfig) -> DecoderSpec:
    require(config, "hidden_act", "silu")
    return base_spec(config, norms="post", qk_norm="all")
