"""A step's DoRA rows: after the LoRA delta, each row's output times its adapter's scale vectors (dora.py).

Rows without DoRA (base rows, plain LoRA, a DoRA adapter's unadapted projections) scale by one. A
step with no DoRA adapter plans nothing and pays nothing.
- `PooledDoraRows` (Triton, CUDA graphs included): one launch per projection group reading the scale
  rows where the pool keeps them (sgmv_kernels/dora.py).
- `DenseDoraRows` (CPU): the step's DoRA adapters' scales gathered once into a dense [D + 1, width]
  tensor per group (row 0 all ones), reused while the same adapters run, then one index_select and
  one multiply per group: a few microseconds, where a per-segment loop would cost a call per adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraserve.lora.adapter import PROJECTIONS
from loraserve.lora.residency import NO_ADAPTER
from loraserve.lora.slots import NO_DORA, AdapterSlots
from sgmv_kernels.dora import sgmv_dora_scale

GroupKey = tuple[int, tuple[str, ...]]  # (layer, projections side by side in the output)


class DoraRows(Protocol):
    def apply(self, layer: int, projections: tuple[str, ...], out: torch.Tensor) -> None:
        """out [T, widths] *= each row's DoRA scales at these projections, in place."""


def group_tables(slots: AdapterSlots, layer: int, projections: tuple[str, ...]) -> tuple[torch.Tensor, list[int]]:
    """The group's dora_rows [projections, slots] (a view) and output widths."""
    first = PROJECTIONS.index(projections[0])
    widths = [slots.shapes[projection][1] for projection in projections]
    return slots.dora_rows[layer, first : first + len(projections)], widths


@dataclass(frozen=True)
class PooledDoraRows:
    slots: AdapterSlots
    seg_indptr: torch.Tensor
    seg_slots: torch.Tensor

    def apply(self, layer: int, projections: tuple[str, ...], out: torch.Tensor) -> None:
        dora_rows, widths = group_tables(self.slots, layer, projections)
        sgmv_dora_scale(self.slots.pool.buffer, dora_rows, widths, self.seg_indptr, self.seg_slots, out)


@dataclass
class DenseDoraScales:
    """The scale vectors of some DoRA slots as dense tensors, built per group on first use."""

    key: tuple[tuple[int, int], ...]  # (slot, its generation) of each, in row order 1..D
    _dense: dict[GroupKey, torch.Tensor | None] = field(default_factory=dict)

    def of(self, slots: AdapterSlots, layer: int, projections: tuple[str, ...]) -> torch.Tensor | None:
        """[D + 1, widths]; None when none of these slots has DoRA at any of the projections."""
        group = (layer, projections)
        if group not in self._dense:
            self._dense[group] = self._gather(slots, layer, projections)
        return self._dense[group]

    def _gather(self, slots: AdapterSlots, layer: int, projections: tuple[str, ...]) -> torch.Tensor | None:
        dora_rows, widths = group_tables(slots, layer, projections)
        chosen = [slot for slot, _ in self.key]
        offsets = dora_rows[:, chosen].tolist()  # [projections][D]
        if all(offset == NO_DORA for row in offsets for offset in row):
            return None
        pool = slots.pool.buffer
        dense = torch.ones(len(chosen) + 1, sum(widths), dtype=pool.dtype, device=pool.device)
        start = 0
        for row_offsets, width in zip(offsets, widths, strict=True):
            for index, offset in enumerate(row_offsets, start=1):
                if offset != NO_DORA:
                    dense[index, start : start + width] = pool[offset : offset + width]
            start += width
        return dense


@dataclass(frozen=True)
class DenseDoraRows:
    slots: AdapterSlots
    scales: DenseDoraScales
    row_index: torch.Tensor  # [T] int64: 0 (scale by one) or i, the i-th slot of scales.key

    def apply(self, layer: int, projections: tuple[str, ...], out: torch.Tensor) -> None:
        dense = self.scales.of(self.slots, layer, projections)
        if dense is not None:
            out.mul_(dense.index_select(0, self.row_index))


def plan_dora_rows(
    slots: AdapterSlots, lengths: list[int], slot_ids: list[int], seg_indptr: torch.Tensor, seg_slots: torch.Tensor,
    pooled: bool,
) -> DoraRows | None:  # fmt: skip
    """This step's DoRA rows; None when none of its adapters has DoRA. `pooled`: the Triton form."""
    dora_slots = sorted({slot for slot in slot_ids if slot != NO_ADAPTER and slots.has_dora[slot]})
    if not dora_slots:
        return None
    if pooled:
        return PooledDoraRows(slots, seg_indptr, seg_slots)
    key = slots.generation_key(dora_slots)
    if slots.dense_dora is None or slots.dense_dora.key != key:
        slots.dense_dora = DenseDoraScales(key)  # kept across steps while the same adapters run
    scales = slots.dense_dora
    index_of = {slot: index for index, slot in enumerate(dora_slots, start=1)}
    per_sequence = torch.tensor([index_of.get(slot, 0) for slot in slot_ids], dtype=torch.int64)
    row_index = per_sequence.repeat_interleave(torch.tensor(lengths, dtype=torch.int64))
    return DenseDoraRows(slots, scales, row_index.to(slots.pool.buffer.device))
