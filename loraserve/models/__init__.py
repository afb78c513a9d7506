"""Base-model loading and our own Llama-family forward over the paged KV cache."""

import os

# torch's tensors of 2 MB and more in transparent huge pages: torch reads this once, at its first allocation, so it is
# set here, before the engine allocates anything (loading the weights first). A decode step streams every weight: with
# 4 KB pages each page is a TLB miss and a restart of the hardware prefetcher. One chat's token took 3-9% less time
# this way on a Zen 3 (docs/benchmarks.md). THP_MEM_ALLOC_ENABLE=0 keeps 4 KB pages.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from loraserve.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
