"""Adapter slots: the index a batch row names, and where each loaded adapter's rows lie.

A slot is what the kernels index by (at most `max_loras` adapters run in one step); the
weights themselves live in pages of the memory pool, taken in proportion to the
adapter's size. Per layer and projection the kernels get a `PooledLora` view: the pool
and, per slot, the offsets of A's rows and of B^T's rows (padding entries point at the
pool's zero tail), the rank (0 = not adapted) and the scale; a DoRA module also keeps one row of
its output scale vector (`dora_rows`, -1 where there is none).

Rows are packed into the pages' slabs in order, never split across slabs. A load
reserves a slot and its pages, writes them (possibly from the loader thread while steps
run: no step reads a reserved slot) and activates it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraserve.errors import ConfigError
from loraserve.lora.adapter import PROJECTIONS, LoraAdapter, projection_shapes
from loraserve.lora.stacked import StackedLora
from loraserve.memory.page_allocator import PageUse
from loraserve.memory.pool import MemoryPool
from loraserve.models.decoder_spec import DecoderSpec
from sgmv_kernels import PooledLora
from sgmv_kernels.layout import row_alignment
from sgmv_kernels.native import ProjectionGroup

if TYPE_CHECKING:
    from loraserve.lora.dora_rows import DenseDoraScales

LayerLora = dict[str, PooledLora]  # projection name -> its weights in every slot
DORA_SCALE = 2  # RowBlock.matrix of a DoRA scale row
NO_DORA = -1  # dora_rows entry of a module without DoRA


@dataclass(frozen=True)
class RowBlock:
    """`rank` rows of `width` elements: rows of A (`matrix` 0), of B^T (1), or DoRA's one scale row (2)."""

    layer: int
    projection: int  # index in PROJECTIONS
    matrix: int
    rows: torch.Tensor  # [rank, width]


@dataclass(frozen=True)
class Placement:
    """Where a block's rows start: a slab of the adapter's own pages and an element in it."""

    block: RowBlock
    first_row: int
    num_rows: int
    slab: int  # index among the adapter's slabs: page (slab // slabs_per_page), piece (slab % ...)
    start: int


def row_blocks(adapter: LoraAdapter) -> Iterator[RowBlock]:
    """A's then B^T's rows of each projection (then its DoRA scale row), layer by layer in PROJECTIONS
    order: the order the CPU kernel reads them, so each call (q/k/v, o, gate/up, down) streams one run
    per adapter."""
    in_read_order = sorted(adapter.weights.items(), key=lambda item: (item[0][0], PROJECTIONS.index(item[0][1])))
    for (layer, projection), weights in in_read_order:
        index = PROJECTIONS.index(projection)
        yield RowBlock(layer, index, 0, weights.a)
        yield RowBlock(layer, index, 1, weights.b.T)
        if weights.magnitude is not None:
            assert weights.dora_scale is not None, "a DoRA adapter is stored with its scales (dora.py)"
            yield RowBlock(layer, index, DORA_SCALE, weights.dora_scale[None])


def pack(blocks: Iterator[RowBlock], slab_elems: int) -> tuple[list[Placement], int]:
    """Fill slabs in order with whole rows; returns the placements and the slabs used."""
    placements: list[Placement] = []
    slab, used = 0, 0
    for block in blocks:
        rank, width = block.rows.shape
        row = 0
        while row < rank:
            fits = (slab_elems - used) // width
            if fits == 0:
                slab, used = slab + 1, 0
                continue
            count = min(fits, rank - row)
            placements.append(Placement(block, row, count, slab, used))
            row, used = row + count, used + count * width
    return placements, slab + (1 if used else 0)


def smallest_block_size(spec: DecoderSpec, block_size: int) -> int:
    """`block_size`, doubled until a page (one block of K and V per layer) holds an adapter's widest row:
    a model with few, narrow KV heads and a wide MLP (Gemma-3-1B: one head of 256, 6,912 wide) needs 32."""
    widest_row = max(width for shape in projection_shapes(spec).values() for width in shape)
    while block_size * spec.num_kv_heads * spec.head_dim < widest_row:
        block_size *= 2
    return block_size


