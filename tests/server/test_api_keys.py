"""Tenants' API keys through the admin API: shown once, stored hashed, required once any exists,
limited to their models, held to their quotas (429 with Retry-After), revoked at once, kept over
a restart; each tenant's use in the metrics under its name."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator

import httpx
import pytest

from loraserve.registry import hash_key
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
    assert httpx.post(f"{server.url}/admin/keys", json={"name": "acme"}).status_code == 401
    created = create(server, name="acme", weight=2)
    assert created.status_code == 201
    record = created.json()
    key = record.pop("key")
    assert key.startswith(record["key_prefix"]) and record["weight"] == 2.0
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

    assert create(server, name="acme").json()["error"]["code"] == "api_key_exists"
    assert create(server, name="beta").status_code == 201  # while any key exists, unknown ones are refused
    revoked = httpx.delete(f"{server.url}/admin/keys/acme", headers=ADMIN)
    assert revoked.json() == {"name": "acme", "deleted": True}
    assert chat(server, key).status_code == 401  # at once
    assert httpx.delete(f"{server.url}/admin/keys/acme", headers=ADMIN).status_code == 404


def test_bad_key_requests_are_refused_naming_the_field(keyed_server):
    for fields, field in (
        ({"name": "unkeyed"}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": "acme", "weight": 0}, "weight"),
        ({"name": "acme", "weight": 1e9}, "weight"),
        ({"name": "acme", "requests_per_minute": 0}, "requests_per_minute"),
        ({"name": "acme", "tokens_per_minute": "lots"}, "tokens_per_minute"),
        ({"name": "acme", "allowed_models": ["ok", "../etc"]}, "allowed_models.1"),
        ({"name": "acme", "priority": 1}, "priority"),
    ):
        response = create(keyed_server, **fields)
        assert response.status_code == 400 and response.json()["error"]["code"] == field, (fields, response.text)
    assert httpx.get(f"{keyed_server.url}/admin/keys", headers=ADMIN).json()["data"] == []


def test_a_key_serves_only_its_allowed_models(keyed_server):
    key = create(keyed_server, name="pirates", allowed_models=["pirate"]).json()["key"]
    assert chat(keyed_server, key, "pirate").status_code == 200
    for model in (MODEL, "robot"):
        refused = chat(keyed_server, key, model)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    models = httpx.get(f"{keyed_server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()
    assert [card["id"] for card in models["data"]] == ["pirate"]


def test_quotas_answer_429_with_retry_after(keyed_server):
    by_requests = create(keyed_server, name="few-requests", requests_per_minute=2).json()["key"]
    assert [chat(keyed_server, by_requests).status_code for _ in range(2)] == [200, 200]
    refused = chat(keyed_server, by_requests)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "requests_per_minute"
    assert 1 <= int(refused.headers["Retry-After"]) <= 30  # one request comes back every 30 s

    by_tokens = create(keyed_server, name="few-tokens", tokens_per_minute=60).json()["key"]
    spent = chat(keyed_server, by_tokens, max_tokens=64).json()["usage"]["total_tokens"]  # overdraws the bucket
    refused = chat(keyed_server, by_tokens)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "tokens_per_minute"
    assert int(refused.headers["Retry-After"]) >= spent - 60  # a token a second comes back
    assert chat(keyed_server, create(keyed_server, name="other").json()["key"]).status_code == 200  # others go on


def test_keys_outlive_a_restart(loaded_model, tmp_path):
    for server in start_server(loaded_model, tmp_path):
        key = create(server, name="acme").json()["key"]
    for server in start_server(loaded_model, tmp_path):
        assert chat(server, None).status_code == 401
        assert chat(server, key).status_code == 200
