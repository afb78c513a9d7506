"""What a base model is to the one decoder (decoder.py): its shapes, and the few ways the families
we serve depart from Llama's forward. Each family's file (families/) reads its HF config into one
of these; the decoder reads nothing else.

The departures, and who takes them:
- norms: "pre" (Llama: a norm before each block), "sandwich" (Gemma: before and after each block),
  "post" (OLMo 2: after each block only); `norm_weight_offset` 1 where a checkpoint stores w - 1 (Gemma).
- qk_norm: RMSNorm of q and k before the rotary, per head ("head": Qwen3, Gemma 3) or over all heads
  together ("all": OLMo 2).
- activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU).
- scales: the attention scale (Gemma's query_pre_attn_scalar, Granite's multiplier), the embedding's
  (Gemma's sqrt(hidden), Granite's), each block's output before it joins the stream (Granite), logits
  divided (Granite); tanh soft-capping of attention scores and logits (Gemma 2).
- layer_windows: per layer, the sliding window (the last W positions) or None (global attention).
- layer_ropes: per layer, which rotary table it reads (Gemma 3's local and global bases).
- fused_projections: modules the checkpoint (and PEFT) fuses, and the projections they hold (Phi-3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

NormPlacement = Literal["pre", "sandwich", "post"]
QkNorm = Literal["head", "all"] | None
Activation = Literal["silu", "gelu_tanh"]

# The projections LoRA adapts, in the order the decoder computes them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GLOBAL_ROPE = "global"
QK_NORMS_PER_HEAD = "q/k norms per head"  # a departure the CPU's fused decode step takes (cpu/decode_step.cpp)


@dataclass(frozen=True)
class DecoderSpec:
    """The shapes of a decoder-only model and its family's departures from Llama's forward."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norms: NormPlacement = "pre"
    norm_weight_offset: float = 0.0
    qk_norm: QkNorm = None
    activation: Activation = "silu"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attention_softcap: float | None = None
    logit_softcap: float | None = None
    logit_divisor: float = 1.0
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    layer_windows: tuple[int | None, ...] = ()  # () : every layer global
    layer_ropes: tuple[str, ...] = ()  # () : every layer reads GLOBAL_ROPE
    fused_projections: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (module, its projections)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else self.attention_scale

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`: it attends to the last `window` positions; None: all."""
        return self.layer_windows[layer] if self.layer_windows else None

    def rope(self, layer: int) -> str:
        return self.layer_ropes[layer] if self.layer_ropes else GLOBAL_ROPE

    @property
    def window_of_every_layer(self) -> int | None:
        """The window when every layer has the same one: KV behind it is never read again."""
        windows = {self.window(layer) for layer in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def sliding_window(self) -> int | None:
        """The (one) window of the windowed layers; None where no layer has one."""
        windows = {w for w in self.layer_windows if w is not None}
        assert len(windows) <= 1, "one window size per model"
        return windows.pop() if windows else None

    def module_projections(self) -> dict[str, tuple[str, ...]]:
        """Each module name of the HF checkpoint (and of PEFT's adapters) -> the projections it computes."""
        fused = dict(self.fused_projections)
        covered = {p for projections in fused.values() for p in projections}
        return {**{p: (p,) for p in PROJECTIONS if p not in covered}, **fused}

    def departures(self) -> list[str]:
        """How this family's layers depart from Llama's, in words: what a fused decode step must know
        (biases, the attention scale and what happens to the logits are the same code for every family)."""
        named = {
            "norms around the blocks": self.norms != "pre",
            QK_NORMS_PER_HEAD: self.qk_norm == "head",
            "q/k norms over all heads": self.qk_norm == "all",
            "GeGLU": self.activation != "silu",
            "attention soft-capping": self.attention_softcap is not None,
            "scaled embeddings or residuals": (self.embedding_scale, self.residual_scale) != (1.0, 1.0),
            "sliding windows": self.sliding_window is not None,
            "per-layer rotary bases": len(set(self.layer_ropes)) > 1,
        }
        return [name for name, departs in named.items() if departs]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype.itemsize
