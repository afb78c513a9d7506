"""The per-layer ops of the model, as torch ops: the reference each platform's fused ops
(cpu/layer_ops.py, cuda/layer_ops.py) compute in one pass each, and what the model runs where a
platform has none for its dtype. A wrong call fails here, with the reason, not inside a kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraserve.models.rope import apply_rotary


class LayerOps:
    """Residual add + RMSNorm, SiLU * up (GELU * up), and rotary + K/V cache write, in torch."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(x + residual), x + residual); the sum is written into `residual`.
        Without a residual: (weight * rms_norm(x), x)."""
        if residual is not None:
            x = residual.add_(x)
        # As transformers computes it: normalize in float32, scale in the model dtype. F.rms_norm
        # on the float32 copy gives bit for bit transformers' x * rsqrt(mean(x^2) + eps) in one op
        # instead of five (on bfloat16 itself it would normalize in bfloat16: other answers).
        normalized = F.rms_norm(x.float(), weight.shape, eps=eps)
        return weight * normalized.to(x.dtype), x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
        gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma): [T, 2I] -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""
        gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary_store_kv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] rows: q heads, k heads, v heads; q rotated in place
        cos: torch.Tensor,  # [T, D], or [T, R < D]: partial rotary, on the first R dimensions only
        sin: torch.Tensor,
        num_heads: int,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], each block contiguous
        v_cache: torch.Tensor,
        slot_blocks: torch.Tensor,  # [T] int64
        slot_offsets: torch.Tensor,  # [T] int64
    ) -> None:
        """Rotary on the q and k heads, k and v written to their cache slots."""
        check_rotary_store_kv(qkv, cos, sin, num_heads, k_cache, v_cache, slot_blocks, slot_offsets, partial=True)
        heads = qkv.view(qkv.shape[0], -1, k_cache.shape[3])  # [T, Hq + 2 Hkv, D]
        num_kv_heads = k_cache.shape[2]
        rotated = apply_rotary(heads[:, : num_heads + num_kv_heads], cos, sin)
        heads[:, :num_heads] = rotated[:, :num_heads]
        slots = (slot_blocks, slot_offsets)
        k_cache.index_put_(slots, rotated[:, num_heads:])
        v_cache.index_put_(slots, heads[:, num_heads + num_kv_heads :])


def check_rotary_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    partial: bool = False,
) -> None:
    """What every implementation of `rotary_store_kv` requires of its arguments; `partial`: cos and sin
    may cover fewer dimensions than the head (the torch implementation's partial rotary)."""
    rows = qkv.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError("qkv rows must hold the q, k and v heads contiguously")
    rotary_dim = cos.shape[1] if partial and cos.dim() == 2 and 0 < cos.shape[1] <= head_dim else head_dim
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (rows, rotary_dim)):
        raise ValueError("cos and sin must be contiguous [T, head_dim]")
    if k_cache.stride() != v_cache.stride() or not k_cache[0].is_contiguous():
        raise ValueError("K and V blocks must be contiguous and laid out alike")
    if not (qkv.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("qkv, cos, sin and the caches must share one dtype")
    if slot_blocks.dtype != torch.int64 or slot_offsets.dtype != torch.int64 or len(slot_blocks) != rows:
        raise ValueError("slot blocks and offsets must be int64, one per token")
