"""Device slots for adapter weights: a fixed number of places, each holding one adapter.

Layout, per layer and projection: lora_a [num_slots, max_rank, in_features] and
lora_b [num_slots, out_features, max_rank], zero past each adapter's rank; ranks and
scales [num_slots], rank 0 where the slot's adapter does not adapt that projection (the
kernels then do nothing for it). Storage is padded to `max_rank`; compute is not (the
kernels stop at each adapter's rank). The unified paged pool (S-LoRA) replaces this
padded storage later; the interface to the model stays `LayerLora`.

A load reserves a slot, writes it (possibly from the loader thread while steps run:
no step reads a reserved slot) and activates it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.errors import AdapterError
from loraserve.lora.adapter import PROJECTIONS, LoraAdapter, projection_shapes
from loraserve.models.llama import LlamaSpec


@dataclass
class ProjectionLora:
    """One projection of one layer, for every slot."""

    lora_a: torch.Tensor  # [num_slots, max_rank, in_features] model dtype
    lora_b: torch.Tensor  # [num_slots, out_features, max_rank] model dtype
    ranks: torch.Tensor  # [num_slots] int32, 0 = not adapted
    scales: torch.Tensor  # [num_slots] float32


LayerLora = dict[str, ProjectionLora]  # projection name -> its weights in every slot


class AdapterSlots:
    """Owns the slot map (adapter name -> slot) and the weights in each slot."""

    def __init__(self, spec: LlamaSpec, num_slots: int, max_rank: int, dtype: torch.dtype, device: str) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self._slot_of: dict[str, int] = {}  # loaded: the kernels may use these
        self._reserved: dict[str, int] = {}  # taken for a load in flight
        self.layers: list[LayerLora] = [
            {
                name: ProjectionLora(
                    lora_a=torch.zeros(num_slots, max_rank, in_features, dtype=dtype, device=device),
                    lora_b=torch.zeros(num_slots, out_features, max_rank, dtype=dtype, device=device),
                    ranks=torch.zeros(num_slots, dtype=torch.int32, device=device),
                    scales=torch.zeros(num_slots, dtype=torch.float32, device=device),
                )
                for name, (in_features, out_features) in projection_shapes(spec).items()
            }
            for _ in range(spec.num_layers)
        ]

    @property
    def names(self) -> list[str]:
        """Adapters whose weights are in a slot, ready for the kernels."""
        return list(self._slot_of)

    def slot_of(self, name: str) -> int:
        return self._slot_of[name]

    def __contains__(self, name: str) -> bool:
        return name in self._slot_of

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self._slot_of) - len(self._reserved)

    def reserve(self, name: str) -> int:
        """Take a free slot for `name` (its weights are written next, maybe from another thread)."""
        taken = set(self._slot_of.values()) | set(self._reserved.values())
        free = [slot for slot in range(self.num_slots) if slot not in taken]
        if not free:
            raise AdapterError("name", f"all {self.num_slots} adapter slots are in use; raise max_loras")
        self._reserved[name] = free[0]
        return free[0]

    def is_reserved(self, name: str) -> bool:
        return name in self._reserved

    def cancel(self, name: str) -> None:
        del self._reserved[name]

    def write(self, name: str, adapter: LoraAdapter) -> None:
        """Copy the weights into the slot reserved for `name`; no other slot is touched."""
        slot = self._reserved[name]
        # read_adapter already refused ranks above the maximum the slots were sized for.
        assert all(w.rank <= self.max_rank for w in adapter.weights.values()), "adapter read with another max rank"
        for layer_index, layer in enumerate(self.layers):
            for projection in PROJECTIONS:
                weights = adapter.weights.get((layer_index, projection))
                target = layer[projection]
                target.lora_a[slot].zero_()
                target.lora_b[slot].zero_()
                if weights is None:
                    target.ranks[slot], target.scales[slot] = 0, 0.0
                    continue
                target.lora_a[slot, : weights.rank] = weights.a
                target.lora_b[slot, :, : weights.rank] = weights.b
                target.ranks[slot], target.scales[slot] = weights.rank, weights.scale

    def activate(self, name: str) -> None:
        """The reserved slot's weights are written: the kernels may use it from the next step."""
        self._slot_of[name] = self._reserved.pop(name)

    def unload(self, name: str) -> None:
        slot = self._slot_of.pop(name)
        for layer in self.layers:
            for target in layer.values():
                target.ranks[slot], target.scales[slot] = 0, 0.0
