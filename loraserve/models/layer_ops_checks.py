"""What the fused per-layer ops (cpu_layer_ops.py, cuda_layer_ops.py) require of their arguments:
a wrong call fails here, with the reason, not inside a kernel."""

from __future__ import annotations

import torch


def check_rotary_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
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
