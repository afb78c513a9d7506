"""A real `loraserve serve` process for the tests that signal or kill it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from loraserve.crash_points import VARIABLE
from tests.server.conftest import free_port

TOKEN = "signal-test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log: Path


@contextmanager
def server_process(data_dir: Path, crash_at: str | None = None, *flags: str) -> Iterator[ServerProcess]:
    """`loraserve serve` on `data_dir` (float32, no sample adapters unless `flags` say otherwise), ready to
    answer; killed on exit if still running. `crash_at`: a point of crash_points.py where it kills itself."""
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key != VARIABLE}
    if crash_at is not None:
        env[VARIABLE] = crash_at
    log = data_dir.parent / f"server-{port}.log"
    command = [sys.executable, "-m", "loraserve.cli", "serve", "--data-dir", str(data_dir), "--port", str(port),
               "--admin-token", TOKEN, "--orphan-grace", "0", "--dtype", "float32"]  # fmt: skip
    command += flags or ("--no-samples",)
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log)
    try:
        wait_until_ready(server)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def wait_until_ready(server: ServerProcess) -> None:
    """Until /ready answers 200; fails with the end of the log if the process exits or takes 3 minutes."""
    deadline = time.monotonic() + 180
    while not _answers(server.url):
        assert server.process.poll() is None, f"the server exited at start:\n{server.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not start:\n{server.log.read_text()[-3000:]}"
        time.sleep(0.2)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
