"""Block manager: allocation, growth, freeing, reference counts, copy-on-write and prefix caching."""

from __future__ import annotations

from loraserve.engine.block_manager import BlockManager
from loraserve.memory.page_allocator import PageAllocator, PageUse
from tests.engine.helpers import make_sequence


def test_allocate_covers_the_prompt_in_whole_blocks():
    manager = BlockManager(PageAllocator(8), block_size=4)
    seq = make_sequence(10)
    assert manager.num_blocks_needed(seq, 10) == 3
    assert manager.allocate(seq, 10) == []
    assert len(seq.block_table) == 3
    assert manager.num_free_blocks == 5
    assert all(manager.ref_count(b) == 1 for b in seq.block_table)


def test_append_takes_a_new_block_only_at_a_block_boundary():
    manager = BlockManager(PageAllocator(8), block_size=4)
    seq = make_sequence(7)
    manager.allocate(seq, 7)
    seq.num_computed_tokens = 7
    assert manager.num_blocks_needed(seq, 1) == 0  # position 7 is the last slot of block 1
    manager.allocate(seq, 1)
    seq.num_computed_tokens = 8
    assert len(seq.block_table) == 2
    assert manager.num_blocks_needed(seq, 1) == 1  # position 8 opens block 2
    manager.allocate(seq, 1)
    assert len(seq.block_table) == 3


def test_can_allocate_refuses_beyond_capacity_and_respects_reserve():
    manager = BlockManager(PageAllocator(4), block_size=4)
    assert not manager.can_allocate(make_sequence(17), 17)  # needs 5 blocks
    assert manager.can_allocate(make_sequence(16), 16)
    assert not manager.can_allocate(make_sequence(16), 16, reserve=1)


def test_free_returns_every_block_to_the_free_list():
    manager = BlockManager(PageAllocator(6), block_size=4)
    first, second = make_sequence(9, seq_id=0), make_sequence(5, seq_id=1)
    manager.allocate(first, 9)
    manager.allocate(second, 5)
    assert manager.num_free_blocks == 1
    manager.free(first)
    manager.free(second)
    assert first.block_table == [] and second.block_table == []
    assert manager.num_free_blocks == 6
    assert all(manager.ref_count(b) == 0 for b in range(6))


def test_fork_shares_blocks_and_counts_references():
    manager = BlockManager(PageAllocator(8), block_size=4)
    parent = make_sequence(6)
    manager.allocate(parent, 6)
    child = parent.fork(seq_id=1, index=1)
    manager.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [manager.ref_count(b) for b in parent.block_table] == [2, 2]
    manager.free(child)
    assert [manager.ref_count(b) for b in parent.block_table] == [1, 1]
    assert manager.num_free_blocks == 6


def test_copy_on_write_of_a_shared_last_block():
    """n = 2 sampling: both siblings share the prompt; the first to write its partial last block copies it."""
    manager = BlockManager(PageAllocator(8), block_size=4)
    parent = make_sequence(6)
    manager.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork(seq_id=1, index=1)
    manager.fork(parent, child)
    full_block, last_block = parent.block_table
    parent.token_ids.append(100)
    assert manager.num_blocks_needed(parent, 1) == 1  # the private copy
    copies = manager.allocate(parent, 1)
    ((source, destination),) = copies
    assert source == last_block and destination != last_block
    assert parent.block_table == [full_block, destination]
    assert manager.ref_count(last_block) == 1  # the child alone holds it now
    assert manager.ref_count(full_block) == 2  # full blocks stay shared
    child.token_ids.append(200)
    assert manager.allocate(child, 1) == []  # the child is the last holder: writes in place
    assert child.block_table == [full_block, last_block]
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 8


def computed(manager: BlockManager, seq, num_tokens: int) -> None:
    """Allocate and 'compute' the sequence's first `num_tokens` tokens, publishing its full blocks."""
    manager.allocate(seq, num_tokens - seq.num_computed_tokens)
    before, seq.num_computed_tokens = seq.num_computed_tokens, num_tokens
    manager.publish_computed_blocks(seq, before)


def test_a_later_sequence_starts_on_the_full_blocks_of_a_cached_prefix():
    manager = BlockManager(PageAllocator(8), block_size=4)
    first = make_sequence(10, seq_id=0)
    computed(manager, first, 10)  # blocks 0 and 1 full, block 2 partial
    second = make_sequence(10, seq_id=1)
    second.token_ids[9] = 999  # same first 9 tokens
    assert manager.attach_cached_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.ref_count(b) for b in first.block_table] == [2, 2, 1]
    same = make_sequence(8, seq_id=2)  # all 8 tokens cached, but the last one is computed again
    assert manager.attach_cached_prefix(same) == 4 and same.block_table == first.block_table[:1]


def test_a_different_salt_or_an_earlier_difference_finds_nothing():
    manager = BlockManager(PageAllocator(8), block_size=4)
    computed(manager, make_sequence(9, seq_id=0), 9)
    other_adapter = make_sequence(9, seq_id=1)
    other_adapter.cache_salt = b"sha256 of an adapter"
    assert manager.attach_cached_prefix(other_adapter) == 0 and other_adapter.block_table == []
    differs_early = make_sequence(9, seq_id=2)
    differs_early.token_ids[0] = 999  # the second block's tokens match, its prefix does not
    assert manager.attach_cached_prefix(differs_early) == 0


def test_freed_blocks_stay_cached_until_their_page_is_taken_for_something_else():
    pages = PageAllocator(4)
    manager = BlockManager(pages, block_size=4)
    first = make_sequence(9, seq_id=0)
    computed(manager, first, 9)
    cached_blocks = first.block_table[:2]
    manager.free(first)
    assert manager.num_free_blocks == 4, "cached blocks are free blocks"
    again = make_sequence(9, seq_id=1)
    assert manager.attach_cached_prefix(again) == 8 and again.block_table == cached_blocks
    assert manager.num_free_blocks == 2
    manager.free(again)
    # Pages are reused least recently freed first: the never-used page, then the partial block,
    # then the prefix from its tail, so its head stays findable longest.
    taken = pages.take(3, PageUse.ADAPTER)
    assert taken is not None and cached_blocks[0] not in taken
    assert manager.attach_cached_prefix(make_sequence(9, seq_id=2)) == 4
    pages.release(taken, PageUse.ADAPTER)
    assert manager.num_cached_blocks == 1


def test_without_prefix_caching_nothing_is_found():
    manager = BlockManager(PageAllocator(8), block_size=4, prefix_caching=False)
    computed(manager, make_sequence(9, seq_id=0), 9)
    assert manager.attach_cached_prefix(make_sequence(9, seq_id=1)) == 0 and manager.num_cached_blocks == 0


def test_reset_forgets_every_cached_prefix():
    manager = BlockManager(PageAllocator(8), block_size=4)
    computed(manager, make_sequence(9, seq_id=0), 9)
    manager.reset_prefix_cache()
    assert manager.attach_cached_prefix(make_sequence(9, seq_id=1)) == 0
