"""Who holds each page of the memory pool: KV blocks and adapter weights share one free list.

S-LoRA's unified paging: a page freed by a finished sequence can hold adapter rows next,
and an idle adapter's pages can become KV blocks. Adapters not in use are a cache: when
the KV side runs short, `reclaim` asks the adapter manager (through `reclaimer`) to
evict idle ones before the scheduler preempts a sequence.

Plain Python and thread-safe: the engine thread takes KV pages while the adapter
loader's reservations happen under the manager's lock on another thread.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Callable


class PageUse(enum.Enum):
    KV = "kv"
    ADAPTER = "adapter"


class PageAllocator:
    """The free list of `num_pages` pages and how many each use holds."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._used = dict.fromkeys(PageUse, 0)
        self._lock = threading.Lock()
        # Frees pages held as a cache (idle adapters); given how many are missing.
        self.reclaimer: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def num_used(self, use: PageUse) -> int:
        return self._used[use]

    def take(self, count: int, use: PageUse) -> list[int] | None:
        """`count` free pages for `use`, or None (and nothing taken) if fewer are free."""
        with self._lock:
            if count > len(self._free):
                return None
            pages = [self._free.popleft() for _ in range(count)]
            self._used[use] += count
            return pages

    def release(self, pages: list[int], use: PageUse) -> None:
        with self._lock:
            self._free.extend(pages)
            self._used[use] -= len(pages)
            assert self._used[use] >= 0, f"more {use.value} pages released than taken"

    def reclaim(self, count: int) -> bool:
        """True when `count` pages are free, after evicting idle adapters if they were not."""
        if count > len(self._free) and self.reclaimer is not None:
            self.reclaimer(count - len(self._free))
        return count <= len(self._free)
