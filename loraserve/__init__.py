"""loraserve: many LoRA adapters on one base LLM, in one batch."""

import os

# torch's tensors of 2 MB and more in transparent huge pages (torch reads this once, at its first
# allocation, so before anything imports it). A decode step streams every weight: with 4 KB pages
# each page is a TLB miss and a restart of the hardware prefetcher. One chat's token took 3-9% less
# time this way on a Zen 3 (docs/benchmarks.md). THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from loraserve.engine import CompletionOutput, RequestOutput, SamplingParams
from loraserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
