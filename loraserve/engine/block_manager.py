"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, copy-on-write, prefix caching.

A block is a page of the memory pool (memory/), whose free list KV blocks share with adapter weights,
a cache of idle ones that `make_room` evicts (`can_allocate` only asks). Plain Python: the pool owns
the tensors, this owns which block holds what. It is the only code that changes a sequence's `block_table`.

With prefix caching, every full block a sequence has computed is published under its key
(prefix_cache.py) and stays findable after its last user frees it, until its page is
taken for something else. A new sequence starts on the blocks of its longest cached
prefix: shared, as n > 1 siblings share a prompt, and never written (they are full).

With a sliding window on every layer (W: a token at position p attends keys (p - W, p]), a block
wholly behind the window of a sequence's next token is never read again: it goes back to the pool
(`release_behind_window`), and its table entry, which keeps its place as positions index the table,
points at PLACEHOLDER. Example, W = 8, blocks of 4: the next token at position 16 reads keys 9..16,
so blocks 0 (0..3) and 1 (4..7) go back, and block 2 (8..11) stays for its keys 9..11.
"""

from __future__ import annotations

from collections.abc import Callable

from loraserve.engine.prefix_cache import PrefixCache, extend_block_keys
from loraserve.engine.sequence import Sequence
from loraserve.memory.page_allocator import PageAllocator, PageUse

BlockCopy = tuple[int, int]  # (source block, destination block) for the runner to copy before the step

# Where a released entry points: block 0, which the runner pads tables with too (model_runner.py `_keys`).
# No query reads it there: windowed layers read from the first block their window reaches. The full tables,
# built still, hold it, and the torch attention path gathers every entry of a table and masks what is out
# of reach with -inf, so its contents must be finite (a NaN score plus -inf is NaN, a zero weight times a
# NaN value too): the pool starts as zeros, and only K/V and adapter rows are ever written to a page.
# Page 0 may be anyone's meanwhile: no entry behind `num_computed_tokens` is written through, and
# `num_released_blocks` says which entries hold no reference, so a placeholder is never released.
PLACEHOLDER = 0


class BlockManager:
    """Owns every block's reference count and every sequence's block table."""

    def __init__(
        self,
        pages: PageAllocator,
        block_size: int,
        prefix_caching: bool = True,
        reclaim: Callable[[int], None] | None = None,  # frees this many pages held as a cache (idle adapters)
        window: int | None = None,  # every layer's sliding window; None: some layer reads the whole context
    ) -> None:
        self.pages = pages
        self.window = window
        self.num_released_behind_window = 0  # blocks back in the pool from behind windows, since start
        self._reclaim = reclaim
        self.num_blocks = pages.num_pages  # the most KV could ever hold: no adapter loaded
        self.block_size = block_size
        self._ref_counts = [0] * pages.num_pages
        self.prefix_cache = PrefixCache() if prefix_caching else None
        pages.on_reuse = self._forget_cached

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by their prefix, held or free."""
        return 0 if self.prefix_cache is None else len(self.prefix_cache)

    @property
    def num_free_blocks(self) -> int:
        return self.pages.num_free

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks needed to write tokens [num_computed, num_computed + num_new_tokens)."""
        new = max(0, self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))
        return new + (1 if self._shared_block_to_write(seq) is not None else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """True when the blocks for `num_new_tokens` fit, leaving `reserve` blocks free."""
        return self.num_blocks_needed(seq, num_new_tokens) + reserve <= self.pages.num_free

    def make_room(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        """Evict idle adapters if that is what it takes for `can_allocate`; returns `can_allocate`."""
        short = self.num_blocks_needed(seq, num_new_tokens) + reserve - self.pages.num_free
        if short > 0 and self._reclaim is not None:
            self._reclaim(short)
        return self.can_allocate(seq, num_new_tokens, reserve)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Give `seq` the blocks its next tokens are written to; returns copy-on-write copies to do."""
        assert self.num_blocks_needed(seq, num_new_tokens) <= self.pages.num_free, "allocate() without can_allocate()"
        copies: list[BlockCopy] = []
        shared_index = self._shared_block_to_write(seq)
        if shared_index is not None:
            # The first block written is shared with a sibling: write into a private copy.
            shared = seq.block_table[shared_index]
            private = self._take()
            self._release(shared)
            seq.block_table[shared_index] = private
            copies.append((shared, private))
        while len(seq.block_table) < self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take())
        return copies

    def attach_cached_prefix(self, seq: Sequence) -> int:
        """Give a waiting sequence the cached blocks of its longest cached prefix; returns their tokens.
        At least its last token is left to compute: that row's logits give the next token."""
        assert not seq.block_table, "the sequence holds blocks already"
        if self.prefix_cache is None:
            return 0
        count = (seq.num_tokens - 1) // self.block_size
        extend_block_keys(seq.block_keys, seq.token_ids, self.block_size, seq.cache_salt, count)
        with self.pages.lock:  # the adapter loader's thread may take a free cached page meanwhile
            found: list[int] = []
            for key in seq.block_keys[:count]:
                page = self.prefix_cache.lookup(key)
                if page is None:
                    break
                found.append(page)
            # Those behind the window of the first token to compute would never be read: they stay in the pool.
            behind = self._num_behind_window(len(found) * self.block_size)
            seq.block_table, seq.num_released_blocks = [PLACEHOLDER] * behind, behind
            for page in found[behind:]:
                if self._ref_counts[page] == 0:
                    self.pages.take_back(page, PageUse.KV)
                self._ref_counts[page] += 1
                seq.block_table.append(page)
        return len(seq.block_table) * self.block_size

    def publish_computed_blocks(self, seq: Sequence, num_computed_before: int) -> None:
        """Make the blocks the sequence filled since `num_computed_before` findable by their prefix."""
        if self.prefix_cache is None:
            return
        first, end = num_computed_before // self.block_size, seq.num_computed_tokens // self.block_size
        if first == end:
            return
        extend_block_keys(seq.block_keys, seq.token_ids, self.block_size, seq.cache_salt, end)
        with self.pages.lock:
            for index in range(first, end):
                self.prefix_cache.publish(seq.block_keys[index], seq.block_table[index])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their sequences)."""
        if self.prefix_cache is not None:
            with self.pages.lock:
                self.prefix_cache = PrefixCache()

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (n > 1 sampling shares the prompt)."""
        assert not child.block_table
        child.block_table, child.num_released_blocks = list(parent.block_table), parent.num_released_blocks
        for block in child.block_table[child.num_released_blocks :]:
            self._ref_counts[block] += 1

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (finished, aborted or preempted)."""
        for block in reversed(seq.block_table[seq.num_released_blocks :]):
            self._release(block)
        seq.block_table, seq.num_released_blocks = [], 0

    def release_behind_window(self, seq: Sequence) -> None:
        """Release the blocks wholly behind the window of the sequence's next token; once a step, after its
        `num_computed_tokens` advanced."""
        behind = self._num_behind_window(seq.num_computed_tokens)
        for index in range(seq.num_released_blocks, behind):
            if self._release(seq.block_table[index]):  # a sibling (n > 1) may hold it still
                self.num_released_behind_window += 1
            seq.block_table[index], seq.num_released_blocks = PLACEHOLDER, index + 1

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past the sequence's tokens (written by drafts it did not keep)."""
        keep = self.blocks_for_tokens(seq.num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _num_behind_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query reads any more: the next query, at position `num_computed_tokens`, reads keys
        from num_computed_tokens - W + 1 on, and block i holds positions [i * block_size, (i + 1) * block_size)."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def _shared_block_to_write(self, seq: Sequence) -> int | None:
        """Index in the block table of an already-held, shared block the next token lands in."""
        index = seq.num_computed_tokens // self.block_size
        if index < len(seq.block_table) and self._ref_counts[seq.block_table[index]] > 1:
            return index
        return None

    def _forget_cached(self, pages: list[int]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.forget(pages)

    def _take(self) -> int:
        taken = self.pages.take(1, PageUse.KV)
        assert taken is not None, "allocate() without can_allocate()"
        self._ref_counts[taken[0]] = 1
        return taken[0]

    def _release(self, block: int) -> bool:
        """Drop a reference to `block`; True when that was the last and its page went back to the pool."""
        self._ref_counts[block] -= 1
        assert self._ref_counts[block] >= 0, f"block {block} released twice"
        if self._ref_counts[block] == 0:
            self.pages.release([block], PageUse.KV)
            return True
        return False