class AdapterSlots:
    """Owns which slots are taken and the row tables the kernels read; which adapter holds a slot
    is in its record (adapter_state.py)."""

    def __init__(self, spec: DecoderSpec, num_slots: int, max_rank: int, pool: MemoryPool) -> None:
        self.num_slots, self.max_rank, self.pool = num_slots, max_rank, pool
        self.shapes = projection_shapes(spec)  # projection -> (in_features, out_features)
        widths = [width for shape in self.shapes.values() for width in shape]
        if (widest_row := max(widths)) > pool.slab_elems:  # rows are never split across slabs (see pack)
            raise ConfigError(
                "--block-size",
                f"a block of {pool.block_size} tokens holds {pool.slab_elems} elements per layer, less than one "
                f"adapter row of {widest_row}; use at least {smallest_block_size(spec, pool.block_size)}",
            )
        shape = (spec.num_layers, len(PROJECTIONS), num_slots)
        device = pool.buffer.device
        # Row tables [layers, projections, slots, max_rank] and per-slot ranks and scales.
        self.a_rows, self.b_rows = (
            torch.full((*shape, max_rank), pool.zero_offset, dtype=torch.int64, device=device) for _ in range(2)
        )
        self.ranks = torch.zeros(shape, dtype=torch.int32, device=device)
        self.scales = torch.zeros(shape, dtype=torch.float32, device=device)
        self.dora_rows = torch.full(shape, NO_DORA, dtype=torch.int64, device=device)  # [layers, projections, slots]
        self.has_dora = [False] * num_slots  # does the slot's adapter have any DoRA module?
        tables = (self.a_rows, self.b_rows, self.ranks, self.scales)
        self.layers: list[LayerLora] = [
            {name: PooledLora(pool.buffer, *(t[layer, p] for t in tables)) for p, name in enumerate(PROJECTIONS)}
            for layer in range(spec.num_layers)
        ]
        self._taken: dict[int, list[int]] = {}  # slot -> its pages: reserved for a load in flight, or loaded
        self._copy_stream = torch.cuda.Stream() if device.type == "cuda" else None
        # Bumped whenever a slot gets new contents: dense stacks of slots are keyed on it.
        self._generations = [0] * num_slots
        self._stacked: StackedLora | None = None
        self.dense_dora: DenseDoraScales | None = None  # the CPU's DoRA scales of the running adapters
        self._groups: dict[tuple[int, tuple[str, ...]], ProjectionGroup] = {}
        # A row starts at a slab's start plus whole rows, or at the zero tail (see pack).
        self.row_alignment = row_alignment(pool.slab_elems, pool.zero_offset, *widths)

    def stacked(self, slots: list[int]) -> StackedLora:
        """Dense stacks of these slots' weights (the CPU path), reused while the same adapters run."""
        key = self.generation_key(slots)
        if self._stacked is None or self._stacked.key != key:
            self._stacked = StackedLora.build(key, self.ranks, self.scales, self.shapes)
        return self._stacked

    def generation_key(self, slots: list[int]) -> tuple[tuple[int, int], ...]:
        """Which contents these slots hold: dense copies of them stay valid while it is the same."""
        return tuple((slot, self._generations[slot]) for slot in slots)

    def projection_group(self, layer: int, projections: tuple[str, ...]) -> ProjectionGroup:
        """The tables of projections that share an input (consecutive in PROJECTIONS), as views."""
        group = self._groups.get((layer, projections))
        if group is None:
            first = PROJECTIONS.index(projections[0])
            chosen = slice(first, first + len(projections))
            assert PROJECTIONS[chosen] == projections, f"not consecutive projections: {projections}"
            widths = [self.shapes[p][1] for p in projections]
            group = ProjectionGroup(
                pool=self.pool.buffer,
                a_rows=self.a_rows[layer, chosen],
                b_rows=self.b_rows[layer, chosen],
                ranks=self.ranks[layer, chosen],
                scales=self.scales[layer, chosen],
                widths=torch.tensor(widths, dtype=torch.int64),
                in_features=self.shapes[projections[0]][0],
                out_features=sum(widths),
                row_alignment=self.row_alignment,
            )
            self._groups[(layer, projections)] = group
        return group

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._taken)

    def pages_needed(self, adapter: LoraAdapter) -> int:
        _, slabs = pack(row_blocks(adapter), self.pool.slab_elems)
        return -(-slabs // self.pool.slabs_per_page)

    def pages_held(self, slot: int) -> list[int]:
        return self._taken[slot]

    def pages_of(self, slot: int) -> int:
        return len(self._taken[slot])

    def reserve(self, num_pages: int) -> int | None:
        """A free slot with `num_pages` pages; None (nothing taken) if either is short."""
        free = [slot for slot in range(self.num_slots) if slot not in self._taken]
        if not free:
            return None
        pages = self.pool.pages.take(num_pages, PageUse.ADAPTER)
        if pages is None:
            return None
        self._taken[free[0]] = pages
        return free[0]

    def cancel(self, slot: int) -> None:
        """Give back a reservation whose load did not finish."""
        self.pool.pages.release(self._taken.pop(slot), PageUse.ADAPTER)

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy the weights into the slot's reserved pages and fill its row tables."""
        pages = self._taken[slot]
        # read_adapter already refused ranks above the maximum the tables were sized for.
        assert adapter.rank <= self.max_rank, "adapter read with another max rank"
        pool = self.pool
        placements, num_slabs = pack(row_blocks(adapter), pool.slab_elems)
        assert num_slabs <= len(pages) * pool.slabs_per_page, "reserved with another size"
        staging = torch.zeros(num_slabs, pool.slab_elems, dtype=pool.dtype)
        slab_ids = [pool.slab_id(pages[s // pool.slabs_per_page], s % pool.slabs_per_page) for s in range(num_slabs)]
        tables = torch.full((2, *self.a_rows[:, :, 0].shape), pool.zero_offset, dtype=torch.int64)  # A's, B^T's
        dora_rows = torch.full(self.dora_rows[:, :, 0].shape, NO_DORA, dtype=torch.int64)
        for placed in placements:
            block, width = placed.block, placed.block.rows.shape[1]
            placed_rows = slice(placed.first_row, placed.first_row + placed.num_rows)
            rows = block.rows[placed_rows].flatten()
            staging[placed.slab, placed.start : placed.start + rows.numel()] = rows
            first = slab_ids[placed.slab] * pool.slab_elems + placed.start
            if block.matrix == DORA_SCALE:
                dora_rows[block.layer, block.projection] = first
                continue
            tables[block.matrix, block.layer, block.projection, placed_rows] = (
                torch.arange(placed.num_rows) * width + first
            )
        ranks = torch.zeros(self.ranks[:, :, 0].shape, dtype=torch.int32)
        scales = torch.zeros(self.scales[:, :, 0].shape, dtype=torch.float32)
        for (layer, projection), weights in adapter.weights.items():
            index = layer, PROJECTIONS.index(projection)
            ranks[index], scales[index] = weights.rank, weights.scale
        slab_index = torch.tensor(slab_ids, dtype=torch.long)
        device = self.a_rows.device
        # CUDA: from pinned memory on a side stream, so the step loop's stream never waits on it
        # (on the CPU the stream is None: no stream, no pinning).
        with torch.cuda.stream(self._copy_stream):
            self.pool.write_slabs(slab_index, staging if self._copy_stream is None else staging.pin_memory())
            self.a_rows[:, :, slot] = tables[0].to(device, non_blocking=True)
            self.b_rows[:, :, slot] = tables[1].to(device, non_blocking=True)
            self.ranks[:, :, slot] = ranks.to(device, non_blocking=True)
            self.scales[:, :, slot] = scales.to(device, non_blocking=True)
            self.dora_rows[:, :, slot] = dora_rows.to(device, non_blocking=True)
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
        self.has_dora[slot] = adapter.use_dora

    def activate(self, slot: int) -> None:
        """The reserved slot's weights are written: the kernels may use it from the next step."""
        self._generations[slot] += 1

    def unload(self, slot: int) -> None:
        """Free the slot and its pages (no running sequence uses it)."""
        self.ranks[:, :, slot] = 0
        self.scales[:, :, slot] = 0.0
        self.dora_rows[:, :, slot] = NO_DORA
        self.has_dora[slot] = False
        self.cancel(slot)
