"""What every inference route shares: choosing the adapter and running one request to the end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import aclosing, contextmanager

from fastapi import Request

from loraserve.engine import RequestOutput, SamplingParams
from loraserve.engine.outputs import ADAPTER_UNAVAILABLE
from loraserve.errors import AdapterUnavailableError, InvalidRequestError, RequestFailedError
from loraserve.registry import AdapterInfo
from loraserve.server.state import ServerState, server_state


def resolve_adapter(state: ServerState, name: str | None) -> AdapterInfo | None:
    """The adapter a request names (None: the base model); UnknownAdapterError (404) when none is ready."""
    if not name or name == state.model_name:
        return None
    return state.catalog.get(name)


@contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Report an InvalidRequestError under the name the route's client gave the field (SamplingParams' name -> it)."""
    try:
        yield
    except InvalidRequestError as error:
        if error.field not in names:
            raise
        raise InvalidRequestError(names[error.field], error.message) from None


async def generate(
    http: Request, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None
) -> AsyncIterator[RequestOutput]:
    """The engine's stream for one request, aborted when the client goes away; counted when finished."""
    state = server_state(http)
    async with aclosing(state.engine.generate(request_id, prompt, params, adapter)) as outputs:
        async for output in outputs:
            if output.finished:
                state.metrics.record_request(adapter or state.model_name, output)
            if output.error is not None:
                if output.error.code == ADAPTER_UNAVAILABLE and adapter is not None:
                    await state.catalog.mark_failed(adapter, output.error.message)
                    raise AdapterUnavailableError(f"adapter {adapter!r} cannot be loaded: {output.error.message}")
                raise RequestFailedError(f"the request failed: {output.error.message}")
            if output.finished and adapter is not None:
                completion_tokens = sum(len(c.token_ids) for c in output.outputs)
                state.catalog.record_usage(adapter, len(output.prompt_token_ids), completion_tokens)
            yield output
            # Closing the engine's stream (leaving this block) aborts the request and frees its blocks.
            if not output.finished and await http.is_disconnected():
                return
