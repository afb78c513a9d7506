"""How the OpenAI routes shape their responses and stream chunks, as the `openai` package's types: a completion's
choices, a chat's message (with the tool calls its reply makes, tools/), usage."""

from __future__ import annotations

import time
from typing import Any, TypeVar

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
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCallUnion as ToolCallOfMessage
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import PromptTokensDetails
from pydantic import BaseModel

from loraserve.engine import CompletionOutput, RequestOutput, TokenLogprob
from loraserve.server.responses import CompletionChunk, CompletionChunkChoice
from loraserve.server.state import ServerState
from loraserve.tools.choice import ToolPlan
from loraserve.tools.stream import ReplyStream, new_call_id

T = TypeVar("T", ChoiceLogprobs, ChunkLogprobs)


def _finish_reason(reason: str | None, made_calls: bool) -> Any:
    """ "tool_calls" where a reply that made calls ended by itself: the client is to call the functions."""
    return "tool_calls" if made_calls and reason == "stop" else reason


def _message_call(call_id: str, name: str, arguments: str) -> ChatCompletionMessageFunctionToolCall:
    return ChatCompletionMessageFunctionToolCall(id=call_id, type="function", function=Function(name=name,
                                                 arguments=arguments))  # fmt: skip


def usage_of(output: RequestOutput) -> CompletionUsage:
    prompt_tokens, completion_tokens = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return CompletionUsage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


class Format:
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
        return self.response_type(
            **self._envelope(request_id, self.object_name), choices=choices, usage=usage_of(output)
        )

    def chunk(self, request_id: str, *choices: BaseModel, **fields: Any) -> BaseModel:
        """A stream chunk of `choices`; the usage chunk has none, and `usage` in `fields`."""
        return self.chunk_type(**self._envelope(request_id, self.chunk_object_name), choices=list(choices), **fields)

    def _envelope(self, request_id: str, object_name: str) -> dict[str, Any]:
        return {"id": request_id, "object": object_name, "created": self.created, "model": self.model}

    def opening_choice(self, index: int) -> BaseModel | None:
        return None

    def choice(self, completion: CompletionOutput, is_chunk: bool) -> BaseModel:
        raise NotImplementedError


class CompletionFormat(Format):
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


class ChatFormat(Format):
    """A chat's message; with tools (`plan`), the calls the reply makes: with a function named in tool_choice, its
    arguments are the whole output; else the reply is read in the model's tool-call format (tools/formats.py)."""

    id_prefix, object_name, chunk_object_name = "chatcmpl", "chat.completion", "chat.completion.chunk"
    response_type, chunk_type = ChatCompletion, ChatCompletionChunk

    def __init__(self, state: ServerState, model: str, plan: ToolPlan | None = None) -> None:
        super().__init__(state, model)
        self.named = plan.named if plan is not None else None
        self.reads_calls = plan is not None and plan.reads_calls
        self._named_ids: dict[int, str] = {}  # choice index -> its named call's id, the same in every chunk
        self._streams: dict[int, ReplyStream] = {}  # choice index -> what its stream has sent

    def opening_choice(self, index: int) -> ChunkChoice:
        delta = ChoiceDelta(role="assistant", content="")
        if self.named is not None:
            function = ChoiceDeltaToolCallFunction(name=self.named.name, arguments="")
            call = ChoiceDeltaToolCall(index=0, id=self._named_id(index), type="function", function=function)
            delta = ChoiceDelta(role="assistant", tool_calls=[call])
        return ChunkChoice(index=index, delta=delta, logprobs=None, finish_reason=None)

    def choice(self, completion: CompletionOutput, is_chunk: bool) -> Choice | ChunkChoice:
        if is_chunk:
            delta, calls = self._delta(completion)
            finish_reason = _finish_reason(completion.finish_reason, calls)
            logprobs = self._logprobs(ChunkLogprobs, completion.logprobs)
            return ChunkChoice(index=completion.index, finish_reason=finish_reason, delta=delta, logprobs=logprobs)
        message = self._message(completion.text, completion.index)
        return Choice(
            index=completion.index,
            finish_reason=_finish_reason(completion.finish_reason, bool(message.tool_calls)),
            message=message,
            logprobs=self._logprobs(ChoiceLogprobs, completion.logprobs),
        )

    def _message(self, text: str, index: int) -> ChatCompletionMessage:
        if self.named is not None:
            return ChatCompletionMessage(role="assistant", content=None, tool_calls=[
                _message_call(self._named_id(index), self.named.name, text)])  # fmt: skip
        if not self.reads_calls:
            return ChatCompletionMessage(role="assistant", content=text)
        reply = self.state.tool_format.read(text, final=True)
        calls: list[ToolCallOfMessage] = [
            _message_call(new_call_id(), call.name or "", call.arguments) for call in reply.complete_calls()
        ]
        if not calls:
            return ChatCompletionMessage(role="assistant", content=reply.content)
        return ChatCompletionMessage(role="assistant", content=reply.content.rstrip() or None, tool_calls=calls)

    def _delta(self, completion: CompletionOutput) -> tuple[ChoiceDelta, bool]:
        """A chunk's delta, and whether the reply has made calls."""
        text = completion.text
        if self.named is not None:
            return (ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(index=0, function=ChoiceDeltaToolCallFunction(
                arguments=text))]) if text else ChoiceDelta()), True  # fmt: skip
        if not self.reads_calls:
            return (ChoiceDelta(content=text) if text else ChoiceDelta()), False
        stream = self._streams.setdefault(completion.index, ReplyStream(self.state.tool_format))
        news = stream.update(text, final=completion.finish_reason is not None)
        calls = [
            ChoiceDeltaToolCall(
                index=call.index,
                id=call.id,
                type="function" if call.id else None,
                function=ChoiceDeltaToolCallFunction(name=call.name, arguments=call.arguments),
            )
            for call in news.calls
        ]
        delta = ChoiceDelta()
        if news.content:
            delta.content = news.content
        if calls:
            delta.tool_calls = calls
        return delta, bool(stream.call_ids)

    def _named_id(self, index: int) -> str:
        return self._named_ids.setdefault(index, new_call_id())

    def _logprobs(self, kind: type[T], logprobs: list[TokenLogprob] | None) -> T | None:
        return None if logprobs is None else kind(content=[self._entry(e.token_id, e.logprob, e.top) for e in logprobs])

    def _entry(self, token_id: int, logprob: float, top: dict[int, float]) -> ChatCompletionTokenLogprob:
        def alternative(token_id: int, logprob: float) -> TopLogprob:
            text = self.state.token_text(token_id)
            return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

        alternatives = [alternative(t, lp) for t, lp in top.items()]
        return ChatCompletionTokenLogprob(**alternative(token_id, logprob).model_dump(), top_logprobs=alternatives)
