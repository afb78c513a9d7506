"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (streamed or not)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion
from openai.types.chat import (
    ChatCompletion,
)
from pydantic import BaseModel

from loraserve.engine import RequestOutput, SamplingParams
from loraserve.engine.chat import chat_prompt_ids
from loraserve.engine.system_role import SYSTEM_ROLES
from loraserve.errors import InvalidRequestError, LoraserveError, ModelNotFoundError, UnknownAdapterError
from loraserve.server.auth import grant_of
from loraserve.server.chat_messages import content_chars
from loraserve.server.errors import stream_error_event
from loraserve.server.generation import Scheduling, Target, fields_named, generate, json_or_events, resolve_target
from loraserve.server.openai_formats import ChatFormat, CompletionFormat, Format, usage_of
from loraserve.server.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, SamplingFields
from loraserve.server.state import ServerState, server_state
from loraserve.tools.choice import ToolPlan, chat_tool_plan

router = APIRouter()

DEFAULT_CHAT_MAX_TOKENS = 512


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
    target = await target_of(state, body.adapter_id or body.model, body.merged_adapters)
    return await _respond(request, body, body.prompt, params, target, CompletionFormat(state, body.model))


@router.post("/v1/chat/completions", response_model=None, responses=json_or_events(ChatCompletion))
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true (as in OpenAI's API)")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens: int | None = getattr(body, max_tokens_field)
    with fields_named({"max_tokens": max_tokens_field, "logprobs": "top_logprobs", "prompt": "messages"}):
        plan = chat_tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if max_tokens is None else max_tokens
        tool_output = plan.output(state.tokenizer, state.tool_format) if plan is not None else None
        params = body.sampling_params(max_tokens, logprobs, tool_output)
        if sum(content_chars(message.content) for message in body.messages) > state.engine.max_prompt_chars:
            raise InvalidRequestError("messages", "hold more text than the context window can take in any tokenization")
        conversation = [message.template_message(i) for i, message in enumerate(body.messages)]
        target = await target_of(state, body.adapter_id or body.model, body.merged_adapters)
        prompt = await conversation_prompt(state, target, conversation, plan)
        return await _respond(request, body, prompt, params, target, ChatFormat(state, body.model, plan))


async def conversation_prompt(
    state: ServerState, target: Target, conversation: list[dict[str, Any]], plan: ToolPlan | None
) -> list[int]:
    """The prompt's token ids: the adapter's persona as the system message where the conversation has none, the
    functions `plan` shows, through the model's chat template (off the event loop)."""
    persona = target.adapter.system_prompt if target.adapter is not None else None
    if persona and not any(message["role"] in SYSTEM_ROLES for message in conversation):
        conversation = [{"role": "system", "content": persona}, *conversation]
    functions = plan.shown if plan is not None else []
    return await state.engine.offload(chat_prompt_ids, state.tokenizer, conversation, functions, state.tool_format)


async def target_of(state: ServerState, name: str, merged: object) -> Target:
    """The adapter `name` (`adapter_id` when given, else `model`), or the base model for its id; with `merged`
    (merged_adapters, `model` the base model's id) the mix of adapters it names."""
    try:
        return await resolve_target(state, name, merged, "merged_adapters")
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
    fmt: Format,
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
    fmt: Format,
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
        yield _event(fmt.chunk(request_id, usage=usage_of(last)))
    yield "data: [DONE]\n\n"


def _event(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"
