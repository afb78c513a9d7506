"""Pick the compute dtype (bfloat16 where the hardware does it natively, float32 otherwise) and how
the weights are held (as the compute dtype, or narrower on the CPU: cpu_linear.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.errors import ConfigError

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NATIVE_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX)."""
    return not _NATIVE_BF16_CPU_FLAGS.isdisjoint(_cpu_flags())


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles for bfloat16 matmuls (oneDNN uses them)."""
    return "amx_bf16" in _cpu_flags()


def _cpu_flags() -> list[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return next((line.split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])


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


def resolve_weights(name: str, dtype_setting: str, dtype: torch.dtype, device: str) -> str:
    """Map `--weights` to how the matmul weights are held: the compute dtype's name, or a narrower
    'bfloat16' / 'int8' that only the CPU kernel computes with. `auto` narrows to bfloat16 where
    `--dtype auto` chose float32 on a CPU (no native bf16): half the bytes a decode step reads."""
    compute = dtype_name(dtype)
    if name == "auto":
        return "bfloat16" if device == "cpu" and dtype_setting == "auto" and dtype == torch.float32 else compute
    if name == compute:
        return name
    if device != "cpu":
        raise ConfigError("--weights", f"weights narrower than the compute dtype are for the CPU; use {compute}")
    if name == "float32" or (name == "bfloat16" and dtype != torch.float32):
        raise ConfigError("--weights", f"{name} weights with {compute} compute: the weights may not be wider")
    return name
