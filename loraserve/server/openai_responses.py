"""POST /v1/responses: OpenAI's Responses API over the chat machinery, stateless (`store: false`).

Input as text or items (responses_input.py), `instructions`, `max_output_tokens`, `temperature`, `top_p`, function
tools with the same choices as chat (tools/choice.py), `text.format` (text, json_object, json_schema); streamed as
OpenAI's typed events: `response.created`, then per output item `response.output_item.added`, its text
(`response.output_text.delta`) or a call's arguments (`response.function_call_arguments.delta`), `...done` events,
and `response.completed` with the whole response. Adapters by `model`, as in chat. `store: true`,
`previous_response_id` and `conversation` (server-side state) are refused by name.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, get_args

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
)
from openai.types.responses.response_output_message import Content
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel

from loraserve.engine import RequestOutput, SamplingParams
from loraserve.errors import InvalidRequestError, LoraserveError
from loraserve.server.errors import stream_error_event
from loraserve.server.generation import Scheduling, fields_named, generate, json_or_events
from loraserve.server.openai import DEFAULT_CHAT_MAX_TOKENS, conversation_prompt, target_of
from loraserve.server.responses_input import read_input
from loraserve.server.responses_request import ResponsesRequest
from loraserve.server.state import ServerState, server_state
from loraserve.server.structured import from_text_format
from loraserve.tools.choice import ToolPlan, responses_tool_plan
from loraserve.tools.functions import Function
from loraserve.tools.stream import ReplyStream, new_call_id

router = APIRouter()


@router.post("/v1/responses", response_model=None, responses=json_or_events(Response))
async def create_response(body: ResponsesRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = server_state(request)
    if body.store not in (None, False):
        raise InvalidRequestError("store", "must be false: loraserve keeps no responses (no server-side state)")
    if body.truncation not in (None, "disabled"):
        raise InvalidRequestError("truncation", "must be 'disabled': a prompt over the context window is refused")
    with fields_named({"max_tokens": "max_output_tokens", "prompt": "input"}):
        plan = responses_tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        text_output = from_text_format(body.text)
        tool_output = plan.output(state.tokenizer, state.tool_format) if plan is not None else None
        if text_output is not None and tool_output is not None:
            raise InvalidRequestError("text.format", "cannot be combined with tools: give one of them")
        params = SamplingParams(
            max_tokens=body.max_output_tokens or DEFAULT_CHAT_MAX_TOKENS,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            structured_output=text_output or tool_output,
        )
        conversation = read_input(body.input, body.instructions)
        if sum(len(message["content"]) for message in conversation) > state.engine.max_prompt_chars:
            raise InvalidRequestError("input", "holds more text than the context window can take in any tokenization")
        target = await target_of(state, body.adapter_id or body.model, None)
        prompt = await conversation_prompt(state, target, conversation, plan)
    response = _ResponseBuilder(state, body, plan)
    scheduling = Scheduling.of(request, body.stream, body.priority, body.timeout)
    outputs = generate(request, response.id, prompt, params, target, scheduling)
    first = await anext(outputs)  # a refused request is a plain error, not a broken stream
    if body.stream:
        return StreamingResponse(response.events(first, outputs), media_type="text/event-stream")
    final = first
    response.update(first)
    async for final in outputs:
        response.update(final)
    return JSONResponse(response.build(final).model_dump(exclude_unset=True))


@dataclass
class _ResponseBuilder:
    """One response's output items, built from the engine's outputs as they come (streamed or at the end): the
    message's text first (where the reply has any), then the calls it makes."""

    state: ServerState
    body: ResponsesRequest
    plan: ToolPlan | None
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: float = field(default_factory=time.time)
    text: str = ""  # the message's text so far
    calls: list[ResponseFunctionToolCall] = field(default_factory=list)
    _seen: str = ""  # the output's text taken so far
    _sequence: int = 0  # of the stream's events

    def __post_init__(self) -> None:
        self.named = self.plan.named if self.plan is not None else None
        self.reads_calls = self.plan is not None and self.plan.reads_calls
        self.reply = ReplyStream(self.state.tool_format)

    def update(self, output: RequestOutput) -> tuple[str, list[int], list[tuple[int, str]]]:
        """Take the output so far; what it adds: message text, the indexes of new calls (each appended to `calls`
        with empty arguments), and (call index, arguments piece) pairs."""
        completion = output.outputs[0]
        news, self._seen = completion.text[len(self._seen) :], completion.text
        if self.named is not None:
            new = [] if self.calls else [self._add_call(self.named.name)]
            pieces = [(0, news)] if news else []
        elif not self.reads_calls:
            self.text += news
            return news, [], []
        else:
            delta = self.reply.update(news, final=completion.finish_reason is not None)
            self.text += delta.content
            new = [self._add_call(call.name, call.id) for call in delta.calls if call.name is not None]
            pieces = [(call.index, call.arguments) for call in delta.calls if call.arguments]
            news = delta.content
        for index, piece in pieces:
            self.calls[index].arguments += piece
        return news if self.named is None else "", new, pieces

    def _add_call(self, name: str, call_id: str | None = None) -> int:
        self.calls.append(ResponseFunctionToolCall(id=f"fc_{uuid.uuid4().hex}", call_id=call_id or new_call_id(),
                                                   name=name, arguments="", type="function_call",
                                                   status="in_progress"))  # fmt: skip
        return len(self.calls) - 1

    def message(self, done: bool) -> ResponseOutputMessage:
        content: list[Content] = [_text_part(self.text)] if done else []
        return ResponseOutputMessage(id=self.message_id, type="message", role="assistant", content=content,
                                     status="completed" if done else "in_progress")  # fmt: skip

    def build(self, final: RequestOutput | None) -> Response:
        """The response: in progress (`final` None), or finished with its items and usage."""
        fields: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.body.model,
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p, "store": False,
            "parallel_tool_calls": self.plan.parallel if self.plan is not None else True,
            "tool_choice": self.body.tool_choice or ("auto" if self.plan is not None else "none"),
            "tools": [_tool(function) for function in self.plan.functions] if self.plan is not None else [],
            "output": [], "status": "in_progress",
        }  # fmt: skip
        if final is None:
            return Response(**fields)
        completion = final.outputs[0]
        finished = self._finished_calls(completion.text)
        fields["output"] = [self.message(done=True)] if self.text.strip() or not finished else []
        fields["output"] += finished
        if completion.finish_reason == "length":
            fields.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            fields["status"] = "completed"
        prompt_tokens, output_tokens = len(final.prompt_token_ids), len(completion.token_ids)
        fields["usage"] = ResponseUsage(
            input_tokens=prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=final.num_cached_tokens, cache_write_tokens=0),
            output_tokens=output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=prompt_tokens + output_tokens,
        )
        return Response(**fields)

    def _finished_calls(self, text: str) -> list[ResponseFunctionToolCall]:
        """The calls made in full (one cut off by max_output_tokens is left out: its arguments do not parse)."""
        made = len(self.state.tool_format.read(text, final=True).complete_calls()) if self.reads_calls else len(
            self.calls)  # fmt: skip
        for call in self.calls[:made]:
            call.status = "completed"
        return self.calls[:made]

    async def events(self, first: RequestOutput, rest: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """The response as OpenAI streams it: each item opened, its pieces, closed; the whole at the end."""
        yield self._event(ResponseCreatedEvent, response=self.build(None))
        yield self._event(ResponseInProgressEvent, response=self.build(None))
        has_message, last = False, first
        output: RequestOutput | None = first
        while output is not None:
            last = output
            text, new_calls, pieces = self.update(output)
            if text and not has_message:
                has_message = True
                yield self._event(ResponseOutputItemAddedEvent, item=self.message(done=False), output_index=0)
                yield self._event(ResponseContentPartAddedEvent, item_id=self.message_id, output_index=0,
                                  content_index=0, part=_text_part(""))  # fmt: skip
            if text:
                yield self._event(ResponseTextDeltaEvent, item_id=self.message_id, output_index=0, content_index=0,
                                  delta=text, logprobs=[])  # fmt: skip
            for index in new_calls:
                if index == 0 and has_message:  # the text is over: calls follow it
                    for event in self._message_done():
                        yield event
                added = self.calls[index].model_copy(update={"arguments": ""})
                yield self._event(ResponseOutputItemAddedEvent, item=added, output_index=index + has_message)
            for index, piece in pieces:
                yield self._event(ResponseFunctionCallArgumentsDeltaEvent, item_id=self.calls[index].id,
                                  output_index=index + has_message, delta=piece)  # fmt: skip
            try:
                output = await anext(rest, None)
            except LoraserveError as error:  # the response has started: the error is its last event
                yield stream_error_event(error)
                return
        response = self.build(last)
        if has_message and not self.calls:
            for event in self._message_done():
                yield event
        for index, call in enumerate(self.calls):
            yield self._event(ResponseFunctionCallArgumentsDoneEvent, item_id=call.id, output_index=index + has_message,
                              name=call.name, arguments=call.arguments)  # fmt: skip
            yield self._event(ResponseOutputItemDoneEvent, item=call, output_index=index + has_message)
        yield self._event(ResponseCompletedEvent, response=response)

    def _message_done(self) -> list[str]:
        return [
            self._event(ResponseTextDoneEvent, item_id=self.message_id, output_index=0, content_index=0,
                        text=self.text, logprobs=[]),
            self._event(ResponseContentPartDoneEvent, item_id=self.message_id, output_index=0, content_index=0,
                        part=_text_part(self.text)),
            self._event(ResponseOutputItemDoneEvent, item=self.message(done=True), output_index=0),
        ]  # fmt: skip

    def _event(self, kind: type[BaseModel], **fields: Any) -> str:
        """One server-sent event of `kind` (its `type` is the one its model allows), numbered in sequence."""
        (name,) = get_args(kind.model_fields["type"].annotation)
        event = kind(type=name, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return f"event: {name}\ndata: {event.model_dump_json(exclude_unset=True)}\n\n"


def _text_part(text: str) -> ResponseOutputText:
    return ResponseOutputText(type="output_text", text=text, annotations=[])


def _tool(function: Function) -> FunctionTool:
    return FunctionTool(type="function", name=function.name, description=function.description,
                        parameters=function.parameters, strict=False)  # fmt: skip
