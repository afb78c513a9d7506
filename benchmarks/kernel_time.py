"""Time spent inside the compiled CPU kernels during engine steps: they are not torch ops, so
the torch profiler cannot see them."""

from __future__ import annotations

import time
from collections.abc import Callable

from loraserve.engine import LLMEngine
from loraserve.models.cpu.attention import DecodeAttentionKernel
from loraserve.models.cpu.decode_step import CpuDecodeStep
from loraserve.models.cpu.layer_ops import LayerOpsKernel
from loraserve.models.cpu.linear import NarrowMatmul
from sgmv_kernels.native import LoraKernel

# What each row of a report names -> the methods that call into that kernel.
KERNEL_CALLS: dict[str, list[tuple[type, str]]] = {
    # the whole decode step in one native call where the weights are ours (the kernels below then run inside it)
    "native decode step (layers only, no lm_head)": [(CpuDecodeStep, "run")],
    "base-model matmuls with 16-bit or int8 weights, outside the native step (its lm_head)": [
        (NarrowMatmul, "__call__")
    ],
    "multi-LoRA kernel": [(LoraKernel, "add")],
    "decode attention kernel": [(DecodeAttentionKernel, "__call__")],
    "per-layer ops kernel (norm + residual, rotary + K/V write, SiLU)": [
        (LayerOpsKernel, "add_rms_norm"),
        (LayerOpsKernel, "rotary_store_kv"),
        (LayerOpsKernel, "silu_mul"),
    ],
}


def kernel_ms(engine: LLMEngine, steps: int) -> dict[str, float]:
    """ms per step inside each compiled kernel over `steps` engine steps (0 for kernels not run)."""
    spent = dict.fromkeys(KERNEL_CALLS, 0.0)

    def timed(name: str, function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start

        return wrapper

    saved = [
        (owner, attribute, getattr(owner, attribute)) for calls in KERNEL_CALLS.values() for owner, attribute in calls
    ]
    try:
        for name, calls in KERNEL_CALLS.items():
            for owner, attribute in calls:
                setattr(owner, attribute, timed(name, getattr(owner, attribute)))
        for _ in range(steps):
            engine.step()
    finally:
        for owner, attribute, original in saved:
            setattr(owner, attribute, original)
    return {name: seconds * 1e3 / steps for name, seconds in spent.items()}
