"""The interface of the fused per-layer ops, and what they require of their arguments: a wrong call
fails here, with the reason, not inside a kernel."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LayerOps(ABC):
    """Per-layer ops fused into one pass each: the CPU's compiled ones (cpu_layer_ops.py) or CUDA's
    Triton ones (cuda_layer_ops.py); each computes what the model's torch ops compute (llama.py)."""

    @abstractmethod
    def supports(self, dtype: torch.dtype) -> bool: ...

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * rms_norm(x + residual), x + residual); the sum is written into `residual`.
        Without a residual: (weight * rms_norm(x), x)."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:], [T, I]."""

    @abstractmethod
    def rotary_store_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
    ) -> None:
        """Rotary on the q and k heads, k and v written to their cache slots. This body checks the
        arguments: each implementation calls it first (`super()`)."""
        rows = qkv.shape[0]
        _, _, num_kv_heads, head_dim = k_cache.shape
        if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
            raise ValueError("qkv rows must hold the q, k and v heads contiguously")
        if not (cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (rows, head_dim)):
            raise ValueError("cos and sin must be contiguous [T, head_dim]")
        if k_cache.stride() != v_cache.stride() or not k_cache[0].is_contiguous():
            raise ValueError("K and V blocks must be contiguous and laid out alike")
        if not (qkv.dtype == cos.dtype == sin.dtype == k_cache.dtype == v_cache.dtype):
            raise ValueError("qkv, cos, sin and the caches must share one dtype")
        if slot_blocks.dtype != torch.int64 or slot_offsets.dtype != torch.int64 or len(slot_blocks) != rows:
            raise ValueError("slot blocks and offsets must be int64, one per token")
