"""Who holds each page of the memory pool: KV blocks and adapter weights share one free list.

S-LoRA's unified paging: a page freed by a finished sequence can hold adapter rows next,
and an idle adapter's pages can become KV blocks. Adapters not in use are a cache: when
the KV side runs short, the block manager has the adapter manager evict idle ones before
the scheduler preempts a sequence.

A free page may still hold a KV block the prefix cache can hand out again: the free list
is ordered, freed pages go to its end and pages are taken from its front (least recently
freed first), and `on_reuse` hears of every page taken so the cache forgets what it held.

Plain Python and thread-safe: the engine thread takes KV pages while the adapter
loader's reservations happen under the manager's lock on another thread.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Callable


class PageUse(enum.Enum):
    KV = "kv"
    ADAPTER = "adapter"


class PageAllocator:
    """The free list of `num_pages` pages and how many each use holds."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._used = dict.fromkeys(PageUse, 0)
        # Re-entrant: the block manager holds it across a prefix-cache lookup and the take.
        self.lock = threading.RLock()
        # Told of pages about to get new contents (called under `lock`).
        self.on_reuse: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_used(self, use: PageUse) -> int:
        return self._used[use]

    def take(self, count: int, use: PageUse) -> list[int] | None:
        """`count` free pages for `use`, or None (and nothing taken) if fewer are free."""
        with self.lock:
            if count > len(self._free):
                return None
            pages = [self._free.popitem(last=False)[0] for _ in range(count)]
            self._used[use] += count
            if self.on_reuse is not None:
                self.on_reuse(pages)
            return pages

    def take_back(self, page: int, use: PageUse) -> None:
        """Take this free page as it is (a prefix-cache hit keeps its contents)."""
        with self.lock:
            del self._free[page]
            self._used[use] += 1

    def release(self, pages: list[int], use: PageUse) -> None:
        """Back to the free list's end, in this order."""
        with self.lock:
            self._free.update(dict.fromkeys(pages))
            self._used[use] -= len(pages)
            assert self._used[use] >= 0, f"more {use.value} pages released than taken"
