"""Slow and idle clients take nothing from the others: with 64 connections that sent their headers and
never their body, and 4 SSE streams read one byte a second, /health still answers within 1 s and a
chat within twice its time alone plus 0.5 s (the bound docs/reliability.md states)."""

from __future__ import annotations

import json
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from tests.server.conftest import RunningServer, start_server

pytestmark = [pytest.mark.slow, pytest.mark.serial]

IDLE = 64
SLOW_READERS = 4


@pytest.fixture(scope="module")
def lone_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    yield from start_server(loaded_model, tmp_path_factory.mktemp("data"))


def chat_seconds(server: RunningServer) -> float:
    body = {"model": server.engine.engine.loaded.name, "messages": [{"role": "user", "content": "Hi there"}],
            "max_tokens": 8, "ignore_eos": True, "temperature": 0}  # fmt: skip
    start = time.monotonic()
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
    return time.monotonic() - start


def health_seconds(server: RunningServer) -> float:
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    return time.monotonic() - start


@contextmanager
def connection(server: RunningServer, request: bytes) -> Iterator[socket.socket]:
    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the slow reader's window fills at once
    try:
        sock.sendall(request)
        yield sock
    finally:
        sock.close()


def request_head(content_length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {content_length}\r\n\r\n"
    ).encode()


def idle_request() -> bytes:
    """Headers promising a body that never comes."""
    return request_head(500)


def streaming_request(model: str) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                       "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    return request_head(len(body)) + body


def test_idle_connections_and_slow_readers_do_not_delay_health_or_other_chats(lone_server):
    server = lone_server
    chat_seconds(server)  # warm-up
    alone = statistics.median(chat_seconds(server) for _ in range(3))
    with ExitStack() as stack:
        idle = [stack.enter_context(connection(server, idle_request())) for _ in range(IDLE)]
        model = server.engine.engine.loaded.name
        readers = [stack.enter_context(connection(server, streaming_request(model))) for _ in range(SLOW_READERS)]
        for reader in readers:
            assert reader.recv(1)  # the stream started; from now on a byte a second
        health, chats = [], []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            health.append(health_seconds(server))
            chats.append(chat_seconds(server))
            for reader in readers:
                reader.recv(1)
            time.sleep(max(0.0, 1.0 - health[-1] - chats[-1]))
        assert len(idle) == IDLE
    assert max(health) < 1.0, health
    assert statistics.median(chats) < 2 * alone + 0.5, (alone, chats)
    assert health_seconds(server) < 1.0, "the server is healthy once they are gone"
