"""The engine the single-system harnesses time: over a model already loaded (each run starts a
fresh engine, not a fresh model), with a 1 GiB memory pool."""

from __future__ import annotations

from loraserve.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from loraserve.engine import LLMEngine
from loraserve.models import LoadedModel
from loraserve.models.dtypes import dtype_name

POOL_BYTES = 1 << 30


def engine_over(
    loaded: LoadedModel,
    max_num_seqs: int,
    max_loras: int = LoraConfig.max_loras,
    prefix_caching: bool = True,
    pool_bytes: int = POOL_BYTES,
    enforce_eager: bool = False,
    speculative_tokens: int = 0,  # > 0: n-gram speculative decoding with this K
) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(dtype=dtype_name(loaded.dtype), device=loaded.device, enforce_eager=enforce_eager),
        cache=CacheConfig(pool_memory=pool_bytes, prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        lora=LoraConfig(max_loras=max_loras, max_lora_rank=16),
        speculation=SpeculativeConfig("ngram", speculative_tokens) if speculative_tokens else SpeculativeConfig(),
    )
    return LLMEngine(config, loaded=loaded)
