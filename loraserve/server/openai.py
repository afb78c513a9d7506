"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (streamed or not)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import PromptTokensDetails
from pydantic import BaseModel

from loraserve.engine import CompletionOutput, RequestOutput, SamplingParams, TokenLogprob
from loraserve.engine.chat import chat_prompt_ids
from loraserve.engine.system_role import SYSTEM_ROLES
from loraserve.errors import InvalidRequestError, LoraserveError, ModelNotFoundError, UnknownAdapterError
from loraserve.server.auth import grant_of
from loraserve.server.errors import stream_error_event
from loraserve.server.generation import Scheduling, Target, fields_named, generate, json_or_events, resolve_target
from loraserve.server.responses import CompletionChunk, CompletionChunkChoice
from loraserve.server.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields
from loraserve.server.state import ServerState, server_state
from loraserve.server.structured import ToolCall, forced_tool_call

router = APIRouter()

DEFAULT_CHAT_MAX_TOKENS = 512

T = TypeVar("T", ChoiceLogprobs, ChunkLogprobs)


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = server_state(request)
    base = ModelCard(id=state.model_name, created=state.started_at)
    adapters = [
        ModelCard(id=info.name, created=int(info.created_at.timestamp()), parent=state.model_name)
        for info in state.catalog.ready
    ]
    grant = grant_of(request)  # a key limited to some models sees only those
    return ModelList(data=[card for card in (base, *adapters) if grant.may_use(card.id)])


