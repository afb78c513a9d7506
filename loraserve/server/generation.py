"""What every inference route shares: choosing the adapter and running one request to the end."""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from contextlib import aclosing, contextmanager, suppress
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from loraserve.engine import RequestOutput, SamplingParams
from loraserve.engine.outputs import ADAPTER_UNAVAILABLE, OVERLOADED, TIMED_OUT
from loraserve.engine.sampling_params import INT64_MAX, INT64_MIN
from loraserve.errors import (
    AdapterUnavailableError,
    ClientGoneError,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
    RequestTimeoutError,
    UnknownAdapterError,
)
from loraserve.lora.mix_spec import FIELD as MIX_FIELD
from loraserve.lora.mix_spec import MixSpec
from loraserve.registry import AdapterInfo
from loraserve.server.auth import grant_of
from loraserve.server.state import ServerState, server_state
from loraserve.server.tenants import UNKEYED_ACCESS, TenantKey


def json_or_events(model: Any) -> dict[int | str, dict[str, Any]]:
    """A route's documented 200: `model` as JSON, or server-sent events when the request says "stream": true."""
    return {200: {"model": model, "content": {"text/event-stream": {}}}}


def resolve_adapter(state: ServerState, name: str | None) -> AdapterInfo | None:
    """The adapter a request names (None: the base model); UnknownAdapterError (404) when none is ready."""
    return None if not name or name == state.model_name else state.catalog.get(name)


MIX_LABEL = "merged_adapters"  # a mix's name in metrics: one series for every mix, not one per spec


@dataclass(frozen=True)
class Target:
    """What a request runs with: a registered adapter, a mix of registered adapters, or (neither) the base model."""

    adapter: AdapterInfo | None = None
    mix: str | None = None  # the engine's name for the mix (engine/mixes.py)
    parts: tuple[AdapterInfo, ...] = ()  # the mix's

    @property
    def engine_adapter(self) -> str | None:
        return self.mix or (self.adapter.name if self.adapter else None)


async def resolve_target(state: ServerState, name: str | None, merged: object, field: str) -> Target:
    """The adapter `name` (None or the base model's id: none), or the mix `merged` (a merged_adapters object,
    the request's `field`) made of ready adapters; errors name the field at fault."""
    if merged is None:
        return Target(resolve_adapter(state, name))
    if name and name != state.model_name:
        raise InvalidRequestError(field, f"mixes adapters over the base model: name {state.model_name!r}, not {name!r}")
    try:
        spec = MixSpec.parse(merged, state.engine.max_mix_parts)
        parts = tuple(state.catalog.get(part) for part in spec.ids)
        return Target(mix=await state.engine.mix_adapters(spec), parts=parts)
    except UnknownAdapterError as error:
        raise UnknownAdapterError(error.name, field=f"{field}.ids") from None
    except InvalidRequestError as error:
        if error.field.startswith(MIX_FIELD):  # merge.py names its own fields: say where this route has them
            raise InvalidRequestError(field + error.field.removeprefix(MIX_FIELD), error.message) from None
        raise


@contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Report an InvalidRequestError under the name the route's client gave the field (SamplingParams' name -> it)."""
    try:
        yield
    except InvalidRequestError as error:
        if error.field not in names:
            raise
        raise InvalidRequestError(names[error.field], error.message) from None


@dataclass(frozen=True)
class Scheduling:
    """Where a request queues: `priority` (lower first, vLLM's field), `timeout` (seconds to start), whose fair share
    and quotas serve it (the API key's grant) and whether it is streamed (which SLO target admits it)."""

    priority: int = 0
    timeout: float | None = None
    grant: TenantKey = UNKEYED_ACCESS
    is_streamed: bool = True

    @classmethod
    def of(cls, http: Request, is_streamed: bool, priority: object = 0, timeout: object = None) -> Scheduling:
        """From the body's fields and the X-Request-Timeout header (the field wins); 400 naming what is wrong."""
        if not (isinstance(priority, int) and not isinstance(priority, bool) and INT64_MIN <= priority <= INT64_MAX):
            raise InvalidRequestError("priority", f"must be an integer in int64, got {priority!r}")
        field = "timeout"
        if timeout is None and "x-request-timeout" in http.headers:
            field, timeout = "X-Request-Timeout", http.headers["x-request-timeout"]
            with suppress(ValueError):  # else refused below, as the text it is
                timeout = float(timeout)
        if timeout is None:
            return cls(priority, None, grant_of(http), is_streamed)
        if not (isinstance(timeout, int | float) and not isinstance(timeout, bool) and 0 < timeout < math.inf):
            raise InvalidRequestError(field, f"must be a positive number of seconds, got {timeout!r}")
        return cls(priority, float(timeout), grant_of(http), is_streamed)


async def generate(
    http: Request,
    request_id: str,
    prompt: str | list[int],
    params: SamplingParams,
    target: Target,
    scheduling: Scheduling,
) -> AsyncIterator[RequestOutput]:
    """The engine's stream for one request, aborted when the client goes away; counted when finished. Refused first if
    the key may not use the model (403) or its quota is spent (429); then started in its tenant's turn (a cluster's
    fair order across replicas; at once on one server); the quota and the share are charged its tokens however it
    ends."""
    state = server_state(http)
    adapter = target.engine_adapter
    grant, tenant = scheduling.grant, scheduling.grant.tenant
    await state.tenants.admit(grant, [part.name for part in target.parts] or [adapter or state.model_name])
    async with state.tenants.turn(grant) as turn:
        stream = state.engine.generate(
            request_id, prompt, params, adapter, scheduling.priority, scheduling.timeout, tenant, scheduling.is_streamed
        )
        last: RequestOutput | None = None
        try:
            # Closing the engine's stream (leaving this block) aborts the request and frees its blocks.
            async with aclosing(stream), aclosing(_checked(state, target, tenant.name, stream)) as outputs:
                async for last in outputs:
                    yield last
                    if not last.finished and await http.is_disconnected():
                        if scheduling.is_streamed:
                            return  # the stream ends where the client left it
                        raise ClientGoneError(f"the client of request {request_id} closed the connection")
        finally:
            if last is not None:
                turn.prompt_tokens, turn.output_tokens = len(last.prompt_token_ids), _num_generated(last)
                state.tenants.charge(grant, turn.prompt_tokens + turn.output_tokens)


def _num_generated(output: RequestOutput) -> int:
    return sum(len(completion.token_ids) for completion in output.outputs)


async def _checked(
    state: ServerState, target: Target, tenant: str, outputs: AsyncIterator[RequestOutput]
) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs, its errors raised as the wire's, each finished request counted (a mix's usage under
    MIX_LABEL in the metrics, and under no adapter of the registry)."""
    adapter = target.adapter.name if target.adapter else None
    async for output in outputs:
        if output.finished:
            state.metrics.record_request(MIX_LABEL if target.mix else adapter or state.model_name, output, tenant)
        if output.error is not None:
            if output.error.code == ADAPTER_UNAVAILABLE and target.engine_adapter is not None:
                if adapter is not None:
                    await state.catalog.mark_failed(adapter, output.error.message)
                name = adapter or MIX_LABEL
                raise AdapterUnavailableError(f"adapter {name!r} cannot be loaded: {output.error.message}")
            if output.error.code == OVERLOADED:
                raise OverloadedError(output.error.message, retry_after=output.error.retry_after or 1.0)
            if output.error.code == TIMED_OUT:
                raise RequestTimeoutError(f"the request timed out: {output.error.message}")
            raise RequestFailedError(f"the request failed: {output.error.message}")
        if output.finished and adapter is not None:
            state.catalog.usage.add(adapter, len(output.prompt_token_ids), _num_generated(output))
        yield output
