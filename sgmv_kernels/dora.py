"""DoRA's output scale: after the LoRA delta, each DoRA row's output is multiplied column by column.

Semantics (the torch reference below is this pseudo-code made to run):

    for s in range(num_segments):
        w = seg_slots[s]                                  # -1: a base-model row, left alone
        for p, (start, width) in enumerate(projections side by side in out):
            o = dora_rows[p, w]                           # -1: no DoRA at this projection
            if w >= 0 and o >= 0:
                out[rows of s, start:start + width] *= pool[o:o + width]

Shapes: out [T, sum(widths)] in the pool's dtype, updated in place; pool [N]; dora_rows
[num_projections, num_slots] int64. The product is taken in float32 and rounded once.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

BLOCK_N = 256


def sgmv_dora_scale_reference(
    pool: torch.Tensor,
    dora_rows: torch.Tensor,
    widths: list[int],
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    bounds, slots, rows_of = seg_indptr.tolist(), seg_slots.tolist(), dora_rows.tolist()
    starts = [0, *itertools.accumulate(widths)]
    for s, w in enumerate(slots):
        for p, width in enumerate(widths):
            offset = rows_of[p][w] if w >= 0 else -1
            if offset < 0:
                continue
            block = out[bounds[s] : bounds[s + 1], starts[p] : starts[p] + width]
            block.copy_(block.float() * pool[offset : offset + width].float())


@triton.jit
def _dora_scale_kernel(
    out_ptr, pool_ptr, dora_rows_ptr, indptr_ptr, slots_ptr, starts_ptr, widths_ptr, stride_proj, stride_out,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    # grid: (num_segments, num_projections, cdiv(widest, BLOCK_N)). A segment without an adapter, or
    # whose adapter has no DoRA at this projection, masks every access and reads nothing of the pool.
    segment, projection, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + segment)
    row = tl.load(dora_rows_ptr + projection * stride_proj + tl.maximum(slot, 0))
    width, start = tl.load(widths_ptr + projection), tl.load(starts_ptr + projection)
    columns = block * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = columns < tl.where((slot >= 0) & (row >= 0), width, 0)  # no columns where nothing is scaled
    scale = tl.load(pool_ptr + tl.maximum(row, 0) + columns, mask=mask, other=1.0).to(tl.float32)
    for token in range(tl.load(indptr_ptr + segment), tl.load(indptr_ptr + segment + 1)):
        pointers = out_ptr + token * stride_out + start + columns
        value = tl.load(pointers, mask=mask, other=0.0)
        tl.store(pointers, (value.to(tl.float32) * scale).to(value.dtype), mask=mask)


@functools.cache
def _columns(widths: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, width) of each projection as device tensors, made once: a CUDA graph keeps their addresses."""
    starts = [0, *itertools.accumulate(widths)][:-1]
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=device)
    return as_tensor(starts), as_tensor(widths)


def sgmv_dora_scale(
    pool: torch.Tensor,
    dora_rows: torch.Tensor,
    widths: list[int],
    seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The Triton form of sgmv_dora_scale_reference: one launch for the projections side by side in out."""
    assert out.stride(1) == 1 and out.shape[1] == sum(widths) and dora_rows.shape[0] == len(widths)
    starts, widths_on_device = _columns(tuple(widths), out.device)
    grid = (seg_slots.shape[0], len(widths), triton.cdiv(max(widths), BLOCK_N))
    _dora_scale_kernel[grid](
        out, pool, dora_rows, seg_indptr, seg_slots, starts, widths_on_device, dora_rows.stride(0), out.stride(0),
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
