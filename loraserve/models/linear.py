"""A linear layer whose weight is plain, or held only in the form its platform multiplies fastest:
on the CPU our kernel's bfloat16 or int8 panels, or oneDNN's blocked layout (cpu/platform.py)."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class HeldWeight(Protocol):
    """A weight in a platform's form: computes x @ W^T (+ bias) as F.linear would."""

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


class Linear(nn.Module):
    """y = x @ W^T (+ b), W: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.held: HeldWeight | None = None  # set by hold
        self._row_norms: torch.Tensor | None = None  # kept before the dense weight goes (hold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.held is not None:
            return self.held(x, self.bias)
        return F.linear(x, self.weight, self.bias)

    def row_norms_squared(self) -> torch.Tensor:
        """||W_i||^2 of every output row, float32 [out_features] (DoRA's norms need it, lora/dora.py)."""
        if self._row_norms is None:
            assert self.held is None, "the dense weight is gone; norms kept before"
            self._row_norms = self.weight.detach().float().square().sum(dim=1)
        return self._row_norms

    def hold(self, held: HeldWeight) -> None:
        """Keep the weight only as `held`, made from it after loading, which computes the matmul."""
        self.row_norms_squared()
        self.held = held
        self.weight = None  # type: ignore[assignment]


def empty_param(*shape: int, dtype: torch.dtype, device: str) -> nn.Parameter:
    # Weights are filled by the loader; skipping random init saves seconds at start.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
