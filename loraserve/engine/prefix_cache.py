"""Automatic prefix caching: a full KV block is found again by the prefix it completes.

A block's key is a SHA-256 over the previous block's key and this block's tokens; the first block's
also covers the salt, the adapter's content hash (an adapter on k_proj / v_proj changes the cached K
and V, and a name can be re-uploaded with other weights). Equal keys mean equal tokens from position
0 under equal weights, and no user can craft a collision with another user's prefix. Only the maps
live here: the block manager publishes blocks once computed; the page allocator says when a page
gets new contents.
"""

from __future__ import annotations

import hashlib
from array import array

BlockKey = bytes


def extend_block_keys(keys: list[BlockKey], token_ids: list[int], block_size: int, salt: bytes, count: int) -> None:
    """Append to `keys` (the keys of the first len(keys) blocks) until it holds `count` keys."""
    for index in range(len(keys), count):
        digest = hashlib.sha256(keys[-1] if keys else b"salt:" + salt)
        digest.update(array("q", token_ids[index * block_size : (index + 1) * block_size]).tobytes())
        keys.append(digest.digest())


class PrefixCache:
    """Which page holds each published block key, and the reverse."""

    def __init__(self) -> None:
        self._page_of: dict[BlockKey, int] = {}
        self._key_of: dict[int, BlockKey] = {}

    def __len__(self) -> int:
        return len(self._page_of)

    def lookup(self, key: BlockKey) -> int | None:
        return self._page_of.get(key)

    def publish(self, key: BlockKey, page: int) -> None:
        """The page holds the block `key` names; the first page to publish a key keeps it."""
        if key not in self._page_of and page not in self._key_of:
            self._page_of[key] = page
            self._key_of[page] = key

    def forget(self, pages: list[int]) -> None:
        """These pages are about to hold something else."""
        for page in pages:
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._page_of[key]
