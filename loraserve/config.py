"""One tree of settings, built once at the edge (CLI, environment or `LLM(...)`).

Each component receives only its own part. Nothing reads `os.environ` after
`EngineConfig` is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loraserve.errors import ConfigError

# Ceilings of the per-request limits below (the flags may lower them): alternatives per token,
# and stop strings, which are searched at every token, their prefixes too (stop_checker.py).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32

# Latency histogram bounds in seconds: decode steps on a CPU take tens of milliseconds, prompts
# and adapter loads up to seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30, 60)

DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHTS = ("auto", "float32", "bfloat16", "bfloat16-dot", "int8")
DEVICES = ("cpu", "cuda")


def default_cache_dir() -> Path:
    """Where converted models are cached: $LORASERVE_CACHE_DIR, else ~/.cache/loraserve."""
    env = os.environ.get("LORASERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "loraserve"


def setting(
    default: Any,
    help_text: str,
    minimum: float | None = None,
    maximum: float | None = None,
    choices: tuple[str, ...] | None = None,
    env: str | None = None,
) -> Any:
    """A field that is also a flag of `loraserve serve` (--its-name-with-dashes, `help_text`), taking
    its default from `env` when set there, checked against `minimum`, `maximum` and `choices`."""
    limits = {"minimum": minimum, "maximum": maximum, "choices": choices}
    return field(default=default, metadata={"help": help_text, "env": env, **limits})


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


class Settings:
    """Checks each `setting` against its limits; subclasses add the checks limits cannot say."""

    def __post_init__(self) -> None:
        for definition in fields(self):  # type: ignore[arg-type]
            value, limits = getattr(self, definition.name), definition.metadata
            if value is None or "help" not in limits:
                continue
            low, high, choices = limits["minimum"], limits["maximum"], limits["choices"]
            if choices is not None and value not in choices:
                raise ConfigError(flag_of(definition.name), f"must be one of {', '.join(choices)}, got {value!r}")
            if (low is not None and not value >= low) or (high is not None and not value <= high):
                bounds = f"at least {low}" if high is None else f"in [{low}, {high}]"
                raise ConfigError(flag_of(definition.name), f"must be {bounds}, got {value}")


@dataclass(frozen=True)
class ModelConfig(Settings):
    """Which base model to serve and how to hold its weights."""

    model: str | None = setting(None, "HF safetensors directory (default: the embedded model)", env="LORASERVE_MODEL")
    dtype: str = setting(
        "auto", "auto = bfloat16 on CUDA or a CPU with AMX, else float32 (with 16-bit weights: --weights)",
        choices=DTYPES,
        env="LORASERVE_DTYPE",
    )  # fmt: skip
    weights: str = setting(
        "auto", "how the base model's matmul weights are held: auto = bfloat16 on a CPU computing in float32 "
        "(--dtype auto without AMX), bfloat16-dot there where the CPU has AVX512-BF16, else as --dtype; "
        "bfloat16-dot = bfloat16 weights multiplied by bfloat16 dot products, each matmul's float32 input rounded "
        "to bfloat16 as it is read (CPU with AVX512-BF16); int8 = a byte a weight, a scale and minimum a block "
        "of 32 (CPU; quantized once, cached beside the model)",
        choices=WEIGHTS, env="LORASERVE_WEIGHTS",
    )  # fmt: skip
    device: str = setting("cpu", "where the model runs", choices=DEVICES, env="LORASERVE_DEVICE")
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Benchmarks of shapes whose weights cannot be had (Llama-3-8B on a lent GPU): seeded random
    # weights made on the device; the directory needs only config.json and a tokenizer.
    random_weights: bool = False
    enforce_eager: bool = setting(False, "CUDA: run decode steps eagerly, without CUDA graphs")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model is not None and not Path(self.model).is_dir():
            raise ConfigError("--model", f"{self.model!r} is not a directory")


@dataclass(frozen=True)
class CacheConfig(Settings):
    """The memory pool that KV blocks and adapter weights share: page size and how much memory."""

    block_size: int = setting(16, "tokens per KV block, a power of two; a block is one page of the pool", minimum=1)
    pool_memory: int = setting(
        2 << 30, "bytes for the memory pool that KV blocks and loaded adapters share (default 2 GiB)", minimum=1
    )
    pool_memory_fraction: float | None = setting(
        None, "size the pool as this fraction of the device's free memory instead (e.g. 0.8 on a GPU)"
    )
    num_pages: int | None = setting(
        None, "pages in the pool, overriding --pool-memory and --pool-memory-fraction (tuning, tests)", minimum=1
    )
    prefix_caching: bool = setting(
        True, "reuse the KV blocks of prompts' common prefixes instead of computing every prompt in full"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.block_size & (self.block_size - 1):
            raise ConfigError("--block-size", f"must be a power of two, got {self.block_size}")
        if self.pool_memory_fraction is not None and not 0 < self.pool_memory_fraction <= 0.95:
            raise ConfigError("--pool-memory-fraction", f"must be in (0, 0.95], got {self.pool_memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig(Settings):
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = setting(128, "sequences decoding together", minimum=1)
    max_num_batched_tokens: int = setting(512, "tokens per step; longer prompts are chunked", minimum=1)
    max_model_len: int | None = setting(
        None, "tokens of prompt + completion a sequence may hold (default: the model's context window)", minimum=2
    )
    max_n: int = setting(128, "completions one request may ask for", minimum=1)
    max_logprobs: int = setting(
        MAX_LOGPROBS, "top alternatives one request may ask for at each token (logprobs / top_logprobs)",
        minimum=0, maximum=MAX_LOGPROBS,
    )  # fmt: skip
    max_stop: int = setting(
        MAX_STOP_STRINGS, "stop strings one request may give (each is searched at every token)",
        minimum=0, maximum=MAX_STOP_STRINGS,
    )  # fmt: skip
    ttft_slo: float | None = setting(
        None, "seconds to the first token of a streamed request: one predicted later is refused at once (503, "
        "Retry-After)",
    )  # fmt: skip
    tpot_slo: float | None = setting(
        None, "seconds per output token: the running batch is kept small enough to meet it"
    )
    queue_slo: float | None = setting(
        None, "seconds a non-streamed request (its client sees nothing before the end) may be predicted to wait for "
        "its start: one predicted later is refused at once (503) with a Retry-After saying when the queue will have "
        "room for it, each refused client its own time",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        targets = (("--ttft-slo", self.ttft_slo), ("--tpot-slo", self.tpot_slo), ("--queue-slo", self.queue_slo))
        for flag, target in targets:
            if target is not None and not 0 < target < float("inf"):
                raise ConfigError(flag, f"must be a positive number of seconds, got {target}")


@dataclass(frozen=True)
class LoraConfig(Settings):
    """How many adapters the device holds at once, and how large they may be."""

    max_loras: int = setting(8, "adapters on the device at once (distinct per step); 0 disables LoRA", minimum=0)
    max_lora_rank: int = setting(16, "adapters of a higher rank are refused", minimum=1)
    host_cache_bytes: int = setting(
        4 << 30, "adapters kept in CPU memory (least recently used leave first; default 4 GiB)", minimum=1
    )
    max_mix_parts: int = setting(4, "adapters one request may mix (merged_adapters.ids)", minimum=1)
    max_mixes: int = setting(
        64, "mixes kept registered; beyond it the least recently asked-for idle ones are forgotten", minimum=1
    )


@dataclass(frozen=True)
class SpeculativeConfig(Settings):
    """Speculative decoding: drafts verified in one step (engine/speculative.py)."""

    speculative: str | None = setting(
        None, "ngram = propose tokens by prompt lookup (what followed the sequence's last n-gram earlier in its "
        "prompt and output) and verify them in one step; output unchanged (default: off)",
        choices=("ngram",),
    )  # fmt: skip
    speculative_tokens: int = setting(4, "most draft tokens a sequence proposes per step", minimum=1, maximum=16)
    ngram_min: int = setting(2, "shortest n-gram looked up", minimum=1)
    ngram_max: int = setting(4, "longest n-gram looked up (the longest match wins)", minimum=1)
    speculative_cost_check: bool = setting(
        True, "draft only where drafts pay for their measured compute against the batch's token cost; with "
        "--no-speculative-cost-check, wherever a draft is found (comparisons, tests)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ngram_min > self.ngram_max:
            raise ConfigError("--ngram-min", f"must be at most --ngram-max ({self.ngram_max}), got {self.ngram_min}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, one part per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculation: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    seed: int = 0  # seeds the sampler of requests that carry no seed of their own

    @classmethod
    def of(cls, seed: int = 0, **settings: Any) -> EngineConfig:
        """From settings named as its parts' fields (`EngineConfig.of(max_loras=4)`); TypeError for any other."""
        parts = {}
        for name, part in ENGINE_PARTS.items():
            own = {f.name for f in fields(part)} & settings.keys()
            parts[name] = part(**{key: settings.pop(key) for key in own})
        if settings:
            raise TypeError(f"no engine setting is named {', '.join(sorted(settings))}")
        return cls(seed=seed, **parts)


