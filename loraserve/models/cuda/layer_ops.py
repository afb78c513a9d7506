"""The per-layer operations on CUDA as Triton kernels: residual add + RMSNorm, SiLU * up, and
rotary + K/V cache write, each one launch instead of four to eight torch ops.

At batch 1 a decode step of an 8B model is ~450 launches of tiny element-wise work beside
the matrix products; even replayed from a CUDA graph each costs a few microseconds. Each
kernel rounds where the torch ops it replaces round (the model dtype after every op), so
the results are the torch path's (tests/kernels/test_cuda_layer_ops.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.models.layer_ops import LayerOps, check_rotary_store_kv


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program per row: s = x + residual (rounded, written back as the new residual), then
    # weight * (s * rsqrt(mean(s^2) + eps)) with the norm in float32, as transformers computes it.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    total = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * hidden + cols, mask=mask, other=0.0)
        total = (total.to(tl.float32) + residual.to(tl.float32)).to(total.dtype)
        tl.store(residual_ptr + row * hidden + cols, total, mask=mask)
    s = total.to(tl.float32)
    normalized = s * tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normalized.to(total.dtype).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(total.dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
    # grid: (rows, cdiv(width, BLOCK)); silu rounded to the model dtype, then the product, as torch does
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * width + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def _rotate_half(x_ptr, cos_ptr, sin_ptr, HEAD_DIM: tl.constexpr):
    """(x * cos + rotate_half(x) * sin) of one head, each product and the sum rounded like torch's ops."""
    first, second = tl.arange(0, HEAD_DIM // 2), HEAD_DIM // 2 + tl.arange(0, HEAD_DIM // 2)
    x1, x2 = tl.load(x_ptr + first), tl.load(x_ptr + second)
    dtype = x1.dtype
    c1, c2 = tl.load(cos_ptr + first).to(tl.float32), tl.load(cos_ptr + second).to(tl.float32)
    s1, s2 = tl.load(sin_ptr + first).to(tl.float32), tl.load(sin_ptr + second).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = ((a1 * c1).to(dtype).to(tl.float32) + (-a2 * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((a2 * c2).to(dtype).to(tl.float32) + (a1 * s2).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2


@triton.jit
def _rotary_store_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, blocks_ptr, offsets_ptr,
    stride_qkv, stride_page, stride_slot, num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    # grid: (tokens, Hq + Hkv). A query head is rotated in place; a KV head's K is rotated and
    # written to the token's cache slot, and its V copied there.
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = qkv_ptr + token * stride_qkv
    cos, sin = cos_ptr + token * HEAD_DIM, sin_ptr + token * HEAD_DIM
    out1, out2 = _rotate_half(row + head * HEAD_DIM, cos, sin, HEAD_DIM)
    first, second = tl.arange(0, HEAD_DIM // 2), HEAD_DIM // 2 + tl.arange(0, HEAD_DIM // 2)
    if head < num_heads:
        tl.store(row + head * HEAD_DIM + first, out1)
        tl.store(row + head * HEAD_DIM + second, out2)
    else:
        kv_head = head - num_heads
        block = tl.load(blocks_ptr + token)
        slot = block * stride_page + tl.load(offsets_ptr + token) * stride_slot + kv_head * HEAD_DIM
        tl.store(k_cache_ptr + slot + first, out1)
        tl.store(k_cache_ptr + slot + second, out2)
        dims = tl.arange(0, HEAD_DIM)
        v = tl.load(row + (num_heads + num_kv_heads + kv_head) * HEAD_DIM + dims)
        tl.store(v_cache_ptr + slot + dims, v)


class CudaLayerOps(LayerOps):
    """The ops as Triton kernels, one launch each."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, hidden = x.shape
        if not x.is_contiguous() or (residual is not None and not residual.is_contiguous()):
            raise ValueError("x and residual must be contiguous [T, hidden]")
        out = torch.empty_like(x)
        _add_rms_norm_kernel[(rows,)](
            x, x if residual is None else residual, weight, out, hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        )  # fmt: skip
        return out, x if residual is None else residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            raise ValueError("gate_up must be contiguous [T, 2 * intermediate]")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block)
        return out

    def rotary_store_kv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] rows: q heads, k heads, v heads; q rotated in place
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        num_heads: int,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], each block contiguous
        v_cache: torch.Tensor,
        slot_blocks: torch.Tensor,  # [T] int64
        slot_offsets: torch.Tensor,  # [T] int64
    ) -> None:
        check_rotary_store_kv(qkv, cos, sin, num_heads, k_cache, v_cache, slot_blocks, slot_offsets)
        rows = qkv.shape[0]
        _, _, num_kv_heads, head_dim = k_cache.shape
        if rows == 0:
            return
        _rotary_store_kv_kernel[(rows, num_heads + num_kv_heads)](
            qkv, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets,
            qkv.stride(0), k_cache.stride(0), k_cache.stride(1), num_heads, num_kv_heads,
            HEAD_DIM=head_dim,
        )  # fmt: skip
