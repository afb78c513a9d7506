"""How a step's LoRA deltas are computed: one backend, chosen once when the engine starts.

- `CompiledCpuLora`: the CPU kernel of sgmv_kernels/native.py, one call per group of
  projections that share an input (q/k/v, gate/up), rows chunked by adapter.
- `TorchCpuLora`: where no compiler is found (or the dtype is not one the kernel takes):
  rows regrouped by adapter, dense stacks of the running adapters reused across steps.
- `TritonLora`: CUDA (and the Triton interpreter in tests): one shrink and one expand
  launch per group of projections, each segment's adapter read once.
Each plans once per step (`plan`) and is called at every adapted projection group: `start`
before the base model's product of that group (which it may run beside), `add` after it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from loraserve.lora.residency import NO_ADAPTER
from loraserve.lora.slots import AdapterSlots
from loraserve.lora.stacked import StackedLora
from sgmv_kernels import column_block, sgmv_expand_group, sgmv_shrink_group, sgmv_shrink_output
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

    def start(self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor) -> object:
        """What needs x alone (the shrink), launched before the base product of `projections`; `add` takes it."""

    def add(
        self,
        batch: LoraBatch,
        layer: int,
        projections: tuple[str, ...],
        x: torch.Tensor,
        out: torch.Tensor,
        started: object,
    ) -> None:
        """out [T, widths] += LoRA(x [T, in_features]) of `projections`, side by side in `out`."""


class _CpuLora:
    """The CPU backends do all their work in `add`."""

    def start(self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor) -> object:
        return None


@dataclass(frozen=True)
class CompiledCpuLora(_CpuLora):
    kernel: LoraKernel
    name: str = "compiled CPU kernel"

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> RowChunks:
        return RowChunks.of_segments(lengths, slot_ids)

    def add(
        self,
        batch: LoraBatch,
        layer: int,
        projections: tuple[str, ...],
        x: torch.Tensor,
        out: torch.Tensor,
        started: object,
    ) -> None:
        assert isinstance(batch.plan, RowChunks)
        self.kernel.add(x, batch.slots.projection_group(layer, projections), batch.plan, out)


@dataclass(frozen=True)
class GroupedRows:
    groups: RowGroups  # the rows regrouped by adapter
    stacked: StackedLora  # the running adapters' weights, dense


@dataclass(frozen=True)
class TorchCpuLora(_CpuLora):
    name: str = "torch (no compiled kernel)"

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> GroupedRows:
        distinct = sorted(set(slot_ids) - {NO_ADAPTER})
        group_of = {slot: group for group, slot in enumerate(distinct)}
        groups = RowGroups.of_segments(lengths, [group_of.get(slot, NO_ADAPTER) for slot in slot_ids], "cpu")
        return GroupedRows(groups, slots.stacked(distinct))

    def add(
        self,
        batch: LoraBatch,
        layer: int,
        projections: tuple[str, ...],
        x: torch.Tensor,
        out: torch.Tensor,
        started: object,
    ) -> None:
        assert isinstance(batch.plan, GroupedRows)
        stacks = batch.plan.stacked.weights(layer, projections, batch.slots.layers[layer])
        if stacks is not None:  # None: no running adapter adapts these projections
            grouped_lora(x, *stacks, batch.plan.groups, out)


@dataclass(frozen=True)
class ShrunkGroup:
    """A projection group's shrink, launched: y per launch (the group at once, or its projections one
    by one where no launch can share them), and the stream it runs on when that is not the step's."""

    launches: list[tuple[slice, list[int], torch.Tensor]]  # (projections, their widths, y)
    stream: torch.cuda.Stream | None


@dataclass(frozen=True)
class TritonLora:
    name: str = "Triton kernels"

    def plan(self, slots: AdapterSlots, lengths: list[int], slot_ids: list[int]) -> object:
        return None  # the segments are all it needs

    def start(self, batch: LoraBatch, layer: int, projections: tuple[str, ...], x: torch.Tensor) -> ShrunkGroup:
        """The shrink. While a CUDA graph is captured it goes on a side stream, so a replay runs it
        beside the base model's product, which seldom fills the GPU at decode sizes (eagerly the
        host's launches are the bottleneck, and the streams' events would add to them)."""
        group = batch.slots.projection_group(layer, projections)
        widths = [batch.slots.shapes[projection][1] for projection in projections]
        launches = [(slice(None), widths)]  # the group at once, or (widths no launch can share) one by one
        if column_block(widths) is None:
            launches = [(slice(p, p + 1), [width]) for p, width in enumerate(widths)]
        ys = [sgmv_shrink_output(x, group.a_rows[chosen]) for chosen, _ in launches]  # on the step's stream
        stream = _side_stream(x.device) if x.is_cuda and torch.cuda.is_current_stream_capturing() else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for (chosen, _), y in zip(launches, ys, strict=True):
                a_tables = (group.pool, group.a_rows[chosen], group.ranks[chosen], batch.seg_indptr, batch.seg_slots)
                alignment, busy = group.row_alignment, batch.busy_segments
                sgmv_shrink_group(x, *a_tables, batch.max_segment_len, False, alignment, busy, y)
        return ShrunkGroup([(chosen, w, y) for (chosen, w), y in zip(launches, ys, strict=True)], stream)

    def add(
        self,
        batch: LoraBatch,
        layer: int,
        projections: tuple[str, ...],
        x: torch.Tensor,
        out: torch.Tensor,
        started: object,
    ) -> None:
        assert isinstance(started, ShrunkGroup)
        if started.stream is not None:
            torch.cuda.current_stream(x.device).wait_stream(started.stream)
        group = batch.slots.projection_group(layer, projections)
        segments, longest = (batch.seg_indptr, batch.seg_slots), batch.max_segment_len
        column = 0
        for chosen, launch_widths, y in started.launches:
            b_tables = (group.pool, group.b_rows[chosen], group.ranks[chosen], group.scales[chosen])
            columns = slice(column, column + sum(launch_widths))
            sgmv_expand_group(
                y, *b_tables, *segments, out[:, columns], launch_widths, longest, group.row_alignment,
                batch.busy_segments,
            )  # fmt: skip
            column = columns.stop


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def choose_backend(device: str, dtype: torch.dtype, kernel_dir: Path) -> LoraBackend:
    """Triton on CUDA; on the CPU the compiled kernel where it builds and takes `dtype`, else torch."""
    backend: LoraBackend = TritonLora()
    if device == "cpu":
        kernel = load_kernel(kernel_dir)
        backend = CompiledCpuLora(kernel) if kernel is not None and kernel.supports(dtype) else TorchCpuLora()
    logger.info("LoRA through the %s", backend.name)
    return backend
