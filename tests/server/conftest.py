"""A real server on a free loopback port, over the shared float32 model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import uvicorn

from loraserve.config import CacheConfig, EngineConfig, ModelConfig
from loraserve.engine import LLMEngine
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.models import LoadedModel
from loraserve.server.app import create_app


@dataclass
class RunningServer:
    url: str
    engine: AsyncLLMEngine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(loaded: LoadedModel, api_keys: frozenset[str] = frozenset()) -> Iterator[RunningServer]:
    engine = AsyncLLMEngine(
        LLMEngine(EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(num_blocks=512)), loaded=loaded)
    )
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(engine, api_keys), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(loaded_model) -> Iterator[RunningServer]:
    yield from start_server(loaded_model)


def wait_until_idle(engine: AsyncLLMEngine, timeout: float = 30) -> None:
    """Aborts reach the engine thread asynchronously; wait for it to drain."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
