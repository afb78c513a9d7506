"""Pick the compute dtype: bfloat16 where the hardware does it natively, float32 otherwise."""

from __future__ import annotations

from pathlib import Path

import torch

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NATIVE_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return not _NATIVE_BF16_CPU_FLAGS.isdisjoint(flags)


def dtype_name(dtype: torch.dtype) -> str:
    """The `--dtype` value that names a torch dtype: 'bfloat16' for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def largest_finite(dtype: torch.dtype) -> float:
    """The largest number `dtype` holds: what an adapter's alpha / r may be at most."""
    return float(torch.finfo(dtype).max)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Map a `--dtype` value to a torch dtype; `auto` looks at the device."""
    if name != "auto":
        return _NAMED[name]
    return torch.bfloat16 if device == "cuda" or cpu_has_native_bf16() else torch.float32
