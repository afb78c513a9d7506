"""A real server on a free loopback port, over the shared float32 model, with its own data directory."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from loraserve.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
)
from loraserve.engine import LLMEngine
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.models import LoadedModel
from loraserve.server.app import create_app
from loraserve.server.catalog import AdapterCatalog

ADMIN_TOKEN = "admin-token-for-the-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class RunningServer:
    url: str
    engine: AsyncLLMEngine
    data_dir: Path
    catalog: AdapterCatalog  # what the server serves


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def async_engine(
    loaded: LoadedModel,
    max_loras: int = 8,
    num_blocks: int = 512,
    scheduler: SchedulerConfig | None = None,
    speculation: SpeculativeConfig | None = None,
) -> AsyncLLMEngine:
    """An engine of its own (KV cache, adapters, scheduler) over the shared float32 model."""
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(num_pages=num_blocks),
        scheduler=scheduler or SchedulerConfig(),
        lora=LoraConfig(max_loras=max_loras, max_lora_rank=16),
        speculation=speculation or SpeculativeConfig(),
    )
    return AsyncLLMEngine(LLMEngine(config, loaded=loaded))


def server_config_in(data_dir: Path, **fields: Any) -> ServerConfig:
    """The tests' admin token, no sample adapters unless asked."""
    return ServerConfig(data_dir=data_dir, admin_token=ADMIN_TOKEN, **{"register_samples": False, **fields})


def start_server(
    loaded: LoadedModel,
    data_dir: Path,
    max_loras: int = 8,
    num_blocks: int = 512,
    scheduler: SchedulerConfig | None = None,
    speculation: SpeculativeConfig | None = None,
    **server_config: Any,
) -> Iterator[RunningServer]:
    """Start, yield once the port answers, stop. `server_config`: ServerConfig fields."""
    engine = async_engine(loaded, max_loras, num_blocks, scheduler, speculation)
    port = free_port()
    app = create_app(engine, server_config_in(data_dir, **server_config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", engine, data_dir, app.state.loraserve.catalog)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    yield from start_server(loaded_model, tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def samples_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    """The sample adapters registered (personas to ask), room for many chats at once."""
    yield from start_server(loaded_model, tmp_path_factory.mktemp("data"), num_blocks=2048, register_samples=True)


@pytest.fixture(scope="module")
def openai_client(samples_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{samples_server.url}/v1", api_key="unused")


def wait_until_idle(engine: AsyncLLMEngine, timeout: float = 30) -> None:
    """Aborts reach the engine thread asynchronously; wait for it to drain."""
    deadline = time.monotonic() + timeout
    while engine.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def data_snapshot(server: RunningServer) -> tuple[list[tuple[str, str, str]], list[tuple[str, int]]]:
    """What the registry and the file store hold: (name, sha256, status) rows and (path, size) files."""
    rows = httpx.get(f"{server.url}/admin/adapters", headers=ADMIN).json()["data"]
    files = sorted(
        (str(p.relative_to(server.data_dir)), p.stat().st_size)
        for p in server.data_dir.rglob("*")
        if p.is_file() and p.name != "registry.db" and not p.name.startswith("registry.db-")
    )
    return [(r["name"], r["sha256"], r["status"]) for r in rows], files
