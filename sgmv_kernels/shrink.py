"""LoRA shrink, y = x @ A^T with each row's own adapter, at that adapter's true rank.

Semantics (the torch references below are this pseudo-code made to run):

    SGMV (rows grouped into segments that share an adapter: a prompt, or decode rows sorted
    by adapter, so each adapter is read once per step):
        for s in range(num_segments):
            w = seg_slots[s]                       # -1: these rows have no adapter
            if w < 0: continue
            rows, r = seg_indptr[s]:seg_indptr[s + 1], ranks[w]
            A = the r rows of length H_in at pool[a_rows[w, i]:]   # see layout.py
            y[rows, :r] = x[rows] @ A.T

    BGMV (any row order): the same with one segment per row, w = row_slots[t].

Columns of y past a row's rank, and rows without an adapter, are zero. Work past an
adapter's rank is skipped, so a rank-8 adapter costs a rank-8 product even beside a
rank-128 one. The engine's form, `sgmv_shrink_group`, shrinks the projections that share x
in one launch; where K is split over programs, the last split to finish sums the partials.

Shapes: x [T, H_in] float32/bfloat16/float16; pool [N] same dtype; a_rows [num_slots,
max_rank] int64; ranks, seg_slots, row_slots int32; seg_indptr [num_segments + 1] int32;
y [T, max_rank] float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.checks import check_shrink
from sgmv_kernels.launch import shapes_for
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
    return sgmv_shrink_reference(x, pool, a_rows, ranks, row_segments(x.shape[0], x.device), row_slots)


@triton.jit
def tile_dot(a, b, TENSOR_CORES: tl.constexpr):
    """16-bit operands on a GPU: tensor cores, fp32 sums. Else exact fp32 products (and the
    interpreter, which multiplies bfloat16 as raw integers, never sees a 16-bit dot)."""
    if TENSOR_CORES:
        return tl.dot(a, b)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


def tensor_cores(operand: torch.Tensor) -> bool:
    """`tile_dot`'s TENSOR_CORES for operands like this one: 16-bit on a GPU."""
    return operand.is_cuda and operand.dtype != torch.float32


