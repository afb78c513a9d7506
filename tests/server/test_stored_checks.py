"""Adapters stored before uploads were checked in a child process are checked there at start, once, the verdict
recorded: hostile files fail their adapter with the reason, the server starts and serves the others, a restart checks
nothing again."""

from __future__ import annotations

import json
import logging
import pickle
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from benchmarks.stored_checks import store_unchecked
from loraserve.file_digest import sha256_of_files
from loraserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from loraserve.registry import sqlite_url
from loraserve.registry.database import create_registry_engine
from loraserve.registry.models import AdapterVersionRow
from tests.postgres_databases import empty_database, postgres_admin_url
from tests.server.conftest import ADMIN, RunningServer, start_server
from tests.server.test_admin_api import SAMPLES, greedy
from tests.server.test_hostile_adapters import BACKTRACKING, lying_weights

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHECKS_SECONDS = 120  # the fork server's start (it imports torch) and a 1 s pattern limit, on a loaded 2-core machine
GOOD = ("pirate", "pirate-twin", "robot")  # the twin: the pirate's content under another name, checked once for both


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "data")
        return
    with empty_database(postgres_admin_url()) as url:
        yield url


def peft_dir(path: Path, config: bytes, weights: bytes) -> Path:
    path.mkdir()
    (path / CONFIG_FILE).write_bytes(config)
    (path / WEIGHTS_FILE).write_bytes(weights)
    return path


def hostile_adapters(directory: Path) -> dict[str, Path]:
    """Files no upload would have let in: a safetensors header claiming a 9 GB tensor, a pickle named as safetensors,
    a config whose regex backtracks for hours over the base model's module names."""
    config, weights = ((SAMPLES / "pirate" / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE))
    backtracking = json.dumps({**json.loads(config), "target_modules": BACKTRACKING}).encode()
    return {
        "huge": peft_dir(directory / "huge", config, dict(lying_weights())[WEIGHTS_FILE]),
        "pickled": peft_dir(directory / "pickled", config, pickle.dumps({"lora_A": [0.0] * 64})),
        "backtracking": peft_dir(directory / "backtracking", backtracking, weights),
    }


def checked_at(url: str) -> dict[str, object]:
    """sha256 -> when its versions were checked (None: never)."""
    engine = create_registry_engine(url)
    try:
        with engine.connect() as connection:
            return dict(connection.execute(select(AdapterVersionRow.sha256, AdapterVersionRow.checked_at)).all())
    finally:
        engine.dispose()


def records(server: RunningServer) -> dict[str, dict[str, object]]:
    return {r["name"]: r for r in httpx.get(f"{server.url}/admin/adapters", headers=ADMIN).json()["data"]}


def served(server: RunningServer) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]} - {MODEL}


def settled(server: RunningServer) -> bool:
    """Every check at start done: the sound adapters served, the others failed."""
    others = {r["status"] for name, r in records(server).items() if name not in GOOD}
    return served(server) == set(GOOD) and others == {"failed"}


def test_stored_adapters_are_checked_once_at_start_and_hostile_ones_fail_while_the_others_serve(
    loaded_model, tmp_path, db_url, caplog
):
    data_dir = tmp_path / "data"
    adapters = {"pirate": SAMPLES / "pirate", "pirate-twin": SAMPLES / "pirate", "robot": SAMPLES / "robot"}
    hashes = store_unchecked(db_url, data_dir / "adapters", [*adapters.items(), *hostile_adapters(tmp_path).items()])
    caplog.set_level(logging.INFO, logger="loraserve.server.stored_checks")

    for server in start_server(loaded_model, data_dir, db_url=db_url):
        # Up before its checks ended: this one's takes a second at least (its pattern's time limit).
        waiting = httpx.post(f"{server.url}/v1/completions", json={"model": "backtracking", "prompt": "Hi"})
        assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "unavailable", waiting.text
        assert httpx.get(f"{server.url}/health").status_code == 200
        deadline = time.monotonic() + CHECKS_SECONDS
        while not settled(server):
            assert time.monotonic() < deadline, (served(server), records(server))
            time.sleep(0.2)
        failed = {name: r["status_reason"] for name, r in records(server).items() if r["status"] == "failed"}
        assert failed.keys() == {"huge", "pickled", "backtracking"}
        assert all(reason.startswith("its stored files failed the check: ") for reason in failed.values())
        assert "adapter_model.safetensors" in failed["huge"] and "adapter_model.safetensors" in failed["pickled"]
        assert "target_modules" in failed["backtracking"] and "did not finish matching" in failed["backtracking"]
        assert greedy(server, "pirate-twin", "Hello") == greedy(server, "pirate", "Hello")
        refused = httpx.post(f"{server.url}/v1/completions", json={"model": "huge", "prompt": "Hi"})
        assert refused.status_code == 404
    first = checked_at(db_url)
    assert None not in first.values() and first.keys() == set(hashes.values())
    assert "5 stored adapter contents (adapters: 6) have no recorded check" in caplog.text  # the twins: one check

    caplog.clear()
    for server in start_server(loaded_model, data_dir, db_url=db_url):
        assert served(server) == set(GOOD)  # at once: nothing waits for a check
        assert settled(server)
    assert checked_at(db_url) == first
    assert "no recorded check" not in caplog.text


def test_a_rollback_to_an_older_version_whose_check_refused_it_answers_422(loaded_model, tmp_path):
    data_dir = tmp_path / "data"
    hostile = hostile_adapters(tmp_path)["huge"]
    store_unchecked(sqlite_url(data_dir), data_dir / "adapters", [("pirate", hostile), ("pirate", SAMPLES / "pirate")])
    old = sha256_of_files(hostile / CONFIG_FILE, hostile / WEIGHTS_FILE)
    for server in start_server(loaded_model, data_dir):
        deadline = time.monotonic() + CHECKS_SECONDS
        while None in checked_at(sqlite_url(data_dir)).values():  # the older version is checked last
            assert time.monotonic() < deadline
            time.sleep(0.2)
        rollback = httpx.post(f"{server.url}/admin/adapters/pirate/rollback", json={"sha256": old}, headers=ADMIN)
        assert rollback.status_code == 422 and rollback.json()["error"]["code"] == "sha256", rollback.text
        assert "its stored files failed the check" in rollback.json()["error"]["message"]
        assert records(server)["pirate"]["status"] == "ready" and served(server) == {"pirate"}
