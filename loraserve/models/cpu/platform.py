"""The CPU platform: compiled kernels (the C++ sources beside their modules), built on first use
for this machine (sgmv_kernels/build.py); where one does not build or take the dtype, the model
keeps its torch ops for that part.

The matmul weights are held narrower than the activations in our kernel's panels (linear.py:
bfloat16, bfloat16 dot products, int8), reordered for oneDNN, or plain.

bfloat16 weights with bfloat16 compute go through our kernel where it has bfloat16 dot products
(AVX512-BF16) and, on a CPU with AMX, its tiles. Measured, a decode step's matmuls: on a Zen 4
(AVX512-BF16, no AMX) one row 2x faster than oneDNN's, 32 rows as fast; on a Xeon with AMX one row
1.7x faster, 32 rows 1.4x (benchmarks/cpu_matmuls.py). Elsewhere oneDNN takes them: a bfloat16
decode matmul with the weight reordered once into oneDNN's blocked layout runs about 2x faster
than `F.linear` (weights stream from memory every step, and the packed layout streams better),
with bit-identical results. float32 stays on `F.linear`: packing changes its rounding, and float32
is the mode that must match transformers token for token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.config import ModelConfig
from loraserve.errors import ModelLoadError
from loraserve.models.attention import DecodeAttention
from loraserve.models.cpu.attention import load_decode_kernel
from loraserve.models.cpu.decode_step import plan_decode_step
from loraserve.models.cpu.layer_ops import load_layer_ops
from loraserve.models.cpu.linear import NarrowMatmul, PackedInt8, load_linear_kernel
from loraserve.models.cpu.packed_weights_cache import PackedWeightsCache
from loraserve.models.decoder import DecoderForCausalLM
from loraserve.models.decoder_spec import QK_NORMS_PER_HEAD
from loraserve.models.dtypes import BFLOAT16_DOT, cpu_has_amx, dtype_name
from loraserve.models.layer_ops import LayerOps
from loraserve.models.linear import Linear
from loraserve.models.platform import FusedStep, Platform, StepPlan


class CpuPlatform(Platform):
    fused_step_covers = frozenset({QK_NORMS_PER_HEAD})

    def __init__(self, kernel_dir: Path) -> None:
        self.kernel_dir = kernel_dir

    def layer_ops(self, dtype: torch.dtype) -> LayerOps | None:
        ops = load_layer_ops(self.kernel_dir)
        return ops if ops is not None and ops.supports(dtype) else None

    def decode_attention(self, dtype: torch.dtype) -> DecodeAttention | None:
        kernel = load_decode_kernel(self.kernel_dir)
        return kernel if kernel is not None and kernel.supports(dtype) else None

    def hold_weights(
        self, model: DecoderForCausalLM, weights: str, config: ModelConfig, model_dir: Path, name: str
    ) -> str:
        """Through our kernel where it holds `weights`, else by oneDNN for bfloat16."""
        if weights != dtype_name(model.dtype) or model.dtype == torch.bfloat16:
            weights = _hold_narrow(model, weights, config, model_dir, name)
        if model.lm_head.held is None and model.dtype == torch.bfloat16 and onednn_reorders_bfloat16():
            model.hold_weights(lambda _, weight: OneDnnWeight.of(weight), torch.bfloat16)
        return weights

    def fused_step(self, plan: StepPlan) -> FusedStep | None:
        """The decode step in one native call (decode_step.py)."""
        return plan_decode_step(plan, self.kernel_dir)


# The batch size oneDNN tunes the packed layout for; decode batches are around this.
PACKING_BATCH_HINT = 32


@dataclass(frozen=True)
class OneDnnWeight:
    """A bfloat16 weight reordered once into oneDNN's blocked layout."""

    packed: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> OneDnnWeight:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


@functools.cache
def onednn_reorders_bfloat16() -> bool:
    # oneDNN's bf16 path needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT; asking it is surer than reading CPU flags.
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACKING_BATCH_HINT)
    except RuntimeError:
        return False
    return True


def _hold_narrow(model: DecoderForCausalLM, weights: str, config: ModelConfig, model_dir: Path, name: str) -> str:
    """Hold the matmul weights as `weights` through our kernel; returns how they are held. Without
    the kernel (no compiler): an error when asked for by name, else (auto) the compute dtype's. int8
    panels come from the cache beside the model when it has them (packed_weights_cache.py)."""
    kernel = load_linear_kernel(config.cache_dir / "kernels")
    dot_products = kernel is not None and kernel.bfloat16_dot_products
    kernel_has_the_cpus_best = dot_products and (not cpu_has_amx() or bool(kernel and kernel.tile_rows_from))
    if weights == dtype_name(model.dtype) and not kernel_has_the_cpus_best:
        return weights  # oneDNN packs them
    if kernel is None:
        if config.weights == weights:
            raise ModelLoadError(f"--weights {weights} needs the CPU matmul kernel, which could not be built")
        return dtype_name(model.dtype)
    if weights == BFLOAT16_DOT and not dot_products:  # a compiler without AVX512-BF16's intrinsics
        if config.weights == weights:
            raise ModelLoadError(f"--weights {weights} needs AVX512-BF16 in the CPU matmul kernel's build")
        weights = "bfloat16"
    linears = {module_name: module for module_name, module in model.named_modules() if isinstance(module, Linear)}
    cache, cached = None, None
    if weights == "int8" and not config.random_weights:
        cache = PackedWeightsCache(config.cache_dir / "weights", model_dir, name, kernel)
        shapes = {
            module_name: (linear.weight.shape[0], linear.weight.shape[1]) for module_name, linear in linears.items()
        }
        cached = cache.load(shapes)
    model.hold_weights(
        lambda module_name, weight: NarrowMatmul(kernel, weight, weights, model.dtype, (cached or {}).get(module_name)),
        torch.bfloat16,
    )
    if cache is not None and cached is None:
        cache.store({module_name: _int8_panels(linear) for module_name, linear in linears.items()})
    return weights


def _int8_panels(linear: Linear) -> PackedInt8:
    assert isinstance(linear.held, NarrowMatmul) and linear.held.int8 is not None
    return linear.held.int8
