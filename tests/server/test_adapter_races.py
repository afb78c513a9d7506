"""Uploads and deletes of the same names racing each other, with chats in between.

Whatever the interleaving, the registry's rows, the files in the store and the adapters
served end up the same set, every adapter's files hashing to its row's sha256.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import ADMIN, RunningServer, wait_until_idle
from tests.server.test_admin_api import SAMPLES, peft_files, upload

pytestmark = pytest.mark.slow

NAMES = ("alpha", "beta", "gamma")
PERSONAS = ("pirate", "robot", "shakespeare", "french-tutor")
OPERATIONS = 200
WORKERS = 4


def test_racing_uploads_and_deletes_leave_rows_files_and_catalog_equal(server: RunningServer):
    files = {persona: peft_files(SAMPLES / persona) for persona in PERSONAS}
    unexpected: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(OPERATIONS // WORKERS):
            name = rng.choice(NAMES)
            action = rng.choice(("upload", "upload", "delete", "chat"))
            if action == "upload":
                status = upload(server, name, files[rng.choice(PERSONAS)]).status_code
                expected = {201, 409}
            elif action == "delete":
                status = httpx.delete(f"{server.url}/admin/adapters/{name}", headers=ADMIN, timeout=60).status_code
                expected = {200, 404}
            else:
                body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
                status = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code
                expected = {200, 404}
            if status not in expected:
                unexpected.append(f"{action} {name}: {status}")

    workers = [threading.Thread(target=work, args=(seed,)) for seed in range(WORKERS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    assert not unexpected, unexpected
    wait_until_idle(server.engine)

    rows = {r["name"]: r["sha256"] for r in httpx.get(f"{server.url}/admin/adapters", headers=ADMIN).json()["data"]}
    served = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"] if m.get("parent")}
    store = server.data_dir / "adapters"
    stored = {path.name for path in store.iterdir()} if store.exists() else set()
    assert set(rows) == served, "every row is served and nothing without a row"
    assert set(rows.values()) == stored, "the store holds the files of the rows, and no others"
    assert not any((server.data_dir / "uploads").iterdir()), "no upload left its scratch files"
    for name, sha256 in rows.items():
        assert _files_hash(store / sha256) == sha256, name


def _files_hash(directory: Path) -> str:
    from loraserve.file_digest import sha256_of_files

    return sha256_of_files(directory / "adapter_config.json", directory / "adapter_model.safetensors")
