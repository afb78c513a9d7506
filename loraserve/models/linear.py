"""A linear layer whose weight is held by our CPU kernel (bfloat16 or int8 panels, cpu_linear.py), pre-packed for
oneDNN, or plain.

bfloat16 weights with bfloat16 compute go to our kernel where it has bfloat16 dot products, and AMX tiles where
the CPU has them (loader.py). Elsewhere (a compiler without them, or none) oneDNN takes them: a bfloat16 decode
matmul with the weight reordered once into oneDNN's blocked layout runs about 2x faster than `F.linear` (weights
stream from memory every step, and the packed layout streams better), with bit-identical results. float32 stays
on `F.linear`: packing changes its rounding, and float32
is the mode that must match transformers token for token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# The batch size oneDNN tunes the packed layout for; decode batches are around this.
PACKING_BATCH_HINT = 32


def can_pack(dtype: torch.dtype, device: str) -> bool:
    """Packing pays (and is exact) for bfloat16 on a CPU whose oneDNN can reorder bfloat16 weights."""
    return device == "cpu" and dtype == torch.bfloat16 and _onednn_reorders_bfloat16()


@functools.cache
def _onednn_reorders_bfloat16() -> bool:
    # oneDNN's bf16 path needs AVX512 (bw/vl/dq) or AVX-NE-CONVERT; asking it is surer than reading CPU flags.
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACKING_BATCH_HINT)
    except RuntimeError:
        return False
    return True


class Linear(nn.Module):
    """y = x @ W^T (+ b), W: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.is_packed = False
        self.narrow: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by hold_narrow
        self._row_norms: torch.Tensor | None = None  # kept before the dense weight goes (pack, hold_narrow)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.narrow is not None:
            out = self.narrow(x)
            return out if self.bias is None else out.add_(self.bias)
        if self.is_packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def row_norms_squared(self) -> torch.Tensor:
        """||W_i||^2 of every output row, float32 [out_features] (DoRA's norms need it, lora/dora.py)."""
        if self._row_norms is None:
            assert not self.is_packed and self.narrow is None, "the dense weight is gone; norms kept before"
            self._row_norms = self.weight.detach().float().square().sum(dim=1)
        return self._row_norms

    def pack(self) -> None:
        """Reorder the loaded weight into oneDNN's layout; call once, after loading."""
        self.row_norms_squared()
        self.weight = nn.Parameter(
            torch.ops.mkldnn._reorder_linear_weight(self.weight.data, PACKING_BATCH_HINT), requires_grad=False
        )
        self.is_packed = True

    def hold_narrow(self, narrow: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """Keep the weight only as `narrow(weight)` (cpu_linear.NarrowMatmul), which computes the matmul."""
        self.row_norms_squared()
        self.narrow = narrow(self.weight.data)
        self.weight = None  # type: ignore[assignment]


def empty_param(*shape: int, dtype: torch.dtype, device: str) -> nn.Parameter:
    # Weights are filled by the loader; skipping random init saves seconds at start.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
