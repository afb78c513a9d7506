"""DoRA (PEFT `use_dora`): an adapted projection's output, base and delta together, scaled per column.

PEFT computes y = (W x + s B A x) * m / ||W + s B A||_row. The norm depends only on weights, so
each module's scale vector m / ||.|| is worked out once, when the adapter enters the host cache,
and travels with its A and B rows into the pool (slots.py); the step multiplies each DoRA row's
output by it after the LoRA delta (dora_rows.py).

The norm never builds the [out, in] sum: ||W_i + s (BA)_i||^2 = ||W_i||^2 + 2 s (W A^T)_i . B_i
+ s^2 B_i (A A^T) B_i^T. ||W_i||^2 is kept by the base's matmul when it loads, and W A^T is that
matmul applied to A's rows, so packed, bfloat16 or int8 base weights serve as they are.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from loraserve.errors import AdapterError
from loraserve.lora.adapter import LoraAdapter, LoraWeights
from loraserve.models.decoder import DecoderForCausalLM


def with_dora_scales(adapter: LoraAdapter, base: DecoderForCausalLM) -> LoraAdapter:
    """The adapter with every DoRA module's scale vector filled in; as it is without DoRA or when done."""
    todo = {m: w for m, w in adapter.weights.items() if w.magnitude is not None and w.dora_scale is None}
    if not todo:
        return adapter
    weights = dict(adapter.weights)
    for (layer, projection), module in todo.items():
        weights[(layer, projection)] = replace(module, dora_scale=_scale(module, base, layer, projection))
    return replace(adapter, weights=weights)


@torch.inference_mode()
def _scale(module: LoraWeights, base: DecoderForCausalLM, layer: int, projection: str) -> torch.Tensor:
    assert module.magnitude is not None
    a, b, s = module.a, module.b, module.scale
    linear, columns = base.projection(layer, projection)
    w_a = linear(a.to(device=base.embed_tokens.device, dtype=base.dtype))[:, columns].float().cpu()  # (W A^T)^T
    cross = (w_a.T * b).sum(dim=1)  # (W A^T)_i . B_i
    delta_squared = ((b @ (a @ a.T)) * b).sum(dim=1)  # ||(B A)_i||^2
    norm_squared = linear.row_norms_squared()[columns].cpu() + 2 * s * cross + s * s * delta_squared
    scale = module.magnitude / norm_squared.clamp_min(0).sqrt()
    if not bool(scale.isfinite().all()):
        where = f"layer {layer} {projection}"
        raise AdapterError("lora_magnitude_vector", f"{where}: W + s B A has a zero row; DoRA's scale is undefined")
    return scale.contiguous()
