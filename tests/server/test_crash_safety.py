"""SIGKILL at every point of an upload, then a restart on the same data directory: the adapter is
whole and serves, or is absent; no stored file without its adapter, no upload scratch left.

Real server processes: a point inside the server is reached with LORASERVE_CRASH_AT (the
server kills itself there, crash_points.py); the body half sent and the moment after the 201
are killed from here.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from loraserve.models import LoadedModel
from loraserve.registry import FileStore, Registry
from loraserve.registry.consistency import check_registry
from loraserve.registry.database import sqlite_url
from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN as RESTART_ADMIN
from tests.server.conftest import start_server
from tests.server.server_process import ADMIN, TOKEN, server_process

pytestmark = pytest.mark.slow

SAMPLE = SAMPLE_ADAPTERS / "pirate"
NAME = "crashy"
POINTS = [
    "upload.received",
    "upload.unpacked",
    "upload.validated",
    "store.copying",
    "store.staged",
    "store.renamed",
    "registry.inserted",
    "upload.served",
]


def upload_body() -> tuple[bytes, str]:
    """The multipart body of an upload of the sample adapter as NAME, and its content type."""
    files = [
        (name, (name, (SAMPLE / name).read_bytes())) for name in ("adapter_config.json", "adapter_model.safetensors")
    ]
    request = httpx.Request("POST", "http://x/admin/adapters", data={"name": NAME}, files=files)
    return request.read(), request.headers["content-type"]


def upload(url: str, admin: dict[str, str] = ADMIN) -> httpx.Response:
    body, content_type = upload_body()
    return httpx.post(f"{url}/admin/adapters", content=body, headers={**admin, "Content-Type": content_type},
                      timeout=120)  # fmt: skip


def assert_whole_or_absent(data_dir: Path, loaded_model: LoadedModel) -> bool:
    """Restart on `data_dir`: NAME serves or is unknown everywhere; the store and scratch hold nothing
    else. Returns whether NAME is there. The restart is a server in this process (the start-up checks and
    repairs are the app's, wherever it runs); the one killed was a process of its own."""
    with contextmanager(start_server)(loaded_model, data_dir, orphan_grace=0.0) as server:
        records = httpx.get(f"{server.url}/admin/adapters", headers=RESTART_ADMIN).json()["data"]
        present = [record for record in records if record["name"] == NAME]
        models = [model["id"] for model in httpx.get(f"{server.url}/v1/models").json()["data"]]
        body = {"model": NAME, "prompt": "Ahoy", "max_tokens": 2}
        completion = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        if present:
            assert present[0]["status"] == "ready" and NAME in models, present
            assert completion.status_code == 200, completion.text
        else:
            assert NAME not in models and completion.status_code == 404, completion.text
        stored = sorted(path.name for path in (data_dir / "adapters").iterdir())
        assert stored == sorted({record["sha256"] for record in records}), "a stored directory no adapter names"
        assert not list((data_dir / "uploads").glob("*")), "upload scratch left behind"
        if not present:  # the name is free again
            assert upload(server.url, RESTART_ADMIN).status_code == 201
    # What `loraserve registry check` runs (its command line is the last test's), in this process: a
    # subprocess per crash point would spend its time importing.
    registry = Registry(sqlite_url(data_dir), FileStore(data_dir / "adapters"))
    try:
        report = check_registry(registry, repair=False, min_orphan_age=0.0)
    finally:
        registry.close()
    assert report.is_consistent and not report.lines(), report.lines()
    return bool(present)


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_at_a_point_of_an_upload_leaves_the_adapter_whole_or_absent(tmp_path, point, loaded_model):
    data_dir = tmp_path / "data"
    with server_process(data_dir, crash_at=point) as server:
        with pytest.raises(httpx.TransportError):
            upload(server.url)
        assert server.process.wait(timeout=30) == -signal.SIGKILL, "it died at the point, not otherwise"
    present = assert_whole_or_absent(data_dir, loaded_model)
    # Once the row is committed the adapter is registered: a crash after it keeps the adapter.
    assert present == (POINTS.index(point) >= POINTS.index("registry.inserted"))


def test_sigkill_with_the_body_half_sent_leaves_nothing(tmp_path, loaded_model):
    data_dir = tmp_path / "data"
    body, content_type = upload_body()
    with server_process(data_dir) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as connection:
            head = (f"POST /admin/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                    f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
            connection.sendall(head.encode() + body[: len(body) // 2])
            time.sleep(1.0)  # the server is reading the body
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(timeout=30)
    assert not assert_whole_or_absent(data_dir, loaded_model)


def test_sigkill_right_after_the_201_keeps_the_adapter(tmp_path, loaded_model):
    data_dir = tmp_path / "data"
    with server_process(data_dir) as server:
        response = upload(server.url)
        assert response.status_code == 201, response.text
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
    assert assert_whole_or_absent(data_dir, loaded_model)


def test_registry_check_reports_and_repairs_orphans_and_marks_adapters_without_files_failed(tmp_path):
    data_dir = tmp_path / "data"
    with server_process(data_dir) as server:
        assert upload(server.url).status_code == 201
        sha256 = httpx.get(f"{server.url}/admin/adapters/{NAME}", headers=ADMIN).json()["sha256"]
    orphan = data_dir / "adapters" / ("f" * 64)
    orphan.mkdir()
    (orphan / "adapter_config.json").write_text(json.dumps({"r": 8}))
    command = [sys.executable, "-m", "loraserve.cli", "registry", "check", "--data-dir", str(data_dir)]
    found = subprocess.run(command, capture_output=True, text=True, check=False)
    assert found.returncode == 1 and f"orphan files (no adapter names them): {'f' * 64}" in found.stdout
    assert orphan.exists(), "reported, not removed, without --repair"
    repaired = subprocess.run([*command, "--repair"], capture_output=True, text=True, check=False)
    assert repaired.returncode == 0 and not orphan.exists(), repaired.stdout + repaired.stderr
    (data_dir / "adapters" / sha256 / "adapter_model.safetensors").unlink()  # a disk fault, not a crash
    damaged = subprocess.run(command, capture_output=True, text=True, check=False)
    assert damaged.returncode == 0 and f"adapter {NAME!r} not served: stored files missing" in damaged.stdout
