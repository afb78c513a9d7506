"""How a step's LoRA deltas are computed: one backend, chosen once when the engine starts.

- `CompiledCpuLora`: the CPU kernel of sgmv_kernels/native.py, one call per group of
  projections that share an input (q/k/v, gate/up), rows chunked by adapter.
- `TorchCpuLora`: where no compiler is found (or the dtype is not one the kernel takes):
  rows regrouped by adapter, dense stacks of the running adapters reused across steps.
- `TritonLora`: CUDA (and the Triton interpreter in tests): one shrink and one expand
  launch per group of projections, each segment's adapter read once.
Each plans once per step (`plan`) and is called at every adapted projection group (`add`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from loraserve.lora.residency import NO_ADAPTER
from loraserve.lora.slots import AdapterSlots
from loraserve.lora.stacked import StackedLora
from sgmv_kernels import column_block, sgmv_expand_group, sgmv_shrink_group
from sgmv_kernels.cpu import RowGroups, grouped_lora
from sgmv_kernels.native import LoraKernel, RowChunks, load_kernel

if TYPE_CHECKING:
    from loraserve.lora.batch import LoraBatch

logger = logging.getLogger(__name__)


class LoraBackend(Protocol):
    @property
    def name(self) -> str: ...

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> object:
        """What `add` needs of this step's rows, worked out once per step (not per layer)."""

    def add(
        self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor
    ) -> None:
        """out [T, widths] += LoRA(x [T, in_features]) of `projections`, side by side in `out`."""


@dataclass(frozen=True)
class CompiledCpuLora:
    kernel: LoraKernel
    name: str = "compiled CPU kernel"

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> RowChunks:
        return RowChunks.of_segments(lengths, slot_ids)

    def add(
        self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor
    ) -> None:
        assert isinstance(batch.plan, RowChunks)
        self.kernel.add(x, batch.slots.projection_group(layer, projections), batch.plan, out)


@dataclass(frozen=True)
class GroupedRows:
    groups: RowGroups  # the rows regrouped by adapter
    stacked: StackedLora  # the running adapters' weights, dense


@dataclass(frozen=True)
class TorchCpuLora:
    name: str = "torch (no compiled kernel)"

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> GroupedRows:
        distinct = sorted(set(slot_ids) - {NO_ADAPTER})
        group_of = {slot: group for group, slot in enumerate(distinct)}
        groups = RowGroups.of_segments(lengths, [group_of.get(slot, NO_ADAPTER) for slot in slot_ids], "cpu")
        return GroupedRows(groups, slots.stacked(distinct))

    def add(
        self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor
    ) -> None:
        assert isinstance(batch.plan, GroupedRows)
        stacks = batch.plan.stacked.weights(layer, projections, batch.slots.layers[layer])
        if stacks is not None:  # None: no running adapter adapts these projections
            grouped_lora(x, *stacks, batch.plan.groups, out)


@dataclass(frozen=True)
class TritonLora:
    name: str = "Triton kernels"

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> object:
        return None  # the segments are all it needs

    def add(
        self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor, out: torch.Tensor
    ) -> None:
        group = batch.slots.projection_group(layer, projections)
        widths = [batch.slots.shapes[projection][1] for projection in projections]
        segments, longest = (batch.seg_indptr, batch.seg_slots), batch.max_segment_len
        launches = [(slice(None), widths)]  # the group at once, or (widths no launch can share) one by one
        if column_block(widths) is None:
            launches = [(slice(p, p + 1), [width]) for p, width in enumerate(widths)]
        column = 0
        for chosen, launch_widths in launches:
            a_tables = (group.pool, group.a_rows[chosen], group.ranks[chosen])
            alignment, busy = group.row_alignment, batch.busy_segments
            partials = sgmv_shrink_group(x, *a_tables, *segments, longest, row_alignment=alignment, busy_segments=busy)
            b_tables = (group.pool, group.b_rows[chosen], group.ranks[chosen], group.scales[chosen])
            columns = slice(column, column + sum(launch_widths))
            sgmv_expand_group(partials, *b_tables, *segments, out[:, columns], launch_widths, longest, alignment)
            column = columns.stop


def choose_backend(device: str, dtype: torch.dtype, kernel_dir: Path) -> LoraBackend:
    """Triton on CUDA; on the CPU the compiled kernel where it builds and takes `dtype`, else torch."""
    backend: LoraBackend = TritonLora()
    if device == "cpu":
        kernel = load_kernel(kernel_dir)
        backend = CompiledCpuLora(kernel) if kernel is not None and kernel.supports(dtype) else TorchCpuLora()
    logger.info("LoRA through the %s", backend.name)
    return backend
