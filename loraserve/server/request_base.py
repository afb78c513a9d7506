"""What the body of every OpenAI route shares: strict types, no unknown field (400 naming it), the model, OpenAI's
fields that change nothing in the answer, and loraserve's scheduling extensions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from loraserve.server.bounds import Int64, Seconds


class OpenAIRequest(BaseModel):
    # strict: `"stream": 0` or `"n": "2"` is refused, as openapi.json's types say.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str = Field(min_length=1)  # an adapter's name or the base model's id
    # OpenAI's fields that change nothing in the answer: accepted, whatever they hold.
    user: Any = None
    metadata: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    priority: Int64 = 0  # vLLM's extension: lower first
    timeout: Seconds | None = None  # seconds the request may wait for its start, else 504
    adapter_id: str | None = None  # LoRAX-style: picks the adapter whatever `model` says
