"""Read a PEFT LoRA adapter directory and validate it against the base model before use.

An adapter is `adapter_config.json` + `adapter_model.safetensors`. Only safetensors are
read: a pickle file (`adapter_model.bin`, `.pt`) is refused and never unpickled.
Everything loraserve cannot serve exactly is refused with an error naming the field or
file, never silently ignored.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from loraserve.errors import AdapterError
from loraserve.file_digest import sha256_of_files
from loraserve.lora.adapter_config import AdapterConfig, parse_config
from loraserve.lora.peft_files import CONFIG_FILE, PICKLE_FILES, WEIGHTS_FILE
from loraserve.models.decoder_spec import PROJECTIONS, DecoderSpec

logger = logging.getLogger(__name__)

FLOAT32_MAX = 3.4028234663852886e38

# lora_A / lora_B weights, and DoRA's magnitude vector (PEFT saves it without ".weight").
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
    r"(?:lora_([AB])(?:\.\w+)?\.weight|lora_(magnitude)_vector(?:\.weight)?)$"
)
MAGNITUDE = "magnitude"


@dataclass(frozen=True)
class LoraWeights:
    """One adapted projection of one layer: delta(x) = (x @ a.T) @ b.T * scale; with DoRA the output
    (base and delta) is then multiplied per column by `dora_scale`, magnitude / ||W + scale B A||_row."""

    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [out_features, rank] float32
    scale: float
    magnitude: torch.Tensor | None = None  # [out_features] float32: DoRA's m, as saved
    dora_scale: torch.Tensor | None = None  # [out_features] float32, worked out from m and the base (dora.py)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter, its weights on the CPU in float32."""

    rank: int  # the config's r; a module's own rank may differ (rank_pattern)
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # which of PROJECTIONS it adapts
    weights: dict[tuple[int, str], LoraWeights]  # (layer, projection) -> weights
    base_model_name: str | None
    sha256: str  # of the config and weights files, in that order: the adapter's content identity
    num_bytes: int

    @property
    def use_dora(self) -> bool:
        return any(w.magnitude is not None for w in self.weights.values())


def projection_shapes(spec: DecoderSpec) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every projection LoRA may adapt."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter(
    path: Path,
    spec: DecoderSpec,
    max_rank: int,
    base_model_names: frozenset[str] = frozenset(),
    max_scale: float = FLOAT32_MAX,
    config: AdapterConfig | None = None,
) -> LoraAdapter:
    """Read and validate the PEFT adapter in directory `path`; raises AdapterError naming the culprit.
    `base_model_names`: the served base model's names; an adapter trained on another name is served with
    a warning (shapes are what must match). `config`: already parsed (adapter_sandbox.py, for uploads)."""
    config = config or parse_config(path, spec, max_rank, max_scale)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = [name for name in PICKLE_FILES if (path / name).exists()]
        hint = f"; {pickles[0]} is a pickle file and is never loaded: re-save with safetensors" if pickles else ""
        raise AdapterError(WEIGHTS_FILE, f"missing{hint}")
    pairs = _lora_pairs(_read_tensors(weights_path), spec)
    weights = _validated_weights(pairs, config, spec, max_rank)
    adapted = {projection for _, projection in weights}
    declared_base = config.base_model_name
    if base_model_names and declared_base and Path(declared_base).name not in base_model_names:
        logger.warning(
            "adapter in %s was trained on %r, serving it on %s", path, declared_base, sorted(base_model_names)
        )
    return LoraAdapter(
        rank=config.rank,
        alpha=config.alpha,
        use_rslora=config.use_rslora,
        target_modules=tuple(p for p in PROJECTIONS if p in adapted or p in config.target_modules),
        weights=weights,
        base_model_name=declared_base,
        sha256=sha256_of_files(path / CONFIG_FILE, weights_path),
        num_bytes=weights_path.stat().st_size,
    )


