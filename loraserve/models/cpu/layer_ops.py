"""The compiled per-layer operations for the CPU (layer_ops.cpp): residual add + RMSNorm,
SiLU * up, and rotary + K/V cache write, each one pass instead of several torch ops.

Built on first use for this machine (sgmv_kernels/build.py); without a compiler
`load_layer_ops` says why and returns None, and the model keeps its torch ops.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from loraserve.models.layer_ops import LayerOps, check_rotary_store_kv
from sgmv_kernels.build import entry_point, load_library

SOURCE = Path(__file__).with_name("layer_ops.cpp")
_DTYPE_SUFFIXES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_P, _I, _F, _THREADS = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _THREADS],
    "silu_mul": [_P, _P, _I, _I, _THREADS],
    "rotary_store_kv": [_P, _I, _P, _P, _I, _I, _I, _I, _P, _P, _I, _P, _P, _THREADS],
}


class LayerOpsKernel(LayerOps):
    """The ops as the compiled library (layer_ops.cpp) runs them, with torch's thread count."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions: dict[tuple[str, torch.dtype], Callable[..., None]] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _DTYPE_SUFFIXES.items():
                function = getattr(library, f"{name}_{suffix}")
                function.restype, function.argtypes = None, argtypes
                self._functions[(name, dtype)] = function

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in _DTYPE_SUFFIXES

    def entry_point(self, name: str, dtype: torch.dtype) -> int:
        """The address of op `name` for `dtype` rows (a key of _SIGNATURES)."""
        return entry_point(self._functions[(name, dtype)])

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_rows(x, weight)
        if residual is None:
            residual, delta_pointer = x, None
        else:
            _check_rows(residual, weight)
            delta_pointer = x.data_ptr()
        out = torch.empty_like(residual)
        rows, hidden = residual.shape
        threads = torch.get_num_threads()
        self._functions[("add_rms_norm", x.dtype)](
            delta_pointer, residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, hidden, eps, threads
        )
        return out, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            raise ValueError("gate_up must be contiguous [T, 2 * intermediate]")
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        threads = torch.get_num_threads()
        self._functions[("silu_mul", gate_up.dtype)](gate_up.data_ptr(), out.data_ptr(), rows, width, threads)
        return out

    def rotary_store_kv(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D] rows: q heads, k heads, v heads; rotated in place
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        num_heads: int,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], each block contiguous
        v_cache: torch.Tensor,
        slot_blocks: torch.Tensor,  # [T] int64
        slot_offsets: torch.Tensor,  # [T] int64
    ) -> None:
        check_rotary_store_kv(qkv, cos, sin, num_heads, k_cache, v_cache, slot_blocks, slot_offsets)
        rows = qkv.shape[0]
        _, _, num_kv_heads, head_dim = k_cache.shape
        self._functions[("rotary_store_kv", qkv.dtype)](
            qkv.data_ptr(),
            qkv.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            num_heads,
            num_kv_heads,
            head_dim,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.stride(0),
            slot_blocks.data_ptr(),
            slot_offsets.data_ptr(),
            torch.get_num_threads(),
        )


def _check_rows(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous() or x.shape[1] != weight.shape[0] or x.dtype != weight.dtype:
        raise ValueError(f"expected contiguous [T, {weight.shape[0]}] {weight.dtype} rows, got {x.dtype} {x.shape}")


def load_layer_ops(cache_dir: Path) -> LayerOpsKernel | None:
    """The kernel built for this machine (building it if needed), or None with a warning saying why."""
    library = load_library(SOURCE, cache_dir, "the CPU's per-layer ops fall back to torch ops")
    return LayerOpsKernel(library) if library is not None else None
