"""The engine for the server: the step loop runs in its own thread, each request gets an async stream.

The event loop never waits on a step: adding runs in a worker thread and takes the
engine lock between steps; outputs come back through `call_soon_threadsafe`. A stream
closed early (a client that went away) queues an abort that the engine thread carries
out before its next step, freeing the request's blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from loraserve.engine.fair_share import UNKEYED, Tenant
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.outputs import RequestOutput
from loraserve.engine.sampling_params import SamplingParams
from loraserve.engine.sequence import Request
from loraserve.errors import EngineDeadError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.mix_spec import MixSpec
from loraserve.models.dtypes import dtype_name
from loraserve.openmp import keep_serial

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Threads for adding requests, engine calls between steps and tokenizing prompts: each holds
# the engine's lock briefly or tokenizes, so a few serve many clients.
INFERENCE_WORKERS = 4


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLMEngine:
    """Owns the engine thread; the only code that calls `LLMEngine.step` in the server."""

    def __init__(self, engine: LLMEngine, on_death: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        # What the server reads of the engine, fixed for its life: routes never reach past this object into LLMEngine.
        self.model_name: str = engine.loaded.name
        # What the numbers are: the activations' dtype and how the matmul weights are held (may be narrower).
        self.precision = {"compute": dtype_name(engine.loaded.dtype), "weights": engine.loaded.weights}
        self.tokenizer: PreTrainedTokenizerBase = engine.tokenizer
        self.max_prompt_chars: int = engine.max_prompt_chars
        self.max_mix_parts: int = engine.config.lora.max_mix_parts
        self.on_death = on_death  # called from the engine thread once the loop has stopped for good
        self._lock = threading.Lock()  # held for each step, add and abort
        self._has_work = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()  # ids whose streams closed early
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="loraserve-engine", daemon=True)
        self._workers = ThreadPoolExecutor(max_workers=INFERENCE_WORKERS, thread_name_prefix="loraserve-inference")
        # Mixes are made one at a time on a thread of their own: a flood of new mixes queues there and never
        # holds the threads that add every other request.
        self._mixer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraserve-mix", initializer=keep_serial)

    def start(self) -> None:
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """Why the step loop stopped (only an unrecoverable error stops it); None while it runs."""
        return self._error

    # What the server asks of the engine's adapters (the reads below are safe beside a running step).
    def read_adapter(self, path: Path, trusted: bool = True) -> LoraAdapter:
        """Read and validate a PEFT directory; an untrusted one (an upload) in the sandbox."""
        return self.engine.read_adapter(path, trusted)

    def register_adapter(
        self, name: str, path: Path, sha256: str | None, adapter: LoraAdapter | None = None, served_as: object = None
    ) -> None:
        self.engine.register_adapter(name, path, sha256, adapter, served_as)

    def served_as(self, name: str) -> object | None:
        """What `register_adapter` was given for the adapter; None once it is removed or was never added."""
        record = self.engine.adapters.record(name)
        return None if record is None or record.draining else record.served_as

    def served(self) -> list[object]:
        """`served_as` of every adapter not removed, in registration order."""
        records = self.engine.adapters.records()
        return [r.served_as for r in records if not r.draining and r.source.mix is None]

    def describe_adapter(self, name: str, served_as: object) -> None:
        self.engine.adapters.describe(name, served_as)

    async def mix_adapters(self, spec: MixSpec) -> str:
        """The adapter name serving this mix; made off the engine's lock, registered between two steps."""
        loop = asyncio.get_running_loop()
        prepared = await loop.run_in_executor(self._mixer, self.engine.mixes.prepare, spec)
        await self.call(lambda engine: engine.mixes.serve(prepared))
        return prepared.name

    def wait_resident(self, name: str) -> bool:
        return self.engine.adapters.wait_resident(name)

    def prefetch(self, name: str) -> None:
        """Start reading the adapter from disk into host memory, unless it is there or on its way (unknown: nothing)."""
        self.engine.adapters.prefetch(name)

    def set_pinned(self, name: str, pinned: bool) -> None:
        """AdapterError if `pinned` would leave no slot unpinned."""
        self.engine.adapters.set_pinned(name, pinned)

    def is_pinned(self, name: str) -> bool:
        return (record := self.engine.adapters.record(name)) is not None and record.pinned

    def residency(self, name: str) -> tuple[str, bool]:
        """Where the adapter's weights are ("device", "host" or "disk"), and whether they are pinned there."""
        where, record = self.engine.adapters.residency(name), self.engine.adapters.record(name)
        return where, where == "device" and record is not None and record.pinned

    def shutdown(self) -> None:
        self._stopping = True
        self._has_work.set()
        self._thread.join(timeout=30)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._mixer.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        adapter: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        tenant: Tenant = UNKEYED,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every step that touched it, the last one finished."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        add = functools.partial(
            self.engine.add_request, params=params, adapter=adapter, priority=priority, timeout=timeout, tenant=tenant
        )
        await self.offload(self._add, request_id, prompt, params, stream, add)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                # No await here: a cancelled task (client gone) would be cancelled again at it.
                self._aborts.put(request_id)
                self._has_work.set()

    async def call(self, action: Callable[[LLMEngine], T]) -> T:
        """Run `action` on the engine between two steps (adapter changes, pool statistics)."""

        def locked() -> T:
            keep_serial()  # a worker thread of the event loop: no OpenMP team of its own (openmp.py)
            with self._lock:
                return action(self.engine)

        return await self.offload(locked)

    async def offload(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the inference threads: no upload or registry call can take them all."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def _add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: _Stream,
        add: Callable[..., Request],
    ) -> None:
        """`add(request_id, token_ids, text=...)` under the lock, with `stream` to receive the outputs."""
        keep_serial()
        # Tokenized, and its grammar built (then cached), before taking the lock: the steps must not wait for them.
        token_ids = self.engine.tokenize(prompt) if isinstance(prompt, str) else prompt
        self.engine.compile_grammar(params)
        text = prompt if isinstance(prompt, str) else None
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine stopped: {self._error}")
            add(request_id, token_ids, text=text)
            self._streams[request_id] = stream
        self._has_work.set()

    def _run(self) -> None:
        while not self._stopping:
            while not self._aborts.empty():
                self.abort(self._aborts.get())
            if not self.engine.has_unfinished_requests():
                self._has_work.wait()
                self._has_work.clear()
                continue
            try:
                with self._lock:
                    outputs = self.engine.step()
                    deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                    for output in outputs:
                        if output.finished:
                            self._streams.pop(output.request_id, None)
            except Exception as error:  # not one request's fault (step_isolation.py): the device's state is lost
                logger.critical("the engine stopped: %r", error, exc_info=error)
                with self._lock:  # no request is added after this without seeing the error (`_add`)
                    self._error = error
                for waiting in self._streams.values():
                    waiting.loop.call_soon_threadsafe(waiting.queue.put_nowait, error)
                if self.on_death is not None:
                    self.on_death(error)
                return
            for receiver, output in deliveries:
                if receiver is not None:
                    receiver.loop.call_soon_threadsafe(receiver.queue.put_nowait, output)
