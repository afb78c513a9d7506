"""An adapter's persona through the server on a tokenizer with Gemma 2's chat template, which raises on a system
role: the chat succeeds and its prompt holds the persona, folded into the user's turn."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.chat_templates import GEMMA2_TEMPLATE, gemma_prompt, with_template
from tests.server.conftest import RunningServer, start_server
from tests.server.test_admin_api import SAMPLES, peft_files, upload

pytestmark = pytest.mark.slow

PERSONA = "You are a pirate captain. Answer in one sentence."
QUESTION = "Where is the treasure?"


@pytest.fixture(scope="module")
def gemma2_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    """The shared model, given Gemma 2's template, serving the pirate sample with PERSONA."""
    loaded = dataclasses.replace(loaded_model, tokenizer=with_template(loaded_model.model_dir, GEMMA2_TEMPLATE))
    for server in start_server(loaded, tmp_path_factory.mktemp("data")):
        assert upload(server, "pirate", peft_files(SAMPLES / "pirate"), system_prompt=PERSONA).status_code == 201
        yield server


def chat(server: RunningServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "pirate", "messages": messages, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_a_persona_chat_on_gemma2s_template_succeeds_with_the_persona_in_its_prompt(gemma2_server):
    implicit = chat(gemma2_server, [{"role": "user", "content": QUESTION}])
    folded = gemma_prompt(gemma2_server.engine.tokenizer, ("user", f"{PERSONA}\n\n{QUESTION}"))
    assert implicit["usage"]["prompt_tokens"] == len(folded)
    # A request's own system message is folded the same way: the same prompt, so the same greedy answer.
    explicit = chat(gemma2_server, [{"role": "system", "content": PERSONA}, {"role": "user", "content": QUESTION}])
    assert explicit["usage"]["prompt_tokens"] == implicit["usage"]["prompt_tokens"]
    assert explicit["choices"][0]["message"] == implicit["choices"][0]["message"]
