"""The platform seam: one object per kind of device (cpu/, cuda/), chosen once at start by
`choose_platform`, answers every device question of the model (its layer ops, decode attention,
the matmul weights' form and, optionally, a fused decode step), so the model (decoder.py,
attention.py) is written once, and a model family is a small file over the same ops."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from loraserve.models.attention import DecodeAttention
from loraserve.models.decoder import DecoderForCausalLM, KVCache
from loraserve.models.layer_ops import LayerOps

if TYPE_CHECKING:
    from loraserve.config import ModelConfig
    from loraserve.lora.slots import AdapterSlots


@dataclass
class DecodeRows:
    """A decode-only step, row by row (host side), as a fused step takes it."""

    input_ids: list[int]
    positions: list[int]
    slot_blocks: list[int]  # the block each row writes its K and V to
    slot_offsets: list[int]
    block_tables: list[list[int]]
    context_lens: list[int]
    lora_slots: list[int]  # NO_ADAPTER: the base model

    def __len__(self) -> int:
        return len(self.input_ids)

    def reordered(self, order: list[int]) -> DecodeRows:
        """These rows in `order` (indices into them)."""
        return DecodeRows(*([getattr(self, column.name)[row] for row in order] for column in fields(self)))


class FusedStep(Protocol):
    def run(self, rows: DecodeRows) -> torch.Tensor | None:
        """The rows' hidden states [len(rows), hidden] after the final norm, in their order, as the
        model computes them; None where this step does not fit (the model runs it)."""


@dataclass(frozen=True)
class GraphSettings:
    """What sizes the decode CUDA graphs: the largest batch and the longest sequence."""

    max_num_seqs: int
    max_model_len: int


@dataclass(frozen=True)
class StepPlan:
    """What a fused decode step is planned over, once at start."""

    model: DecoderForCausalLM
    kv_caches: list[KVCache]
    adapter_slots: AdapterSlots
    block_size: int
    take_scratch_block: Callable[[], int]  # a KV block no sequence owns, for padding rows to write
    graphs: GraphSettings | None  # None: --enforce-eager


class Platform(ABC):
    """The device's answers; each method is asked once, at start."""

    # The departures from Llama's forward (DecoderForCausalLM.departures) its fused step computes;
    # a model with any other decodes layer by layer.
    fused_step_covers: frozenset[str] = frozenset()

    @abstractmethod
    def layer_ops(self, dtype: torch.dtype) -> LayerOps | None:
        """The fused per-layer ops for `dtype`; None: torch's (layer_ops.py)."""

    @abstractmethod
    def decode_attention(self, dtype: torch.dtype) -> DecodeAttention | None:
        """The kernel for one-token rows; None: attention.py's torch paths."""

    def hold_weights(
        self, model: DecoderForCausalLM, weights: str, config: ModelConfig, model_dir: Path, name: str
    ) -> str:
        """Hold the loaded matmul weights of model `name` as `weights` (dtypes.resolve_weights) in this
        platform's fastest form; returns how they are held. Here: as loaded."""
        return weights

    @abstractmethod
    def fused_step(self, plan: StepPlan) -> FusedStep | None:
        """A decode step in one call (CUDA graphs; the CPU's native step) giving the model's results
        for the steps it serves, or None where this platform has none for the model."""


def choose_platform(device: str, kernel_dir: Path) -> Platform:
    """The platform of `device`; its kernels are built or compiled in `kernel_dir` when first asked for."""
    # Imported once chosen: CUDA's imports the LoRA batch code, which imports the model.
    if device == "cuda":
        from loraserve.models.cuda.platform import CudaPlatform

        return CudaPlatform()
    from loraserve.models.cpu.platform import CpuPlatform

    return CpuPlatform(kernel_dir)
