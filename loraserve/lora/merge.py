"""Mixing adapters per request (LoRAX's `merged_adapters`), each strategy as PEFT's `add_weighted_adapter`
defines it for LoRA.

Per adapted module, over the parts that adapt it (weight w, scale s = alpha / r of the part):
- `cat`: A = [w1 s1 A1; w2 s2 A2; ...], B = [B1 B2 ...]: the exact weighted sum of the deltas, at the
  sum of the ranks.
- `linear`: A = sum sign(ws) sqrt|ws| A_i, B = sum sqrt|ws| B_i (PEFT: "efficient but a very rough
  approximation"). It needs parts of one rank; for parts of different ranks `linear` is served as
  `cat`, the weighted sum PEFT would otherwise refuse to compute.
- `ties`, `dare_linear`, `dare_ties`, `magnitude_prune`: A's and B's as `linear` weighs them, each part
  pruned to `density` first (by magnitude, or DARE's random mask rescaled by 1 / density), TIES
  keeping per element the values that agree with the majority sign (`majority_sign_method`).
The merged module's scale is 1. (PEFT copies the first part's `use_rslora` into the merged config,
so after an rsLoRA first part it scales the merge by sqrt(r); loraserve does not.) DARE draws its
masks from a generator seeded by the mix's hash, module by module in PEFT's order (layers, then
q, k, v, o, gate, up, down; A's parts, then B's), so a mix is the same on every server and every
time, and equals PEFT's after `torch.manual_seed(mix_seed(...))`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from loraserve.errors import InvalidRequestError
from loraserve.lora.adapter import PROJECTIONS, LoraAdapter, LoraWeights
from loraserve.lora.host_cache import host_bytes
from loraserve.lora.mix_spec import FIELD, MixSpec, mix_seed


def merge_adapters(spec: MixSpec, parts: list[LoraAdapter], sha256: str, max_rank: int) -> LoraAdapter:
    """The mixed adapter; InvalidRequestError when these parts cannot be mixed so (or exceed `max_rank`)."""
    for name, part in zip(spec.ids, parts, strict=True):
        if part.use_dora:
            raise InvalidRequestError(f"{FIELD}.ids", f"{name!r} is a DoRA adapter; only LoRA adapters mix")
    strategy = spec.merge_strategy if len(parts) > 1 else "linear"  # PEFT: one part is always linear
    modules = sorted({m for part in parts for m in part.weights}, key=lambda m: (m[0], PROJECTIONS.index(m[1])))
    one_rank = len({part.rank for part in parts}) == 1 and all(
        len({part.weights[m].rank for part in parts if m in part.weights}) == 1 for m in modules
    )
    if not one_rank and strategy != "cat":
        if strategy != "linear":
            raise InvalidRequestError(
                f"{FIELD}.merge_strategy", f"{strategy} needs adapters of one rank; linear and cat mix any ranks"
            )
        strategy = "cat"
    generator = torch.Generator().manual_seed(mix_seed(sha256))
    weighted_parts = list(zip(parts, spec.weights, strict=True))
    weights: dict[tuple[int, str], LoraWeights] = {}
    for module in modules:
        present = [(part.weights[module], w) for part, w in weighted_parts if module in part.weights]
        merged = weights[module] = _merge_module(present, strategy, spec, generator)
        where = f"layer {module[0]} {module[1]}"
        if merged.rank > max_rank:
            raise InvalidRequestError(FIELD, f"the mix has rank {merged.rank} at {where}; at most {max_rank}")
        if not (bool(merged.a.isfinite().all()) and bool(merged.b.isfinite().all())):
            raise InvalidRequestError(f"{FIELD}.weights", f"are too large: the mix's weights overflow at {where}")
    mixed = LoraAdapter(
        rank=max(w.rank for w in weights.values()),
        alpha=1.0,
        use_rslora=False,
        target_modules=tuple(p for p in PROJECTIONS if any(m[1] == p for m in weights)),
        weights=weights,
        base_model_name=parts[0].base_model_name,
        sha256=sha256,
        num_bytes=0,
    )
    return replace(mixed, num_bytes=host_bytes(mixed))


def _merge_module(
    present: list[tuple[LoraWeights, float]], strategy: str, spec: MixSpec, generator: torch.Generator
) -> LoraWeights:
    if strategy == "cat":
        a = torch.cat([module.a * weight * module.scale for module, weight in present])
        b = torch.cat([module.b for module, _ in present], dim=1)
        return LoraWeights(a=a.contiguous(), b=b.contiguous(), scale=1.0)
    # A negative weight flips A only: on both sides it would cancel out.
    scaled = [weight * module.scale for module, weight in present]
    a_weights = torch.tensor([math.sqrt(abs(w)) * (1 if w >= 0 else -1) for w in scaled])
    b_weights = torch.tensor([math.sqrt(abs(w)) for w in scaled])
    a = _combine([module.a for module, _ in present], a_weights, strategy, spec, generator)
    b = _combine([module.b for module, _ in present], b_weights, strategy, spec, generator)
    return LoraWeights(a=a.contiguous(), b=b.contiguous(), scale=1.0)


def _combine(
    tensors: list[torch.Tensor], weights: torch.Tensor, strategy: str, spec: MixSpec, generator: torch.Generator
) -> torch.Tensor:
    """PEFT's merge_utils (task_arithmetic, ties, dare_linear, dare_ties, magnitude_prune) for one side."""
    if strategy in ("ties", "magnitude_prune"):
        tensors = [_prune_by_magnitude(t, spec.density) for t in tensors]
    elif strategy in ("dare_linear", "dare_ties"):
        tensors = [_prune_at_random(t, spec.density, generator) for t in tensors]
    stacked = torch.stack(tensors, dim=0)
    weighted = stacked * weights.view(-1, *[1] * (stacked.dim() - 1))
    if strategy not in ("ties", "dare_ties"):
        return weighted.sum(dim=0)
    sign = stacked.sign()
    magnitude = stacked.sum(dim=0) if spec.majority_sign_method == "total" else sign.sum(dim=0)
    agrees = sign == torch.where(magnitude >= 0, 1, -1)
    return (weighted * agrees).sum(dim=0) / torch.clamp(agrees.sum(dim=0), min=1.0)


def _prune_by_magnitude(tensor: torch.Tensor, density: float) -> torch.Tensor:
    if density >= 1:
        return tensor
    mask = torch.zeros_like(tensor).reshape(-1)
    mask[torch.topk(tensor.abs().reshape(-1), k=int(density * tensor.numel()), largest=True)[1]] = 1
    return tensor * mask.reshape(tensor.shape)


def _prune_at_random(tensor: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    if density >= 1:
        return tensor
    mask = torch.bernoulli(torch.full_like(tensor, density), generator=generator)
    return tensor * mask / density
