"""A full disk: an upload answers 507 `insufficient_storage`, nothing of it is kept, the server stays
healthy and stores again once there is room. The disk is a 2 MiB tmpfs (the sample adapter's weights
are 3.7 MB) under the data directory, or under its store alone; where this machine lets no test mount
one, the store's writes fail with ENOSPC instead."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loraserve.registry import file_store
from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN, RunningServer, start_server

pytestmark = pytest.mark.slow

SAMPLE = SAMPLE_ADAPTERS / "pirate"
FILES = ("adapter_config.json", "adapter_model.safetensors")


def mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=False,
                                 capture_output=True)  # fmt: skip
    except OSError:  # no mount command
        return False
    return mounted.returncode == 0


@pytest.fixture(params=["data-dir", "store"])
def full_disk(request, tmp_path, monkeypatch) -> Iterator[tuple[Path, Path]]:
    """(data dir, the tmpfs mount point or None) with the small disk under the data dir or under its store."""
    data_dir = tmp_path / "data"
    mount = data_dir if request.param == "data-dir" else data_dir / "adapters"
    mounted = mount_tmpfs(mount, "2m")
    if not mounted:  # no mount allowed here: the store's file writes fail as on a full disk

        def full(*_: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(file_store, "_copy_durably", full)
    try:
        yield data_dir, mount if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def upload(server: RunningServer, name: str) -> httpx.Response:
    files = [("files", (file, (SAMPLE / file).read_bytes())) for file in FILES]
    return httpx.post(f"{server.url}/admin/adapters", data={"name": name}, files=files, headers=ADMIN, timeout=60)


def test_a_full_disk_answers_507_keeps_nothing_and_the_server_stays_healthy(loaded_model, full_disk):
    data_dir, mount = full_disk
    servers = start_server(loaded_model, data_dir)
    server = next(servers)
    try:
        response = upload(server, "pirate")
        assert response.status_code == 507, response.text
        error = response.json()["error"]
        assert error["code"] == "insufficient_storage" and "no space left" in error["message"]
        assert httpx.get(f"{server.url}/admin/adapters", headers=ADMIN).json()["data"] == []
        assert not [p for p in (data_dir / "adapters").iterdir()], "nothing half stored"
        assert not list((data_dir / "uploads").glob("*")), "no upload scratch left"
        assert httpx.get(f"{server.url}/health").status_code == 200
        chat = {"model": server.engine.engine.loaded.name, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2}  # fmt: skip
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        if mount is not None:  # room again: the same upload is stored and served
            subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
            assert upload(server, "pirate").status_code == 201
            chat["model"] = "pirate"
            assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
    finally:
        next(servers, None)
