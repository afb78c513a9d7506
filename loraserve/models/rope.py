"""Rotary position embeddings with the config's scaling, as a cos/sin table indexed by position.

LongRoPE (Phi-3, Phi-4-mini) has two tables: transformers rotates with the short factors while the
sequence is within `original_max_position_embeddings` and with the long ones once it is past it
(`max(position_ids) + 1` of the forward). Each row here makes that choice by its own end in this
step, which is that rule for every row of a batch.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from loraserve.errors import ModelLoadError

# Frequencies recomputed from the sequence length at every step: not a table.
_UNSERVED = {"dynamic"}


class RotaryEmbedding:
    """cos/sin for every position up to the context window, computed once like transformers does.

    `layer_type`: the key of `config.rope_parameters` where the config holds one set per kind of
    layer (Gemma 3: "full_attention", "sliding_attention"); None where it holds one."""

    def __init__(
        self,
        config: PretrainedConfig,
        layer_type: str | None,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        if layer_type is not None:
            params = params[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type in _UNSERVED:
            raise ModelLoadError(f"rope_type {rope_type!r} is not supported (its frequencies change at every step)")
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        cpu = torch.device("cpu")
        self.long_after: int | None = None  # LongRoPE: rows ending past this read the long table
        if rope_type == "default":
            base = params["rope_theta"]
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
            inv_freqs, attention_scaling = [1.0 / (base**exponents)], 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            init = ROPE_INIT_FUNCTIONS[rope_type]
            inv_freq, attention_scaling = init(config, cpu, layer_type=layer_type)
            inv_freqs = [inv_freq]
            if rope_type == "longrope":
                self.long_after = params["original_max_position_embeddings"]
                inv_freqs.append(init(config, cpu, seq_len=self.long_after + 1, layer_type=layer_type)[0])
        else:
            raise ModelLoadError(f"unknown rope_type {rope_type!r}")
        self.max_positions = max_positions
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.cat([positions[:, None] * inv_freq.float()[None, :] for inv_freq in inv_freqs])
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_positions (x 2 with LongRoPE: short, then long), rotary_dim]
        self.cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * attention_scaling).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor, row_ends: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rotary_dim] of the tokens at `positions`; `row_ends` [T]: the end (last position
        + 1) of each token's row in this step, which LongRoPE's choice of table needs."""
        if self.long_after is not None:
            assert row_ends is not None, "LongRoPE reads each row's end"
            positions = positions + torch.where(row_ends > self.long_after, self.max_positions, 0)
        return self.cos[positions], self.sin[positions]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], cos and sin [T, rotary_dim]; the rotate-half convention of HF checkpoints,
    on the first rotary_dim dimensions (partial rotary: the rest pass through)."""
    rotary_dim = cos.shape[-1]
    rotary, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rotary[..., half:], rotary[..., :half]), dim=-1)
    out = rotary * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
    return out if rotary_dim == x.shape[-1] else torch.cat((out, passed), dim=-1)
