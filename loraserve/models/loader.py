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
from loraserve.models.cpu_linear import NarrowMatmul, PackedInt8, load_linear_kernel
from loraserve.models.default_model import MODEL_NAME, default_model_dir
from loraserve.models.dtypes import BFLOAT16_DOT, cpu_has_amx, dtype_name, resolve_dtype, resolve_weights
from loraserve.models.linear import Linear
from loraserve.models.llama import LlamaForCausalLM, LlamaSpec
from loraserve.models.packed_weights_cache import PackedWeightsCache
from loraserve.models.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Checkpoint tensors that carry nothing we need (precomputed RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A ready model and everything needed to turn text into its tokens and back."""

    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    name: str  # the id clients use for the base model
    model_dir: Path
    eos_token_ids: frozenset[int]
    dtype: torch.dtype  # of the activations and the sums
    device: str
    weights: str  # how the matmul weights are held: the dtype's name, or 'bfloat16' / 'int8' narrower


def load_model(config: ModelConfig) -> LoadedModel:
    """Load the configured model (the embedded default when `config.model` is None)."""
    if config.model is None:
        model_dir, name = default_model_dir(config.cache_dir), MODEL_NAME
    else:
        model_dir = Path(config.model)
        name = model_dir.resolve().name
    hf_config = _read_hf_config(model_dir)
    dtype = resolve_dtype(config.dtype, config.device)
    weights = resolve_weights(config.weights, config.dtype, dtype, config.device)
    spec = LlamaSpec.from_hf_config(hf_config)
    rope = RotaryEmbedding(hf_config, spec.head_dim, spec.max_positions, dtype, config.device)
    model = LlamaForCausalLM(spec, rope, dtype, config.device)
    if config.random_weights:
        _random_weights(model)
    else:
        _load_weights(model, model_dir)
    if weights != dtype_name(dtype) or (config.device == "cpu" and dtype == torch.bfloat16):
        weights = _hold_narrow(model, weights, config, model_dir, name)
    model.pack_weights()
    logger.info("%s: %s compute, %s weights", name, dtype_name(dtype), weights)
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
    )


def _hold_narrow(model: LlamaForCausalLM, weights: str, config: ModelConfig, model_dir: Path, name: str) -> str:
    """Hold the matmul weights as `weights` through the CPU kernel; returns how they are held. Without
    the kernel (no compiler): an error when asked for by name, else (auto) the compute dtype's. int8
    panels come from the cache beside the model when it has them (packed_weights_cache.py).

    bfloat16 weights with bfloat16 compute go through the kernel where it has bfloat16 dot products
    (AVX512-BF16) and, on a CPU with AMX, its tiles; else oneDNN packs them (`pack_weights`). Measured,
    a decode step's matmuls: on a Zen 4 (AVX512-BF16, no AMX) one row 2x faster than oneDNN's, 32 rows
    as fast; on a Xeon with AMX one row 1.7x faster, 32 rows 1.4x (benchmarks/cpu_matmuls.py)."""
    kernel = load_linear_kernel(config.cache_dir / "kernels")
    dot_products = kernel is not None and kernel.bfloat16_dot_products
    kernel_has_the_cpus_best = dot_products and (not cpu_has_amx() or bool(kernel and kernel.tile_rows_from))
    if weights == dtype_name(model.dtype) and not kernel_has_the_cpus_best:
        return weights  # oneDNN packs them
    if kernel is None:
        if config.weights == weights:
            raise ModelLoadError(f"--weights {weights} needs the CPU matmul kernel, which could not be built")
        return dtype_name(model.dtype)
    if weights == BFLOAT16_DOT and not dot_products:  # a compiler without AVX512-BF16's intrinsics
        if config.weights == weights:
            raise ModelLoadError(f"--weights {weights} needs AVX512-BF16 in the CPU matmul kernel's build")
        weights = "bfloat16"
    linears = {module_name: module for module_name, module in model.named_modules() if isinstance(module, Linear)}
    cache, cached = None, None
    if weights == "int8" and not config.random_weights:
        cache = PackedWeightsCache(config.cache_dir / "weights", model_dir, name, kernel)
        shapes = {
            module_name: (linear.weight.shape[0], linear.weight.shape[1]) for module_name, linear in linears.items()
        }
        cached = cache.load(shapes)
    model.hold_narrow_weights(
        lambda module_name, weight: NarrowMatmul(kernel, weight, weights, model.dtype, (cached or {}).get(module_name))
    )
    if cache is not None and cached is None:
        cache.store({module_name: _int8_panels(linear) for module_name, linear in linears.items()})
    return weights


def _int8_panels(linear: Linear) -> PackedInt8:
    assert isinstance(linear.narrow, NarrowMatmul) and linear.narrow.int8 is not None
    return linear.narrow.int8


def _read_hf_config(model_dir: Path) -> PretrainedConfig:
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    hf_config = AutoConfig.from_pretrained(model_dir)
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model_type {hf_config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    window = getattr(hf_config, "sliding_window", None)
    uses_window = getattr(hf_config, "use_sliding_window", True)
    if window is not None and uses_window and window < hf_config.max_position_embeddings:
        raise ModelLoadError(f"sliding-window attention (sliding_window={window}) is not supported")
    return hf_config


def _load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights (pickle checkpoints are not loaded)")
    targets = model.hf_weight_targets()
    missing = set(targets)
    with tqdm(total=len(targets), desc="Loading weights", unit="tensor", leave=False) as progress:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if name not in targets:
                        if not name.endswith(_IGNORED_SUFFIXES) and name != "lm_head.weight":
                            logger.warning("ignoring unexpected tensor %s in %s", name, path.name)
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


def _random_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
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
