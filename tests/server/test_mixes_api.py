"""merged_adapters over HTTP: LoRAX's `parameters.merged_adapters` and the OpenAI routes' extension field
answer what the engine's mix answers offline, and a mix that cannot be made is a 4xx naming the field."""

from __future__ import annotations

import httpx
import pytest

from loraserve import SamplingParams
from loraserve.lora.mix_spec import MixSpec
from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MIX = {"ids": ["pirate", "robot"], "weights": [0.7, 0.5], "merge_strategy": "ties", "density": 0.7}
PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def mixing_server(server):
    for name in MIX["ids"]:
        body = {"lora_name": name, "lora_path": str(SAMPLE_ADAPTERS / name)}
        loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=ADMIN)
        assert loaded.status_code == 200, loaded.text
    return server


def test_both_apis_serve_a_mix_as_the_engine_mixes_it(mixing_server, make_llm):
    offline = make_llm(max_loras=2)
    for name in MIX["ids"]:
        offline.add_adapter(name, SAMPLE_ADAPTERS / name)
    mix = offline.engine.mix_adapters(MixSpec.parse(MIX, max_parts=4))
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    expected, plain = offline.generate([PROMPT, PROMPT], greedy, adapters=[mix, "pirate"], use_tqdm=False)
    assert expected.outputs[0].token_ids != plain.outputs[0].token_ids

    url = mixing_server.url
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "merged_adapters": MIX}
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == expected.outputs[0].text
    parameters = {"merged_adapters": MIX, "max_new_tokens": 10, "details": True}
    generated = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": parameters}, timeout=60)
    assert generated.status_code == 200, generated.text
    assert [t["id"] for t in generated.json()["details"]["tokens"]] == expected.outputs[0].token_ids


@pytest.mark.parametrize(
    ("route", "body", "status", "code"),
    [
        ("/v1/completions", {"model": "pirate", "merged_adapters": MIX}, 400, "merged_adapters"),
        ("/v1/completions", {"merged_adapters": {**MIX, "ids": ["pirate", "ghost"]}}, 404, "merged_adapters.ids"),
        ("/v1/completions", {"merged_adapters": {**MIX, "weights": [1]}}, 400, "merged_adapters.weights"),
        ("/v1/completions", {"merged_adapters": "pirate"}, 400, "merged_adapters"),
        ("/generate", {"merged_adapters": {**MIX, "merge_strategy": "svd"}}, 400,
         "parameters.merged_adapters.merge_strategy"),
        ("/generate", {"merged_adapters": {**MIX, "ids": ["ghost"], "weights": [1]}}, 404,
         "parameters.merged_adapters.ids"),
        ("/generate", {"adapter_id": "robot", "merged_adapters": MIX}, 400, "parameters.merged_adapters"),
    ],
)  # fmt: skip
def test_a_mix_that_cannot_be_made_is_refused_naming_the_field(mixing_server, route, body, status, code):
    if route == "/generate":
        request = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, **body}}
    else:
        request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body}
    response = httpx.post(f"{mixing_server.url}{route}", json=request, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    if status == 404:  # an unknown adapter's code, the field in the message
        assert error["code"] == "adapter_not_found" and error["message"].startswith(f"{code}: "), error
    else:
        assert error["code"] == code, error
