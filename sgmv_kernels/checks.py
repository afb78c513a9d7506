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


def check_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, ranks: torch.Tensor, slots: torch.Tensor, seg_indptr: torch.Tensor | None
) -> None:
    _require(x.dim() == 2 and lora_a.dim() == 3, "x must be [T, H_in] and lora_a [num_slots, max_rank, H_in]")
    _require(x.shape[1] == lora_a.shape[2], f"x has {x.shape[1]} features, lora_a expects {lora_a.shape[2]}")
    _require(x.dtype in FLOAT_DTYPES and lora_a.dtype == x.dtype, "x and lora_a must share a float dtype")
    _require(x.stride(1) == 1 and lora_a.is_contiguous(), "x rows and lora_a must be contiguous")
    _require(ranks.shape == (lora_a.shape[0],), "ranks must be [num_slots]")
    check_indices(ranks, slots, seg_indptr, x.shape[0])


def check_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
    seg_indptr: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    _require(y.dim() == 2 and lora_b.dim() == 3, "y must be [T, max_rank] and lora_b [num_slots, H_out, max_rank]")
    _require(y.dtype == torch.float32 and y.shape[1] == lora_b.shape[2], "y must be float32 [T, max_rank]")
    _require(out.shape == (y.shape[0], lora_b.shape[1]), f"out must be [{y.shape[0]}, {lora_b.shape[1]}]")
    _require(out.dtype in FLOAT_DTYPES and lora_b.dtype == out.dtype, "out and lora_b must share a float dtype")
    _require(y.is_contiguous() and lora_b.is_contiguous() and out.stride(1) == 1, "inputs must be contiguous")
    _require(ranks.shape == (lora_b.shape[0],) and scales.shape == ranks.shape, "ranks and scales: [num_slots]")
    _require(scales.dtype == torch.float32, "scales must be float32")
    check_indices(ranks, slots, seg_indptr, y.shape[0])
