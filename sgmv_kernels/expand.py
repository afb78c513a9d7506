"""LoRA expand, out += (y @ B^T) * scale with each row's own adapter, at its true rank.

Semantics (the torch references below are this pseudo-code made to run):

    SGMV (rows grouped into segments that share an adapter):
        for s in range(num_segments):
            w = seg_slots[s]                       # -1: nothing is added to these rows
            if w < 0: continue
            rows, r = seg_indptr[s]:seg_indptr[s + 1], ranks[w]
            Bt = the r rows of length H_out at pool[b_rows[w, i]:]   # B transposed; see layout.py
            out[rows] += (y[rows, :r] @ Bt) * scales[w]

    BGMV (any row order): the same with one segment per row, w = row_slots[t].

The engine's form, `sgmv_expand_group`, expands the projections that share x in one launch.

Shapes: y [T, max_rank] float32 (from the shrink); pool [N] in out's dtype; b_rows
[num_slots, max_rank] int64; scales [num_slots] float32; out [T, H_out] float32/bfloat16/
float16, updated in place (each element by one program, so no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.checks import check_expand
from sgmv_kernels.launch import ExpandShape, shapes_for
from sgmv_kernels.layout import gather_rows
from sgmv_kernels.shrink import num_sms, row_programs, row_segments


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
    sgmv_expand_reference(y, pool, b_rows, ranks, scales, row_segments(y.shape[0], y.device), row_slots, out)


@triton.jit
def _expand_operands(
    y_ptr, b_rows_ptr, pool_ptr, offs_m, k, offs_n, columns, row_end, rank, end, stride_y, ROW_ALIGNMENT: tl.constexpr
):  # fmt: skip
    """y's [rows, k] tile and B^T's [k, columns] tile in float32, zero outside the segment and rank."""
    y_mask = (offs_m[:, None] < row_end) & (k[None, :] < rank)
    y_tile = tl.load(y_ptr + offs_m[:, None] * stride_y + k[None, :], mask=y_mask, other=0.0)
    b_offsets = tl.multiple_of(tl.load(b_rows_ptr + k, mask=k < rank, other=0), ROW_ALIGNMENT)
    b_tile = tl.load(
        pool_ptr + b_offsets[:, None] + columns[None, :], mask=(k[:, None] < rank) & (offs_n[None, :] < end), other=0.0
    )  # fmt: skip
    return y_tile, b_tile.to(tl.float32)


@triton.jit
def _expand_kernel(
    y_ptr, pool_ptr, b_rows_ptr, out_ptr, ranks_ptr, scales_ptr, indptr_ptr, slots_ptr,
    out_features, start_1, start_2, chunk_1, chunk_2, tiles_per_chunk, num_m_programs, stride_proj_y, stride_y,
    stride_rows, stride_proj_rows, stride_proj_ranks, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_ALIGNMENT: tl.constexpr,
    TENSOR_TILE: tl.constexpr, FMA_K: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments * num_m_programs, chunks), a segment's row blocks dealt round-robin over
    # its num_m_programs programs. Up to three projections side by side in out (q/k/v, gate/up),
    # starting at columns 0, start_1, start_2; a chunk is `tiles_per_chunk` column blocks of one of
    # them (chunks 0, chunk_1, chunk_2 are each one's first), so a program follows the chain of
    # loads that finds its adapter (segment, slot, rank, row offsets) once for several B tiles.
    segment = tl.program_id(0) // num_m_programs
    m_first = (tl.program_id(0) % num_m_programs) * BLOCK_M
    chunk = tl.program_id(1)
    projection = (chunk >= chunk_1).to(tl.int32) + (chunk >= chunk_2).to(tl.int32)
    first = tl.where(projection == 0, 0, tl.where(projection == 1, start_1, start_2))
    end = tl.where(projection == 0, start_1, tl.where(projection == 1, start_2, out_features))
    first_chunk = tl.where(projection == 0, 0, tl.where(projection == 1, chunk_1, chunk_2))
    n_begin = first + (chunk - first_chunk) * tiles_per_chunk * BLOCK_N
    n_stop = tl.minimum(end, n_begin + tiles_per_chunk * BLOCK_N)
    slot = tl.load(slots_ptr + segment)
    row_start = tl.load(indptr_ptr + segment)
    row_end = tl.load(indptr_ptr + segment + 1)
    if slot >= 0 and row_start < row_end:
        rank = tl.load(ranks_ptr + projection * stride_proj_ranks + slot)
        scale = tl.load(scales_ptr + projection * stride_proj_ranks + slot)
        b_rows_ptr += projection * stride_proj_rows + slot * stride_rows
        y_ptr += projection * stride_proj_y
        offs_k = tl.arange(0, BLOCK_K)
        for m_start in range(row_start + m_first, row_end, num_m_programs * BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            for n_start in range(n_begin, n_stop, BLOCK_N):
                offs_n = n_start + tl.arange(0, BLOCK_N)
                columns = offs_n - first  # of this projection's B^T rows
                out_tile = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
                mask = (offs_m[:, None] < row_end) & (offs_n[None, :] < end)
                current = tl.load(out_tile, mask=mask, other=0.0)  # before B's loads: their latencies overlap
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k_start in range(0, rank, BLOCK_K):  # the adapter's true rank, not the pool's maximum
                    if TENSOR_TILE:  # 16 rows: a prompt's
                        y_tile, b_tile = _expand_operands(
                            y_ptr, b_rows_ptr, pool_ptr, offs_m, k_start + offs_k, offs_n, columns, row_end, rank,
                            end, stride_y, ROW_ALIGNMENT,
                        )  # fmt: skip
                        acc += tl.dot(y_tile, b_tile, input_precision="ieee")
                    else:  # a decode segment's few rows, on the CUDA cores (no 16-row tile of mostly
                        # padding), a few ranks at a time to keep the product's registers few
                        for sub in tl.static_range(0, BLOCK_K, FMA_K):
                            y_tile, b_tile = _expand_operands(
                                y_ptr, b_rows_ptr, pool_ptr, offs_m, k_start + sub + tl.arange(0, FMA_K), offs_n,
                                columns, row_end, rank, end, stride_y, ROW_ALIGNMENT,
                            )  # fmt: skip
                            acc += tl.sum(y_tile[:, :, None] * b_tile[None, :, :], axis=1)
                tl.store(out_tile, (current.to(tl.float32) + acc * scale).to(current.dtype), mask=mask)


BLOCK_M, BLOCK_K = 16, 16  # a tensor-core tile of rows; rank in steps of 16
# Rows per program where segments are this short (a CUDA graph's, cut to this length): products
# summed on the CUDA cores rather than a 16-row tile of mostly padding.
DECODE_SEGMENT_ROWS = 4
FMA_K = 4  # ranks per product there: a [4, 4, column block] product in registers
NARROWEST_COLUMN_BLOCK = 64  # a fused group's widths must be multiples of it


def column_block(widths: list[int], widest: int = ExpandShape.column_block) -> int | None:
    """Columns per program, at most `widest` (a power of two): within one projection (a group's
    widths are multiples of it), as wide as the widths allow; None when a group cannot share a
    launch (run its projections one by one)."""
    if len(widths) == 1:
        return widest
    block = widest
    while block >= NARROWEST_COLUMN_BLOCK and any(width % block for width in widths):
        block //= 2
    return block if block >= NARROWEST_COLUMN_BLOCK else None


def _tiles_per_chunk(tiles: int, busy_programs: int, waves: int, device: torch.device) -> int:
    """Column blocks per program: as many as leave about `waves` waves of busy programs over the SMs."""
    return max(1, tiles * busy_programs // (waves * num_sms(device)))


def sgmv_expand_group(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
    widths: list[int],
    max_segment_len: int | None = None,
    row_alignment: int = 1,
    busy_segments: int | None = None,
) -> None:
    """The expand of up to 3 projections whose outputs lie side by side in out [T, sum(widths)], in
    one launch: y [P, T, max_rank] from `sgmv_shrink_group`, b_rows [P, num_slots, max_rank], ranks
    and scales [P, num_slots]. `max_segment_len`, `row_alignment` (of b_rows) and `busy_segments`
    as for the shrink."""
    shape = shapes_for(out.device).expand
    block_n = column_block(widths, shape.column_block)
    if not (len(widths) <= 3 and sum(widths) == out.shape[1] and ranks.stride(0) == scales.stride(0)):
        raise ValueError("up to 3 projections filling out, ranks and scales laid out alike")
    if block_n is None:
        raise ValueError(f"a group's widths must be multiples of {NARROWEST_COLUMN_BLOCK}, got {widths}")
    column = 0
    for p, width in enumerate(widths):
        check_expand(y[p], pool, b_rows[p], ranks[p], scales[p], seg_slots, seg_indptr, out[:, column : column + width])
        column += width
    if out.shape[0] == 0 or seg_slots.numel() == 0:
        return
    fma = shape.decode_fma and (max_segment_len is None or max_segment_len <= DECODE_SEGMENT_ROWS)
    block_m = DECODE_SEGMENT_ROWS if fma else BLOCK_M
    m_programs = row_programs(max_segment_len, block_m)
    tiles = [triton.cdiv(width, block_n) for width in widths]
    busy_programs = (busy_segments or seg_slots.numel()) * m_programs
    per_chunk = _tiles_per_chunk(sum(tiles), busy_programs, shape.waves, out.device)
    chunks = [triton.cdiv(count, per_chunk) for count in tiles]
    starts = [sum(widths[:i]) for i in range(1, len(widths))]
    first_chunks = [sum(chunks[:i]) for i in range(1, len(chunks))]
    start_1, start_2 = (starts + [out.shape[1]] * 2)[:2]
    chunk_1, chunk_2 = (first_chunks + [sum(chunks)] * 2)[:2]
    _expand_kernel[(seg_slots.numel() * m_programs, sum(chunks))](
        y, pool, b_rows, out, ranks, scales, seg_indptr, seg_slots,
        out.shape[1], start_1, start_2, chunk_1, chunk_2, per_chunk, m_programs, y.stride(0), y.stride(1),
        b_rows.stride(1), b_rows.stride(0), ranks.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, ROW_ALIGNMENT=row_alignment,
        TENSOR_TILE=not fma, FMA_K=FMA_K, num_warps=shape.num_warps, num_stages=shape.num_stages,
    )  # fmt: skip


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
    check_expand(y, pool, b_rows, ranks, scales, seg_slots, seg_indptr, out)
    tables = (b_rows[None], ranks[None], scales[None])
    sgmv_expand_group(y[None], pool, *tables, seg_indptr, seg_slots, out, [out.shape[1]], max_segment_len)


def bgmv_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """SGMV with a segment per row: any row order."""
    check_expand(y, pool, b_rows, ranks, scales, row_slots, None, out)
    sgmv_expand(y, pool, b_rows, ranks, scales, row_segments(y.shape[0], y.device), row_slots, out, max_segment_len=1)
