"""Punica-style multi-LoRA kernels: one launch applies LoRA to a batch whose rows use different adapters.

`lora_shrink` / `lora_expand` read adapter rows where the pool keeps them: Triton kernels
on CUDA, torch paths on the CPU. `segments` selects the SGMV form (rows grouped by adapter:
a prompt, or decode rows sorted by adapter); `row_slots` the BGMV form (any row order, a
segment per row). On CUDA the engine runs every step through `sgmv_shrink_group` /
`sgmv_expand_group`: the projections that share an input (q/k/v, gate/up) in one shrink and
one expand launch, each adapter read once per segment, the shrink's split-K partials summed
by the last split to finish (two launches per group, nothing else). Adapter weights
are rows in one flat pool, found through per-slot row tables (layout.py). The engine's CPU
path is the compiled kernel of native.py (one call per group of projections that share an
input), and where no compiler is found `cpu.grouped_lora` over dense stacks of the running
adapters that it reuses across steps (see cpu.py).
This package imports nothing from loraserve.
"""

from __future__ import annotations

import torch

from sgmv_kernels.cpu import bgmv_expand_gathered, bgmv_shrink_gathered
from sgmv_kernels.expand import (
    bgmv_expand,
    bgmv_expand_reference,
    column_block,
    sgmv_expand,
    sgmv_expand_group,
    sgmv_expand_reference,
)
from sgmv_kernels.layout import PooledLora, gather_rows, pool_from_dense
from sgmv_kernels.shrink import (
    bgmv_shrink,
    bgmv_shrink_reference,
    sgmv_shrink,
    sgmv_shrink_group,
    sgmv_shrink_output,
    sgmv_shrink_reference,
)

__all__ = [
    "PooledLora",
    "bgmv_expand",
    "bgmv_expand_reference",
    "bgmv_shrink",
    "bgmv_shrink_reference",
    "column_block",
    "gather_rows",
    "lora_expand",
    "lora_shrink",
    "pool_from_dense",
    "sgmv_expand",
    "sgmv_expand_group",
    "sgmv_expand_reference",
    "sgmv_shrink",
    "sgmv_shrink_group",
    "sgmv_shrink_output",
    "sgmv_shrink_reference",
]


def lora_shrink(
    x: torch.Tensor,
    weights: PooledLora,
    *,
    seg_indptr: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T, max_rank] float32 = x @ A^T per row's adapter (see shrink.py)."""
    on_cuda = x.is_cuda
    tables = (weights.pool, weights.a_rows, weights.ranks)
    if row_slots is not None:
        return (bgmv_shrink if on_cuda else bgmv_shrink_gathered)(x, *tables, row_slots)
    if seg_indptr is None or seg_slots is None:
        raise ValueError("give seg_indptr and seg_slots (SGMV) or row_slots (BGMV)")
    if on_cuda:
        return sgmv_shrink(x, *tables, seg_indptr, seg_slots)
    return sgmv_shrink_reference(x, *tables, seg_indptr, seg_slots)


def lora_expand(
    y: torch.Tensor,
    weights: PooledLora,
    out: torch.Tensor,
    *,
    seg_indptr: torch.Tensor | None = None,
    seg_slots: torch.Tensor | None = None,
    row_slots: torch.Tensor | None = None,
) -> None:
    """out += (y @ B^T) * scale per row's adapter, in place (see expand.py)."""
    on_cuda = out.is_cuda
    tables = (weights.pool, weights.b_rows, weights.ranks, weights.scales)
    if row_slots is not None:
        (bgmv_expand if on_cuda else bgmv_expand_gathered)(y, *tables, row_slots, out)
        return
    if seg_indptr is None or seg_slots is None:
        raise ValueError("give seg_indptr and seg_slots (SGMV) or row_slots (BGMV)")
    if on_cuda:
        sgmv_expand(y, *tables, seg_indptr, seg_slots, out)
    else:
        sgmv_expand_reference(y, *tables, seg_indptr, seg_slots, out)
