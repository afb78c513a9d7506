"""Pick the compute dtype and how the weights are held (as the compute dtype, or narrower on the CPU:
cpu/linear.py). `auto`: bfloat16 on CUDA and on CPUs with AMX tiles; on other CPUs float32 activations
with bfloat16 weights, multiplied by bfloat16 dot products where the CPU has them (AVX512-BF16).

Why not bfloat16 compute on AVX512-BF16 CPUs: measured on a Zen 5 with the shipped text
(`loraserve bench quality`), bfloat16 compute keeps 96.5-97.4% of float32's top tokens (mean KL
0.002-0.003), float32 activations with bfloat16 dot products 98.7-99.3% (KL 0.0003-0.0004): a
bfloat16 residual stream, norms and KV cache cost the quality, the products' rounding little. The
speed (`loraserve bench weights`, one run): one chat 161.4 against 160.6 tok/s, 32 chats over 8
adapters 1183 against 1373, whose gap is the float32 KV cache and adapter pool (docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from loraserve.errors import ConfigError

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NATIVE_BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}
# bfloat16 weights whose products are bfloat16 dot products (AVX512-BF16): float32 rows rounded to
# bfloat16 as the kernel reads them, sums and outputs float32. With bfloat16 rows, every bfloat16
# weight is multiplied so.
BFLOAT16_DOT = "bfloat16-dot"


def cpu_has_native_bf16() -> bool:
    """True when the CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX)."""
    return not _NATIVE_BF16_CPU_FLAGS.isdisjoint(_cpu_flags())


def cpu_has_bf16_dot_products() -> bool:
    """True when the CPU has AVX512-BF16's dot products (vdpbf16ps), which our kernel uses."""
    return "avx512_bf16" in _cpu_flags()


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles for bfloat16 matmuls (our kernel's batches and oneDNN use them)."""
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
    return torch.bfloat16 if device == "cuda" or cpu_has_amx() else torch.float32


def resolve_weights(name: str, dtype_setting: str, dtype: torch.dtype, device: str) -> str:
    """Map `--weights` to how the matmul weights are held: the compute dtype's name, or a narrower
    'bfloat16' / 'bfloat16-dot' / 'int8' that only the CPU kernel computes with. `auto` narrows to
    bfloat16 where `--dtype auto` chose float32 on a CPU (half the bytes a decode step reads), with
    bfloat16 dot products where the CPU has them (twice the products an FMA does)."""
    compute = dtype_name(dtype)
    if name == "auto":
        if device != "cpu" or dtype_setting != "auto" or dtype != torch.float32:
            return compute
        return BFLOAT16_DOT if cpu_has_bf16_dot_products() else "bfloat16"
    if name == compute:
        return name
    if device != "cpu":
        raise ConfigError("--weights", f"weights narrower than the compute dtype are for the CPU; use {compute}")
    if name == "float32" or (name == "bfloat16" and dtype != torch.float32):
        raise ConfigError("--weights", f"{name} weights with {compute} compute: the weights may not be wider")
    if dtype not in (torch.float32, torch.bfloat16):  # the kernel's rows (cpu/linear.py)
        raise ConfigError("--weights", f"{name} weights need float32 or bfloat16 compute, not {compute}")
    if name == BFLOAT16_DOT and dtype == torch.bfloat16:
        return "bfloat16"  # bfloat16 rows: the kernel's products for bfloat16 weights, whatever the CPU
    if name == BFLOAT16_DOT and not cpu_has_bf16_dot_products():
        raise ConfigError("--weights", f"{name} needs a CPU with bfloat16 dot products (AVX512-BF16); use bfloat16")
    return name
