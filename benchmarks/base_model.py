"""The base model every system in a comparison loads: one HF safetensors directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from loraserve.config import default_cache_dir
from loraserve.models.decoder_spec import DecoderSpec
from loraserve.models.default_model import default_model_dir
from loraserve.models.families import decoder_spec


@dataclass(frozen=True)
class BaseModel:
    path: Path
    tokenizer: PreTrainedTokenizerBase
    spec: DecoderSpec


def resolve_base_model(model: str | None) -> BaseModel:
    """`model`, or the embedded default model saved as safetensors (converted on first use)."""
    path = Path(model) if model else default_model_dir(default_cache_dir())
    return BaseModel(path, AutoTokenizer.from_pretrained(path), decoder_spec(AutoConfig.from_pretrained(path)))
