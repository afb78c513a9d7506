"""Reading an HF config into a DecoderSpec: the shapes every family shares, the sliding windows, and
refusing by name a config field whose value the forward would not honour."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from loraserve.errors import ModelLoadError
from loraserve.models.decoder_spec import DecoderSpec

_LAYER_TYPES = ("full_attention", "sliding_attention")


def base_spec(config: PretrainedConfig, **departures: Any) -> DecoderSpec:
    """The config's shapes, biases and windows, with the family's `departures` (DecoderSpec's fields)."""
    num_heads = config.num_attention_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    fields: dict[str, Any] = dict(
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_positions=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        layer_windows=sliding_windows(config),
    )
    return DecoderSpec(**{**fields, **departures})


def sliding_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """Each layer's window: per `layer_types` where the config has them (Gemma, Qwen), else the one
    `sliding_window` on every layer (Mistral v0.1, Phi-3); () where no layer has one."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ModelLoadError(f"layer_types {unknown} are not supported; only {list(_LAYER_TYPES)}")
    if window is None or window >= config.max_position_embeddings:  # a window past the context changes nothing
        return ()
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def require(config: PretrainedConfig, field: str, *served: Any) -> None:
    """Refuse, naming the field, a config whose `field` holds a value the forward does not compute."""
    value = getattr(config, field, served[0])
    if value not in served:
        raise ModelLoadError(f"{config.model_type}: {field}={value!r} is not supported; served: {list(served)}")
