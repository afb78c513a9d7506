"""Zeros that cost nothing until they are touched: anonymous pages, which the kernel zeroes on first use.

`torch.zeros` writes every byte at once: a 2 GiB pool took 2.7 s of a server's start on a Zen 4, and its
whole size showed as resident before a single request. Mapped pages come in as KV blocks and adapters
first use them.
"""

from __future__ import annotations

import mmap
import os

import torch


def lazy_zeros(numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A flat tensor of `numel` zeros; on the CPU, pages mapped on first touch (huge pages where torch's
    own allocations take them, see loraserve/models/__init__.py)."""
    if device != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(1, numel * itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" and hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer holds a reference to the mapping: it is unmapped when the last view of it goes.
    return torch.frombuffer(pages, dtype=dtype, count=numel)
