"""Per-step LoRA metadata handed to the LoRA backend, built once per step (not per layer)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from loraserve.lora.backends import LoraBackend, TritonLora
from loraserve.lora.dora_rows import DoraRows, plan_dora_rows
from loraserve.lora.residency import NO_ADAPTER
from loraserve.lora.slots import AdapterSlots


@dataclass
class LoraBatch:
    """Which slot each row of the step uses; the model calls `add` at every adapted projection.

    Rows are the step's tokens in the runner's order; a segment is a run of rows of one slot
    (neighbouring sequences of one adapter share a segment, so the kernels read it once).
    Example: decodes of adapters in slots 2, 2 and -1, then a 3-token chunk of slot 0:
    seg_indptr = [0, 2, 3, 6], seg_slots = [2, -1, 0].
    """

    slots: AdapterSlots
    seg_indptr: torch.Tensor  # [num_segments + 1] int32
    seg_slots: torch.Tensor  # [num_segments] int32, NO_ADAPTER for base-model rows
    backend: LoraBackend
    plan: object = None  # the backend's own view of this step's rows (backends.py)
    # Rows of the longest segment: the kernels spread a prompt's rows over programs. None (the
    # CUDA graphs' fixed grid): a program per segment loops over its rows.
    max_segment_len: int | None = None
    # Segments that hold rows, where the tables have more (a CUDA graph's): sizes the kernels' K split.
    busy_segments: int | None = None
    dora: DoraRows | None = None  # the step's DoRA rows; None: no adapter of the step has DoRA

    @classmethod
    def build(
        cls, slots: AdapterSlots, lengths: list[int], slot_ids: list[int], backend: LoraBackend
    ) -> LoraBatch | None:
        """None when no row of the step uses an adapter: the model then skips LoRA entirely."""
        if all(slot == NO_ADAPTER for slot in slot_ids):
            return None
        ends, run_slots = adapter_runs(lengths, slot_ids)
        device = slots.pool.buffer.device
        seg_indptr = torch.tensor([0, *ends], dtype=torch.int32, device=device)
        seg_slots = torch.tensor(run_slots, dtype=torch.int32, device=device)
        return cls(
            slots=slots,
            seg_indptr=seg_indptr,
            seg_slots=seg_slots,
            backend=backend,
            plan=backend.plan(slots, lengths, slot_ids),
            max_segment_len=max(end - start for start, end in zip([0, *ends], ends, strict=False)),
            dora=plan_dora_rows(
                slots, lengths, slot_ids, seg_indptr, seg_slots, pooled=isinstance(backend, TritonLora)
            ),
        )

    def start(self, layer: int, projections: tuple[str, ...], x: torch.Tensor) -> object:
        """What the LoRA of `projections` needs of x alone, started before the base model's product
        (on CUDA, the shrink, which a graph replays beside that product); hand it to `add`."""
        return self.backend.start(self, layer, projections, x)

    def add(
        self, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor, started: object = None
    ) -> None:
        """out [T, widths] += LoRA(x [T, in_features]) with each row's adapter, in place. `projections`
        share the input x and their outputs lie side by side in `out` (q/k/v, gate/up), or it is one.
        `started`: what `start` returned for them (None: started here). Rows of DoRA adapters then
        scale base and delta together."""
        if started is None:
            started = self.start(layer, projections, x)
        self.backend.add(self, layer, projections, x, out, started)
        if self.dora is not None:
            self.dora.apply(layer, projections, out)


def adapter_runs(lengths: list[int], slot_ids: list[int], longest: int | None = None) -> tuple[list[int], list[int]]:
    """Consecutive sequences of one slot merged: (each run's end row, its slot), a run cut before a
    sequence that would take it past `longest` rows (a sequence is never cut).
    Example: lengths [1, 1, 1, 3], slots [2, 2, -1, 2] -> ([2, 3, 6], [2, -1, 2]); lengths [1] * 5 of
    slot 4 with longest 2 -> ([2, 4, 5], [4, 4, 4])."""
    ends: list[int] = []
    slots: list[int] = []
    for slot, run in itertools.groupby(zip(lengths, slot_ids, strict=True), key=lambda pair: pair[1]):
        start = ends[-1] if ends else 0
        ends.append(start)
        slots.append(slot)
        for length, _ in run:
            if longest is not None and ends[-1] > start and ends[-1] - start + length > longest:
                start = ends[-1]
                ends.append(start)
                slots.append(slot)
            ends[-1] += length
    return ends, slots
