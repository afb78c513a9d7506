"""One tree of settings, built once at the edge (CLI, environment or `LLM(...)`).

Each component receives only its own part. Nothing reads `os.environ` after
`EngineConfig` is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from loraserve.errors import ConfigError

# Ceilings of the per-request limits below (the flags may lower them): alternatives per token,
# and stop strings, which are searched at every token, their prefixes too (stop_checker.py).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


def default_cache_dir() -> Path:
    """Where converted models are cached: $LORASERVE_CACHE_DIR, else ~/.cache/loraserve."""
    env = os.environ.get("LORASERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loraserve"


@dataclass(frozen=True)
class ModelConfig:
    """Which base model to serve and how to hold its weights."""

    model: str | None = None  # a local HF safetensors directory; None = embedded default
    dtype: str = "auto"  # auto = bfloat16 where the hardware has it natively, else float32
    device: str = "cpu"
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Benchmarks of shapes whose weights cannot be had (Llama-3-8B on a lent GPU): seeded random
    # weights made on the device; the directory needs only config.json and a tokenizer.
    random_weights: bool = False
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, without CUDA graphs (engine/cuda_graphs.py)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError("--device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.model is not None and not Path(self.model).is_dir():
            raise ConfigError("--model", f"{self.model!r} is not a directory")


@dataclass(frozen=True)
class CacheConfig:
    """The memory pool that KV blocks and adapter weights share: page size and how much memory."""

    block_size: int = 16  # tokens per KV block; a page of the pool is one block
    pool_memory: int = 2 << 30  # bytes for the pool: K and V of every layer, and loaded adapters
    pool_memory_fraction: float | None = None  # of the device's free memory; overrides pool_memory
    num_pages: int | None = None  # overrides both when set (tests, tuning)
    prefix_caching: bool = True  # reuse the KV blocks of prompts' common prefixes (engine/prefix_cache.py)

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("--block-size", f"must be a power of two, got {self.block_size}")
        if self.pool_memory <= 0:
            raise ConfigError("--pool-memory", "must be a positive number of bytes")
        if self.pool_memory_fraction is not None and not 0 < self.pool_memory_fraction <= 0.95:
            raise ConfigError("--pool-memory-fraction", f"must be in (0, 0.95], got {self.pool_memory_fraction}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError("--num-pages", "must be at least 1")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 128  # sequences decoding together
    max_num_batched_tokens: int = 512  # tokens computed in one step; longer prompts are chunked
    max_model_len: int | None = None  # None = the model's context window
    max_n: int = 128  # completions one request may ask for (OpenAI's limit)
    max_logprobs: int = MAX_LOGPROBS  # top alternatives one request may ask for at each token
    max_stop: int = MAX_STOP_STRINGS  # stop strings one request may give (each searched at every token)
    ttft_slo: float | None = None  # seconds to the first token; a request predicted later is refused (admission.py)
    tpot_slo: float | None = None  # seconds per output token; the running batch is kept small enough for it

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs", "must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens", "must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("--max-model-len", "must be at least 2")
        if self.max_n < 1:
            raise ConfigError("--max-n", "must be at least 1")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError("--max-logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        if not 0 <= self.max_stop <= MAX_STOP_STRINGS:
            raise ConfigError("--max-stop", f"must be in [0, {MAX_STOP_STRINGS}]")
        for flag, target in (("--ttft-slo", self.ttft_slo), ("--tpot-slo", self.tpot_slo)):
            if target is not None and not 0 < target < float("inf"):
                raise ConfigError(flag, f"must be a positive number of seconds, got {target}")


@dataclass(frozen=True)
class LoraConfig:
    """How many adapters the device holds at once, and how large they may be."""

    max_loras: int = 8  # adapter slots on the device
    max_lora_rank: int = 16  # adapters of a higher rank are refused at load
    host_cache_bytes: int = 4 << 30  # adapters kept in CPU memory, least recently used dropped first

    def __post_init__(self) -> None:
        if self.max_loras < 0:
            raise ConfigError("--max-loras", "must be >= 0 (0 disables LoRA)")
        if self.max_lora_rank < 1:
            raise ConfigError("--max-lora-rank", "must be at least 1")
        if self.host_cache_bytes < 1:
            raise ConfigError("--host-cache-bytes", "must be a positive number of bytes")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, one part per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = 0  # seeds the sampler of requests that carry no seed of their own


def default_data_dir() -> Path:
    """Where the registry and adapter files live: $XDG_DATA_HOME/loraserve (~/.local/share/loraserve)."""
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "loraserve"


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server's own settings; the engine's are in EngineConfig."""

    data_dir: Path = field(default_factory=default_data_dir)
    db_url: str | None = None  # None = SQLite in data_dir
    admin_token: str | None = None  # None = a random one, printed once at start
    api_keys: frozenset[str] = frozenset()  # inference needs a key once any exists (these or the admin API's)
    max_body_bytes: int = 8 << 20  # any request but an upload
    max_upload_bytes: int = 1 << 30  # an adapter upload, archive included
    max_unpacked_bytes: int = 2 << 30  # what one archive may unpack to
    register_samples: bool = True  # the sample adapters of loraserve/samples/, on the first start with this data dir
    registry_timeout: float = 10.0  # seconds an admin request waits for the database before a 503
    # At start, stored files no adapter names and upload scratch left by a crash are removed once
    # this old: where replicas share a store, younger ones may be another server's upload in flight.
    orphan_grace: float = 600.0
    drain_timeout: int = 30  # seconds running requests get to finish after SIGTERM or Ctrl-C

    def __post_init__(self) -> None:
        for flag, value in (
            ("--max-body-bytes", self.max_body_bytes),
            ("--max-upload-bytes", self.max_upload_bytes),
            ("--max-unpacked-bytes", self.max_unpacked_bytes),
        ):
            if value < 1:
                raise ConfigError(flag, "must be a positive number of bytes")
        if self.drain_timeout < 0:
            raise ConfigError("--drain-timeout", "must be a number of seconds, 0 or more")
        if not self.orphan_grace >= 0:
            raise ConfigError("--orphan-grace", "must be a number of seconds, 0 or more")
        if not self.registry_timeout > 0:
            raise ConfigError("--registry-timeout", "must be a positive number of seconds")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("--admin-token", "must be at least 16 characters")
