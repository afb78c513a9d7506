"""Adapter versions: new weights under a served name (PUT, or vLLM's load_inplace) while a stream runs finish that
stream on the old weights and serve the new ones next, with the prefix cache on; every version is listed and any may
be served again (rollback)."""

from __future__ import annotations

import json

import httpx
import pytest

from loraserve import SamplingParams
from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Tell me about the sea and the ships that sail on it, in many words."
FILES = ("adapter_config.json", "adapter_model.safetensors")


def files_of(sample: str) -> list[tuple[str, tuple[str, bytes]]]:
    return [(name, (name, (SAMPLE_ADAPTERS / sample / name).read_bytes())) for name in FILES]


def completion(url: str, max_tokens: int) -> dict:
    body = {"model": "persona", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def offline(make_llm):
    """What pirate and robot answer, computed apart from the server."""
    llm = make_llm(max_loras=2)
    for sample in ("pirate", "robot"):
        llm.add_adapter(sample, SAMPLE_ADAPTERS / sample)
    greedy = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    outputs = llm.generate([PROMPT, PROMPT], greedy, adapters=["pirate", "robot"], use_tqdm=False)
    return {sample: output.outputs[0].text for sample, output in zip(("pirate", "robot"), outputs, strict=True)}


def test_a_replacement_mid_stream_finishes_the_stream_on_the_old_weights_then_serves_the_new(server, offline):
    url = server.url
    created = httpx.post(f"{url}/admin/adapters", data={"name": "persona"}, files=files_of("pirate"), headers=ADMIN)
    assert created.status_code == 201, created.text
    first_sha = created.json()["sha256"]
    assert (
        completion(url, 8)["choices"][0]["text"] == offline["pirate"][: len(completion(url, 8)["choices"][0]["text"])]
    )

    body = {
        "model": "persona",
        "prompt": PROMPT,
        "max_tokens": 160,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces = []
    with httpx.Client(timeout=120) as client, client.stream("POST", f"{url}/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
                break
        replaced = httpx.put(f"{url}/admin/adapters/persona", files=files_of("robot"), headers=ADMIN, timeout=120)
        assert replaced.status_code == 200, replaced.text
        assert server.engine.engine.adapters.record("persona@1") is not None, "the stream was still running"
        for line in lines:
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(pieces) == offline["pirate"], "the stream ended on the weights it started with"

    new = completion(url, 48)  # shorter answers than the stream's: a prefix of what the adapter says at length
    assert offline["robot"].startswith(new["choices"][0]["text"])
    assert new["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "no block of the old version is reused"
    assert completion(url, 48)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the new one's own blocks are"

    record = httpx.get(f"{url}/admin/adapters/persona", headers=ADMIN).json()
    versions = record["versions"]
    assert [v["sha256"] for v in versions] == [first_sha, replaced.json()["sha256"]] and record["sha256"] == versions[
        1
    ]["sha256"]
    assert [v["current"] for v in versions] == [False, True]
    assert all(v["uploaded_by"].startswith("admin-") and v["uploaded_by"][6:] not in str(ADMIN) for v in versions)

    back = httpx.post(f"{url}/admin/adapters/persona/rollback", json={"sha256": first_sha}, headers=ADMIN)
    assert back.status_code == 200 and back.json()["sha256"] == first_sha, back.text
    assert offline["pirate"].startswith(completion(url, 48)["choices"][0]["text"])

    # vLLM's load_inplace replaces too; without it the name is taken.
    load = {"lora_name": "persona", "lora_path": str(SAMPLE_ADAPTERS / "robot")}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=ADMIN).status_code == 409
    inplace = httpx.post(f"{url}/v1/load_lora_adapter", json={**load, "load_inplace": True}, headers=ADMIN)
    assert inplace.status_code == 200 and inplace.json()["sha256"] == versions[1]["sha256"], inplace.text
    assert offline["robot"].startswith(completion(url, 48)["choices"][0]["text"])


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "code"),
    [
        ("post", "/admin/adapters/ghost/rollback", {"json": {"sha256": "0" * 64}}, 404, "adapter_not_found"),
        ("post", "/admin/adapters/robot-v/rollback", {"json": {"sha256": "0" * 64}}, 404, "version_not_found"),
        ("post", "/admin/adapters/robot-v/rollback", {"json": {}}, 400, None),
        ("put", "/admin/adapters/ghost", {"files": "robot"}, 404, "adapter_not_found"),
        ("put", "/admin/adapters/robot-v", {"files": "robot", "data": {"name": "other"}}, 422, "name"),
    ],
)  # fmt: skip
def test_versions_refuse_what_they_cannot_do(server, method, path, kwargs, status, code):
    url = server.url
    if httpx.get(f"{url}/admin/adapters/robot-v", headers=ADMIN).status_code == 404:
        httpx.post(f"{url}/admin/adapters", data={"name": "robot-v"}, files=files_of("robot"), headers=ADMIN)
    if "files" in kwargs:
        kwargs = {**kwargs, "files": files_of(kwargs["files"])}
    response = getattr(httpx, method)(f"{url}{path}", headers=ADMIN, timeout=60, **kwargs)
    assert response.status_code == status, response.text
    if code is not None:
        assert response.json()["error"]["code"] == code
    assert httpx.put(f"{url}/admin/adapters/robot-v", files=files_of("robot")).status_code == 401, "admin token needed"
