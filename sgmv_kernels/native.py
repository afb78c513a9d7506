"""The compiled CPU kernel (lora_cpu.cpp): multi-LoRA straight from the pool, one call per
group of projections that share an input.

Built on first use for this machine (build.py); without a compiler `load_kernel` says why
and returns None, and the caller keeps to the torch path (cpu.grouped_lora).

Example of the row chunks a step hands it: segments of lengths [1, 1, 3] in slots
[2, -1, 2] give order = [0, 2, 3, 4] (the adapted rows, sorted by slot) and one chunk
(0, 4, slot 2); with more than CHUNK_ROWS rows a slot's rows take several chunks.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from sgmv_kernels.build import entry_point, load_library

SOURCE = Path(__file__).with_name("lora_cpu.cpp")
CHUNK_ROWS = 8  # kChunkRows in lora_cpu.cpp: rows of one slot that share a read of its weights
_FUNCTIONS = {torch.float32: "lora_add_float32", torch.bfloat16: "lora_add_bfloat16"}


@dataclass(frozen=True)
class RowChunks:
    """The step's adapted rows sorted by slot, cut into chunks of one slot; built once per step."""

    order: torch.Tensor  # [N] int64 row indices
    chunks: torch.Tensor  # [C, 3] int32: (first, end) into order, slot

    @classmethod
    def of_segments(cls, lengths: list[int], slot_of_segment: list[int]) -> RowChunks:
        rows_of: dict[int, list[int]] = {}
        row = 0
        for length, slot in zip(lengths, slot_of_segment, strict=True):
            if slot >= 0:
                rows_of.setdefault(slot, []).extend(range(row, row + length))
            row += length
        order: list[int] = []
        chunks: list[tuple[int, int, int]] = []
        for slot in sorted(rows_of):
            rows = rows_of[slot]
            for start in range(0, len(rows), CHUNK_ROWS):
                first = len(order) + start
                chunks.append((first, first + len(rows[start : start + CHUNK_ROWS]), slot))
            order += rows
        return cls(torch.tensor(order, dtype=torch.int64), torch.tensor(chunks, dtype=torch.int32).view(-1, 3))


@dataclass(frozen=True)
class ProjectionGroup:
    """Projections of one layer that share an input (q/k/v, gate/up, or one alone), as one set
    of slot tables (layout.py); their outputs lie side by side in the kernel's `out`."""

    pool: torch.Tensor  # [N] model dtype
    a_rows: torch.Tensor  # [projections, num_slots, max_rank] int64, contiguous
    b_rows: torch.Tensor  # [projections, num_slots, max_rank] int64, contiguous
    ranks: torch.Tensor  # [projections, num_slots] int32, contiguous
    scales: torch.Tensor  # [projections, num_slots] float32, contiguous
    widths: torch.Tensor  # [projections] int64 output columns of each
    in_features: int
    out_features: int  # the sum of widths
    row_alignment: int = 1  # every row offset is a multiple of it (layout.row_alignment)


class LoraKernel:
    """The loaded library: `add` runs one group of projections for every adapted row."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for dtype, name in _FUNCTIONS.items():
            function = getattr(library, name)
            function.restype = None
            function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
            function.argtypes += [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64]
            function.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            function.argtypes += [ctypes.c_int]
            self._functions[dtype] = function

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def entry_point(self, dtype: torch.dtype) -> int:
        return entry_point(self._functions[dtype])

    def add(self, x: torch.Tensor, group: ProjectionGroup, rows: RowChunks, out: torch.Tensor) -> None:
        """out [T, sum(widths)] += each projection's LoRA of x [T, in] with each row's adapter, in place."""
        if x.shape[1] != group.in_features or out.shape[1] != group.out_features:
            raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} do not fit the projections")
        if x.stride(1) != 1 or out.stride(1) != 1:
            raise ValueError("x and out need contiguous rows")
        if not (x.dtype == out.dtype == group.pool.dtype) or x.device.type != "cpu":
            raise ValueError(f"x, out and the pool must share one CPU dtype, got {x.dtype}, {out.dtype}")
        num_projections, num_slots, max_rank = group.a_rows.shape
        self._functions[x.dtype](
            x.data_ptr(),
            x.stride(0),
            x.shape[1],
            group.pool.data_ptr(),
            group.a_rows.data_ptr(),
            group.b_rows.data_ptr(),
            group.ranks.data_ptr(),
            group.scales.data_ptr(),
            num_slots,
            max_rank,
            group.widths.data_ptr(),
            num_projections,
            rows.order.data_ptr(),
            rows.chunks.data_ptr(),
            rows.chunks.shape[0],
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )


def load_kernel(cache_dir: Path) -> LoraKernel | None:
    """The kernel built for this machine (building it if needed), or None with a warning saying why."""
    library = load_library(SOURCE, cache_dir, "multi-LoRA on the CPU falls back to the slower torch path")
    return LoraKernel(library) if library is not None else None
