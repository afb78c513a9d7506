"""The unified pool's tensor: sized from the configured budget, laid out in pages."""

from __future__ import annotations

import pytest
import torch

from loraserve.config import CacheConfig
from loraserve.errors import ConfigError
from loraserve.memory.pool import free_device_memory, page_bytes, pool_pages
from tests.lora.tiny_adapters import TINY_SPEC


def test_the_pool_is_sized_from_bytes_or_a_fraction_of_free_memory():
    page = page_bytes(TINY_SPEC, 16, torch.float32)
    assert pool_pages(CacheConfig(pool_memory=10 * page), TINY_SPEC, torch.float32, "cpu") == 10
    free = free_device_memory("cpu")
    pages = pool_pages(CacheConfig(pool_memory_fraction=0.01), TINY_SPEC, torch.float32, "cpu")
    assert 0 < pages * page <= 0.011 * free
    with pytest.raises(ConfigError, match="--pool-memory-fraction"):
        CacheConfig(pool_memory_fraction=1.5)
