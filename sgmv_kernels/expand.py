"""LoRA expand, out += (y @ B^T) * scale with each row's own adapter, at its true rank.

Semantics (the torch references below are this pseudo-code made to run):

    SGMV (prefill):
        for s in range(num_segments):
            w = seg_slots[s]                       # -1: nothing is added to these rows
            if w < 0: continue
            rows, r = seg_indptr[s]:seg_indptr[s + 1], ranks[w]
            out[rows] += (y[rows, :r] @ lora_b[w, :, :r].T) * scales[w]

    BGMV (decode): the same with one segment per row, w = row_slots[t].

Shapes: y [T, max_rank] float32 (from the shrink); lora_b [num_slots, H_out, max_rank] in
out's dtype; scales [num_slots] float32; out [T, H_out] float32/bfloat16/float16, updated
in place (each element by one program, so no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.checks import check_expand


def sgmv_expand_reference(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    bounds, slots, rank_of, scale_of = seg_indptr.tolist(), seg_slots.tolist(), ranks.tolist(), scales.tolist()
    for s, w in enumerate(slots):
        if w < 0:
            continue
        start, end, r = bounds[s], bounds[s + 1], rank_of[w]
        delta = (y[start:end, :r] @ lora_b[w, :, :r].float().T) * scale_of[w]
        out[start:end] = (out[start:end].float() + delta).to(out.dtype)


def bgmv_expand_reference(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    indptr = torch.arange(y.shape[0] + 1, dtype=torch.int32, device=y.device)
    sgmv_expand_reference(y, lora_b, ranks, scales, indptr, row_slots, out)


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, scales_ptr, indptr_ptr, slots_ptr,
    out_features, stride_y, stride_b_slot, stride_b_row, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments, cdiv(H_out, BLOCK_N))
    segment = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + segment)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        scale = tl.load(scales_ptr + slot)
        row_start = tl.load(indptr_ptr + segment)
        row_end = tl.load(indptr_ptr + segment + 1)
        offs_k = tl.arange(0, BLOCK_K)
        b_cols = b_ptr + slot * stride_b_slot + offs_n[None, :] * stride_b_row  # B^T tile: [BLOCK_K, BLOCK_N]
        for m_start in range(row_start, row_end, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_start in range(0, rank, BLOCK_K):  # the adapter's true rank, not the pool's maximum
                k = k_start + offs_k
                y_tile = tl.load(
                    y_ptr + offs_m[:, None] * stride_y + k[None, :],
                    mask=(offs_m[:, None] < row_end) & (k[None, :] < rank), other=0.0,
                )  # fmt: skip
                b_tile = tl.load(
                    b_cols + k[:, None], mask=(k[:, None] < rank) & (offs_n[None, :] < out_features), other=0.0
                )
                acc += tl.dot(y_tile, b_tile.to(tl.float32), input_precision="ieee")
            out_tile = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
            mask = (offs_m[:, None] < row_end) & (offs_n[None, :] < out_features)
            current = tl.load(out_tile, mask=mask, other=0.0)
            tl.store(out_tile, (current.to(tl.float32) + acc * scale).to(current.dtype), mask=mask)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, scales_ptr, slots_ptr,
    out_features, stride_y, stride_b_slot, stride_b_row, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_rows, cdiv(H_out, BLOCK_N)); one row, so a reduction instead of a dot
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        scale = tl.load(scales_ptr + slot)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k_start in range(0, rank, BLOCK_K):
            k = k_start + offs_k
            y_row = tl.load(y_ptr + row * stride_y + k, mask=k < rank, other=0.0)
            b_tile = tl.load(
                b_ptr + slot * stride_b_slot + offs_n[:, None] * stride_b_row + k[None, :],
                mask=(offs_n[:, None] < out_features) & (k[None, :] < rank), other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc += tl.sum(b_tile * y_row[None, :], axis=1)
        out_row = out_ptr + row * stride_out + offs_n
        current = tl.load(out_row, mask=offs_n < out_features, other=0.0)
        tl.store(out_row, (current.to(tl.float32) + acc * scale).to(current.dtype), mask=offs_n < out_features)


def sgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_expand(y, lora_b, ranks, scales, seg_slots, seg_indptr, out)
    if y.shape[0] == 0 or seg_slots.numel() == 0:
        return
    block_n = 64
    grid = (seg_slots.numel(), triton.cdiv(lora_b.shape[1], block_n))
    _sgmv_expand_kernel[grid](
        y, lora_b, out, ranks, scales, seg_indptr, seg_slots,
        lora_b.shape[1], y.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=16,
    )  # fmt: skip


def bgmv_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_expand(y, lora_b, ranks, scales, row_slots, None, out)
    if y.shape[0] == 0:
        return
    block_n = 64
    grid = (y.shape[0], triton.cdiv(lora_b.shape[1], block_n))
    _bgmv_expand_kernel[grid](
        y, lora_b, out, ranks, scales, row_slots,
        lora_b.shape[1], y.stride(0), lora_b.stride(0), lora_b.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=16,
    )  # fmt: skip
