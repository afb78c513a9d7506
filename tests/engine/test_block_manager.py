"""Block manager: allocation, growth, freeing, reference counts, copy-on-write and prefix caching."""

from __future__ import annotations

from loraserve.engine.block_manager import PLACEHOLDER, BlockManager
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


WINDOW = 8  # with blocks of 4: a token at position p attends keys (p - 8, p]


def windowed(num_pages: int = 16, **settings) -> BlockManager:
    return BlockManager(PageAllocator(num_pages), block_size=4, window=WINDOW, **settings)


def advance(manager: BlockManager, seq, num_tokens: int) -> None:
    """A step: `num_tokens` more computed (and published), then what fell behind the window goes back."""
    computed(manager, seq, seq.num_computed_tokens + num_tokens)
    manager.release_behind_window(seq)


def test_a_block_goes_back_once_no_key_of_it_is_in_the_window_of_the_next_token():
    manager = windowed()
    seq = make_sequence(30)
    held = []
    for num_computed in range(1, 30):
        advance(manager, seq, 1)
        held += seq.block_table[len(held) :]  # each block as it is taken
        # The next query, at position num_computed, reads keys (num_computed - 8, num_computed].
        behind = [i for i in range(len(held)) if (i + 1) * 4 - 1 <= num_computed - WINDOW]
        assert seq.num_released_blocks == len(behind), f"{num_computed} tokens computed"
        assert seq.block_table[: len(behind)] == [PLACEHOLDER] * len(behind)
        assert all(manager.ref_count(held[i]) == (0 if i in behind else 1) for i in range(len(held)))
    assert seq.num_released_blocks == 5  # 29 computed: keys 22..29 are read, blocks 0..4 (0..19) are not
    assert manager.num_released_behind_window == 5
    assert manager.num_free_blocks == 16 - 3  # blocks 5..7 held: positions 20..31
    manager.free(seq)
    assert manager.num_free_blocks == 16 and all(manager.ref_count(b) == 0 for b in range(16))


def test_without_a_window_every_block_stays():
    manager = BlockManager(PageAllocator(16), block_size=4)
    seq = make_sequence(30)
    advance(manager, seq, 30)
    assert seq.num_released_blocks == 0 and PLACEHOLDER not in seq.block_table[1:]
    assert manager.num_free_blocks == 16 - 8 and manager.num_released_behind_window == 0


def test_a_placeholder_is_never_released_though_its_page_is_another_sequences():
    manager = windowed(num_pages=8)
    owner, other = make_sequence(4, seq_id=0), make_sequence(20, seq_id=1)
    manager.allocate(owner, 4)
    assert owner.block_table == [PLACEHOLDER], "the first page taken is the placeholder's"
    advance(manager, other, 20)
    assert other.block_table[:3] == [PLACEHOLDER] * 3
    manager.release_behind_window(other)  # again, nothing more behind: nothing happens
    assert manager.num_released_behind_window == 3 and manager.ref_count(PLACEHOLDER) == 1
    manager.free(other)
    assert manager.ref_count(PLACEHOLDER) == 1, "the owner's block"
    manager.free(owner)
    assert manager.num_free_blocks == 8 and all(manager.ref_count(b) == 0 for b in range(8))


def test_siblings_each_release_their_share_and_a_page_goes_back_with_its_last_holder():
    manager = windowed()
    parent = make_sequence(14)
    advance(manager, parent, 14)  # keys 7..14 are read next: block 0 is behind
    prompt_blocks = [PLACEHOLDER, *parent.block_table[1:]]
    child = parent.fork(seq_id=1, index=1)
    manager.fork(parent, child)
    assert child.block_table == prompt_blocks and child.num_released_blocks == 1
    assert [manager.ref_count(b) for b in prompt_blocks[1:]] == [2, 2, 2]
    for seq, token in ((parent, 100), (child, 200)):  # each writes its own copy of the shared last block
        seq.token_ids += [token] * 6
        advance(manager, seq, 6)  # 20 computed: keys 13..20 are read next, blocks 0..2 behind
    assert parent.num_released_blocks == child.num_released_blocks == 3
    assert manager.num_released_behind_window == 1 + 2, "block 0 before the fork; 1 and 2 with their last holder"
    manager.free(parent)
    manager.free(child)
    assert manager.num_free_blocks == 16 and all(manager.ref_count(b) == 0 for b in range(16))


def test_a_fork_before_the_parents_release_holds_the_blocks_until_it_releases_them_too():
    """The scheduler forks n > 1 siblings before the step that computes the prompt's last token."""
    manager = windowed()
    parent = make_sequence(14)
    manager.allocate(parent, 14)
    child = parent.fork(seq_id=1, index=1)
    manager.fork(parent, child)
    first = parent.block_table[0]
    for seq in (parent, child):
        before, seq.num_computed_tokens = seq.num_computed_tokens, 14
        manager.publish_computed_blocks(seq, before)
    manager.release_behind_window(parent)
    assert manager.ref_count(first) == 1 and manager.num_released_behind_window == 0
    manager.release_behind_window(child)
    assert manager.ref_count(first) == 0 and manager.num_released_behind_window == 1


def test_a_released_block_stays_findable_and_a_new_sequence_holds_only_its_windows_blocks():
    manager = windowed()
    first = make_sequence(22, seq_id=0)
    manager.allocate(first, 22)
    blocks = list(first.block_table)
    computed(manager, first, 22)  # blocks 0..4 full: published, then 0..3 behind the window
    manager.release_behind_window(first)
    assert first.num_released_blocks == 3 and manager.num_cached_blocks == 5
    second = make_sequence(22, seq_id=1)
    second.token_ids[21] = 999  # the same first 21 tokens: blocks 0..4 are found
    assert manager.attach_cached_prefix(second) == 20
    # 20 computed: keys 13..20 are read next, blocks 0..2 never: left in the pool, not taken back.
    assert second.block_table == [PLACEHOLDER] * 3 + blocks[3:5] and second.num_released_blocks == 3
    assert [manager.ref_count(b) for b in blocks] == [0, 0, 0, 2, 2, 1]
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 16 and manager.num_cached_blocks == 5


def test_a_sequence_preempted_after_releasing_gives_back_the_rest_and_starts_over():
    manager = windowed(num_pages=8, prefix_caching=False)
    seq = make_sequence(24)
    advance(manager, seq, 24)
    assert seq.num_released_blocks == 4
    manager.free(seq)  # preempted: recomputed from its first token
    seq.num_computed_tokens = 0
    assert seq.block_table == [] and seq.num_released_blocks == 0
    assert manager.num_free_blocks == 8 and all(manager.ref_count(b) == 0 for b in range(8))
    advance(manager, seq, 8)
    assert seq.num_released_blocks == 0 and len(seq.block_table) == 2
    advance(manager, seq, 16)
    assert seq.num_released_blocks == 4 and manager.num_free_blocks == 8 - 2


def test_drafts_not_kept_are_trimmed_behind_the_placeholders():
    manager = windowed()
    seq = make_sequence(20)
    advance(manager, seq, 20)
    seq.token_ids.append(7)
    manager.allocate(seq, 1 + 8)  # its pending token and 8 drafts: positions 20..28
    assert len(seq.block_table) == 8
    seq.num_computed_tokens = 21  # no draft kept: the pending token and the correction's
    seq.token_ids.append(8)
    manager.trim(seq)
    manager.release_behind_window(seq)  # keys 14..21 are read next: blocks 0..2 are behind
    assert seq.block_table[:3] == [PLACEHOLDER] * 3 and len(seq.block_table) == 6
    manager.free(seq)
    assert manager.num_free_blocks == 16
