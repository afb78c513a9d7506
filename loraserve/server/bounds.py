"""The ranges SamplingParams checks (engine/sampling_params.py), as types of the request models' fields: openapi.json
states them, and a value outside them is refused by name before it reaches the engine."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictInt

from loraserve.config import MAX_LOGPROBS, MAX_STOP_STRINGS
from loraserve.engine.sampling_params import (
    FLOAT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
)


def _integral(value: Any) -> Any:
    """JSON Schema's integer holds 2.0 (a number with no fraction), never true nor "2"."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON's safe integers (JavaScript's Number.MAX_SAFE_INTEGER), the top of counts no one needs whole: many clients and
# schema-driven generators read JSON numbers as doubles, exact only up to here (INT64_MAX itself rounds past int64).
MAX_SAFE_INTEGER = 2**53 - 1
# After the bounds: set before it, they would wrap the validator and reach openapi.json as pydantic's "ge"/"le",
# which JSON Schema does not know, rather than as "minimum"/"maximum".
INTEGRAL = BeforeValidator(_integral)
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX), INTEGRAL]  # seeds take the whole range
Count = Annotated[StrictInt, Field(ge=1, le=MAX_SAFE_INTEGER), INTEGRAL]  # n, max_tokens
NonNegative = Annotated[StrictInt, Field(ge=0, le=MAX_SAFE_INTEGER), INTEGRAL]  # min_tokens, token ids
TopK = Annotated[StrictInt, Field(ge=-1, le=MAX_SAFE_INTEGER), INTEGRAL]  # -1 and 0: no cut
Logprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS), INTEGRAL]  # the server's --max-logprobs may lower it
Temperature = Annotated[float, Field(ge=0, le=FLOAT32_MAX)]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]  # presence and frequency
RepetitionPenalty = Annotated[float, Field(ge=1e-4, le=1e4)]
Seconds = Annotated[float, Field(gt=0, le=FLOAT32_MAX)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]  # --max-stop may lower it
StopTokenIds = Annotated[list[NonNegative], Field(max_length=MAX_STOP_TOKEN_IDS)]
# OpenAI's {"token id": bias}: JSON's keys are strings of digits.
TokenIdText = Annotated[str, Field(pattern=r"^[0-9]{1,18}$")]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
# No key but a token id: without additionalProperties the schema would admit any other key (with any value).
LogitBias = Annotated[
    dict[TokenIdText, Bias],
    Field(max_length=MAX_LOGIT_BIAS_TOKENS, json_schema_extra={"additionalProperties": False}),
]
