"""Per-step LoRA metadata handed to the kernels, built once per step (not per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.lora.slots import AdapterSlots
from loraserve.lora.stacked import StackedLora
from sgmv_kernels import PooledLora, bgmv_expand_group, bgmv_shrink_group, lora_expand, lora_shrink
from sgmv_kernels.cpu import RowGroups, grouped_lora
from sgmv_kernels.expand import GROUP_COLUMN_BLOCK
from sgmv_kernels.native import LoraKernel, RowChunks

NO_ADAPTER = -1


@dataclass
class LoraBatch:
    """Which slot each row of the step uses; the model calls `add` at every adapted projection.

    Rows are the step's tokens in the runner's order, a segment per scheduled sequence.
    Example: decodes of adapters in slots 2 and -1, then a 3-token chunk of slot 0:
    seg_indptr = [0, 1, 2, 5], seg_slots = [2, -1, 0]; row_slots = None (a prefill is present).
    """

    slots: AdapterSlots
    seg_indptr: torch.Tensor  # [num_segments + 1] int32
    seg_slots: torch.Tensor  # [num_segments] int32, NO_ADAPTER for base-model rows
    row_slots: torch.Tensor | None  # [T] int32 when every segment is one row (decode: BGMV)
    max_segment_len: int  # sizes the SGMV grid without reading seg_indptr back from the device
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
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        seg_slots = torch.tensor(slot_ids, dtype=torch.int32, device=device)
        native = grouped = None
        if device == "cpu" and cpu_kernel is not None and cpu_kernel.supports(slots.pool.dtype):
            native = cpu_kernel, RowChunks.of_segments(lengths, slot_ids)
        elif device == "cpu":
            distinct = sorted(set(slot_ids) - {NO_ADAPTER})
            group_of = {slot: group for group, slot in enumerate(distinct)}
            groups = RowGroups.of_segments(lengths, [group_of.get(slot, NO_ADAPTER) for slot in slot_ids], device)
            grouped = groups, slots.stacked(distinct)
        return cls(
            slots=slots,
            seg_indptr=torch.tensor(offsets, dtype=torch.int32, device=device),
            seg_slots=seg_slots,
            row_slots=seg_slots if all(length == 1 for length in lengths) else None,
            max_segment_len=max(lengths),
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
        widths = [self.slots.shapes[projection][1] for projection in projections]
        if self.row_slots is not None and x.is_cuda and all(width % GROUP_COLUMN_BLOCK == 0 for width in widths):
            # Decode on CUDA: one shrink and one expand launch for the projections that share x.
            group = self.slots.projection_group(layer, projections)
            y = bgmv_shrink_group(x, group.pool, group.a_rows, group.ranks, self.row_slots)
            bgmv_expand_group(y, group.pool, group.b_rows, group.ranks, group.scales, self.row_slots, out, widths)
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

    def _add_one(self, weights: PooledLora, x: torch.Tensor, out: torch.Tensor) -> None:
        if self.row_slots is not None:
            y = lora_shrink(x, weights, row_slots=self.row_slots)
            lora_expand(y, weights, out, row_slots=self.row_slots)
            return
        segments, slots, longest = self.seg_indptr, self.seg_slots, self.max_segment_len
        y = lora_shrink(x, weights, seg_indptr=segments, seg_slots=slots, max_segment_len=longest)
        lora_expand(y, weights, out, seg_indptr=segments, seg_slots=slots, max_segment_len=longest)
