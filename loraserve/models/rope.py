"""Rotary position embeddings with the config's scaling, as a cos/sin table indexed by position."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from loraserve.errors import ModelLoadError

# Scalings whose frequencies depend on the current sequence length are not a fixed table.
_LENGTH_DEPENDENT = {"dynamic", "longrope"}


class RotaryEmbedding:
    """cos/sin for every position up to the context window, computed once like transformers does."""

    def __init__(
        self, config: PretrainedConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: str
    ) -> None:
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT:
            raise ModelLoadError(f"rope_type {rope_type!r} is not supported (its frequencies change with length)")
        if rope_type == "default":
            base = params["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            attention_scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        else:
            raise ModelLoadError(f"unknown rope_type {rope_type!r}")
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(device=device, dtype=dtype)  # [max_positions, head_dim]
        self.sin = (emb.sin() * attention_scaling).to(device=device, dtype=dtype)  # [max_positions, head_dim]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim], cos and sin [T, head_dim]; the rotate-half convention of HF Llama checkpoints."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
