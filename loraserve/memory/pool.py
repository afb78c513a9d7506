"""One device pool for KV blocks and adapter weights (S-LoRA unified paging); the PageAllocator says
which page holds what, this file owns the tensor.

One flat tensor: first the paged KV cache, `[num_pages, 2 (k, v), layers, block_size, Hkv, D]`, a page
being one KV block (the same index in every layer's K and V). A page can instead hold adapter rows: its
2 x layers "slabs" of `block_size * Hkv * D` elements are filled with whole rows of A and B^T, which the
kernels read where they lie through row tables (sgmv_kernels/layout.py); every table entry past a rank
points at a zero tail of one slab after the pages (no row is wider: lora/slots.py). Pages come first so
that a page's slabs lie together: an adapter's rows, packed in the CPU kernel's reading order, stream in
runs of a page, not of a slab (decode steps with many adapters ~30% faster); a layer's K (or V) is strided.
Example, SmolLM2-135M in bfloat16, 16-token blocks: a page is 30 x 2 x 16 x 3 x 64 elements (360 KiB);
a rank-16 adapter on all seven projections takes 27 pages, room for 432 tokens of KV.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from loraserve.config import CacheConfig
from loraserve.memory.lazy_zeros import lazy_zeros
from loraserve.memory.page_allocator import PageAllocator


class KVShape(Protocol):
    """What the pool needs of a model's shape (models' DecoderSpec has it)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    def kv_bytes_per_token(self, dtype: torch.dtype) -> int: ...


def page_bytes(spec: KVShape, block_size: int, dtype: torch.dtype) -> int:
    return spec.kv_bytes_per_token(dtype) * block_size


def pool_pages(config: CacheConfig, spec: KVShape, dtype: torch.dtype, device: str) -> int:
    """Pages from the configured budget: a page count, a fraction of free memory, or bytes."""
    if config.num_pages is not None:
        return config.num_pages
    memory = config.pool_memory
    if config.pool_memory_fraction is not None:
        memory = int(free_device_memory(device) * config.pool_memory_fraction)
    return max(1, memory // page_bytes(spec, config.block_size, dtype))


def free_device_memory(device: str) -> int:
    """Bytes the device could still give: CUDA's free memory, or the host's available RAM."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class MemoryPool:
    """The tensor behind every KV block and every loaded adapter, and its page allocator."""

    def __init__(self, spec: KVShape, block_size: int, num_pages: int, dtype: torch.dtype, device: str) -> None:
        self.num_pages, self.block_size, self.dtype = num_pages, block_size, dtype
        self.page_bytes = page_bytes(spec, block_size, dtype)
        self.slab_elems = block_size * spec.num_kv_heads * spec.head_dim
        self.slabs_per_page = 2 * spec.num_layers
        kv_elems = self.slabs_per_page * num_pages * self.slab_elems
        # Zeros, not empty: padded attention reads are masked out, but a NaN bit pattern
        # would still poison 0 * NaN; and the tail must read as zeros.
        self.buffer = lazy_zeros(kv_elems + self.slab_elems, dtype, device)
        self.zero_offset = kv_elems
        self.kv_cache = self.buffer[:kv_elems].view(
            num_pages, 2, spec.num_layers, block_size, spec.num_kv_heads, spec.head_dim
        )
        # Per layer (k, v), models' KVCache: [num_pages, block_size, Hkv, D] each.
        self.kv_caches = [(self.kv_cache[:, 0, i], self.kv_cache[:, 1, i]) for i in range(spec.num_layers)]
        self._slabs = self.buffer[:kv_elems].view(-1, self.slab_elems)
        self.pages = PageAllocator(num_pages)

    def slab_id(self, page: int, piece: int) -> int:
        """Index of the `piece`-th slab (0 .. 2 x layers - 1) of `page`; it starts at element id x slab_elems."""
        return page * self.slabs_per_page + piece

    def page_of(self, offset: int) -> int:
        """The page that holds element `offset` of the pool."""
        return offset // self.slab_elems // self.slabs_per_page

    def write_slabs(self, slab_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Copy `data` [n, slab_elems] into the slabs whose flat indices are `slab_ids`."""
        self._slabs.index_copy_(0, slab_ids.to(self.buffer.device), data.to(self.buffer.device, non_blocking=True))

    def copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Copy-on-write of KV blocks: every layer's K and V of each source page."""
        self.kv_cache[destinations] = self.kv_cache[sources]