@triton.jit
def _shrink_kernel(
    x_ptr, pool_ptr, a_rows_ptr, partials_ptr, y_ptr, counters_ptr, ranks_ptr, indptr_ptr, slots_ptr,
    hidden, k_per_split, num_splits, num_n_blocks, num_m_programs, stride_x, stride_rows, stride_proj_rows,
    stride_proj_ranks, stride_split, stride_proj_out, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    TENSOR_CORES: tl.constexpr, ROW_ALIGNMENT: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments * num_m_programs, projections * cdiv(max_rank, BLOCK_N), num_splits); a
    # segment's row blocks are dealt round-robin over its num_m_programs programs. A program reads its
    # adapter's A tile once for the whole segment (its rows share the adapter: decode rows sorted
    # by adapter, or a prompt) and sums its K range. Projections that share x (q/k/v, gate/up) go in
    # one launch. With K split, each split writes its partial; the last of a tile's splits to finish
    # (a counter) sums them all in split order, so y does not depend on scheduling, unlike atomic
    # adds, and the expand reads one y.
    segment = tl.program_id(0) // num_m_programs
    m_first = (tl.program_id(0) % num_m_programs) * BLOCK_M
    projection = tl.program_id(1) // num_n_blocks
    n_start = (tl.program_id(1) % num_n_blocks) * BLOCK_N
    split = tl.program_id(2)
    row_start = tl.load(indptr_ptr + segment)
    row_end = tl.load(indptr_ptr + segment + 1)
    slot = tl.load(slots_ptr + segment)
    a_rows_ptr += projection * stride_proj_rows
    rank = tl.load(ranks_ptr + projection * stride_proj_ranks + tl.maximum(slot, 0))
    if slot >= 0 and n_start < rank and row_start < row_end:
        offs_n = n_start + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_offsets = tl.load(a_rows_ptr + slot * stride_rows + offs_n, mask=offs_n < rank, other=0)
        a_offsets = tl.multiple_of(a_offsets, ROW_ALIGNMENT)  # lets rows load in wide vectors
        a_cols = pool_ptr + a_offsets[None, :]  # A^T tile: [BLOCK_K, BLOCK_N], a column per rank row
        y_ptr += projection * stride_proj_out
        partials_ptr += projection * stride_proj_out
        k_begin = split * k_per_split
        for m_start in range(row_start + m_first, row_end, num_m_programs * BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k_start in range(k_begin, k_begin + k_per_split, BLOCK_K):
                k = k_start + offs_k
                x_tile = tl.load(
                    x_ptr + offs_m[:, None] * stride_x + k[None, :],
                    mask=(offs_m[:, None] < row_end) & (k[None, :] < hidden), other=0.0,
                )  # fmt: skip
                a_tile = tl.load(a_cols + k[:, None], mask=(offs_n[None, :] < rank) & (k[:, None] < hidden), other=0.0)
                acc += tile_dot(x_tile, a_tile, TENSOR_CORES)
            tile = offs_m[:, None] * stride_out + offs_n[None, :]
            mask = (offs_m[:, None] < row_end) & (offs_n[None, :] < rank)
            if num_splits == 1:
                tl.store(y_ptr + tile, acc, mask=mask)
            else:
                tl.store(partials_ptr + split * stride_split + tile, acc, mask=mask)
        if num_splits > 1:
            counter = counters_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            tl.debug_barrier()  # every thread's partial stored before the counter says so
            if tl.atomic_add(counter, 1, sem="acq_rel") == num_splits - 1:  # the last split: sum them all
                splits = tl.arange(0, SPLITS)
                for m_start in range(row_start + m_first, row_end, num_m_programs * BLOCK_M):
                    offs_m = m_start + tl.arange(0, BLOCK_M)
                    tile = offs_m[:, None] * stride_out + offs_n[None, :]
                    mask = (offs_m[:, None] < row_end) & (offs_n[None, :] < rank)
                    parts = tl.load(
                        partials_ptr + splits[:, None, None] * stride_split + tile[None, :, :],
                        mask=(splits[:, None, None] < num_splits) & mask[None, :, :], other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
                    tl.store(y_ptr + tile, tl.sum(parts, axis=0), mask=mask)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and CUDA graph replay)


def k_splits(
    x: torch.Tensor,
    a_rows: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int | None,
    busy_segments: int | None,
) -> tuple[int, int]:
    """(splits, K per split) of `sgmv_shrink_group`'s launch with these arguments."""
    num_projections, _, max_rank = a_rows.shape
    per_segment = row_programs(max_segment_len, BLOCK_M) * num_projections * triton.cdiv(max_rank, BLOCK_N)
    shape = shapes_for(x.device).shrink
    busy = (busy_segments or seg_slots.numel()) * per_segment
    return _split_k(x.shape[1], busy, shape.block_k, shape.split_waves, x.device)


def _split_k(hidden: int, programs: int, block_k: int, waves: int, device: torch.device) -> tuple[int, int]:
    """(splits, K per split): enough programs for about `waves` waves over the GPU's SMs.

    Each split sums its own K range into its own partial; the last to finish adds them up in a
    fixed order, all at once (so at most MAX_SPLITS of them).
    """
    target = waves * num_sms(device)
    splits = max(1, min(-(-target // max(programs, 1)), triton.cdiv(hidden, block_k), MAX_SPLITS))
    k_per_split = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    return triton.cdiv(hidden, k_per_split), k_per_split


MAX_SPLITS = 32
_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, that every launch leaves zeroed again: kept per
    device for good (a CUDA graph holds their address), grown by a new tensor when too few."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < count:
        counters = _counters[device] = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
    return counters


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter on the CPU: no waves to fill
    return torch.cuda.get_device_properties(device).multi_processor_count


# A row block of 16 (a tensor-core tile; decode segments are a few rows) and a rank block of 16;
# K's step, its splits, warps and pipelining are the device's ShrinkShape (launch.py).
BLOCK_M, BLOCK_N = 16, 16


def sgmv_shrink_group(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_rows: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int | None = None,
    zeroed: bool = False,
    row_alignment: int = 1,
    busy_segments: int | None = None,
    y: torch.Tensor | None = None,
) -> torch.Tensor:
    """The shrink of P projections that share x, in one launch: a_rows [P, num_slots, max_rank],
    ranks [P, num_slots] -> y [P, T, max_rank] float32 (written into `y` when given: see
    `sgmv_shrink_output`), what `sgmv_expand_group` reads. Entries
    past a row's rank and rows without an adapter are left unwritten unless `zeroed`.
    `max_segment_len` (rows of the longest segment) spreads a prompt's rows over programs; None (a
    CUDA graph's fixed grid) gives each segment one program that loops over its rows, which suits
    decode's short segments. `row_alignment`: a promise that every offset in a_rows is a multiple
    of it (layout.row_alignment). `busy_segments`: how many segments hold rows, for sizing the K
    split, where a CUDA graph's tables have a segment per row of its bucket and most stay empty
    (default: all of them)."""
    for p in range(a_rows.shape[0]):
        check_shrink(x, pool, a_rows[p], ranks[p], seg_slots, seg_indptr)
    num_projections, _, max_rank = a_rows.shape
    n_blocks, m_programs = triton.cdiv(max_rank, BLOCK_N), row_programs(max_segment_len, BLOCK_M)
    programs = seg_slots.numel() * m_programs * num_projections * n_blocks
    shape = shapes_for(x.device).shrink
    splits, k_per_split = k_splits(x, a_rows, seg_slots, max_segment_len, busy_segments)
    y = sgmv_shrink_output(x, a_rows) if y is None else y
    if zeroed:
        y.zero_()
    if x.shape[0] == 0 or programs == 0:
        return y
    partials = torch.empty((splits if splits > 1 else 0, *y.shape), dtype=torch.float32, device=x.device)
    grid = (seg_slots.numel() * m_programs, num_projections * n_blocks, splits)
    _shrink_kernel[grid](
        x, pool, a_rows, partials, y, _split_counters(x.device, grid[0] * grid[1]), ranks, seg_indptr, seg_slots,
        x.shape[1], k_per_split, splits, n_blocks, m_programs, x.stride(0), a_rows.stride(1), a_rows.stride(0),
        ranks.stride(0), partials.stride(0), y.stride(0), y.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=shape.block_k, SPLITS=triton.next_power_of_2(splits),
        TENSOR_CORES=tensor_cores(x), ROW_ALIGNMENT=row_alignment,
        num_warps=shape.num_warps, num_stages=shape.num_stages,
    )  # fmt: skip
    return y


def sgmv_shrink_output(x: torch.Tensor, a_rows: torch.Tensor) -> torch.Tensor:
    """An uninitialised y [P, T, max_rank] float32 for `sgmv_shrink_group` of a_rows [P, slots, max_rank]."""
    return torch.empty(a_rows.shape[0], x.shape[0], a_rows.shape[2], dtype=torch.float32, device=x.device)


def sgmv_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_rows: torch.Tensor,
    ranks: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    max_segment_len: int | None = None,
) -> torch.Tensor:
    """y [T, max_rank] float32, zero past each row's rank and on rows without an adapter."""
    tables = (a_rows.unsqueeze(0), ranks.unsqueeze(0))
    return sgmv_shrink_group(x, pool, *tables, seg_indptr, seg_slots, max_segment_len, zeroed=True)[0]


def bgmv_shrink(
    x: torch.Tensor, pool: torch.Tensor, a_rows: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    """SGMV with a segment per row: any row order, each row reading its own adapter."""
    check_shrink(x, pool, a_rows, ranks, row_slots, None)
    return sgmv_shrink(x, pool, a_rows, ranks, row_segments(x.shape[0], x.device), row_slots, max_segment_len=1)


def row_programs(max_segment_len: int | None, block_m: int) -> int:
    """Programs per segment: one per row block of the longest segment, or one when it is unknown."""
    return triton.cdiv(max_segment_len, block_m) if max_segment_len else 1


def row_segments(num_rows: int, device: torch.device) -> torch.Tensor:
    """seg_indptr of one segment per row: 0, 1, ..., num_rows."""
    return torch.arange(num_rows + 1, dtype=torch.int32, device=device)
