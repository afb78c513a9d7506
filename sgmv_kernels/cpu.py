"""Torch paths for the CPU, compared by `benchmarks/bench_lora_ops.py`.

- `bgmv_*_gathered`: each row's A and B gathered out of the pool up to the batch's largest
  rank, then two bmm calls. What `lora_shrink`/`lora_expand` run for decode rows on the CPU.
- `grouped_lora`: rows regrouped by adapter and two bmm calls over dense stacks of the
  step's distinct adapters. The engine's CPU path where the compiled kernel (native.py)
  cannot be built: it gathers the stacks once and reuses
  them for as long as the same adapters run (loraserve/lora/stacked.py), so a decode step
  copies no weights at all, where the gathered form copies every row's A and B at every
  projection of every step.

Same semantics as the references in shrink.py and expand.py; rows come from the pool
(layout.py): entries past a rank point at zeros, so padding to a larger rank adds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sgmv_kernels.layout import gather_rows


def bgmv_shrink_gathered(
    x: torch.Tensor, pool: torch.Tensor, a_rows: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    """y [T, max_rank] float32; rows with slot -1 stay zero."""
    y = torch.zeros(x.shape[0], a_rows.shape[1], dtype=torch.float32, device=x.device)
    rows = (row_slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return y
    slots = row_slots[rows].long()
    rank = int(ranks[slots].max())
    a = gather_rows(pool, a_rows[slots, :rank], x.shape[1])  # [R, r, H_in]
    y[rows, :rank] = torch.bmm(a, x[rows].unsqueeze(2)).squeeze(2).float()
    return y


def bgmv_expand_gathered(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out [T, H_out] += (y @ B^T) * scale per row, in place."""
    rows = (row_slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    slots = row_slots[rows].long()
    rank = int(ranks[slots].max())
    b_t = gather_rows(pool, b_rows[slots, :rank], out.shape[1])  # [R, r, H_out]
    delta = torch.bmm(y[rows, :rank].to(b_t.dtype).unsqueeze(1), b_t).squeeze(1)  # [R, H_out]
    delta = delta.float() * scales[slots].unsqueeze(1)
    out.index_add_(0, rows, delta.to(out.dtype))


@dataclass(frozen=True)
class RowGroups:
    """A step's rows regrouped by adapter for `grouped_lora`: adapted row `rows[i]` sits at
    `flat[i]` of a [groups, size] grid (group d holds adapter d's rows, zero-padded to `size`).

    Example: segments of lengths [1, 1, 3] in groups [1, -1, 0] (-1: no adapter) give
    rows = [0, 2, 3, 4], groups = 2, size = 3, flat = [3, 0, 1, 2].
    """

    rows: torch.Tensor | None  # [N] int64 adapted rows; None when every row is adapted, in order
    flat: torch.Tensor | None  # [N] int64; None when the rows already are the grid (no regrouping)
    groups: int
    size: int

    @classmethod
    def of_segments(cls, lengths: list[int], group_of_segment: list[int], device: str) -> RowGroups:
        filled: dict[int, int] = {}  # group -> rows placed so far
        placed: list[tuple[int, int]] = []  # (row, group) in row order
        row = 0
        for length, group in zip(lengths, group_of_segment, strict=True):
            if group >= 0:
                placed += [(r, group) for r in range(row, row + length)]
                filled[group] = filled.get(group, 0) + length
            row += length
        size = max(filled.values())
        seen = dict.fromkeys(filled, 0)
        flat = []
        for _, group in placed:
            flat.append(group * size + seen[group])
            seen[group] += 1
        every_row = len(placed) == row
        rows = None if every_row else torch.tensor([r for r, _ in placed], dtype=torch.int64, device=device)
        groups = max(filled) + 1
        # One adapter, or rows already grouped into equal groups: the rows are the grid.
        in_place = every_row and groups * size == row and flat == list(range(row))
        grid = None if in_place else torch.tensor(flat, dtype=torch.int64, device=device)
        return cls(rows, grid, groups, size)


def grouped_lora(
    x: torch.Tensor,
    a: torch.Tensor,
    bs: Sequence[torch.Tensor],
    scales: torch.Tensor,
    groups: RowGroups,
    out: torch.Tensor,
) -> None:
    """out[rows] += ((x[rows] @ A_d^T) * scales_d) @ B_d^T for each row's group d, in place.

    a [groups, K, H_in] stacks the A rows of one or more projections that share x (K = the sum
    of their ranks); bs holds each projection's B^T [groups, R_j, W_j], whose outputs lie side
    by side in `out` [T, sum W_j]. One shrink for all of them, one expand each. Stacks are
    dense, zero past each adapter's rank; scales [groups, K] scale each shrink column. The
    math runs in the stacks' dtype; the result is added in the output's dtype.
    """
    if groups.flat is None:
        grid = x.to(a.dtype)
    else:
        grid = torch.zeros(groups.groups * groups.size, x.shape[1], dtype=a.dtype, device=x.device)
        grid.index_copy_(0, groups.flat, (x if groups.rows is None else x.index_select(0, groups.rows)).to(a.dtype))
    y = torch.bmm(grid.view(groups.groups, groups.size, -1), a.transpose(1, 2))  # [groups, size, K]
    y.mul_(scales.unsqueeze(1))
    first_rank, first_column = 0, 0
    for b in bs:
        rank, width = b.shape[1], b.shape[2]
        delta = torch.bmm(y[:, :, first_rank : first_rank + rank], b).view(-1, width)
        if groups.flat is not None:
            delta = delta.index_select(0, groups.flat)
        target = out[:, first_column : first_column + width]
        if groups.rows is None:
            target.add_(delta)
        else:
            target.index_add_(0, groups.rows, delta.to(out.dtype))
        first_rank, first_column = first_rank + rank, first_column + width
