"""Bounded work per request: `n`, logprobs and stop strings are capped (flags), and n x (prompt +
max_tokens) must fit the KV pool."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from loraserve.config import SchedulerConfig
from tests.server.conftest import start_server, wait_until_idle

pytestmark = [pytest.mark.slow, pytest.mark.serial]

MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def rss_bytes() -> int:
    """This process's resident memory: the test server runs in it."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, **body}, timeout=120)


def test_n_above_the_cap_answers_400_and_costs_no_memory(server):
    before = rss_bytes()
    for n in (129, 100_000):
        response = post(server, {"n": n, "max_tokens": 1})
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "n"
        assert "at most 128 (--max-n)" in response.json()["error"]["message"]
    assert rss_bytes() - before < 64 << 20, "a refused request allocates nothing to speak of"


def test_n_completions_that_could_never_fit_the_kv_pool_answer_400_saying_so(server):
    response = post(server, {"n": 128, "max_tokens": 2000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "n" and "KV blocks" in error["message"] and "--pool-memory" in error["message"]


def test_n_at_the_cap_is_served(server):
    response = post(server, {"n": 128, "max_tokens": 1, "temperature": 1.0, "seed": 3})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 128
    wait_until_idle(server.engine)


def test_a_prompt_no_tokenization_fits_is_refused_before_tokenizing(server):
    huge = "hello world, " * 600_000  # 7.8 MB: seconds to tokenize, far past any context window
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": huge}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "prompt"
    chat = post(server, {"messages": [{"role": "user", "content": huge}]})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "messages"
    assert time.monotonic() - started < 5, "refused without tokenizing"


@pytest.fixture(scope="module")
def strict_server(loaded_model, tmp_path_factory):
    yield from start_server(
        loaded_model, tmp_path_factory.mktemp("data"), scheduler=SchedulerConfig(max_logprobs=2, max_stop=2)
    )


def test_logprobs_and_stop_strings_past_their_flags_answer_400_naming_the_field(strict_server):
    top = post(strict_server, {"logprobs": True, "top_logprobs": 3, "max_tokens": 1})
    assert top.status_code == 400 and top.json()["error"]["code"] == "top_logprobs"
    assert "at most 2 (--max-logprobs)" in top.json()["error"]["message"]
    stops = post(strict_server, {"stop": ["a", "b", "c"], "max_tokens": 1})
    assert stops.status_code == 400 and stops.json()["error"]["code"] == "stop"
    assert "at most 2 stop strings (--max-stop)" in stops.json()["error"]["message"]
    within = post(strict_server, {"logprobs": True, "top_logprobs": 2, "stop": ["a", "b"], "max_tokens": 1})
    assert within.status_code == 200, within.text
