"""LoRA shrink, y = x @ A^T with each row's own adapter, at that adapter's true rank.

Semantics (the torch references below are this pseudo-code made to run):

    SGMV (prefill; rows grouped into segments that share an adapter):
        for s in range(num_segments):
            w = seg_slots[s]                       # -1: these rows have no adapter
            if w < 0: continue
            rows, r = seg_indptr[s]:seg_indptr[s + 1], ranks[w]
            A = the r rows of length H_in at pool[a_rows[w, i]:]   # see layout.py
            y[rows, :r] = x[rows] @ A.T

    BGMV (decode; any row order): the same with one segment per row, w = row_slots[t].

Columns of y past a row's rank, and rows without an adapter, are left as the caller
allocated them (zeros from `empty_shrink_output`). Work past an adapter's rank is skipped,
so a rank-8 adapter costs a rank-8 product even beside a rank-128 one.

Shapes: x [T, H_in] float32/bfloat16/float16; pool [N] same dtype; a_rows [num_slots,
max_rank] int64; ranks, seg_slots, row_slots int32; seg_indptr [num_segments + 1] int32;
y [T, max_rank] float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.checks import check_shrink
from sgmv_kernels.layout import gather_rows


def empty_shrink_output(x: torch.Tensor, a_rows: torch.Tensor) -> torch.Tensor:
    return torch.zeros(x.shape[0], a_rows.shape[1], dtype=torch.float32, device=x.device)


def sgmv_shrink_reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_rows: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
) -> torch.Tensor:
    y = empty_shrink_output(x, a_rows)
    bounds, slots, rank_of = seg_indptr.tolist(), seg_slots.tolist(), ranks.tolist()
    for s, w in enumerate(slots):
        if w < 0:
            continue
        start, end, r = bounds[s], bounds[s + 1], rank_of[w]
        a = gather_rows(pool, a_rows[w, :r], x.shape[1])  # [r, H_in]
        y[start:end, :r] = x[start:end].float() @ a.float().T
    return y


def bgmv_shrink_reference(
    x: torch.Tensor, pool: torch.Tensor, a_rows: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    indptr = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    return sgmv_shrink_reference(x, pool, a_rows, ranks, indptr, row_slots)


@triton.jit
def _dot(a, b, TENSOR_CORES: tl.constexpr):
    """16-bit operands on a GPU: tensor cores, fp32 sums. Else exact fp32 products (and the
    interpreter, which multiplies bfloat16 as raw integers, never sees a 16-bit dot)."""
    if TENSOR_CORES:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, pool_ptr, a_rows_ptr, y_ptr, ranks_ptr, indptr_ptr, slots_ptr,
    hidden, k_per_split, num_n_blocks, stride_x, stride_rows, stride_y, stride_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TENSOR_CORES: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments, cdiv(longest segment, BLOCK_M), num_n_blocks * split_k); each
    # program sums its K range of one row block into its own partial (summed on the host side).
    segment = tl.program_id(0)
    m_start = tl.load(indptr_ptr + segment) + tl.program_id(1) * BLOCK_M
    row_end = tl.load(indptr_ptr + segment + 1)
    n_start = (tl.program_id(2) % num_n_blocks) * BLOCK_N
    split = tl.program_id(2) // num_n_blocks
    slot = tl.load(slots_ptr + segment)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if slot >= 0 and n_start < rank and m_start < row_end:
        offs_m = m_start + tl.arange(0, BLOCK_M)
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_offsets = tl.load(a_rows_ptr + slot * stride_rows + offs_n, mask=offs_n < rank, other=0)
        a_cols = pool_ptr + a_offsets[None, :]  # A^T tile: [BLOCK_K, BLOCK_N], a column per rank row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = split * k_per_split
        for k_start in range(k_begin, k_begin + k_per_split, BLOCK_K):
            k = k_start + offs_k
            x_tile = tl.load(
                x_ptr + offs_m[:, None] * stride_x + k[None, :],
                mask=(offs_m[:, None] < row_end) & (k[None, :] < hidden), other=0.0,
            )  # fmt: skip
            a_tile = tl.load(a_cols + k[:, None], mask=(offs_n[None, :] < rank) & (k[:, None] < hidden), other=0.0)
            acc += _dot(x_tile, a_tile, TENSOR_CORES)
        tl.store(
            y_ptr + split * stride_split + offs_m[:, None] * stride_y + offs_n[None, :],
            acc,
            mask=(offs_m[:, None] < row_end) & (offs_n[None, :] < rank),
        )


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, pool_ptr, a_rows_ptr, y_ptr, ranks_ptr, slots_ptr,
    hidden, k_per_split, num_n_blocks, stride_x, stride_rows, stride_y, stride_split,
    stride_proj_rows, stride_proj_ranks, stride_proj_y,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_rows, projections * cdiv(max_rank, BLOCK_N), split_k); one row, so a reduction
    # instead of a dot. Projections that share x (q/k/v, gate/up) go in one launch.
    row = tl.program_id(0)
    projection = tl.program_id(1) // num_n_blocks
    n_start = (tl.program_id(1) % num_n_blocks) * BLOCK_N
    split = tl.program_id(2)
    a_rows_ptr += projection * stride_proj_rows
    ranks_ptr += projection * stride_proj_ranks
    y_ptr += projection * stride_proj_y
    slot = tl.load(slots_ptr + row)
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    if slot >= 0 and n_start < rank:
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_offsets = tl.load(a_rows_ptr + slot * stride_rows + offs_n, mask=offs_n < rank, other=0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        k_begin = split * k_per_split
        for k_start in range(k_begin, k_begin + k_per_split, BLOCK_K):
            k = k_start + offs_k
            x_row = tl.load(x_ptr + row * stride_x + k, mask=k < hidden, other=0.0).to(tl.float32)
            a_tile = tl.load(
                pool_ptr + a_offsets[:, None] + k[None, :],
                mask=(offs_n[:, None] < rank) & (k[None, :] < hidden), other=0.0,
            ).to(tl.float32)  # fmt: skip
            acc += tl.sum(a_tile * x_row[None, :], axis=1)
        tl.store(y_ptr + split * stride_split + row * stride_y + offs_n, acc, mask=offs_n < rank)


def _split_k(hidden: int, programs: int, block_k: int, device: torch.device) -> tuple[int, int]:
    """(splits, K per split): enough programs for about four waves over the GPU's SMs.

    Each split sums its own K range into its own partial, added up afterwards in a fixed
    order: the result does not depend on scheduling, unlike atomic adds.
    """
    target = 4 * _num_sms(device)
    splits = max(1, min(-(-target // max(programs, 1)), triton.cdiv(hidden, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    return triton.cdiv(hidden, k_per_split), k_per_split


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter on the CPU: no waves to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sum_partials(partials: torch.Tensor) -> torch.Tensor:
    return partials[0] if partials.shape[0] == 1 else partials.sum(0)


def sgmv_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_rows: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """`max_segment_len` (the longest segment) sizes the grid; given, it spares reading seg_indptr back."""
    check_shrink(x, pool, a_rows, ranks, seg_slots, seg_indptr)
    if x.shape[0] == 0 or seg_slots.numel() == 0:
        return empty_shrink_output(x, a_rows)
    if max_segment_len is None:
        max_segment_len = int(seg_indptr.diff().max())
    block_m, block_n, block_k = 32, 16, 64
    m_blocks, n_blocks = triton.cdiv(max_segment_len, block_m), triton.cdiv(a_rows.shape[1], block_n)
    splits, k_per_split = _split_k(x.shape[1], seg_slots.numel() * m_blocks * n_blocks, block_k, x.device)
    partials = torch.zeros(splits, x.shape[0], a_rows.shape[1], dtype=torch.float32, device=x.device)
    grid = (seg_slots.numel(), m_blocks, n_blocks * splits)
    _sgmv_shrink_kernel[grid](
        x, pool, a_rows, partials, ranks, seg_indptr, seg_slots,
        x.shape[1], k_per_split, n_blocks, x.stride(0), a_rows.stride(0), partials.stride(1), partials.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        TENSOR_CORES=x.is_cuda and x.dtype != torch.float32,
    )  # fmt: skip
    return _sum_partials(partials)


def bgmv_shrink(
    x: torch.Tensor, pool: torch.Tensor, a_rows: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    check_shrink(x, pool, a_rows, ranks, row_slots, None)
    return bgmv_shrink_group(x, pool, a_rows.unsqueeze(0), ranks.unsqueeze(0), row_slots)[0]


def bgmv_shrink_group(
    x: torch.Tensor, pool: torch.Tensor, a_rows: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    """The shrink of P projections that share x in one launch: a_rows [P, num_slots, max_rank],
    ranks [P, num_slots] -> y [P, T, max_rank] float32."""
    for p in range(a_rows.shape[0]):
        check_shrink(x, pool, a_rows[p], ranks[p], row_slots, None)
    num_projections, _, max_rank = a_rows.shape
    if x.shape[0] == 0:
        return torch.zeros(num_projections, 0, max_rank, dtype=torch.float32, device=x.device)
    block_n, block_k = 16, 128
    n_blocks = triton.cdiv(max_rank, block_n)
    splits, k_per_split = _split_k(x.shape[1], x.shape[0] * num_projections * n_blocks, block_k, x.device)
    partials = torch.zeros(splits, num_projections, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    _bgmv_shrink_kernel[(x.shape[0], num_projections * n_blocks, splits)](
        x, pool, a_rows, partials, ranks, row_slots,
        x.shape[1], k_per_split, n_blocks, x.stride(0), a_rows.stride(1), partials.stride(2), partials.stride(0),
        a_rows.stride(0), ranks.stride(0), partials.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return _sum_partials(partials)
