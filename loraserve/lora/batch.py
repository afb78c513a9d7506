"""Per-step LoRA metadata handed to the kernels, built once per step (not per layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.lora.slots import AdapterSlots
from sgmv_kernels import lora_expand, lora_shrink

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

    @classmethod
    def build(cls, slots: AdapterSlots, lengths: list[int], slot_ids: list[int], device: str) -> LoraBatch | None:
        """None when no row of the step uses an adapter: the model then skips LoRA entirely."""
        if all(slot == NO_ADAPTER for slot in slot_ids):
            return None
        offsets = [0]
        for length in lengths:
            offsets.append(offsets[-1] + length)
        seg_slots = torch.tensor(slot_ids, dtype=torch.int32, device=device)
        return cls(
            slots=slots,
            seg_indptr=torch.tensor(offsets, dtype=torch.int32, device=device),
            seg_slots=seg_slots,
            row_slots=seg_slots if all(length == 1 for length in lengths) else None,
            max_segment_len=max(lengths),
        )

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out [T, out_features] += LoRA(x [T, in_features]) with each row's adapter, in place."""
        weights = self.slots.layers[layer][projection]
        if self.row_slots is not None:
            y = lora_shrink(x, weights, row_slots=self.row_slots)
            lora_expand(y, weights, out, row_slots=self.row_slots)
            return
        segments, slots, longest = self.seg_indptr, self.seg_slots, self.max_segment_len
        y = lora_shrink(x, weights, seg_indptr=segments, seg_slots=slots, max_segment_len=longest)
        lora_expand(y, weights, out, seg_indptr=segments, seg_slots=slots, max_segment_len=longest)