@router.post("/v1/completions", response_model=None, responses=json_or_events(Completion))
async def create_completion(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    params = body.sampling_params(body.max_tokens, body.logprobs)
    target = await _target_of(state, body)
    return await _respond(request, body, body.prompt, params, target, _CompletionFormat(state, body.model))


@router.post("/v1/chat/completions", response_model=None, responses=json_or_events(ChatCompletion))
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true (as in OpenAI's API)")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens: int | None = getattr(body, max_tokens_field)
    with fields_named({"max_tokens": max_tokens_field, "logprobs": "top_logprobs", "prompt": "messages"}):
        tool_call = forced_tool_call(body.tools, body.tool_choice)
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if max_tokens is None else max_tokens
        params = body.sampling_params(max_tokens, logprobs, tool_call)
        if sum(len(message.content or "") for message in body.messages) > state.engine.max_prompt_chars:
            raise InvalidRequestError("messages", "hold more text than the context window can take in any tokenization")
        conversation = [message.template_message(i) for i, message in enumerate(body.messages)]
        target = await _target_of(state, body)
        persona = target.adapter.system_prompt if target.adapter is not None else None
        if persona and not any(message["role"] in SYSTEM_ROLES for message in conversation):
            conversation.insert(0, {"role": "system", "content": persona})
        tools = body.tools if tool_call is not None else None
        prompt = await state.engine.offload(chat_prompt_ids, state.tokenizer, conversation, tools)
        return await _respond(request, body, prompt, params, target, _ChatFormat(state, body.model, tool_call))


async def _target_of(state: ServerState, body: SamplingFields) -> Target:
    """`adapter_id` when given, else `model`: an adapter's name, or the base model's id for none; or with
    `merged_adapters` (`model` the base model's id) the mix of adapters it names."""
    name = body.adapter_id or body.model
    try:
        return await resolve_target(state, name, body.merged_adapters, "merged_adapters")
    except UnknownAdapterError as error:
        if error.field != "adapter":
            raise
        raise ModelNotFoundError(f"model {name!r} does not exist; GET /v1/models lists what is served") from None


async def _respond(
    request: Request,
    body: SamplingFields,
    prompt: str | list[int],
    params: SamplingParams,
    target: Target,
    fmt: _Format,
) -> JSONResponse | StreamingResponse:
    request_id = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    scheduling = Scheduling.of(request, bool(body.stream), body.priority, body.timeout)
    outputs = generate(request, request_id, prompt, params, target, scheduling)
    # The first output is awaited here so a refused request is a plain error, not a broken stream.
    first = await anext(outputs)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(fmt, request_id, first, outputs, include_usage, params.n), media_type="text/event-stream"
        )
    final = first
    async for final in outputs:  # noqa: B007 - only the finished output is answered
        pass
    return JSONResponse(fmt.response(request_id, final).model_dump(exclude_unset=True))


async def _sse(
    fmt: _Format,
    request_id: str,
    first: RequestOutput,
    rest: AsyncIterator[RequestOutput],
    include_usage: bool,
    n: int,
) -> AsyncIterator[str]:
    sent_text = [""] * n
    sent_logprobs = [0] * n
    for index in range(n):
        opening = fmt.opening_choice(index)
        if opening is not None:
            yield _event(fmt.chunk(request_id, opening))
    output: RequestOutput | None = first
    last = first
    while output is not None:
        last = output
        for completion in output.outputs:
            i = completion.index
            delta = completion.text[len(sent_text[i]) :]
            new_logprobs = (completion.logprobs or [])[sent_logprobs[i] :] if completion.logprobs is not None else None
            if delta or completion.finish_reason is not None or new_logprobs:
                news = replace(completion, text=delta, logprobs=new_logprobs)  # what this chunk adds
                yield _event(fmt.chunk(request_id, fmt.choice(news, is_chunk=True)))
                sent_text[i] = completion.text
                sent_logprobs[i] += len(new_logprobs or [])
        try:
            output = await anext(rest, None)
        except LoraserveError as error:  # the response has started: the error is its last event
            yield stream_error_event(error)
            yield "data: [DONE]\n\n"
            return
    if include_usage:
        yield _event(fmt.chunk(request_id, usage=_usage(last)))
    yield "data: [DONE]\n\n"


def _event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"


def _usage(output: RequestOutput) -> CompletionUsage:
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


class _Format:
    """How one route shapes its responses and stream chunks (as the `openai` package's types)."""

    id_prefix = ""
    object_name = ""
    chunk_object_name = ""
    response_type: type[BaseModel]
    chunk_type: type[BaseModel]

    def __init__(self, state: ServerState, model: str) -> None:
        self.state = state
        self.model = model  # echoed as asked: the adapter's name or the base model's id
        self.created = int(time.time())

    def response(self, request_id: str, output: RequestOutput) -> BaseModel:
        choices = [self.choice(completion, is_chunk=False) for completion in output.outputs]
        return self.response_type(**self._envelope(request_id, self.object_name), choices=choices, usage=_usage(output))

    def chunk(self, request_id: str, *choices: BaseModel, **fields: Any) -> BaseModel:
        """A stream chunk of `choices`; the usage chunk has none, and `usage` in `fields`."""
        return self.chunk_type(**self._envelope(request_id, self.chunk_object_name), choices=list(choices), **fields)

    def _envelope(self, request_id: str, object_name: str) -> dict[str, Any]:
        return {"id": request_id, "object": object_name, "created": self.created, "model": self.model}

    def opening_choice(self, index: int) -> BaseModel | None:
        return None

    def choice(self, completion: CompletionOutput, is_chunk: bool) -> BaseModel:
        raise NotImplementedError


class _CompletionFormat(_Format):
    id_prefix, object_name, chunk_object_name = "cmpl", "text_completion", "text_completion"
    response_type, chunk_type = Completion, CompletionChunk

    def choice(self, completion: CompletionOutput, is_chunk: bool) -> CompletionChoice:
        return (CompletionChunkChoice if is_chunk else CompletionChoice)(
            index=completion.index,
            text=completion.text,
            logprobs=self._logprobs(completion.logprobs),
            finish_reason=completion.finish_reason,  # type: ignore[arg-type]
        )

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> Logprobs | None:
        if logprobs is None:
            return None
        text = self.state.token_text
        return Logprobs(
            tokens=[text(e.token_id) for e in logprobs],
            token_logprobs=[e.logprob for e in logprobs],
            top_logprobs=[{text(t): lp for t, lp in e.top.items()} for e in logprobs],
        )


class _ChatFormat(_Format):
    """A chat's message, or with a forced tool call (`tool_call`) the call: its arguments are the output."""

    id_prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"
    response_type, chunk_type = ChatCompletion, ChatCompletionChunk

    def __init__(self, state: ServerState, model: str, tool_call: ToolCall | None = None) -> None:
        super().__init__(state, model)
        self.tool_call = tool_call
        self._call_ids: dict[int, str] = {}  # choice index -> its call's id, the same in every chunk

    def opening_choice(self, index: int) -> ChunkChoice:
        delta = ChoiceDelta(role="assistant", content="")
        if self.tool_call is not None:
            function = ChoiceDeltaToolCallFunction(name=self.tool_call.name, arguments="")
            call = ChoiceDeltaToolCall(index=0, id=self._call_id(index), type="function", function=function)
            delta = ChoiceDelta(role="assistant", tool_calls=[call])
        return ChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)

    def choice(self, completion: CompletionOutput, is_chunk: bool) -> Choice | ChunkChoice:
        finish_reason = completion.finish_reason
        if self.tool_call is not None and finish_reason == "stop":
            finish_reason = "tool_calls"  # the arguments are complete: the client is to call the function
        shared: dict[str, Any] = {"index": completion.index, "finish_reason": finish_reason}
        if is_chunk:
            logprobs = self._logprobs(ChunkLogprobs, completion.logprobs)
            return ChunkChoice(**shared, delta=self._delta(completion.text), logprobs=logprobs)
        message = ChatCompletionMessage(role="assistant", content=completion.text)
        if self.tool_call is not None:
            function = Function(name=self.tool_call.name, arguments=completion.text)
            call = ChatCompletionMessageFunctionToolCall(id=self._call_id(completion.index), type="function",
                                                         function=function)  # fmt: skip
            message = ChatCompletionMessage(role="assistant", content=None, tool_calls=[call])
        return Choice(**shared, message=message, logprobs=self._logprobs(ChoiceLogprobs, completion.logprobs))

    def _delta(self, text: str) -> ChoiceDelta:
        if not text:
            return ChoiceDelta()
        if self.tool_call is None:
            return ChoiceDelta(content=text)
        arguments = ChoiceDeltaToolCallFunction(arguments=text)
        return ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(index=0, function=arguments)])

    def _call_id(self, index: int) -> str:
        return self._call_ids.setdefault(index, f"call_{uuid.uuid4().hex[:24]}")

    def _logprobs(self, kind: type[T], logprobs: list[TokenLogprob] | None) -> T | None:
        return None if logprobs is None else kind(content=[self._entry(e.token_id, e.logprob, e.top) for e in logprobs])

    def _entry(self, token_id: int, logprob: float, top: dict[int, float]) -> ChatCompletionTokenLogprob:
        def alternative(token_id: int, logprob: float) -> TopLogprob:
            text = self.state.token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        alternatives = [alternative(t, lp) for t, lp in top.items()]
        return ChatCompletionTokenLogprob(**alternative(token_id, logprob).model_dump(), top_logprobs=alternatives)
