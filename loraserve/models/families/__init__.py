"""The model families served, each a small file reading its HF config into the one decoder's spec
(decoder_spec.py): what differs from Llama, and nothing else. Anything else is refused at start,
by name and reason: never a silent wrong forward."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from loraserve.errors import ModelLoadError
from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.families import gemma, granite, llama, olmo2, phi3, qwen3

FAMILIES: dict[str, Callable[[PretrainedConfig], DecoderSpec]] = {
    "llama": llama.read,
    "mistral": llama.read,
    "qwen2": llama.read,
    "qwen3": qwen3.read,
    "gemma2": gemma.read_gemma2,
    "gemma3_text": gemma.read_gemma3,
    "phi3": phi3.read,
    "granite": granite.read,
    "olmo2": olmo2.read,
}
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_OTHER_MODALITIES = ("vision_config", "audio_config", "text_config")


def decoder_spec(config: PretrainedConfig) -> DecoderSpec:
    """The spec of a served family's config; ModelLoadError naming the type and why otherwise."""
    read = FAMILIES.get(config.model_type)
    if read is None:
        raise ModelLoadError(f"model_type {config.model_type!r} is not supported: {_why(config)}")
    return read(config)


def _why(config: PretrainedConfig) -> str:
    served = f"served: {', '.join(FAMILIES)}"
    experts = [field for field in _EXPERTS if getattr(config, field, None)]
    if experts:
        return f"a mixture-of-experts model ({experts[0]}), which loraserve does not serve; {served}"
    modalities = [field for field in _OTHER_MODALITIES if getattr(config, field, None) is not None]
    if modalities:
        return (
            f"a multimodal model ({modalities[0]}), which loraserve does not serve "
            f"(a text-only checkpoint of its language model may be); {served}"
        )
    return served
