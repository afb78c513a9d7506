"""Punica-style multi-LoRA kernels: one launch applies LoRA to a batch whose rows use different adapters.

`lora_shrink` / `lora_expand` are the one interface the model calls, and the only device
branch: Triton kernels on CUDA, the fastest measured torch path on the CPU (cpu.py). `segments` selects the
SGMV form (rows grouped by adapter, prefill); `row_slots` the BGMV form (decode).
This package imports nothing from loraserve.
"""

from __future__ import annotations

import torch

from sgmv_kernels.cpu import bgmv_expand_gathered, bgmv_shrink_gathered
from sgmv_kernels.expand import bgmv_expand, bgmv_expand_reference, sgmv_expand, sgmv_expand_reference
from sgmv_kernels.shrink import bgmv_shrink, bgmv_shrink_reference, sgmv_shrink, sgmv_shrink_reference

__all__ = [
    "bgmv_expand",
    "bgmv_expand_reference",
    "bgmv_shrink",
    "bgmv_shrink_reference",
    "lora_expand",
    "lora_shrink",
    "sgmv_expand",
    "sgmv_expand_reference",
    "sgmv_shrink",
    "sgmv_shrink_reference",
]


def lora_shrink(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    ranks: torch.Tensor,
    *,
    seg_indptr: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T, max_rank] float32 = x @ A^T per row's adapter (see shrink.py)."""
    on_cuda = x.is_cuda
    if row_slots is not None:
        return (bgmv_shrink if on_cuda else bgmv_shrink_gathered)(x, lora_a, ranks, row_slots)
    if seg_indptr is None or seg_slots is None:
        raise ValueError("give seg_indptr and seg_slots (SGMV) or row_slots (BGMV)")
    return (sgmv_shrink if on_cuda else sgmv_shrink_reference)(x, lora_a, ranks, seg_indptr, seg_slots)


def lora_expand(
    y: torch.Tensor,
    lora_b: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor,
    *,
    seg_indptr: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> None:
    """out += (y @ B^T) * scale per row's adapter, in place (see expand.py)."""
    on_cuda = out.is_cuda
    if row_slots is not None:
        (bgmv_expand if on_cuda else bgmv_expand_gathered)(y, lora_b, ranks, scales, row_slots, out)
        return
    if seg_indptr is None or seg_slots is None:
        raise ValueError("give seg_indptr and seg_slots (SGMV) or row_slots (BGMV)")
    (sgmv_expand if on_cuda else sgmv_expand_reference)(y, lora_b, ranks, scales, seg_indptr, seg_slots, out)
