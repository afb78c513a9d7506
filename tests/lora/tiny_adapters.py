"""A tiny model shape and adapters for it: manager and scheduler tests need no real model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from loraserve.lora.adapter import LoraAdapter, LoraWeights
from loraserve.lora.adapter_state import AdapterState
from loraserve.lora.manager import AdapterManager, AdapterSource
from loraserve.lora.slots import AdapterSlots
from loraserve.memory.pool import MemoryPool
from loraserve.models.decoder_spec import DecoderSpec

TINY_SPEC = DecoderSpec(
    model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
    head_dim=4, rms_norm_eps=1e-6, max_positions=64, tie_word_embeddings=True, qkv_bias=False,
)  # fmt: skip


def tiny_adapter(seed: int, rank: int = 2) -> LoraAdapter:
    """An adapter of q_proj on every layer with random weights."""
    generator = torch.Generator().manual_seed(seed)
    weights = {
        (layer, "q_proj"): LoraWeights(
            a=torch.randn(rank, 8, generator=generator), b=torch.randn(8, rank, generator=generator), scale=2.0
        )
        for layer in range(TINY_SPEC.num_layers)
    }
    return LoraAdapter(
        rank=rank, alpha=2.0 * rank, use_rslora=False, target_modules=("q_proj",), weights=weights,
        base_model_name=None, sha256=f"{seed:064x}", num_bytes=0,
    )  # fmt: skip


def read_tiny(path: Path) -> LoraAdapter:
    """The 'disk' of these tests: a path named tiny/<seed> reads as tiny_adapter(seed)."""
    return tiny_adapter(int(path.name))


TINY_BLOCK_SIZE = 4  # a page: 2 layers x K, V x 4 tokens x 4 elements = 4 slabs of 16 elements


def tiny_adapter_manager(
    num_slots: int,
    read: Callable[[Path], LoraAdapter] = read_tiny,
    host_cache_bytes: int = 1 << 30,
    num_pages: int = 64,
    max_rank: int = 4,
) -> AdapterManager:
    """A manager over a real memory pool of the tiny shape (its page allocator also serves KV)."""
    pool = MemoryPool(TINY_SPEC, TINY_BLOCK_SIZE, num_pages, torch.float32, "cpu")
    slots = AdapterSlots(TINY_SPEC, num_slots, max_rank, pool)
    return AdapterManager(slots, lambda source: read(source.path), host_cache_bytes)


def register_tiny(manager: AdapterManager, name: str, seed: int) -> None:
    manager.register(name, AdapterSource(Path("tiny") / str(seed), None))


def device_names(manager: AdapterManager) -> list[str]:
    """The adapters in a device slot."""
    return [record.name for record in manager.records() if record.state is AdapterState.ON_DEVICE]