def _lora_pairs(tensors: dict[str, torch.Tensor], spec: DecoderSpec) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Group the file's tensors by (layer, module of the checkpoint) -> {"A": ..., "B": ...}."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules = spec.module_projections()
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(WEIGHTS_FILE, f"unexpected tensor {name!r}: only LoRA A/B of the projections are served")
        layer, projection, side = int(match[1]), match[3], match[4] or match[5]
        if projection not in modules:
            raise AdapterError(
                "target_modules", f"LoRA on {projection!r} is not supported on {spec.model_type}; only {tuple(modules)}"
            )
        if not 0 <= layer < spec.num_layers:
            raise AdapterError(WEIGHTS_FILE, f"{name}: no layer {layer} in the base model ({spec.num_layers} layers)")
        pairs.setdefault((layer, projection), {})[side] = tensor
    if not pairs:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA weights")
    return pairs


def _validated_weights(
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]], config: AdapterConfig, spec: DecoderSpec, max_rank: int
) -> dict[tuple[int, str], LoraWeights]:
    shapes = projection_shapes(spec)
    held = spec.module_projections()
    weights: dict[tuple[int, str], LoraWeights] = {}
    for (layer, module), sides in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if not {"A", "B"} <= set(sides):
            raise AdapterError(WEIGHTS_FILE, f"{where} has lora_{next(iter(sides))} without its pair")
        projections = held[module]
        in_features, out_features = shapes[projections[0]][0], sum(shapes[p][1] for p in projections)
        magnitude = _magnitude(sides.get(MAGNITUDE), config.use_dora, where, out_features)
        # fan_in_fan_out describes Conv1D base weights; for Linear projections PEFT itself
        # turns it off and stores A and B as Linear weights, so they are read as they are.
        a, b = sides["A"], sides["B"]
        module_rank, _ = config.modules[(layer, projections[0])]
        if a.shape != (module_rank, in_features) or b.shape != (out_features, module_rank):
            raise AdapterError(
                WEIGHTS_FILE,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model, which needs "
                f"({module_rank}, {in_features}) and ({out_features}, {module_rank})",
            )
        if module_rank > max_rank:
            raise AdapterError("r", f"{where} has rank {module_rank}, above the configured maximum {max_rank}")
        a, b = a.float().contiguous(), b.float().contiguous()
        if not (bool(a.isfinite().all()) and bool(b.isfinite().all())):
            raise AdapterError(WEIGHTS_FILE, f"{where}: the weights hold NaN or infinite values")
        scale = config.scale((layer, projections[0]))
        # A fused module's delta is B A x: each projection it holds is its rows of B (and of DoRA's m), one A.
        rows = torch.tensor([shapes[p][1] for p in projections]).cumsum(0).tolist()
        for projection, start, end in zip(projections, [0, *rows[:-1]], rows, strict=True):
            part = None if magnitude is None else magnitude[start:end].contiguous()
            weights[(layer, projection)] = LoraWeights(a=a, b=b[start:end].contiguous(), scale=scale, magnitude=part)
    return weights


def _magnitude(tensor: torch.Tensor | None, use_dora: bool, where: str, out_features: int) -> torch.Tensor | None:
    """DoRA's magnitude vector of one module: present exactly when the config says use_dora."""
    if not use_dora:
        if tensor is not None:
            raise AdapterError("use_dora", f"{where} has a lora_magnitude_vector but use_dora is not true")
        return None
    if tensor is None:
        raise AdapterError(WEIGHTS_FILE, f"{where}: use_dora is true but its lora_magnitude_vector is missing")
    if tensor.shape != (out_features,):
        raise AdapterError(
            WEIGHTS_FILE, f"{where}: lora_magnitude_vector {tuple(tensor.shape)} does not fit ({out_features},)"
        )
    magnitude = tensor.float().contiguous()
    if not bool(magnitude.isfinite().all()):
        raise AdapterError(WEIGHTS_FILE, f"{where}: lora_magnitude_vector holds NaN or infinite values")
    return magnitude


def _read_tensors(weights_path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(weights_path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(WEIGHTS_FILE, f"cannot be read (truncated or not safetensors): {error}") from error
