"""LoRAX/TGI-compatible routes: /generate, /generate_stream, and POST / (what `lorax-client` calls).

`inputs` is raw text, tokenized as `tokenizer(text)` does (no chat template); `parameters.adapter_id` names the adapter.
Stream events are TGI's: one per token, the last with `details` and `generated_text` (the token texts joined).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt

from loraserve.engine import CompletionOutput, RequestOutput, SamplingParams
from loraserve.errors import LoraserveError
from loraserve.server.bounds import (
    INTEGRAL,
    Count,
    Int64,
    Logprobs,
    RepetitionPenalty,
    StopStrings,
    Temperature,
    TopK,
    TopP,
)
from loraserve.server.checked_fields import LoraxResponseFormat, MergedAdapters
from loraserve.server.generation import Scheduling, fields_named, generate, json_or_events, resolve_target
from loraserve.server.responses import (
    AlternativeToken,
    GenerateDetails,
    GeneratedToken,
    GenerateResponse,
    StreamDetails,
    StreamEvent,
)
from loraserve.server.state import ServerState, server_state
from loraserve.server.structured import from_lorax_response_format

router = APIRouter()

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's default


def _refuse_true(value: bool) -> bool:
    if value:
        raise ValueError("is not supported by loraserve")
    return value


Unsupported = Annotated[StrictBool, AfterValidator(_refuse_true), Field(json_schema_extra={"const": False})]


class GenerateParameters(BaseModel):
    """lorax-client's Parameters, every one of which it sends (null or its default when not asked); any other key is
    refused by name (parameters.foo), as are those loraserve does not implement when set (their types say so)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    adapter_id: str | None = None
    adapter_source: str | None = None  # every adapter comes from the registry, whatever the source says
    api_token: str | None = None
    merged_adapters: MergedAdapters = None  # checked by MixSpec.parse, which names the sub-field at fault
    do_sample: bool = False
    max_new_tokens: Count | None = None
    ignore_eos_token: bool = False
    repetition_penalty: RepetitionPenalty | None = None
    return_full_text: bool = False
    stop: StopStrings = Field(default_factory=list)
    seed: Int64 | None = None
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    truncate: Count | None = None  # keep the prompt's last this many tokens
    # Not implemented: null, or what asks for nothing.
    typical_p: None = None
    best_of: Annotated[StrictInt, Field(le=1), INTEGRAL] | None = None
    watermark: Unsupported = False
    details: bool = False
    decoder_input_details: Unsupported = False
    return_k_alternatives: Logprobs | None = None
    response_format: LoraxResponseFormat = None  # JSON output, to a schema if given (server/structured.py)

    def sampling_params(self) -> SamplingParams:
        """TGI semantics: greedy unless do_sample or a sampling knob is set."""
        sampling = self.do_sample or any(v is not None for v in (self.temperature, self.top_k, self.top_p))
        structured_output = None if self.response_format is None else from_lorax_response_format(self.response_format)
        return SamplingParams(
            max_tokens=self.max_new_tokens if self.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS,
            temperature=(1.0 if self.temperature is None else self.temperature) if sampling else 0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=list(self.stop),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            ignore_eos=self.ignore_eos_token,
            logprobs=self.return_k_alternatives or 0,  # every TGI token carries its logprob
            structured_output=structured_output,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    inputs: str = Field(min_length=1)  # an empty prompt has nothing to continue
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    stream: bool = False


@router.post("/generate", response_model=GenerateResponse, response_model_exclude_unset=True)
async def generate_route(body: GenerateRequest, request: Request) -> GenerateResponse:
    return await _complete(request, body)


@router.post("/generate_stream", responses={200: {"model": StreamEvent, "content": {"text/event-stream": {}}}})
async def generate_stream_route(body: GenerateRequest, request: Request) -> StreamingResponse:
    return await _stream(request, body)


@router.post("/", response_model=None, responses=json_or_events(list[GenerateResponse]))
async def lorax_root(body: GenerateRequest, request: Request) -> JSONResponse | StreamingResponse:
    """lorax-client posts here: a one-element list when not streaming, events when streaming."""
    if body.stream:
        return await _stream(request, body)
    return JSONResponse([(await _complete(request, body)).model_dump(exclude_unset=True)])


# SamplingParams' names -> the names this route's clients send.
_FIELD_NAMES = {
    "max_tokens": "parameters.max_new_tokens",
    "ignore_eos": "parameters.ignore_eos_token",
    "logprobs": "parameters.return_k_alternatives",
    "prompt": "inputs",
    **{name: f"parameters.{name}" for name in ("temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty")},
}


async def _start(
    request: Request, body: GenerateRequest, is_streamed: bool
) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    state = server_state(request)
    parameters = body.parameters
    with fields_named(_FIELD_NAMES):
        params = parameters.sampling_params()
        mix = parameters.merged_adapters
        target = await resolve_target(state, parameters.adapter_id, mix, "parameters.merged_adapters")
        prompt: str | list[int] = body.inputs
        if parameters.truncate is not None:
            prompt = (await state.engine.offload(state.tokenizer, body.inputs))["input_ids"][-parameters.truncate :]
        scheduling = Scheduling.of(request, is_streamed)
        outputs = generate(request, f"generate-{uuid.uuid4().hex}", prompt, params, target, scheduling)
        # Awaited here so a refused request is a plain error, not a broken stream.
        return outputs, await anext(outputs)


async def _complete(request: Request, body: GenerateRequest) -> GenerateResponse:
    state = server_state(request)
    outputs, final = await _start(request, body, is_streamed=False)
    async for final in outputs:  # noqa: B007 - only the finished output is answered
        pass
    completion = final.outputs[0]
    text = _full_text(body, completion.text)
    if not body.parameters.details:
        return GenerateResponse(generated_text=text)
    tokens = [_token(state, completion, i) for i in range(len(completion.token_ids))]
    details = GenerateDetails(
        **_stream_details(body, final).model_dump(), prefill=[], tokens=tokens, best_of_sequences=None
    )
    return GenerateResponse(generated_text=text, details=details)


async def _stream(request: Request, body: GenerateRequest) -> StreamingResponse:
    state = server_state(request)
    outputs, first = await _start(request, body, is_streamed=True)

    async def events() -> AsyncIterator[str]:
        sent_tokens, sent_text = 0, ""
        output: RequestOutput | None = first
        while output is not None:
            completion = output.outputs[0]
            for i in range(sent_tokens, len(completion.token_ids)):
                last = i == len(completion.token_ids) - 1
                text = completion.text[len(sent_text) :] if last else ""
                done = last and output.finished
                event = StreamEvent(
                    token=_token(state, completion, i).model_copy(update={"text": text}),
                    generated_text=_full_text(body, completion.text) if done else None,
                    details=_stream_details(body, output) if done else None,
                )
                sent_text += text
                yield f"data:{event.model_dump_json(exclude_unset=True)}\n\n"
            sent_tokens = len(completion.token_ids)
            try:
                output = await anext(outputs, None)
            except LoraserveError as error:  # the response has started: TGI's error event ends it
                yield f"data:{json.dumps({'error': str(error), 'error_type': 'generation'})}\n\n"
                return

    return StreamingResponse(events(), media_type="text/event-stream")


def _full_text(body: GenerateRequest, text: str) -> str:
    return body.inputs + text if body.parameters.return_full_text else text


def _stream_details(body: GenerateRequest, output: RequestOutput) -> StreamDetails:
    completion = output.outputs[0]
    return StreamDetails(
        finish_reason=_finish_reason(completion),
        prompt_tokens=len(output.prompt_token_ids),
        generated_tokens=len(completion.token_ids),
        seed=body.parameters.seed,
    )


def _finish_reason(completion: CompletionOutput) -> Literal["length", "eos_token", "stop_sequence"]:
    if completion.finish_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(completion.stop_reason, str) else "eos_token"


def _token(state: ServerState, completion: CompletionOutput, index: int) -> GeneratedToken:
    token_id = completion.token_ids[index]
    entry = completion.logprobs[index] if completion.logprobs else None
    token = GeneratedToken(
        id=token_id,
        text=state.token_text(token_id),
        logprob=entry.logprob if entry else 0.0,
        special=token_id in state.special_token_ids,
    )
    if entry is not None and entry.top:
        token.alternative_tokens = [
            AlternativeToken(id=t, text=state.token_text(t), logprob=lp) for t, lp in entry.top.items()
        ]
    return token
