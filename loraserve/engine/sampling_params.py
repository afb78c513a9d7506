"""How to sample a request's tokens, validated where the user hands it in.

Every field is checked for its type and range here, so nothing a client sends can reach
the sampler as a value it cannot hold (an int past int64, a NaN temperature, a list of a
million stop strings): a bad value is an InvalidRequestError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from loraserve.config import MAX_LOGPROBS, MAX_STOP_STRINGS
from loraserve.engine.structured_output import StructuredOutput
from loraserve.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Stop strings are searched at every token, their prefixes too (stop_checker.py): bounded work.
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
# Below this temperature logits / temperature can overflow float32: such rows are greedy (as in vLLM).
MIN_SAMPLING_TEMPERATURE = 1e-5
FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class SamplingParams:
    """OpenAI/vLLM-style sampling settings; `temperature=0` is greedy."""

    n: int = 1  # completions per prompt; they share the prompt's KV blocks
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut; above the vocabulary it cuts nothing
    seed: int | None = None  # any int64; same seed, same prompt -> same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF/CTRL: divides positive logits of prompt and generated tokens
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the top k
    skip_special_tokens: bool = True
    min_tokens: int = 0  # vLLM's: no EOS or stop token id (nor stop string) before this many tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # OpenAI's: added to the token's logit
    structured_output: StructuredOutput | None = None  # what the output must match (grammar.py)

    def __post_init__(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop  # one string, as OpenAI allows, or a list
        self.stop = _list_of(stops, "stop", "stop strings", MAX_STOP_STRINGS)
        self.stop_token_ids = _list_of(self.stop_token_ids, "stop_token_ids", "token ids", MAX_STOP_TOKEN_IDS)
        if self.top_k == -1:
            self.top_k = 0
        _check_int(self.n, "n", 1, INT64_MAX)
        _check_int(self.max_tokens, "max_tokens", 1, INT64_MAX)
        _check_int(self.min_tokens, "min_tokens", 0, self.max_tokens, "must be at least 0 and at most max_tokens")
        self.logit_bias = _logit_bias(self.logit_bias)
        is_output = self.structured_output is None or isinstance(self.structured_output, StructuredOutput)
        _check(is_output, "structured_output", "must be a StructuredOutput (StructuredOutput.json_schema(...), ...)")
        _check_int(self.top_k, "top_k", 0, INT64_MAX, "must be -1 or 0 (no cut), or a positive integer below 2**63")
        if self.seed is not None:
            _check_int(self.seed, "seed", INT64_MIN, INT64_MAX)
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        for name, (low, high, message) in _FLOAT_RANGES.items():
            setattr(self, name, _check_float(getattr(self, name), name, low, high, message))
        for flag in ("ignore_eos", "skip_special_tokens"):
            _check(isinstance(getattr(self, flag), bool), flag, "must be true or false")
        for stop in self.stop:
            _check(isinstance(stop, str) and 0 < len(stop) <= MAX_STOP_STRING_CHARS, "stop",
                   f"stop strings must be strings of 1 to {MAX_STOP_STRING_CHARS} characters")  # fmt: skip
        for token_id in self.stop_token_ids:
            _check_int(token_id, "stop_token_ids", 0, INT64_MAX)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _check_int(value: Any, field_name: str, low: int, high: int, message: str | None = None) -> None:
    # bool is an int in Python, never in JSON: true is not a count.
    _check(isinstance(value, int) and not isinstance(value, bool), field_name, f"must be an integer, got {value!r}")
    _check(low <= value <= high, field_name, f"{message or f'must be in [{low}, {high}]'}, got {value}")


# Each float field's bounds (inclusive) and what a value outside them is told.
_FLOAT_RANGES = {
    "temperature": (0.0, FLOAT32_MAX, "must be >= 0"),
    "top_p": (math.ulp(0.0), 1.0, "must be in (0, 1]"),
    "presence_penalty": (-2.0, 2.0, "must be in [-2, 2]"),
    "frequency_penalty": (-2.0, 2.0, "must be in [-2, 2]"),
    "repetition_penalty": (1e-4, 1e4, "must be in [1e-4, 1e4] (1 = none)"),
}


def _check_float(value: Any, field_name: str, low: float, high: float, message: str) -> float:
    """The value as a float (an int such as 10**19 would overflow the sampler's tensors)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    # The sampler computes in float32: larger values would become infinities there. NaN fails the
    # comparison; an int compares exactly, however large (math.isfinite would overflow on 10**400).
    is_finite = is_number and abs(value) <= FLOAT32_MAX
    _check(is_finite, field_name, f"must be a finite number, got {value!r}")
    _check(low <= value <= high, field_name, f"{message}, got {value}")
    return float(value)


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's `{"token id": bias}` (ids as JSON's string keys, or ints) -> {int id: float bias}."""
    _check(isinstance(bias, dict), "logit_bias", "must map token ids to biases")
    _check(len(bias) <= MAX_LOGIT_BIAS_TOKENS, "logit_bias", f"at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    checked = {}
    for token, value in bias.items():
        as_text = isinstance(token, str) and 0 < len(token) <= 19 and token.isascii() and token.isdigit()
        is_id = (isinstance(token, int) and not isinstance(token, bool) and token >= 0) or as_text
        _check(is_id and int(token) <= INT64_MAX, "logit_bias", f"keys must be token ids, got {token!r}")
        range_message = f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
        checked[int(token)] = _check_float(value, "logit_bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, range_message)
    return checked


def _list_of(values: Any, field_name: str, what: str, max_items: int) -> list[Any]:
    _check(isinstance(values, list | tuple), field_name, f"must be a list of {what}")
    _check(len(values) <= max_items, field_name, f"at most {max_items} {what}, got {len(values)}")
    return list(values)
