"""loraserve: many LoRA adapters on one base LLM, in one batch."""

from __future__ import annotations

import os
from importlib import import_module
from typing import TYPE_CHECKING, Any

# torch's tensors of 2 MB and more in transparent huge pages. torch reads this once, at the process's first CPU
# allocation, which any module under loraserve that imports torch may make; set from loraserve/models/__init__.py
# instead, it came too late for a process that imports the engine first (one chat with an adapter 10% slower, bench
# weights on a Zen 3). A decode step streams every weight: with 4 KB pages each page is a TLB miss and a restart of
# the hardware prefetcher (3-9% of a token's time on a Zen 3, docs/benchmarks/weights.md). THP_MEM_ALLOC_ENABLE=0
# keeps 4 KB pages. Setting it imports nothing.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

if TYPE_CHECKING:
    from loraserve.engine import CompletionOutput, RequestOutput, SamplingParams
    from loraserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: the engine and torch stay out of the CLI's HTTP clients."""
    if name not in __all__:
        raise AttributeError(f"module 'loraserve' has no attribute {name!r}")
    return getattr(import_module("loraserve.llm" if name == "LLM" else "loraserve.engine"), name)
