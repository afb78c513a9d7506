"""The inference-auth mode across servers sharing one registry (SQLite or PostgreSQL): open until the first key,
closed for good once keys were used (revoking them all leaves only the admin token), open again only when an admin
says so; shown in /health and /admin/auth; closed at start by --api-key or --require-api-key."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from loraserve.registry import InferenceAuth, sqlite_url
from loraserve.server.auth import auth_notice
from loraserve.server.tenants import REFRESH_SECONDS
from tests.postgres_databases import empty_database, postgres_admin_url
from tests.server.conftest import ADMIN, RunningServer, start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
running = contextmanager(start_server)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def registry_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "shared")
        return
    with empty_database(postgres_admin_url()) as url:
        yield url


@pytest.fixture
def two_servers(loaded_model, tmp_path_factory, registry_url) -> Iterator[tuple[RunningServer, RunningServer]]:
    with ExitStack() as servers:
        yield tuple(  # type: ignore[misc]
            servers.enter_context(running(loaded_model, tmp_path_factory.mktemp("disk"), db_url=registry_url))
            for _ in range(2)
        )


def infer(server: RunningServer, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60).status_code


def auth_of(server: RunningServer) -> str:
    return str(httpx.get(f"{server.url}/health").json()["auth"])


def eventually(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + REFRESH_SECONDS * 5  # each server reads the registry every REFRESH_SECONDS
    while not check():
        assert time.monotonic() < deadline, f"not within {REFRESH_SECONDS * 5} s: {what}"
        time.sleep(0.1)


def test_the_key_lifecycle_across_two_servers_never_opens_by_itself(two_servers):
    first, second = two_servers
    admin_token = ADMIN["Authorization"].split()[1]
    for server in two_servers:
        assert auth_of(server) == "open" and infer(server) == 200 and infer(server, "anything") == 200
        assert httpx.get(f"{server.url}/admin/auth", headers=ADMIN).json() == {"mode": "open", "keys": 0}

    created = httpx.post(f"{first.url}/admin/keys", json={"tenant": "acme"}, headers=ADMIN).json()
    assert auth_of(first) == "keys" and infer(first) == 401  # at once where the key was made
    eventually(lambda: infer(second) == 401, "the other server closes too")
    assert auth_of(second) == "keys" and infer(second, created["key"]) == 200

    revoked = httpx.delete(f"{second.url}/admin/keys/{created['id']}", headers=ADMIN)
    assert revoked.status_code == 200
    eventually(lambda: infer(first, created["key"]) == 401, "the revoked key is refused on the other server")
    for server in two_servers:  # no key left: still closed, the admin token alone passes
        assert auth_of(server) == "keys" and infer(server) == 401 and infer(server, "anything") == 401
        assert infer(server, admin_token) == 200
        assert httpx.get(f"{server.url}/admin/auth", headers=ADMIN).json() == {"mode": "keys", "keys": 0}
        assert httpx.get(f"{server.url}/admin/keys", headers=ADMIN).json()["auth"] == "keys"

    assert httpx.put(f"{first.url}/admin/auth", json={"mode": "open"}).status_code == 401  # the admin's call alone
    for body, field in (({"mode": "OPEN"}, "mode"), ({}, "mode"), ({"mode": "open", "why": 1}, "why")):
        refused = httpx.put(f"{first.url}/admin/auth", json=body, headers=ADMIN)
        assert refused.status_code == 400 and refused.json()["error"]["code"] == field, refused.text
    opened = httpx.put(f"{first.url}/admin/auth", json={"mode": "open"}, headers=ADMIN)
    assert opened.status_code == 200 and opened.json() == {"mode": "open", "keys": 0}
    assert infer(first) == 200
    eventually(lambda: infer(second) == 200, "the other server opens too")
    assert auth_of(second) == "open"


@pytest.mark.parametrize("closing", [{"api_keys": frozenset({"cli-key-0123456789"})}, {"require_api_key": True}])
def test_a_start_with_keys_required_closes_the_registry_for_later_starts(loaded_model, tmp_path, closing):
    with running(loaded_model, tmp_path, **closing) as server:
        assert auth_of(server) == "keys" and infer(server) == 401
        if "api_keys" in closing:
            assert infer(server, "cli-key-0123456789") == 200
    with running(loaded_model, tmp_path) as server:  # started again without the flag: still closed
        assert auth_of(server) == "keys" and infer(server) == 401 and infer(server, "cli-key-0123456789") == 401


def test_the_start_says_loudly_when_anyone_on_the_network_may_infer():
    assert "WARNING" in auth_notice(InferenceAuth.OPEN, "0.0.0.0")
    assert "WARNING" in auth_notice(InferenceAuth.OPEN, "10.1.2.3")
    for host in ("127.0.0.1", "::1", "localhost"):
        assert "WARNING" not in auth_notice(InferenceAuth.OPEN, host)
    assert "WARNING" not in auth_notice(InferenceAuth.KEYS, "0.0.0.0")
