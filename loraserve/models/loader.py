"""Load a base model: config, tokenizer (with its chat template) and weights, from one directory."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from loraserve.config import ModelConfig
from loraserve.errors import ModelLoadError
from loraserve.models.decoder import DecoderForCausalLM, RMSNorm
from loraserve.models.decoder_spec import GLOBAL_ROPE, DecoderSpec
from loraserve.models.default_model import MODEL_NAME, default_model_dir
from loraserve.models.dtypes import dtype_name, resolve_dtype, resolve_weights
from loraserve.models.families import decoder_spec
from loraserve.models.platform import Platform, choose_platform
from loraserve.models.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

# Checkpoint tensors that carry nothing we need (precomputed RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
SHARD_INDEX = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    """A ready model and everything needed to turn text into its tokens and back."""

    model: DecoderForCausalLM
    tokenizer: PreTrainedTokenizerBase
    name: str  # the id clients use for the base model
    model_dir: Path
    eos_token_ids: frozenset[int]
    dtype: torch.dtype  # of the activations and the sums
    device: str
    weights: str  # how the matmul weights are held: the dtype's name, or 'bfloat16' / 'int8' narrower
    platform: Platform  # answers the device's questions (platform.py), chosen here once


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the configured model (the embedded default when `config.model` is None)."""
    if config.model is None:
        model_dir, name = default_model_dir(config.cache_dir), MODEL_NAME
    else:
        model_dir = Path(config.model)
        name = model_dir.resolve().name
    hf_config = _read_hf_config(model_dir)
    platform = choose_platform(config.device, config.cache_dir / "kernels")
    dtype = resolve_dtype(config.dtype, config.device)
    weights = resolve_weights(config.weights, config.dtype, dtype, config.device)
    spec = decoder_spec(hf_config)
    model = DecoderForCausalLM(spec, _ropes(hf_config, spec, dtype, config.device), dtype, config.device)
    if config.random_weights:
        _random_weights(model)
    else:
        _load_weights(model, model_dir)
    weights = platform.hold_weights(model, weights, config, model_dir, name)
    logger.info("%s (%s): %s compute, %s weights", name, spec.model_type, dtype_name(dtype), weights)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LoadedModel(
        model=model.eval(),
        tokenizer=tokenizer,
        name=name,
        model_dir=model_dir,
        eos_token_ids=_eos_token_ids(model_dir, tokenizer),
        dtype=dtype,
        device=config.device,
        weights=weights,
        platform=platform,
    )


def _read_hf_config(model_dir: Path) -> PretrainedConfig:
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError) as error:  # a model_type transformers does not know, or a broken config
        try:
            model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        except (ValueError, AttributeError):
            model_type = None
        raise ModelLoadError(f"model_type {model_type!r} is not supported ({error})") from None


def _ropes(
    hf_config: PretrainedConfig, spec: DecoderSpec, dtype: torch.dtype, device: str
) -> dict[str, RotaryEmbedding]:
    """The rotary table of each name the layers read (one, or Gemma 3's one per layer type)."""
    return {
        name: RotaryEmbedding(
            hf_config, None if name == GLOBAL_ROPE else name, spec.head_dim, spec.max_positions, dtype, device
        )
        for name in {spec.rope(layer) for layer in range(spec.num_layers)}
    }


def _weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors: the shards its index names, else every *.safetensors (a repository may
    also hold another format's single file beside the shards, as Mistral's do)."""
    index = model_dir / SHARD_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(f"{index} is not a safetensors index: {error!r}") from None
        paths = [model_dir / shard for shard in shards]
        absent = [path.name for path in paths if not path.is_file() or path.parent != model_dir]
        if absent:
            raise ModelLoadError(f"{index} names shards that are not in {model_dir}: {absent[:3]}")
        return paths
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (pickle checkpoints are not loaded)")
    return files


def _load_weights(model: DecoderForCausalLM, model_dir: Path) -> None:
    files = _weight_files(model_dir)
    targets = model.hf_weight_targets()
    missing = set(targets)
    with tqdm(total=len(targets), desc="Loading weights", unit="tensor", leave=False) as progress:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if name not in targets:
                        if not name.endswith(_IGNORED_SUFFIXES) and name != "lm_head.weight":  # tied: the same
                            raise ModelLoadError(
                                f"{path.name} holds {name}, which the {model.spec.model_type} forward has no place for"
                            )
                        continue
                    param, rows = targets[name]
                    tensor = f.get_tensor(name)
                    destination = param[rows]
                    if destination.shape != tensor.shape:
                        raise ModelLoadError(
                            f"{name} has shape {tuple(tensor.shape)}, the config implies {tuple(destination.shape)}"
                        )
                    destination.copy_(tensor)
                    missing.discard(name)
                    progress.update()
    if missing:
        raise ModelLoadError(f"{model_dir} lacks {len(missing)} weights, e.g. {sorted(missing)[0]}")
    if model.spec.norm_weight_offset:  # checkpoints of the family store w - offset (Gemma: 1 + w)
        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.data += model.spec.norm_weight_offset


def _random_weights(model: DecoderForCausalLM, seed: int = 0) -> None:
    """Norms at 1, everything else N(0, 0.02) as transformers initialises Llama, drawn on the model's device."""
    generator = torch.Generator(model.embed_tokens.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)


def _eos_token_ids(model_dir: Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) and the tokenizer."""
    ids: set[int] = set()
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
