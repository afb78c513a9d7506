"""LoRA expand, out += (y @ B^T) * scale with each row's own adapter, at its true rank.

Semantics (the torch references below are this pseudo-code made to run):

    SGMV (prefill):
        for s in range(num_segments):
            w = seg_slots[s]                       # -1: nothing is added to these rows
            if w < 0: continue
            rows, r = seg_indptr[s]:seg_indptr[s + 1], ranks[w]
            Bt = the r rows of length H_out at pool[b_rows[w, i]:]   # B transposed; see layout.py
            out[rows] += (y[rows, :r] @ Bt) * scales[w]

    BGMV (decode): the same with one segment per row, w = row_slots[t].

Shapes: y [T, max_rank] float32 (from the shrink); pool [N] in out's dtype; b_rows
[num_slots, max_rank] int64; scales [num_slots] float32; out [T, H_out] float32/bfloat16/
float16, updated in place (each element by one program, so no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.checks import check_expand
from sgmv_kernels.layout import gather_rows


def sgmv_expand_reference(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
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
        b_t = gather_rows(pool, b_rows[w, :r], out.shape[1])  # [r, H_out]
        delta = (y[start:end, :r] @ b_t.float()) * scale_of[w]
        out[start:end] = (out[start:end].float() + delta).to(out.dtype)


def bgmv_expand_reference(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    indptr = torch.arange(y.shape[0] + 1, dtype=torch.int32, device=y.device)
    sgmv_expand_reference(y, pool, b_rows, ranks, scales, indptr, row_slots, out)


@triton.jit
def _sgmv_expand_kernel(
    y_ptr, pool_ptr, b_rows_ptr, out_ptr, ranks_ptr, scales_ptr, indptr_ptr, slots_ptr,
    out_features, stride_y, stride_rows, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments, cdiv(longest segment, BLOCK_M), cdiv(H_out, BLOCK_N))
    segment = tl.program_id(0)
    m_start = tl.load(indptr_ptr + segment) + tl.program_id(1) * BLOCK_M
    row_end = tl.load(indptr_ptr + segment + 1)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + segment)
    if slot >= 0 and m_start < row_end:
        rank = tl.load(ranks_ptr + slot)
        scale = tl.load(scales_ptr + slot)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, rank, BLOCK_K):  # the adapter's true rank, not the pool's maximum
            k = k_start + offs_k
            y_tile = tl.load(
                y_ptr + offs_m[:, None] * stride_y + k[None, :],
                mask=(offs_m[:, None] < row_end) & (k[None, :] < rank), other=0.0,
            )  # fmt: skip
            b_offsets = tl.load(b_rows_ptr + slot * stride_rows + k, mask=k < rank, other=0)
            b_tile = tl.load(
                pool_ptr + b_offsets[:, None] + offs_n[None, :],
                mask=(k[:, None] < rank) & (offs_n[None, :] < out_features), other=0.0,
            )  # fmt: skip
            acc += tl.dot(y_tile, b_tile.to(tl.float32), input_precision="ieee")
        out_tile = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
        mask = (offs_m[:, None] < row_end) & (offs_n[None, :] < out_features)
        current = tl.load(out_tile, mask=mask, other=0.0)
        tl.store(out_tile, (current.to(tl.float32) + acc * scale).to(current.dtype), mask=mask)


@triton.jit
def _bgmv_expand_kernel(
    y_ptr, pool_ptr, b_rows_ptr, out_ptr, ranks_ptr, scales_ptr, slots_ptr,
    out_features, start_1, start_2, stride_y, stride_rows, stride_out,
    stride_proj_y, stride_proj_rows, stride_proj_ranks,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_rows, cdiv(H_out, BLOCK_N)); one row, so a reduction instead of a dot. Up to three
    # projections side by side in out (q/k/v, gate/up), starting at columns 0, start_1, start_2:
    # a column block lies in one of them.
    row = tl.program_id(0)
    n_start = tl.program_id(1) * BLOCK_N
    projection = (n_start >= start_1).to(tl.int32) + (n_start >= start_2).to(tl.int32)
    first = tl.where(projection == 0, 0, tl.where(projection == 1, start_1, start_2))
    end = tl.where(projection == 0, start_1, tl.where(projection == 1, start_2, out_features))
    y_ptr += projection * stride_proj_y
    b_rows_ptr += projection * stride_proj_rows
    ranks_ptr += projection * stride_proj_ranks
    scales_ptr += projection * stride_proj_ranks
    offs_n = n_start + tl.arange(0, BLOCK_N)
    columns = offs_n - first  # of this projection's B^T rows
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        rank = tl.load(ranks_ptr + slot)
        scale = tl.load(scales_ptr + slot)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k_start in range(0, rank, BLOCK_K):
            k = k_start + offs_k
            y_row = tl.load(y_ptr + row * stride_y + k, mask=k < rank, other=0.0)
            b_offsets = tl.load(b_rows_ptr + slot * stride_rows + k, mask=k < rank, other=0)
            b_tile = tl.load(
                pool_ptr + b_offsets[:, None] + columns[None, :],
                mask=(k[:, None] < rank) & (offs_n[None, :] < end), other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc += tl.sum(b_tile * y_row[:, None], axis=0)
        out_row = out_ptr + row * stride_out + offs_n
        current = tl.load(out_row, mask=offs_n < end, other=0.0)
        tl.store(out_row, (current.to(tl.float32) + acc * scale).to(current.dtype), mask=offs_n < end)


def sgmv_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    max_segment_len: int | None = None,
) -> None:
    """`max_segment_len` (the longest segment) sizes the grid; given, it spares reading seg_indptr back."""
    check_expand(y, pool, b_rows, ranks, scales, seg_slots, seg_indptr, out)
    if y.shape[0] == 0 or seg_slots.numel() == 0:
        return
    if max_segment_len is None:
        max_segment_len = int(seg_indptr.diff().max())
    block_m, block_n = 32, 64
    grid = (seg_slots.numel(), triton.cdiv(max_segment_len, block_m), triton.cdiv(out.shape[1], block_n))
    _sgmv_expand_kernel[grid](
        y, pool, b_rows, out, ranks, scales, seg_indptr, seg_slots,
        out.shape[1], y.stride(0), b_rows.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=16,
    )  # fmt: skip


def bgmv_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_expand(y, pool, b_rows, ranks, scales, row_slots, None, out)
    bgmv_expand_group(y.unsqueeze(0), pool, b_rows.unsqueeze(0), ranks.unsqueeze(0), scales.unsqueeze(0), row_slots,
                      out, [out.shape[1]])  # fmt: skip


GROUP_COLUMN_BLOCK = 64  # a fused group's widths are multiples of it: a column block lies in one projection


def bgmv_expand_group(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
    widths: list[int],
) -> None:
    """The expand of up to 3 projections whose outputs lie side by side in out [T, sum(widths)], in one
    launch: y [P, T, max_rank], b_rows [P, num_slots, max_rank], ranks and scales [P, num_slots]."""
    starts = [sum(widths[:i]) for i in range(1, len(widths))]
    if not (len(widths) <= 3 and sum(widths) == out.shape[1] and ranks.stride(0) == scales.stride(0)):
        raise ValueError("up to 3 projections filling out, ranks and scales laid out alike")
    if len(widths) > 1 and any(width % GROUP_COLUMN_BLOCK for width in widths):
        raise ValueError(f"a group's widths must be multiples of {GROUP_COLUMN_BLOCK}, got {widths}")
    for p, width in enumerate(widths):
        check_expand(y[p], pool, b_rows[p], ranks[p], scales[p], row_slots, None, out[:, :width])
    if y.shape[1] == 0:
        return
    start_1, start_2 = (starts + [out.shape[1]] * 2)[:2]
    grid = (y.shape[1], triton.cdiv(out.shape[1], GROUP_COLUMN_BLOCK))
    _bgmv_expand_kernel[grid](
        y, pool, b_rows, out, ranks, scales, row_slots,
        out.shape[1], start_1, start_2, y.stride(1), b_rows.stride(1), out.stride(0),
        y.stride(0), b_rows.stride(0), ranks.stride(0),
        BLOCK_N=GROUP_COLUMN_BLOCK, BLOCK_K=16,
    )  # fmt: skip