# EngineConfig's parts by field name: the settings `EngineConfig.of` and the CLI's flags spread over.
ENGINE_PARTS: dict[str, Any] = {f.name: f.default_factory for f in fields(EngineConfig) if f.name != "seed"}


def default_data_dir() -> Path:
    """Where the registry and adapter files live: $XDG_DATA_HOME/loraserve (~/.local/share/loraserve)."""
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "loraserve"


@dataclass(frozen=True)
class ServerConfig(Settings):
    """The HTTP server's own settings; the engine's are in EngineConfig."""

    data_dir: Path = field(default_factory=default_data_dir)
    db_url: str | None = None  # None = SQLite in data_dir
    admin_token: str | None = setting(
        None, "bearer token of the admin API (default: a new one, printed at start)", env="LORASERVE_ADMIN_TOKEN"
    )
    api_keys: frozenset[str] = frozenset()  # inference keys besides the admin API's; any closes inference to keys
    quota_failure: str = setting(
        "closed", "a cluster's quotas are counted by its ledger (a Ray actor); while it cannot be asked, a key with a "
        "quota is refused (closed: 503 quota_unavailable) or served uncounted (open)", choices=("closed", "open"),
    )  # fmt: skip
    require_api_key: bool = setting(
        False, "close inference to API keys (and the admin token) from this start on, for every server sharing the "
        "registry; it stays closed until an admin opens it (PUT /admin/auth)",
    )  # fmt: skip
    max_body_bytes: int = setting(8 << 20, "largest request body but an upload", minimum=1)
    max_upload_bytes: int = setting(1 << 30, "largest adapter upload, archive included", minimum=1)
    max_unpacked_bytes: int = setting(2 << 30, "what one uploaded archive may unpack to", minimum=1)
    register_samples: bool = True  # the sample adapters of adapters/, on the first start with this data dir
    registry_timeout: float = setting(
        10.0, "seconds an admin request waits for the registry database before a 503 (inference never waits on it)"
    )
    orphan_grace: float = setting(
        600.0, "stored files no adapter names (a crash mid-upload) are removed once this many seconds old; younger "
        "ones may be another replica's upload in flight where replicas share a store (0 with one server)",
        minimum=0,
    )  # fmt: skip
    files_in_database: bool = setting(
        False, "keep each adapter's files in the registry database too, so servers sharing it but not this disk (a "
        "cluster's replicas on other machines) copy them from there; `loraserve cluster` always does",
    )  # fmt: skip
    tool_call_parser: str | None = setting(
        None, "how the model writes tool calls, held to and read back in that format (default: the one its chat "
        "template shows, else hermes)", choices=("hermes", "llama3_json", "mistral"),
    )  # fmt: skip
    drain_timeout: int = setting(
        30, "on SIGTERM or Ctrl-C, seconds the running requests (streams too) may take to finish before exit",
        minimum=0,
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.registry_timeout > 0:
            raise ConfigError("--registry-timeout", "must be a positive number of seconds")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("--admin-token", "must be at least 16 characters")
