"""What clients and supervisors see when a request fails inside a step, and when the engine dies."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from loraserve.server.app import create_app
from loraserve.server.process import run_server
from tests.server.conftest import RunningServer, async_engine, free_port, server_config_in, start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0}


@pytest.fixture
def doomed_server(loaded_model, tmp_path) -> Iterator[RunningServer]:
    """A server of its own: its engine is made to die."""
    yield from start_server(loaded_model, tmp_path)


def test_a_request_failing_mid_stream_ends_with_an_error_event_while_another_finishes(server):
    body = {**CHAT, "max_tokens": 24, "ignore_eos": True}
    expected = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    other: list[httpx.Response] = []
    neighbour = threading.Thread(
        target=lambda: other.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60))
    )
    events = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        lines = (line for line in s.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines).removeprefix("data: "))
        neighbour.start()
        server.engine.engine.model_runner.faults.failing_request_ids.add(first["id"])
        events = [line.removeprefix("data: ") for line in lines]
    neighbour.join(timeout=60)
    server.engine.engine.model_runner.faults.failing_request_ids.clear()

    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "request_failed"
    assert "fault injected" in error["message"]
    assert other[0].status_code == 200
    assert other[0].json()["choices"][0]["message"] == expected["choices"][0]["message"]
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "loraserve_failed_requests 1.0" in metrics
    assert httpx.get(f"{server.url}/health").json()["engine"] == "running"


def test_once_the_engine_dies_requests_and_health_answer_503_with_the_reason(doomed_server):
    url = doomed_server.url
    precision = {"compute": "float32", "weights": "float32"}
    assert httpx.get(f"{url}/health").json() == {
        "status": "ok", "engine": "running", "registry": "ok", "model": MODEL, "auth": "open", **precision
    }  # fmt: skip
    doomed_server.engine.engine.model_runner.faults.device_failure = True
    for _ in range(2):  # the request that met the failure, then any later one
        response = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=60)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_stopped"
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503
    assert health.json()["engine"] == "stopped"
    assert "the device failed" in health.json()["error"]["message"]


def test_the_server_exits_non_zero_once_its_engine_dies(loaded_model, tmp_path):
    engine = async_engine(loaded_model)
    app = create_app(engine, server_config_in(tmp_path))
    port = free_port()
    status: list[int] = []
    serving = threading.Thread(target=lambda: status.append(run_server(app, engine, "127.0.0.1", port, True, 5)))
    serving.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
    engine.engine.model_runner.faults.device_failure = True
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=60)
    assert response.status_code == 503
    serving.join(timeout=30)
    assert not serving.is_alive() and status == [1]
