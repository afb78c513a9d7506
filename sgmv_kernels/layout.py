"""Where the kernels find adapter weights: rows anywhere in one flat pool (S-LoRA unified paging).

The pool is a 1-D tensor in the model dtype. Each adapted projection keeps, per slot,
the element offset of every row of its A (`in_features` long) and of its B transposed
(`out_features` long): `a_rows`, `b_rows` [num_slots, max_rank] int64. A row is
contiguous; rows need not be near each other, so an adapter can live in scattered
pages, and a rank-8 adapter takes 8 rows, not `max_rank`. Entries at or past a slot's
rank point at a row of zeros the pool keeps (the torch paths gather up to the batch's
largest rank and rely on it; the Triton kernels never read them).

Example: rank 2, in_features 4, page of 16 elements, pages [7, 3]: A's rows at 112 and
116 (page 7), B^T's rows at 120 and 48 (page 7's tail, then page 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PooledLora:
    """One adapted projection of one layer, for every slot."""

    pool: torch.Tensor  # [N] model dtype
    a_rows: torch.Tensor  # [num_slots, max_rank] int64 offsets of A's rows
    b_rows: torch.Tensor  # [num_slots, max_rank] int64 offsets of B^T's rows
    ranks: torch.Tensor  # [num_slots] int32, 0 = the slot does not adapt this projection
    scales: torch.Tensor  # [num_slots] float32


MAX_ROW_ALIGNMENT = 16  # elements; beyond it a GPU's widest load gains nothing


def row_alignment(*offsets: int) -> int:
    """The largest power of two (at most MAX_ROW_ALIGNMENT) that divides every offset: what the
    CUDA kernels may assume of where rows start, so they load rows in wide vectors."""
    alignment = MAX_ROW_ALIGNMENT
    while any(offset % alignment for offset in offsets):
        alignment //= 2
    return alignment


def gather_rows(pool: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """[*offsets.shape, width]: row i is pool[offsets[i] : offsets[i] + width], copied."""
    # A sliding-window view: its row o starts at element o, so one index_select gathers any rows.
    windows = pool.as_strided((pool.numel() - width + 1, width), (1, 1))
    return windows.index_select(0, offsets.reshape(-1)).view(*offsets.shape, width)


def pool_from_dense(
    lora_a: torch.Tensor,  # [num_slots, max_rank, in_features]
    lora_b: torch.Tensor,  # [num_slots, out_features, max_rank]
    ranks: torch.Tensor,
    scales: torch.Tensor,
    generator: torch.Generator,
) -> PooledLora:
    """Scatter dense per-slot weights' rows over a pool in random order (tests and benchmarks)."""
    num_slots, max_rank, in_features = lora_a.shape
    out_features = lora_b.shape[1]
    rows = [lora_a[s, i] for s in range(num_slots) for i in range(int(ranks[s]))]
    rows += [lora_b[s, :, i] for s in range(num_slots) for i in range(int(ranks[s]))]
    order = torch.randperm(len(rows), generator=generator).tolist()
    chunks, offsets, position = [], [0] * len(rows), 0
    for index in order:
        offsets[index] = position
        chunks.append(rows[index])
        position += rows[index].numel()
    zero = position  # the zero row every entry past a rank points at
    pool = torch.cat([*chunks, lora_a.new_zeros(max(in_features, out_features))])
    a_rows = torch.full((num_slots, max_rank), zero, dtype=torch.int64)
    b_rows = torch.full((num_slots, max_rank), zero, dtype=torch.int64)
    next_row = iter(offsets)
    for table in (a_rows, b_rows):
        for s in range(num_slots):
            for i in range(int(ranks[s])):
                table[s, i] = next(next_row)
    return PooledLora(pool.to(lora_a.device), a_rows.to(lora_a.device), b_rows.to(lora_a.device), ranks, scales)
