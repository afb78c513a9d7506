"""The engine for the server: the step loop runs in its own thread, each request gets an async stream.

The event loop never waits on a step: a prompt is tokenized in a worker thread, and whatever
touches the engine's state (adding a request, an abort, an adapter change, statistics) is queued
for the engine thread, which runs the queue before each step. So a request added during a flood
starts at the next step: with a lock instead, the engine thread took it back for step after step
while the adding threads waited (measured: up to five steps of delay). Outputs come back through
`call_soon_threadsafe`. A stream closed early (a client that went away) queues an abort, freeing
the request's blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from loraserve.config import SchedulerConfig
from loraserve.engine.fair_share import UNKEYED, Tenant
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.outputs import RequestOutput
from loraserve.engine.sampling_params import SamplingParams
from loraserve.errors import EngineDeadError
from loraserve.lora.adapter import LoraAdapter
from loraserve.lora.adapter_config import AdapterConfig
from loraserve.lora.mix_spec import MixSpec
from loraserve.lora.residency import Residency
from loraserve.models.dtypes import dtype_name
from loraserve.openmp import keep_serial

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Threads for tokenizing prompts (and chat templates): a few serve many clients.
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
        self.scheduler_config: SchedulerConfig = engine.config.scheduler  # its per-request limits: --max-n...
        self.vocab_size: int = engine.loaded.model.spec.vocab_size  # token ids lie in [0, vocab_size)
        self.on_death = on_death  # called from the engine thread once the loop has stopped for good
        self._has_work = threading.Event()
        self._streams: dict[str, _Stream] = {}  # the engine thread's alone
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        # Orders queueing a call against the engine stopping, so that no call is left unanswered.
        self._calls_guard = threading.Lock()
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

    def check_adapter(self, path: Path) -> AdapterConfig:
        """Check a PEFT directory in the sandbox only (stored files not checked yet); raises AdapterError."""
        return self.engine.check_adapter(path)

    def register_adapter(self, name: str, path: Path, sha256: str | None, adapter: LoraAdapter | None = None) -> None:
        self.engine.register_adapter(name, path, sha256, adapter)

    async def mix_adapters(self, spec: MixSpec) -> str:
        """The adapter name serving this mix; made off the engine thread, registered between two steps."""
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

    def residency(self, name: str) -> tuple[Residency, bool]:
        """Where the adapter's weights are, and whether they are pinned there (on the device)."""
        where, record = self.engine.adapters.residency(name), self.engine.adapters.record(name)
        return where, where is Residency.DEVICE and record is not None and record.pinned

    def shutdown(self) -> None:
        with self._calls_guard:
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
        is_streamed: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every step that touched it, the last one finished. `is_streamed`:
        whether the client sees them as they come or only the last (LLMEngine.add_request)."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        add = functools.partial(
            self.engine.add_request, params=params, adapter=adapter, priority=priority, timeout=timeout, tenant=tenant,
            is_streamed=is_streamed,
        )  # fmt: skip
        token_ids = await self.offload(self._prepare, prompt, params)
        text = prompt if isinstance(prompt, str) else None

        def add_streaming() -> None:
            add(request_id, token_ids, text=text)
            self._streams[request_id] = stream

        try:
            await asyncio.wrap_future(self._between_steps(add_streaming))
        except asyncio.CancelledError:  # the client left while it was being added
            self._between_steps(functools.partial(self._abort, request_id))
            raise
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
                self._between_steps(functools.partial(self._abort, request_id))

    async def call(self, action: Callable[[LLMEngine], T]) -> T:
        """Run `action` on the engine between two steps (adapter changes, pool statistics)."""
        return await asyncio.wrap_future(self._between_steps(lambda: action(self.engine)))

    async def offload(self, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` on the inference threads: no upload or registry call can take them all."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, function, *args)

    def _prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, and its grammar built (then cached): off the engine thread, which must not wait
        for them."""
        keep_serial()  # a worker thread of the event loop: no OpenMP team of its own (openmp.py)
        token_ids = self.engine.tokenize(prompt) if isinstance(prompt, str) else prompt
        self.engine.compile_grammar(params)
        return token_ids

    def _between_steps(self, action: Callable[[], T]) -> Future[T]:
        """Queue `action` for the engine thread, which runs it before its next step; its result or error comes in
        the future, EngineDeadError once the engine has stopped."""
        future: Future[T] = Future()
        with self._calls_guard:
            if self._error is not None or self._stopping:
                reason = f"the engine stopped: {self._error}" if self._error is not None else "the engine shut down"
                future.set_exception(EngineDeadError(reason))
                return future
            self._calls.put((action, future))
        self._has_work.set()
        return future

    def _run_calls(self) -> None:
        while True:
            try:
                action, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue  # its caller left before it ran
            try:
                future.set_result(action())
            except BaseException as error:  # the caller's to handle (a bad request, an overload)
                future.set_exception(error)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def _run(self) -> None:
        try:
            self._step_until_stopped()
        finally:  # queued calls of a stopped engine are answered, never left waiting
            with self._calls_guard:
                self._stopping = True
            while not self._calls.empty():
                _, future = self._calls.get_nowait()
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineDeadError(f"the engine stopped: {self._error or 'shut down'}"))

    def _step_until_stopped(self) -> None:
        while not self._stopping:
            self._run_calls()
            if not self.engine.has_unfinished_requests():
                self._has_work.wait()
                self._has_work.clear()
                continue
            try:
                outputs = self.engine.step()
                deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._streams.pop(output.request_id, None)
            except Exception as error:  # not one request's fault (step_isolation.py): the device's state is lost
                logger.critical("the engine stopped: %r", error, exc_info=error)
                with self._calls_guard:  # no call is queued after this without seeing the error (`_between_steps`)
                    self._error = error
                for waiting in self._streams.values():
                    waiting.loop.call_soon_threadsafe(waiting.queue.put_nowait, error)
                if self.on_death is not None:
                    self.on_death(error)
                return
            for receiver, output in deliveries:
                if receiver is not None:
                    receiver.loop.call_soon_threadsafe(receiver.queue.put_nowait, output)
