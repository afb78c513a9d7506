"""Read a PEFT LoRA adapter directory and validate it against the base model before use.

An adapter is `adapter_config.json` + `adapter_model.safetensors`. Only safetensors are
read: a pickle file (`adapter_model.bin`, `.pt`) is refused and never unpickled.
Everything loraserve cannot serve exactly is refused with an error naming the field or
file, never silently ignored.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from loraserve.errors import AdapterError
from loraserve.file_digest import sha256_of_files
from loraserve.models.llama import LlamaSpec

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_BLOCK_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}

# PEFT config fields whose non-neutral value changes what the adapter computes in ways we
# do not implement. A field absent from the config counts as neutral.
_UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "layer_replication": (None,),
    "trainable_token_indices": (None,),
    "target_parameters": (None, []),
    "alora_invocation_tokens": (None,),
    "arrow_config": (None,),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "monteclora_config": (None,),
    "kasa_config": (None,),
}
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


@dataclass(frozen=True)
class LoraWeights:
    """One adapted projection of one layer: delta(x) = (x @ a.T) @ b.T * scale."""

    a: torch.Tensor  # [rank, in_features] float32
    b: torch.Tensor  # [out_features, rank] float32
    scale: float

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


def projection_shapes(spec: LlamaSpec) -> dict[str, tuple[int, int]]:
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
    path: Path, spec: LlamaSpec, max_rank: int, base_model_names: frozenset[str] = frozenset()
) -> LoraAdapter:
    """Read and validate the PEFT adapter in directory `path`; raises AdapterError naming the culprit.

    `base_model_names`: names the served base model goes by; an adapter trained on a model
    of another name is served with a warning (shapes are what must match).
    """
    config = _read_config(path)
    rank, alpha = int(_positive_number(config, "r")), _positive_number(config, "lora_alpha")
    if rank != config["r"]:
        raise AdapterError("r", f"must be a whole number, got {config['r']!r}")
    use_rslora = bool(config.get("use_rslora", False))
    target_modules = _target_modules(config, spec)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        pickles = [name for name in PICKLE_FILES if (path / name).exists()]
        hint = f"; {pickles[0]} is a pickle file and is never loaded: re-save with safetensors" if pickles else ""
        raise AdapterError(WEIGHTS_FILE, f"missing{hint}")
    pairs = _lora_pairs(_read_tensors(weights_path), spec)
    weights = _validated_weights(pairs, config, spec, rank, alpha, use_rslora, max_rank)
    adapted = {projection for _, projection in weights}
    declared_base = config.get("base_model_name_or_path")
    if base_model_names and declared_base and Path(str(declared_base)).name not in base_model_names:
        logger.warning(
            "adapter in %s was trained on %r, serving it on %s", path, declared_base, sorted(base_model_names)
        )
    return LoraAdapter(
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        target_modules=tuple(p for p in PROJECTIONS if p in adapted or p in target_modules),
        weights=weights,
        base_model_name=declared_base,
        sha256=sha256_of_files(path / CONFIG_FILE, weights_path),
        num_bytes=weights_path.stat().st_size,
    )


def _lora_pairs(tensors: dict[str, torch.Tensor], spec: LlamaSpec) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Group the file's tensors by (layer, projection) -> {"A": ..., "B": ...}."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(WEIGHTS_FILE, f"unexpected tensor {name!r}: only LoRA A/B of the projections are served")
        layer, projection, side = int(match[1]), match[3], match[4]
        if projection not in PROJECTIONS:
            raise AdapterError("target_modules", f"LoRA on {projection!r} is not supported; only {PROJECTIONS}")
        if not 0 <= layer < spec.num_layers:
            raise AdapterError(WEIGHTS_FILE, f"{name}: no layer {layer} in the base model ({spec.num_layers} layers)")
        pairs.setdefault((layer, projection), {})[side] = tensor
    if not pairs:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA weights")
    return pairs


def _validated_weights(
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
    config: dict[str, Any],
    spec: LlamaSpec,
    rank: int,
    alpha: float,
    use_rslora: bool,
    max_rank: int,
) -> dict[tuple[int, str], LoraWeights]:
    shapes = projection_shapes(spec)
    weights: dict[tuple[int, str], LoraWeights] = {}
    for (layer, projection), sides in sorted(pairs.items()):
        where = f"layer {layer} {projection}"
        if set(sides) != {"A", "B"}:
            raise AdapterError(WEIGHTS_FILE, f"{where} has lora_{next(iter(sides))} without its pair")
        # fan_in_fan_out describes Conv1D base weights; for Linear projections PEFT itself
        # turns it off and stores A and B as Linear weights, so they are read as they are.
        a, b = sides["A"], sides["B"]
        module_rank = _pattern_value(config.get("rank_pattern"), layer, projection, rank)
        module_alpha = _pattern_value(config.get("alpha_pattern"), layer, projection, alpha)
        in_features, out_features = shapes[projection]
        if a.shape != (module_rank, in_features) or b.shape != (out_features, module_rank):
            raise AdapterError(
                WEIGHTS_FILE,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model, which needs "
                f"({module_rank}, {in_features}) and ({out_features}, {module_rank})",
            )
        if module_rank > max_rank:
            raise AdapterError("r", f"{where} has rank {module_rank}, above the configured maximum {max_rank}")
        scale = module_alpha / (math.sqrt(module_rank) if use_rslora else module_rank)
        weights[(layer, projection)] = LoraWeights(a=a.float().contiguous(), b=b.float().contiguous(), scale=scale)
    return weights


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(CONFIG_FILE, f"missing from {path}")
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(CONFIG_FILE, f"is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError("peft_type", f"{config['peft_type']!r} is not supported; only LORA")
    for field, neutral in _UNSUPPORTED_UNLESS_NEUTRAL.items():
        if field in config and config[field] not in neutral:
            raise AdapterError(field, f"{config[field]!r} is not supported (loraserve serves plain LoRA)")
    return config


def _positive_number(config: dict[str, Any], field: str) -> float:
    value = config.get(field)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise AdapterError(field, f"must be a positive number, got {value!r}")
    return float(value)


def _target_modules(config: dict[str, Any], spec: LlamaSpec) -> set[str]:
    """The projections `target_modules` selects (a list of names or a regex over full module names)."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        names = [f"model.layers.{i}.{_BLOCK_OF.get(p, 'mlp')}.{p}" for i in range(spec.num_layers) for p in PROJECTIONS]
        others = ["model.embed_tokens", "lm_head"]
        if any(re.fullmatch(targets, name) for name in others):
            raise AdapterError("target_modules", "LoRA on the embedding or lm_head is not supported")
        return {name.rsplit(".", 1)[1] for name in names if re.fullmatch(targets, name)}
    if not isinstance(targets, list) or not targets:
        raise AdapterError("target_modules", f"must be a non-empty list or a regex, got {targets!r}")
    unsupported = [t for t in targets if t not in PROJECTIONS]
    if unsupported:
        raise AdapterError("target_modules", f"{unsupported} not supported; LoRA may target only {PROJECTIONS}")
    return set(targets)


def _pattern_value(pattern: dict[str, Any] | None, layer: int, projection: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key whose regex matches the module's name."""
    name = f"model.layers.{layer}.{_BLOCK_OF.get(projection, 'mlp')}.{projection}"
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _read_tensors(weights_path: Path) -> dict[str, torch.Tensor]:
    try:
        with safe_open(weights_path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a Mapping
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(WEIGHTS_FILE, f"cannot be read (truncated or not safetensors): {error}") from error
