"""adapter_config.json, checked field by field, its patterns resolved to every module of the base model.

Every field loraserve reads is checked for its type and range (an error names it), and
the regexes in it (`target_modules` as a string, the keys of `rank_pattern` and
`alpha_pattern`) are matched here, once, with PEFT's semantics: `target_modules` by
`re.fullmatch` over full module names, the patterns by the suffix rule. Matching a
hostile regex can take forever, so uploads run this in a child process (adapter_sandbox.py)
that reports each pattern field before matching it; the result crosses back as JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loraserve.errors import AdapterError
from loraserve.lora.peft_files import CONFIG_FILE
from loraserve.models.decoder_spec import DecoderSpec

MAX_PATTERN_KEYS = 4096
_ATTENTION_MODULES = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"))

# PEFT config fields whose non-neutral value changes what the adapter computes in ways we
# do not implement. A field absent from the config counts as neutral.
_UNSUPPORTED_UNLESS_NEUTRAL: dict[str, tuple[Any, ...]] = {
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

Module = tuple[int, str]  # (layer, projection); for a module of the checkpoint, (layer, its name)
PatternReport = Callable[[str | None], None]  # the pattern field about to be matched; None once done


@dataclass(frozen=True)
class AdapterConfig:
    """What loraserve serves of an adapter_config.json: every module's rank and alpha, resolved."""

    rank: int  # the config's r; a module's own rank may differ (rank_pattern)
    alpha: float
    use_rslora: bool
    use_dora: bool  # DoRA: each adapted module's output rescaled per row (lora/dora.py)
    target_modules: frozenset[str]  # the projections `target_modules` selects (a fused module: each it holds)
    modules: dict[Module, tuple[int, float]]  # every (layer, projection) of the base model -> (rank, alpha)
    base_model_name: str | None

    def scale(self, module: Module) -> float:
        rank, alpha = self.modules[module]
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    def to_json(self) -> str:
        modules = [[*module, *values] for module, values in self.modules.items()]
        return json.dumps({**asdict(self), "target_modules": sorted(self.target_modules), "modules": modules})

    @classmethod
    def from_json(cls, text: str) -> AdapterConfig:
        data = json.loads(text)
        modules = {(layer, projection): (rank, alpha) for layer, projection, rank, alpha in data.pop("modules")}
        targets = frozenset(data.pop("target_modules"))
        return cls(**data, target_modules=targets, modules=modules)


def module_name(layer: int, module: str) -> str:
    """The module's full name in the HF model, as PEFT's patterns see it."""
    return f"model.layers.{layer}.{'self_attn' if module in _ATTENTION_MODULES else 'mlp'}.{module}"


def module_names(spec: DecoderSpec) -> dict[Module, str]:
    """Every adaptable module of the base model's checkpoint (Phi-3's fused ones as such) -> its full name."""
    return {
        (layer, module): module_name(layer, module)
        for layer in range(spec.num_layers)
        for module in spec.module_projections()
    }


def parse_config(
    path: Path, spec: DecoderSpec, max_rank: int, max_scale: float, report: PatternReport = lambda _: None
) -> AdapterConfig:
    """Read and check `path`/adapter_config.json; AdapterError names the field at fault.

    `max_scale`: the largest alpha / r (or alpha / sqrt(r)) the serving dtype holds.
    """
    config = _read_json(path / CONFIG_FILE)
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError("peft_type", f"{config['peft_type']!r} is not supported; only LORA")
    for field, neutral in _UNSUPPORTED_UNLESS_NEUTRAL.items():
        if field in config and config[field] not in neutral:
            raise AdapterError(field, f"{config[field]!r} is not supported (loraserve serves plain LoRA)")
    rank = _rank(config.get("r"), "r", max_rank)
    alpha = _alpha(config.get("lora_alpha"), "lora_alpha")
    use_rslora, use_dora = (_flag(config, field) for field in ("use_rslora", "use_dora"))
    base_model_name = config.get("base_model_name_or_path")
    if base_model_name is not None and not isinstance(base_model_name, str):
        raise AdapterError("base_model_name_or_path", f"must be a string, got {base_model_name!r}")
    names = module_names(spec)
    report("target_modules")
    targets = _target_modules(config.get("target_modules"), names, spec)
    report("rank_pattern")
    ranks = _resolve_pattern(config, "rank_pattern", names, lambda v, where: _rank(v, where, max_rank))
    report("alpha_pattern")
    alphas = _resolve_pattern(config, "alpha_pattern", names, _alpha)
    report(None)
    held = spec.module_projections()
    parsed = AdapterConfig(
        rank=rank,
        alpha=alpha,
        use_rslora=use_rslora,
        use_dora=use_dora,
        target_modules=frozenset(p for module in targets for p in held[module]),
        modules={
            (layer, p): (ranks.get((layer, module), rank), alphas.get((layer, module), alpha))
            for layer, module in names
            for p in held[module]
        },
        base_model_name=base_model_name,
    )
    for layer, module in names:
        if not parsed.scale((layer, held[module][0])) <= max_scale:
            field = "lora_alpha" if (layer, module) not in alphas else "alpha_pattern"
            scale = parsed.scale((layer, held[module][0]))
            raise AdapterError(field, f"alpha / r = {scale:g} is beyond what the serving dtype holds")
    return parsed


