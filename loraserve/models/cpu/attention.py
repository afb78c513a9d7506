"""The compiled decode attention for the CPU (paged_attention.cpp): one query token per row,
K and V read in the paged cache where they lie instead of gathered first.

Built on first use for this machine (sgmv_kernels/build.py); without a compiler
`load_decode_kernel` says why and returns None, and attention.py keeps its torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from sgmv_kernels.build import entry_point, load_library

SOURCE = Path(__file__).with_name("paged_attention.cpp")
_FUNCTIONS = {torch.float32: "paged_decode_attention_float32", torch.bfloat16: "paged_decode_attention_bfloat16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P, ctypes.c_int]


class DecodeAttentionKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {dtype: getattr(library, name) for dtype, name in _FUNCTIONS.items()}
        for function in self._functions.values():
            function.restype, function.argtypes = None, _ARGTYPES

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def entry_point(self, dtype: torch.dtype) -> int:
        return entry_point(self._functions[dtype])

    def __call__(
        self,
        queries: torch.Tensor,  # [B, Hq, D], heads contiguous within a row
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], each block contiguous
        v_cache: torch.Tensor,  # the same layout and strides as k_cache
        block_tables: torch.Tensor,  # [B, max_blocks] int64
        context_lens: torch.Tensor,  # [B] int64 keys each row attends to (its position + 1)
        scale: float,
    ) -> torch.Tensor:  # [B, Hq, D]
        rows, num_heads, head_dim = queries.shape
        _, block_size, num_kv_heads, _ = k_cache.shape
        if queries.stride(2) != 1 or queries.stride(1) != head_dim:
            raise ValueError("the query heads of a row must be contiguous")
        if k_cache.stride() != v_cache.stride() or k_cache[0].is_contiguous() is False:
            raise ValueError("K and V blocks must be contiguous and laid out alike")
        if not (queries.dtype == k_cache.dtype == v_cache.dtype) or queries.device.type != "cpu":
            raise ValueError(f"queries and caches must share one CPU dtype, got {queries.dtype}, {k_cache.dtype}")
        if block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64:
            raise ValueError("block tables and context lengths must be int64")
        out = torch.empty(rows, num_heads, head_dim, dtype=queries.dtype)
        self._functions[queries.dtype](
            queries.data_ptr(),
            queries.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            rows,
            num_heads,
            num_kv_heads,
            head_dim,
            block_size,
            scale,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out


def load_decode_kernel(cache_dir: Path) -> DecodeAttentionKernel | None:
    """The kernel built for this machine (building it if needed), or None with a warning saying why."""
    library = load_library(SOURCE, cache_dir, "decode attention on the CPU falls back to the torch path")
    return DecodeAttentionKernel(library) if library is not None else None
