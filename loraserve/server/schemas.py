"""Request and response bodies of the OpenAI-compatible routes."""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraserve.engine import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The sampling fields both routes share (OpenAI names, plus vLLM's extras). Any other field is refused by name
    (400): a client that asked for, say, `response_format` must not get plain text back as if it had been honoured."""

    model_config = ConfigDict(extra="forbid")

    model: str
    user: str | None = None  # OpenAI's end-user id: accepted, changes nothing in the answer
    priority: Any = 0  # vLLM's extension: lower first (checked by Scheduling.of, which names it)
    timeout: Any = None  # seconds the request may wait for its start, else 504
    adapter_id: str | None = None  # LoRAX-style: picks the adapter whatever `model` says
    merged_adapters: Any = None  # LoRAX's mix of adapters, as an extension (checked by merge.MixSpec.parse)
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Validated engine parameters; raises InvalidRequestError naming the field."""
        return SamplingParams(
            **self.model_dump(include=_SAME_NAMED),
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            logprobs=logprobs,
        )


# The fields SamplingParams takes as they are, under the same names.
_SAME_NAMED = {f.name for f in fields(SamplingParams)} & SamplingFields.model_fields.keys() - {"stop", "stop_token_ids"}


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    max_tokens: int = 16
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraserve"
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
