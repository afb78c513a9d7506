"""The unified pool: KV blocks and adapter rows share one set of pages (S-LoRA)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from loraserve.engine.block_manager import BlockManager
from loraserve.errors import ConfigError
from loraserve.lora.adapter import PROJECTIONS, LoraWeights, projection_shapes
from loraserve.lora.manager import AdapterSource
from loraserve.lora.residency import Acquired
from loraserve.lora.slots import AdapterSlots
from loraserve.memory.page_allocator import PageUse
from loraserve.memory.pool import MemoryPool
from sgmv_kernels import gather_rows
from sgmv_kernels.layout import row_alignment
from tests.engine.helpers import make_sequence
from tests.lora.tiny_adapters import TINY_BLOCK_SIZE, TINY_SPEC, register_tiny, tiny_adapter, tiny_adapter_manager


def load(manager, name: str) -> None:
    for _ in range(3):
        if manager.acquire(name) is Acquired.ON_DEVICE:
            return
        assert manager.wait_idle()
    raise AssertionError(f"{name} did not load")


def test_an_adapter_takes_pages_in_proportion_to_its_rank():
    # A tiny page holds 4 slabs of 16 elements; a rank-r q_proj adapter has 2r rows of 8 per layer.
    manager = tiny_adapter_manager(num_slots=2, num_pages=64, max_rank=64)
    for name, seed, rank in (("r8", 1, 8), ("r64", 2, 64)):
        manager.register(name, AdapterSource(Path("tiny") / str(seed), None), tiny_adapter(seed, rank=rank))
    for name in ("r8", "r64"):
        load(manager, name)
        manager.release(name)
    pages = manager.slots.pool.pages
    assert (manager.pages_of("r8"), manager.pages_of("r64")) == (4, 32), "1:8, no padding to a max rank"
    assert pages.num_used(PageUse.ADAPTER) == 36 and pages.num_free == 64 - 36


def test_rows_land_in_the_reserved_pages_and_unloading_returns_them():
    manager = tiny_adapter_manager(num_slots=1, num_pages=8)
    register_tiny(manager, "a", seed=3)
    load(manager, "a")
    slots, pool = manager.slots, manager.slots.pool
    reserved = slots.pages_held(manager.record("a").slot)
    q = slots.layers[0]["q_proj"]
    rows = q.a_rows[manager.record("a").slot, :2]
    pages_of_rows = {pool.page_of(int(offset)) for offset in rows}
    assert pages_of_rows <= set(reserved), "the table points into the adapter's own pages"
    torch.testing.assert_close(gather_rows(q.pool, rows, 8), tiny_adapter(3).weights[(0, "q_proj")].a)
    manager.release("a")
    manager.unregister("a")
    assert pool.pages.num_free == 8 and pool.pages.num_used(PageUse.ADAPTER) == 0


def loaded_on_every_projection():
    """A manager holding one rank-2 adapter of all seven projections; (manager, its slot)."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        (layer, name): LoraWeights(
            torch.randn(2, fan_in, generator=generator), torch.randn(fan_out, 2, generator=generator), 1.0
        )
        for layer in range(TINY_SPEC.num_layers)
        for name, (fan_in, fan_out) in projection_shapes(TINY_SPEC).items()
    }
    adapter = replace(tiny_adapter(0), target_modules=PROJECTIONS, weights=weights)
    manager = tiny_adapter_manager(num_slots=2, num_pages=64)
    manager.register("all", AdapterSource(Path("tiny") / "0", None), adapter)
    load(manager, "all")
    return manager, manager.record("all").slot


def test_an_adapters_rows_lie_in_the_order_the_cpu_kernel_reads_them():
    # The kernel reads, per layer, q/k/v then o, gate/up, down, each A then B^T: packed in that
    # order, every call streams one run per adapter instead of hopping between projections.
    manager, slot = loaded_on_every_projection()
    slots, pool = manager.slots, manager.slots.pool
    pages = slots.pages_held(slot)
    page_elems = pool.slabs_per_page * pool.slab_elems

    def place_in_adapter(offset: int) -> int:  # where the row lies in the adapter's own pages, in order
        return pages.index(pool.page_of(offset)) * page_elems + offset % page_elems

    read_order = [
        place_in_adapter(int(offset))
        for layer in range(TINY_SPEC.num_layers)
        for name in PROJECTIONS
        for table in (slots.layers[layer][name].a_rows, slots.layers[layer][name].b_rows)
        for offset in table[slot, :2]
    ]
    assert read_order == sorted(read_order)


def test_every_row_starts_where_the_alignment_promised_to_the_cuda_kernels_says():
    # The CUDA kernels load rows in vectors as wide as this promise; a row off it would be misread.
    manager, _ = loaded_on_every_projection()
    slots = manager.slots
    assert slots.row_alignment == 4, "the tiny model's narrowest rows (k/v of one 4-wide head) are 4 elements"
    offsets = torch.cat([slots.a_rows.flatten(), slots.b_rows.flatten()])  # loaded, free and padding entries
    assert bool((offsets % slots.row_alignment == 0).all())


def test_row_alignment_is_the_largest_power_of_two_dividing_every_offset():
    assert row_alignment(3072, 576, 192, 1536) == 16, "capped: a wider promise loads nothing wider"
    assert row_alignment(64, 24) == 8
    assert row_alignment(64, 12, 6) == 2
    assert row_alignment(7) == 1


def test_kv_capacity_shrinks_while_an_adapter_is_loaded_and_idle_adapters_give_way_to_kv():
    manager = tiny_adapter_manager(num_slots=2, num_pages=8)
    blocks = BlockManager(manager.slots.pool.pages, TINY_BLOCK_SIZE, reclaim=manager.reclaim_pages)
    register_tiny(manager, "a", seed=1)  # rank 2: one page
    load(manager, "a")
    assert blocks.num_free_blocks == 7, "the adapter's page is not KV's"
    seq = make_sequence(28)  # 7 blocks: fits beside the busy adapter
    assert blocks.can_allocate(seq, 28)
    blocks.allocate(seq, 28)
    longer = make_sequence(4)
    assert not blocks.make_room(longer, 4), "a running adapter is never evicted for KV"
    manager.release("a")  # idle now: a cache, KV may take its page
    assert not blocks.can_allocate(longer, 4), "asking evicts nothing"
    assert blocks.make_room(longer, 4)
    assert manager.residency("a") == "host" and manager.stats.evictions == 1
    blocks.allocate(longer, 4)
    register_tiny(manager, "b", seed=2)
    assert manager.acquire("b") is Acquired.LOADING and manager.wait_idle()
    assert manager.acquire("b") is Acquired.NO_SLOT, "every page holds KV of running sequences"
    blocks.free(seq)
    load(manager, "b")
    assert manager.slots.pool.pages.num_used(PageUse.KV) == 1 and manager.pages_of("b") == 1


def test_a_block_narrower_than_an_adapter_row_is_refused_naming_the_flag():
    pool = MemoryPool(TINY_SPEC, 2, 8, torch.float32, "cpu")  # slabs of 2 x 4 elements; an MLP row has 16
    with pytest.raises(ConfigError, match=r"--block-size.*use at least 4"):
        AdapterSlots(TINY_SPEC, 2, 4, pool)