def _read_json(config_path: Path) -> dict[str, Any]:
    if not config_path.is_file():
        raise AdapterError(CONFIG_FILE, f"missing from {config_path.parent}")
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise AdapterError(CONFIG_FILE, f"is not valid JSON: {error}") from error
    except RecursionError:
        raise AdapterError(CONFIG_FILE, "is nested too deeply") from None
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "must hold a JSON object")
    return config


def _flag(config: dict[str, Any], field: str) -> bool:
    value = config.get(field, False)
    if value is None:  # PEFT writes null for an unset use_dora
        return False
    if not isinstance(value, bool):
        raise AdapterError(field, f"must be true or false, got {value!r}")
    return value


def _rank(value: Any, field: str, max_rank: int) -> int:
    is_whole = isinstance(value, int | float) and not isinstance(value, bool) and float(value).is_integer()
    if not is_whole or value < 1:
        raise AdapterError(field, f"must be a positive whole number, got {value!r}")
    if value > max_rank:
        raise AdapterError(field, f"{value} is above the configured maximum {max_rank} (--max-lora-rank)")
    return int(value)


def _alpha(value: Any, field: str) -> float:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (is_number and 0 < value < math.inf):  # NaN fails the comparison
        raise AdapterError(field, f"must be a finite positive number, got {value!r}")
    return float(value)


def _compile(pattern: Any, field: str) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise AdapterError(field, f"must hold strings, got {pattern!r}")
    try:
        return re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        raise AdapterError(field, f"{pattern!r} is not a valid regular expression: {error}") from None


def _target_modules(targets: Any, names: dict[Module, str], spec: DecoderSpec) -> set[str]:
    """The modules `target_modules` selects: a list of names, or a regex fullmatched against module names."""
    if isinstance(targets, str):
        regex = _compile(targets, "target_modules")
        if any(regex.fullmatch(name) for name in ("model.embed_tokens", "lm_head")):
            raise AdapterError("target_modules", "LoRA on the embedding or lm_head is not supported")
        selected = {projection for (_, projection), name in names.items() if regex.fullmatch(name)}
        if not selected:
            raise AdapterError("target_modules", f"{targets!r} selects no module of the base model")
        return selected
    if not isinstance(targets, list) or not targets:
        raise AdapterError("target_modules", f"must be a non-empty list or a regex, got {targets!r}")
    if not all(isinstance(t, str) for t in targets):
        raise AdapterError("target_modules", "must list module names (strings)")
    modules = tuple(spec.module_projections())
    unsupported = [t for t in targets if t not in modules]
    if unsupported:
        raise AdapterError(
            "target_modules", f"{unsupported} not supported; LoRA on {spec.model_type} may target only {modules}"
        )
    return set(targets)


def _resolve_pattern(
    config: dict[str, Any], field: str, names: dict[Module, str], check: Callable[[Any, str], Any]
) -> dict[Module, Any]:
    """PEFT's rank_pattern / alpha_pattern: each module takes the value of the first key matching its name's end."""
    pattern = config.get(field)
    if pattern is None:
        return {}
    if not isinstance(pattern, dict):
        raise AdapterError(field, f"must map module-name patterns to values, got {pattern!r}")
    if len(pattern) > MAX_PATTERN_KEYS:
        raise AdapterError(field, f"has {len(pattern)} keys; at most {MAX_PATTERN_KEYS}")
    compiled = [
        (_compile(rf"(.*\.)?({key})$", field), check(value, f"{field}.{key}")) for key, value in pattern.items()
    ]
    resolved: dict[Module, Any] = {}
    for module, name in names.items():
        for regex, value in compiled:
            if regex.match(name):
                resolved[module] = value
                break
    return resolved
