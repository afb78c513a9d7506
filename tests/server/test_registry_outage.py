"""A registry database that hangs instead of refusing: inference goes on, admin calls answer 503 in time.

The test's own PostgreSQL is stopped with SIGSTOP while eight admin reads are waiting on
it; chats for the base model and for a loaded adapter (with an API key: checked without the
database) still answer at once, /health at once, each admin read 503 within 20 s (the list
of API keys answers from memory), and after SIGCONT everything recovers without a
restart, the usage counted meanwhile included.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import ADMIN, RunningServer, start_server
from tests.server.test_admin_api import SAMPLES, peft_files, upload
from tests.throwaway_postgres import ThrowawayPostgres, throwaway_postgres

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.postgres]

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def postgres() -> Iterator[ThrowawayPostgres]:
    with throwaway_postgres() as server:
        yield server


@pytest.fixture
def server_on_postgres(loaded_model, tmp_path, postgres) -> Iterator[RunningServer]:
    yield from start_server(loaded_model, tmp_path, db_url=postgres.url)


def chat(server: RunningServer, model: str, key: str) -> tuple[int, float]:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    started = time.monotonic()
    auth = {"Authorization": f"Bearer {key}"}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=30)
    return response.status_code, time.monotonic() - started


def test_a_hung_registry_stops_no_inference_and_everything_recovers(server_on_postgres, postgres):
    server = server_on_postgres
    assert upload(server, "pirate", peft_files(SAMPLES / "pirate")).status_code == 201
    key = httpx.post(f"{server.url}/admin/keys", json={"tenant": "acme"}, headers=ADMIN).json()["key"]
    assert chat(server, "pirate", key)[0] == 200  # loaded
    postgres.hang()

    answers: list[tuple[int, float]] = []

    def admin_read() -> None:
        started = time.monotonic()
        response = httpx.get(f"{server.url}/admin/adapters", headers=ADMIN, timeout=60)
        answers.append((response.status_code, time.monotonic() - started))

    readers = [threading.Thread(target=admin_read) for _ in range(8)]
    for reader in readers:
        reader.start()
    time.sleep(0.5)
    for model in (MODEL, "pirate", "pirate"):  # API keys are checked without the database
        status, elapsed = chat(server, model, key)
        assert status == 200 and elapsed < 5, (model, status, elapsed)
    keys = httpx.get(f"{server.url}/admin/keys", headers=ADMIN, timeout=5)  # answered from memory
    assert keys.status_code == 200 and [k["tenant"] for k in keys.json()["data"]] == ["acme"]
    started = time.monotonic()
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 200 and time.monotonic() - started < 1
    for reader in readers:
        reader.join(timeout=60)
    assert len(answers) == 8
    assert all(status == 503 and elapsed < 20 for status, elapsed in answers), answers
    refused = httpx.post(f"{server.url}/admin/keys", json={"tenant": "beta"}, headers=ADMIN, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "registry_unavailable"
    health = httpx.get(f"{server.url}/health").json()
    assert (health["status"], health["engine"], health["registry"]) == ("degraded", "running", "unavailable")
    ready = httpx.get(f"{server.url}/ready")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "registry_unavailable"

    postgres.resume()
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/ready").status_code != 200:
        assert time.monotonic() < deadline, "the server did not see the registry come back"
        time.sleep(0.2)
    assert httpx.get(f"{server.url}/health").json()["registry"] == "ok"
    assert upload(server, "robot", peft_files(SAMPLES / "robot")).status_code == 201
    assert httpx.post(f"{server.url}/admin/keys", json={"tenant": "beta"}, headers=ADMIN).status_code == 201
    while True:  # the three pirate chats, counted while the database was away, are not lost
        record = httpx.get(f"{server.url}/admin/adapters/pirate", headers=ADMIN).json()
        if record["request_count"] == 3:
            break
        assert time.monotonic() < deadline and record["request_count"] < 3, record
        time.sleep(0.2)
