"""Servers sharing one PostgreSQL registry, each with its own disk, serve the same adapters: what one is told (an
upload, an edit, a pin, a delete) the others follow within seconds, without a restart (registry/change_feed.py), the
files coming from the database (--files-in-database)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from tests.postgres_databases import empty_database, postgres_admin_url
from tests.server.conftest import ADMIN, RunningServer, start_server
from tests.server.test_admin_api import greedy, peft_files, upload

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

FOLLOW_SECONDS = 10  # notifications arrive in milliseconds; this allows for a loaded machine
running = contextmanager(start_server)


@pytest.fixture(scope="module")
def two_servers(loaded_model, tmp_path_factory) -> Iterator[tuple[RunningServer, RunningServer]]:
    with empty_database(postgres_admin_url()) as db_url, ExitStack() as servers:
        first, second = (
            servers.enter_context(
                running(loaded_model, tmp_path_factory.mktemp("own-disk"), db_url=db_url, files_in_database=True)
            )
            for _ in range(2)
        )
        yield first, second


def served_models(server: RunningServer) -> set[str]:
    return {model["id"] for model in httpx.get(f"{server.url}/v1/models").json()["data"]}


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + FOLLOW_SECONDS
    while not check():
        assert time.monotonic() < deadline, f"not within {FOLLOW_SECONDS} s: {what}"
        time.sleep(0.1)


def test_an_upload_edit_and_delete_on_one_server_reach_the_other(two_servers, peft_adapter_dir):
    first, second = two_servers
    assert "shared" not in served_models(second)

    created = upload(first, "shared", peft_files(peft_adapter_dir), description="v1")
    assert created.status_code == 201, created.text
    eventually(lambda: "shared" in served_models(second), "the second server serves the upload")
    assert greedy(second, "shared", "Hello, my name is") == greedy(first, "shared", "Hello, my name is")

    edited = httpx.patch(
        f"{first.url}/admin/adapters/shared", json={"system_prompt": "Answer in French."}, headers=ADMIN
    )
    assert edited.status_code == 200, edited.text
    eventually(
        lambda: second.catalog.get("shared").system_prompt == "Answer in French.",
        "the second server's chats use the new persona",
    )

    pinned = httpx.post(f"{first.url}/admin/adapters/shared/pin", headers=ADMIN)
    assert pinned.status_code == 200 and pinned.json()["pinned"], pinned.text
    eventually(lambda: second.engine.residency("shared") == ("device", True), "the second server pins it too")
    unpinned = httpx.post(f"{second.url}/admin/adapters/shared/unpin", headers=ADMIN)
    assert unpinned.status_code == 200 and not unpinned.json()["pinned"], unpinned.text
    eventually(lambda: not first.engine.is_pinned("shared"), "the first server unpins it")

    deleted = httpx.delete(f"{second.url}/admin/adapters/shared", headers=ADMIN)
    assert deleted.status_code == 200, deleted.text
    eventually(lambda: "shared" not in served_models(first), "the first server stops serving it")
    gone = httpx.post(f"{first.url}/v1/completions", json={"model": "shared", "prompt": "Hi", "max_tokens": 1})
    assert gone.status_code == 404, gone.text
    for server in two_servers:  # the last adapter of that content is gone: so are its files, on every disk it reached
        assert not (server.data_dir / "adapters" / created.json()["sha256"]).exists()
