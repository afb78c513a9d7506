"""Shape and dtype checks shared by the launchers: a wrong call fails here, not in a kernel."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_indices(ranks: torch.Tensor, slots: torch.Tensor, seg_indptr: torch.Tensor | None, num_rows: int) -> None:
    _require(ranks.dtype == torch.int32 and slots.dtype == torch.int32, "ranks and slots must be int32")
    if seg_indptr is None:
        _require(slots.shape == (num_rows,), f"row_slots must be [{num_rows}], got {tuple(slots.shape)}")
        return
    _require(seg_indptr.dtype == torch.int32, "seg_indptr must be int32")
    _require(seg_indptr.shape == (slots.numel() + 1,), "seg_indptr must be [num_segments + 1]")


def check_pool(pool: torch.Tensor, rows: torch.Tensor, ranks: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    _require(pool.dim() == 1 and pool.is_contiguous(), "pool must be a contiguous 1-D tensor")
    _require(pool.dtype == dtype, f"pool and {name} must share a float dtype")
    _require(rows.dim() == 2 and rows.dtype == torch.int64 and rows.is_contiguous(), "row tables: int64 [slots, rank]")
    _require(ranks.shape == (rows.shape[0],), "ranks must be [num_slots]")


def check_shrink(
    x: torch.Tensor,
    pool: torch.Tensor,
    a_rows: torch.Tensor,
    ranks: torch.Tensor,
    slots: torch.Tensor,
    seg_indptr: torch.Tensor | None,
) -> None:
    _require(x.dim() == 2 and x.dtype in FLOAT_DTYPES and x.stride(1) == 1, "x must be [T, H_in] with contiguous rows")
    check_pool(pool, a_rows, ranks, x.dtype, "x")
    check_indices(ranks, slots, seg_indptr, x.shape[0])


def check_expand(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    seg_indptr: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    _require(y.dtype == torch.float32 and y.shape[1] == b_rows.shape[1], "y must be float32 [T, max_rank]")
    _require(y.is_contiguous() and out.dim() == 2 and out.stride(1) == 1, "y and out rows must be contiguous")
    _require(out.shape[0] == y.shape[0] and out.dtype in FLOAT_DTYPES, f"out must be [{y.shape[0]}, H_out]")
    check_pool(pool, b_rows, ranks, out.dtype, "out")
    _require(scales.shape == ranks.shape and scales.dtype == torch.float32, "scales must be float32 [num_slots]")
    check_indices(ranks, slots, seg_indptr, y.shape[0])
