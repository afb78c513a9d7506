"""Request and response bodies of the OpenAI-compatible routes."""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loraserve.engine import SamplingParams
from loraserve.engine.structured_output import StructuredOutput
from loraserve.errors import InvalidRequestError
from loraserve.server.bounds import (
    Count,
    Int64,
    LogitBias,
    Logprobs,
    NonNegative,
    Penalty,
    RepetitionPenalty,
    StopString,
    StopStrings,
    StopTokenIds,
    Temperature,
    TopK,
    TopP,
)
from loraserve.server.chat_messages import ChatMessage
from loraserve.server.checked_fields import (
    CHAT_FIELD_RULES,
    MergedAdapters,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
    Tools,
)
from loraserve.server.request_base import OpenAIRequest
from loraserve.server.responses_request import FIELD_POLICY as RESPONSES_FIELD_POLICY
from loraserve.server.structured import from_response_format, from_structured_outputs


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class SamplingFields(OpenAIRequest):
    """The sampling fields both routes share (OpenAI names, plus vLLM's extras). Any other field is refused by name
    (400): a client that asked for, say, `audio` must not get plain text back as if it had been honoured.
    FIELD_POLICY below says, for each field of OpenAI's requests, which it is."""

    store: Any = None  # inert: chat keeps nothing either way
    merged_adapters: MergedAdapters = None  # LoRAX's mix of adapters, as an extension (checked by MixSpec.parse)
    n: Count = 1  # the server's --max-n may lower the bound (openapi.json says it)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    seed: Int64 | None = None
    stop: StopString | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    min_tokens: NonNegative = 0  # vLLM's; at most max_tokens (checked by SamplingParams, which names it)
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat = None  # structured output (server/structured.py checks these three)
    structured_outputs: StructuredOutputs = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, tool_output: StructuredOutput | None = None
    ) -> SamplingParams:
        """Validated engine parameters; raises InvalidRequestError naming the field."""
        return SamplingParams(
            **self.model_dump(include=_SAME_NAMED),
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            logprobs=logprobs,
            structured_output=self._structured_output(tool_output),
        )

    def _structured_output(self, tool_output: StructuredOutput | None) -> StructuredOutput | None:
        """What the output must match: one way of asking at most (400 naming the second); `tool_output` is what
        the request's tools ask (tools/choice.py)."""
        ways = (
            ("response_format", self.response_format, from_response_format),
            ("structured_outputs", self.structured_outputs, from_structured_outputs),
        )
        asked = [(field, read(value)) for field, value, read in ways if value is not None]
        if tool_output is not None:
            asked.append(("tools", tool_output))
        asked = [(field, output) for field, output in asked if output is not None]  # response_format "text": none
        if len(asked) > 1:
            raise InvalidRequestError(asked[1][0], f"cannot be combined with {asked[0][0]}: give one of them")
        return asked[0][1] if asked else None


# The fields SamplingParams takes as they are, under the same names.
_SAME_NAMED = {f.name for f in fields(SamplingParams)} & SamplingFields.model_fields.keys() - {
    "stop", "stop_token_ids", "logit_bias"
}  # fmt: skip


class CompletionRequest(SamplingFields):
    # Text or token ids, neither empty (nothing to continue); a token id is an integer, never `true`.
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[NonNegative], Field(min_length=1)]
    max_tokens: Count = 16
    logprobs: Logprobs | None = None


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=CHAT_FIELD_RULES)  # checked by create_chat_completion

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: Tools = None  # read with tool_choice and parallel_tool_calls by tools/choice.py
    tool_choice: ToolChoice = None
    parallel_tool_calls: bool | None = None  # false: one call at most


# How the server takes each field of OpenAI's requests (the openai package's CompletionCreateParams):
# "implemented", "inert" (accepted; changes nothing in the answer) or "refused" (400 naming it).
_SHARED_POLICY = {
    **dict.fromkeys(["model", "n", "temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty",
                     "logit_bias", "logprobs", "max_tokens", "stream", "stream_options"], "implemented"),
    "user": "inert",
}  # fmt: skip
FIELD_POLICY = {
    "/v1/chat/completions": {
        **_SHARED_POLICY,
        **dict.fromkeys(["messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "tool_choice", "parallel_tool_calls"], "implemented"),
        **dict.fromkeys(["metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                         "prompt_cache_retention", "prompt_cache_options"], "inert"),
        **dict.fromkeys(["audio", "modalities", "functions", "function_call", "prediction", "reasoning_effort",
                         "verbosity", "web_search_options", "moderation"], "refused"),
    },
    "/v1/responses": RESPONSES_FIELD_POLICY,
    "/v1/completions": {
        **_SHARED_POLICY,
        "prompt": "implemented",
        **dict.fromkeys(["best_of", "echo", "suffix"], "refused"),
    },
}  # fmt: skip


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraserve"
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
