"""A restart on the same data serves what was there; a stored file altered on disk fails only its adapter."""

from __future__ import annotations

import httpx
import pytest

from loraserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from loraserve.engine import LLMEngine
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.errors import RegistryError
from loraserve.resources import SAMPLE_ADAPTERS
from loraserve.server.app import create_app
from tests.server.conftest import ADMIN, start_server
from tests.server.test_admin_api import greedy, peft_files, upload

pytestmark = pytest.mark.slow

SAMPLES = SAMPLE_ADAPTERS
MODEL = "SmolLM2-135M-Instruct"


def test_restart_keeps_adapters_and_a_tampered_one_is_failed_with_a_reason(loaded_model, tmp_path):
    prompt = "Tell me about the weather."
    answers = {}
    for running in start_server(loaded_model, tmp_path):
        for name in ("pirate", "robot"):
            assert upload(running, name, peft_files(SAMPLES / name), description=f"the {name}").status_code == 201
            answers[name] = greedy(running, name, prompt)
    for running in start_server(loaded_model, tmp_path):
        records = httpx.get(f"{running.url}/admin/adapters", headers=ADMIN).json()["data"]
        assert [(r["name"], r["status"], r["description"]) for r in records] == [
            ("pirate", "ready", "the pirate"),
            ("robot", "ready", "the robot"),
        ]
        assert {name: greedy(running, name, prompt) for name in answers} == answers
        robot_sha = records[1]["sha256"]
    weights = tmp_path / "adapters" / robot_sha / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of one weight
    weights.write_bytes(bytes(data))
    for running in start_server(loaded_model, tmp_path):
        robot = httpx.get(f"{running.url}/admin/adapters/robot", headers=ADMIN).json()
        assert robot["status"] == "failed" and "changed on disk" in robot["status_reason"]
        assert robot["residency"] == "disk"
        served = [m["id"] for m in httpx.get(f"{running.url}/v1/models").json()["data"]]
        assert "robot" not in served and "pirate" in served
        assert greedy(running, "pirate", prompt) == answers["pirate"]
        refused = httpx.post(f"{running.url}/v1/completions", json={"model": "robot", "prompt": prompt})
        assert refused.status_code == 404


def test_server_refuses_to_start_on_a_database_it_cannot_migrate(loaded_model, tmp_path):
    config = EngineConfig(model=ModelConfig(dtype="float32"), cache=CacheConfig(num_pages=64))
    engine = AsyncLLMEngine(LLMEngine(config, loaded=loaded_model))
    unreachable = "postgresql://nobody@127.0.0.1:9/none"
    with pytest.raises(RegistryError, match=r"postgresql://nobody@127\.0\.0\.1:9/none"):
        create_app(engine, ServerConfig(data_dir=tmp_path, db_url=unreachable, admin_token="x" * 16))


def test_an_adapter_whose_files_change_while_serving_fails_with_a_503_and_is_marked_failed(loaded_model, tmp_path):
    for running in start_server(loaded_model, tmp_path, max_loras=1):
        assert upload(running, "robot", peft_files(SAMPLES / "robot")).status_code == 201
        sha = httpx.get(f"{running.url}/admin/adapters/robot", headers=ADMIN).json()["sha256"]
        running.engine.engine.adapters.host.drop("robot")  # as if the host cache had let it go
        weights = tmp_path / "adapters" / sha / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")
        refused = httpx.post(f"{running.url}/v1/completions", json={"model": "robot", "prompt": "Hi", "max_tokens": 4})
        assert refused.status_code == 503 and "changed on disk" in refused.json()["error"]["message"]
        record = httpx.get(f"{running.url}/admin/adapters/robot", headers=ADMIN).json()
        assert record["status"] == "failed" and "changed on disk" in record["status_reason"]
        assert "robot" not in [m["id"] for m in httpx.get(f"{running.url}/v1/models").json()["data"]]
        ok = httpx.post(f"{running.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4})
        assert ok.status_code == 200, "the server serves on"
