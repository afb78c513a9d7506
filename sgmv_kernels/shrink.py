"""LoRA shrink, y = x @ A^T with each row's own adapter, at that adapter's true rank.

Semantics (the torch references below are this pseudo-code made to run):

    SGMV (prefill; rows grouped into segments that share an adapter):
        for s in range(num_segments):
            w = seg_slots[s]                       # -1: these rows have no adapter
            if w < 0: continue
            rows, r = seg_indptr[s]:seg_indptr[s + 1], ranks[w]
            y[rows, :r] = x[rows] @ lora_a[w, :r, :].T

    BGMV (decode; any row order): the same with one segment per row, w = row_slots[t].

Columns of y past a row's rank, and rows without an adapter, are left as the caller
allocated them (zeros from `empty_shrink_output`). Work past an adapter's rank is skipped,
so a rank-8 adapter costs a rank-8 product even beside a rank-128 one.

Shapes: x [T, H_in] float32/bfloat16/float16; lora_a [num_slots, max_rank, H_in] same dtype;
ranks, seg_slots, row_slots int32; seg_indptr [num_segments + 1] int32; y [T, max_rank] float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.checks import check_shrink


def empty_shrink_output(x: torch.Tensor, lora_a: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)


def sgmv_shrink_reference(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    y = empty_shrink_output(x, lora_a)
    bounds, slots, rank_of = seg_indptr.tolist(), seg_slots.tolist(), ranks.tolist()
    for s, w in enumerate(slots):
        if w < 0:
            continue
        start, end, r = bounds[s], bounds[s + 1], rank_of[w]
        y[start:end, :r] = x[start:end].float() @ lora_a[w, :r].float().T
    return y


def bgmv_shrink_reference(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    indptr = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return sgmv_shrink_reference(x, lora_a, ranks, indptr, row_slots)


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr, indptr_ptr, slots_ptr,
    hidden, stride_x, stride_a_slot, stride_a_rank, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments, cdiv(max_rank, BLOCK_N))
    segment = tl.program_id(0)
    n_start = tl.program_id(1) * BLOCK_N
    slot = tl.load(slots_ptr + segment)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if slot >= 0 and n_start < rank:
        row_start = tl.load(indptr_ptr + segment)
        row_end = tl.load(indptr_ptr + segment + 1)
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = a_ptr + slot * stride_a_slot + offs_n[None, :] * stride_a_rank  # A^T tile: [BLOCK_K, BLOCK_N]
        for m_start in range(row_start, row_end, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_start in range(0, hidden, BLOCK_K):
                k = k_start + offs_k
                x_tile = tl.load(
                    x_ptr + offs_m[:, None] * stride_x + k[None, :],
                    mask=(offs_m[:, None] < row_end) & (k[None, :] < hidden), other=0.0,
                )  # fmt: skip
                a_tile = tl.load(a_rows + k[:, None], mask=(offs_n[None, :] < rank) & (k[:, None] < hidden), other=0.0)
                acc += tl.dot(x_tile.to(tl.float32), a_tile.to(tl.float32), input_precision="ieee")
            tl.store(
                y_ptr + offs_m[:, None] * stride_y + offs_n[None, :],
                acc,
                mask=(offs_m[:, None] < row_end) & (offs_n[None, :] < rank),
            )


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr, slots_ptr,
    hidden, stride_x, stride_a_slot, stride_a_rank, stride_y,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_rows, cdiv(max_rank, BLOCK_N)); one row, so a reduction instead of a dot
    row = tl.program_id(0)
    n_start = tl.program_id(1) * BLOCK_N
    slot = tl.load(slots_ptr + row)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if slot >= 0 and n_start < rank:
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k_start in range(0, hidden, BLOCK_K):
            k = k_start + offs_k
            x_row = tl.load(x_ptr + row * stride_x + k, mask=k < hidden, other=0.0).to(tl.float32)
            a_tile = tl.load(
                a_ptr + slot * stride_a_slot + offs_n[:, None] * stride_a_rank + k[None, :],
                mask=(offs_n[:, None] < rank) & (k[None, :] < hidden), other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc += tl.sum(a_tile * x_row[None, :], axis=1)
        tl.store(y_ptr + row * stride_y + offs_n, acc, mask=offs_n < rank)


def sgmv_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, seg_indptr: torch.Tensor, seg_slots: torch.Tensor
) -> torch.Tensor:
    check_shrink(x, lora_a, ranks, seg_slots, seg_indptr)
    y = empty_shrink_output(x, lora_a)
    if x.shape[0] == 0 or seg_slots.numel() == 0:
        return y
    block_n = 16
    grid = (seg_slots.numel(), triton.cdiv(lora_a.shape[1], block_n))
    _sgmv_shrink_kernel[grid](
        x, lora_a, y, ranks, seg_indptr, seg_slots,
        x.shape[1], x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    return y


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    check_shrink(x, lora_a, ranks, row_slots, None)
    y = empty_shrink_output(x, lora_a)
    if x.shape[0] == 0:
        return y
    block_n = 16
    grid = (x.shape[0], triton.cdiv(lora_a.shape[1], block_n))
    _bgmv_shrink_kernel[grid](
        x, lora_a, y, ranks, row_slots,
        x.shape[1], x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0),
        BLOCK_N=block_n, BLOCK_K=64,
    )  # fmt: skip
    return y
