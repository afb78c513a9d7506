"""Tenants' API keys through the admin API: shown once, stored hashed, required from the first on,
limited to their models, held to their quotas (429 with Retry-After), revoked at once, rotated,
kept over a restart; each tenant's use in the metrics under its name."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator

import httpx
import pytest

from loraserve.registry import FileStore, KeySpec, Registry, hash_key, sqlite_url, upgrade_database
from loraserve.server.registry_calls import RegistryCalls
from loraserve.server.tenants import Tenants
from tests.server.conftest import ADMIN, RunningServer, start_server

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def keyed_server(loaded_model, tmp_path) -> Iterator[RunningServer]:
    yield from start_server(loaded_model, tmp_path, register_samples=True)


def create(server: RunningServer, **fields: object) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/keys", json=fields, headers=ADMIN)


def chat(server: RunningServer, key: str | None, model: str = MODEL, max_tokens: int = 4) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_a_key_is_shown_once_stored_as_a_hash_and_required_once_it_exists(keyed_server, loaded_model):
    server = keyed_server
    assert chat(server, None).status_code == 200  # no key exists: inference is open
    assert httpx.post(f"{server.url}/admin/keys", json={"tenant": "acme"}).status_code == 401
    created = create(server, tenant="acme", weight=2)
    assert created.status_code == 201
    record = created.json()
    key = record.pop("key")
    assert key.startswith(record["key_prefix"]) and (record["tenant"], record["weight"]) == ("acme", 2.0)
    listed = httpx.get(f"{server.url}/admin/keys", headers=ADMIN).json()["data"]
    assert listed == [record]  # the key itself is never shown again
    rows = sqlite3.connect(server.data_dir / "registry.db").execute("SELECT * FROM api_keys").fetchall()
    assert hash_key(key) in rows[0] and not any(key in str(value) for value in rows[0])

    assert chat(server, None).status_code == 401  # now that a key exists, inference needs one
    assert chat(server, "lsk-not-a-key").status_code == 401
    assert chat(server, ADMIN["Authorization"].split()[1]).status_code == 200  # the admin token still serves
    assert chat(server, key).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'loraserve_tenant_requests_total{tenant="acme"} 1.0' in metrics

    other_weight = create(server, tenant="acme", weight=1)  # a tenant has one share of the engine
    assert other_weight.status_code == 409 and other_weight.json()["error"]["code"] == "weight"
    rotated = create(server, tenant="acme", weight=2).json()  # a second key, to rotate the first
    revoked = httpx.delete(f"{server.url}/admin/keys/{record['id']}", headers=ADMIN)
    assert revoked.json() == {"id": record["id"], "tenant": "acme", "deleted": True}
    assert chat(server, key).status_code == 401  # at once
    assert chat(server, rotated["key"]).status_code == 200
    assert httpx.delete(f"{server.url}/admin/keys/{record['id']}", headers=ADMIN).status_code == 404
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'loraserve_tenant_requests_total{tenant="acme"} 2.0' in metrics, "one tenant, whichever key"


def test_bad_key_requests_are_refused_naming_the_field(keyed_server):
    for fields, field in (
        ({"tenant": "unkeyed"}, "tenant"),
        ({"tenant": "a/b"}, "tenant"),
        ({"name": "acme"}, "tenant"),
        ({"tenant": "acme", "weight": 0}, "weight"),
        ({"tenant": "acme", "weight": 1e9}, "weight"),
        ({"tenant": "acme", "requests_per_minute": 0}, "requests_per_minute"),
        ({"tenant": "acme", "tokens_per_minute": "lots"}, "tokens_per_minute"),
        ({"tenant": "acme", "allowed_models": ["ok", "../etc"]}, "allowed_models.1"),
        ({"tenant": "acme", "priority": 1}, "priority"),
    ):
        response = create(keyed_server, **fields)
        assert response.status_code == 400 and response.json()["error"]["code"] == field, (fields, response.text)
    assert httpx.get(f"{keyed_server.url}/admin/keys", headers=ADMIN).json()["data"] == []
    for key_id in ("0", "2147483648", "abc"):
        assert httpx.delete(f"{keyed_server.url}/admin/keys/{key_id}", headers=ADMIN).status_code == 400


def test_a_key_serves_only_its_allowed_models(keyed_server):
    key = create(keyed_server, tenant="pirates", allowed_models=["pirate"]).json()["key"]
    assert chat(keyed_server, key, "pirate").status_code == 200
    for model in (MODEL, "robot"):
        refused = chat(keyed_server, key, model)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    models = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert [card["id"] for card in models["data"]] == ["pirate"]


def test_quotas_answer_429_with_retry_after(keyed_server):
    by_requests = create(keyed_server, tenant="few-requests", requests_per_minute=2).json()["key"]
    assert [chat(keyed_server, by_requests).status_code for _ in range(2)] == [200, 200]
    refused = chat(keyed_server, by_requests)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "requests_per_minute"
    assert 1 <= int(refused.headers["Retry-After"]) <= 30  # one request comes back every 30 s

    by_tokens = create(keyed_server, tenant="few-tokens", tokens_per_minute=60).json()["key"]
    spent = chat(keyed_server, by_tokens, max_tokens=64).json()["usage"]["total_tokens"]  # overdraws the bucket
    refused = chat(keyed_server, by_tokens)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tokens_per_minute"
    assert int(refused.headers["Retry-After"]) >= spent - 60  # a token a second comes back
    assert chat(keyed_server, create(keyed_server, tenant="other").json()["key"]).status_code == 200  # others go on


def test_keys_outlive_a_restart(loaded_model, tmp_path):
    for server in start_server(loaded_model, tmp_path):
        key = create(server, tenant="acme").json()["key"]
    for server in start_server(loaded_model, tmp_path):
        assert chat(server, None).status_code == 401
        assert chat(server, key).status_code == 200


def test_keys_made_or_revoked_by_another_replica_are_picked_up(tmp_path):
    url = sqlite_url(tmp_path)
    upgrade_database(url)
    here, other = (Registry(url, FileStore(tmp_path / "store")) for _ in range(2))  # two servers, one database
    tenants = Tenants(here, RegistryCalls(here), frozenset())
    tenants.load()

    async def refreshed() -> None:
        refresh = asyncio.create_task(tenants.refresh_forever(seconds=0.01))
        await asyncio.sleep(0.3)
        refresh.cancel()

    record, key = other.keys.create(KeySpec("acme"))
    assert tenants.key_of(key) is None
    asyncio.run(refreshed())
    grant = tenants.key_of(key)
    assert grant is not None and grant.tenant.name == "acme" and tenants.keys_required
    other.keys.delete(record.id)
    asyncio.run(refreshed())
    assert tenants.key_of(key) is None and tenants.keys_required  # revoking the last key leaves inference closed
    here.close()
    other.close()
