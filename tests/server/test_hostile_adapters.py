"""Hostile adapter files: a JSON 422 naming the field, nothing stored, and no other request notices."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import data_snapshot
from tests.server.test_admin_api import SAMPLES, peft_files, upload

pytestmark = [pytest.mark.slow, pytest.mark.serial]

MODEL = "SmolLM2-135M-Instruct"
BACKTRACKING = r"(?=.{0,18}$)(((\w|\.)+)+)+X"  # exponential in the length of every module name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def with_config(**changes: object) -> list[tuple[str, bytes]]:
    """The pirate sample with its adapter_config.json changed (a value of None drops the field)."""
    files = dict(peft_files(SAMPLES / "pirate"))
    config = json.loads(files["adapter_config.json"])
    config.update(changes)
    files["adapter_config.json"] = json.dumps(config).encode()  # NaN and Infinity as Python writes them
    return list(files.items())


def lying_weights() -> list[tuple[str, bytes]]:
    """A safetensors header that claims a 9 GB tensor over 64 bytes of data."""
    header = json.dumps({
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
            {"dtype": "F32", "shape": [4_000_000, 576], "data_offsets": [0, 9_216_000_000]},
    }).encode()  # fmt: skip
    weights = len(header).to_bytes(8, "little") + header + bytes(64)
    return [peft_files(SAMPLES / "pirate")[0], ("adapter_model.safetensors", weights)]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (with_config(r=float("inf")), "r"),
        (with_config(r=True), "r"),
        (with_config(r=2.5), "r"),
        (with_config(lora_alpha=float("nan")), "lora_alpha"),
        (with_config(lora_alpha=1e308), "lora_alpha"),
        (with_config(lora_alpha="8"), "lora_alpha"),
        (with_config(use_rslora="yes"), "use_rslora"),
        (with_config(target_modules="(q_proj"), "target_modules"),
        (with_config(target_modules="nothing_matches"), "target_modules"),
        (with_config(target_modules=[1, 2]), "target_modules"),
        (with_config(alpha_pattern={"q_proj": "abc"}), "alpha_pattern.q_proj"),
        (with_config(rank_pattern={"q_proj": 99}), "rank_pattern.q_proj"),
        (with_config(rank_pattern={"(": 4}), "rank_pattern"),
        (with_config(rank_pattern=[1]), "rank_pattern"),
        (with_config(base_model_name_or_path=7), "base_model_name_or_path"),
        ([("adapter_config.json", b"[" * 100_000 + b"]" * 100_000), peft_files(SAMPLES / "pirate")[1]],
         "adapter_config.json"),
        (lying_weights(), "adapter_model.safetensors"),
        (with_config(target_modules=BACKTRACKING), "target_modules"),
        (with_config(rank_pattern={BACKTRACKING: 4}), "rank_pattern"),
    ],
)  # fmt: skip
def test_a_hostile_config_answers_422_naming_the_field_and_stores_nothing(server, config, field):
    before = data_snapshot(server)
    response = upload(server, "hostile", config)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == field and error["type"] == "invalid_adapter_error", error
    assert data_snapshot(server) == before


def test_a_chat_sent_while_a_backtracking_regex_is_checked_answers_at_once(server):
    upload_answer: list[httpx.Response] = []
    uploading = threading.Thread(
        target=lambda: upload_answer.append(upload(server, "backtracking", with_config(target_modules=BACKTRACKING)))
    )
    uploading.start()
    time.sleep(0.2)  # the child is matching the pattern
    started = time.monotonic()
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30)
    elapsed = time.monotonic() - started
    uploading.join(timeout=30)
    assert chat.status_code == 200
    assert elapsed < 3, f"the chat took {elapsed:.1f} s while the upload was checked"
    assert upload_answer[0].status_code == 422
    assert "did not finish matching in 1 s" in upload_answer[0].json()["error"]["message"]


def test_an_adapter_with_a_regex_that_finishes_is_served(server, tmp_path: Path):
    response = upload(server, "regex-ok", with_config(target_modules=r".*\.(q_proj|v_proj)"))
    assert response.status_code == 201, response.text
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "model": "regex-ok"}, timeout=30)
    assert chat.status_code == 200
