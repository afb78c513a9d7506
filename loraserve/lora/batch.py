"""Per-step LoRA metadata handed to the kernels, built once per step (not per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.lora.slots import AdapterSlots
from loraserve.lora.stacked import StackedLora
from sgmv_kernels import (
    PooledLora,
    column_block,
    lora_expand,
    lora_shrink,
    sgmv_expand_group,
    sgmv_shrink_group,
)
from sgmv_kernels.cpu import RowGroups, grouped_lora
from sgmv_kernels.native import LoraKernel, RowChunks

NO_ADAPTER = -1


@dataclass
class LoraBatch:
    """Which slot each row of the step uses; the model calls `add` at every adapted projection.

    Rows are the step's tokens in the runner's order; a segment is a run of rows of one slot
    (neighbouring sequences of one adapter share a segment, so the kernels read it once).
    Example: decodes of adapters in slots 2, 2 and -1, then a 3-token chunk of slot 0:
    seg_indptr = [0, 2, 3, 6], seg_slots = [2, -1, 0]; row_slots = None (a prefill is present).
    """

    slots: AdapterSlots
    seg_indptr: torch.Tensor  # [num_segments + 1] int32
    seg_slots: torch.Tensor  # [num_segments] int32, NO_ADAPTER for base-model rows
    row_slots: torch.Tensor | None  # [T] int32 when every sequence is one row (decode), for the CPU
    # Rows of the longest segment: the kernels spread a prompt's rows over programs. None (the
    # CUDA graphs' fixed grid): a program per segment loops over its rows.
    max_segment_len: int | None = None
    # On the CPU, the compiled kernel and the rows sorted by slot (native.py); without a
    # compiler, the torch path: rows regrouped by adapter and dense weights (grouped_lora).
    native: tuple[LoraKernel, RowChunks] | None = None
    grouped: tuple[RowGroups, StackedLora] | None = None

    @classmethod
    def build(
        cls,
        slots: AdapterSlots,
        lengths: list[int],
        slot_ids: list[int],
        device: str,
        cpu_kernel: LoraKernel | None = None,
    ) -> LoraBatch | None:
        """None when no row of the step uses an adapter: the model then skips LoRA entirely."""
        if all(slot == NO_ADAPTER for slot in slot_ids):
            return None
        ends, run_slots = adapter_runs(lengths, slot_ids)
        native = grouped = None
        if device == "cpu" and cpu_kernel is not None and cpu_kernel.supports(slots.pool.dtype):
            native = cpu_kernel, RowChunks.of_segments(lengths, slot_ids)
        elif device == "cpu":
            distinct = sorted(set(slot_ids) - {NO_ADAPTER})
            group_of = {slot: group for group, slot in enumerate(distinct)}
            groups = RowGroups.of_segments(lengths, [group_of.get(slot, NO_ADAPTER) for slot in slot_ids], device)
            grouped = groups, slots.stacked(distinct)
        decode = device == "cpu" and all(length == 1 for length in lengths)  # row_slots: the CPU's torch paths
        return cls(
            slots=slots,
            seg_indptr=torch.tensor([0, *ends], dtype=torch.int32, device=device),
            seg_slots=torch.tensor(run_slots, dtype=torch.int32, device=device),
            row_slots=torch.tensor(slot_ids, dtype=torch.int32, device=device) if decode else None,
            max_segment_len=max(end - start for start, end in zip([0, *ends], ends, strict=False)),
            native=native,
            grouped=grouped,
        )

    def add(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, widths] += LoRA(x [T, in_features]) with each row's adapter, in place. `projections`
        share the input x and their outputs lie side by side in `out` (q/k/v, gate/up), or it is one."""
        if self.native is not None:
            kernel, rows = self.native
            kernel.add(x, self.slots.projection_group(layer, projections), rows, out)
            return
        if x.is_cuda:
            self.add_with_kernels(layer, projections, x, out)
            return
        layer_lora = self.slots.layers[layer]
        if self.grouped is not None:
            groups, stacked = self.grouped
            stacks = stacked.weights(layer, projections, layer_lora)
            if stacks is not None:
                grouped_lora(x, *stacks, groups, out)
            return
        column = 0
        for projection in projections:
            width = self.slots.shapes[projection][1]
            self._add_one(layer_lora[projection], x, out[:, column : column + width])
            column += width

    def add_with_kernels(self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor) -> None:
        """`add` through the Triton kernels (CUDA; the interpreter on the CPU): one shrink and one
        expand launch for the projections that share x, each segment's adapter read once."""
        group = self.slots.projection_group(layer, projections)
        widths = [self.slots.shapes[projection][1] for projection in projections]
        segments, longest = (self.seg_indptr, self.seg_slots), self.max_segment_len
        if column_block(widths) is not None:
            partials = sgmv_shrink_group(x, group.pool, group.a_rows, group.ranks, *segments, longest)
            tables = (group.pool, group.b_rows, group.ranks, group.scales)
            sgmv_expand_group(partials, *tables, *segments, out, widths, longest)
            return
        column = 0
        for p, width in enumerate(widths):  # widths no launch can share: a projection at a time
            one = slice(p, p + 1)
            partials = sgmv_shrink_group(x, group.pool, group.a_rows[one], group.ranks[one], *segments, longest)
            tables = (group.pool, group.b_rows[one], group.ranks[one], group.scales[one])
            sgmv_expand_group(partials, *tables, *segments, out[:, column : column + width], [width], longest)
            column += width

    def _add_one(self, weights: PooledLora, x: torch.Tensor, out: torch.Tensor) -> None:
        """The torch paths (CPU): rows gathered per adapter for decode, the references for segments."""
        if self.row_slots is not None:
            y = lora_shrink(x, weights, row_slots=self.row_slots)
            lora_expand(y, weights, out, row_slots=self.row_slots)
            return
        y = lora_shrink(x, weights, seg_indptr=self.seg_indptr, seg_slots=self.seg_slots)
        lora_expand(y, weights, out, seg_indptr=self.seg_indptr, seg_slots=self.seg_slots)


def adapter_runs(lengths: list[int], slot_ids: list[int]) -> tuple[list[int], list[int]]:
    """Consecutive sequences of one slot merged: (each run's end row, its slot).
    Example: lengths [1, 1, 1, 3], slots [2, 2, -1, 2] -> ([2, 3, 6], [2, -1, 2])."""
    ends: list[int] = []
    slots: list[int] = []
    row = 0
    for length, slot in zip(lengths, slot_ids, strict=True):
        row += length
        if slots and slots[-1] == slot:
            ends[-1] = row
        else:
            ends.append(row)
            slots.append(slot)
    return ends, slots
