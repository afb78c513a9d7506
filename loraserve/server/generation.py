"""What every inference route shares: choosing the adapter and running one request to the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request

from loraserve.engine import RequestOutput, SamplingParams
from loraserve.errors import AdapterUnavailableError
from loraserve.registry import AdapterInfo
from loraserve.server.state import ServerState, server_state


def resolve_adapter(state: ServerState, name: str | None) -> AdapterInfo | None:
    """The adapter a request names (None: the base model); UnknownAdapterError (404) when none is ready."""
    if not name or name == state.model_name:
        return None
    return state.catalog.get(name)


async def generate(
    http: Request, request_id: str, prompt: str | list[int], params: SamplingParams, adapter: str | None
) -> AsyncIterator[RequestOutput]:
    """The engine's stream for one request, aborted when the client goes away; counted when finished."""
    state = server_state(http)
    async with aclosing(state.engine.generate(request_id, prompt, params, adapter)) as outputs:
        async for output in outputs:
            if output.error is not None and adapter is not None:
                await state.catalog.mark_failed(adapter, output.error)
                raise AdapterUnavailableError(f"adapter {adapter!r} cannot be loaded: {output.error}")
            if output.finished:
                state.metrics.record_request(adapter or state.model_name, output)
                if adapter is not None:
                    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
                    state.catalog.record_usage(adapter, len(output.prompt_token_ids), completion_tokens)
            yield output
            # Closing the engine's stream (leaving this block) aborts the request and frees its blocks.
            if not output.finished and await http.is_disconnected():
                return
