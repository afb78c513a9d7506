"""PEFT adapter directories with random weights, for benchmarks.

Throughput does not depend on what an adapter learned, only on its rank and targets, so
the weights are seeded noise written the way peft saves them (`adapter_config.json` +
`adapter_model.safetensors`): every system under test reads the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraserve.lora.adapter import PROJECTIONS, projection_shapes
from loraserve.models.decoder_spec import DecoderSpec

_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def write_random_adapters(
    spec: DecoderSpec,
    count: int,
    out_dir: Path,
    projections: tuple[str, ...] = PROJECTIONS,
    ranks: tuple[int, ...] = (8, 16),
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    dora: bool = False,
) -> list[Path]:
    """`count` adapters named adapter-0.. under `out_dir`, on `projections` (the modules holding them, for a
    family that fuses some); adapter i has rank `ranks[i % len(ranks)]`.
    Stored in bfloat16 by default, as peft saves the adapters of a bfloat16 model. `dora`: DoRA adapters
    (a magnitude vector per module, near one)."""
    shapes = projection_shapes(spec)
    # As PEFT names them: a module the checkpoint fuses (Phi-3's qkv_proj) is one adapter module.
    modules = {m: held for m, held in spec.module_projections().items() if set(held) <= set(projections)}
    generator = torch.Generator().manual_seed(seed)
    paths = []
    for i in range(count):
        rank = ranks[i % len(ranks)]
        tensors = {}
        for layer in range(spec.num_layers):
            for module, held in modules.items():
                in_features, out_features = shapes[held[0]][0], sum(shapes[p][1] for p in held)
                block = "self_attn" if held[0] in _ATTENTION else "mlp"
                prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
                if dora:
                    magnitude = 1 + 0.1 * torch.randn(out_features, generator=generator)
                    tensors[f"{prefix}.lora_magnitude_vector"] = magnitude
        path = out_dir / f"{'dora' if dora else 'adapter'}-{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(dtype) for k, v in tensors.items()}, path / "adapter_model.safetensors")
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(modules),
            "bias": "none",
            "use_dora": dora,
        }
        (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
        paths.append(path)
    return paths
