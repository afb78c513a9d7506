"""The admin API: uploads serve the next request, deletes drain, bad input changes nothing."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from loraserve import SamplingParams
from loraserve.resources import SAMPLE_ADAPTERS
from loraserve.server.responses import AdapterRecord, Pool
from tests.server.conftest import ADMIN, data_snapshot, start_server, wait_until_idle

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
SAMPLES = SAMPLE_ADAPTERS
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def upload(server, name: str, files: list[tuple[str, bytes]], headers=ADMIN, **fields: str) -> httpx.Response:
    parts = [("files", (filename, data)) for filename, data in files]
    # An upload is checked in a child process (adapter_sandbox.py): on a loaded 2-core machine, past httpx's 5 s.
    return httpx.post(
        f"{server.url}/admin/adapters", data={"name": name, **fields}, files=parts, headers=headers, timeout=60
    )


def peft_files(directory: Path) -> list[tuple[str, bytes]]:
    return [(name, (directory / name).read_bytes()) for name in PEFT_FILES]


def zipped(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def greedy(server, model: str, prompt: str, max_tokens: int = 16) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_peft_adapter_uploaded_as_files_and_as_zip_serves_the_next_request_like_llm_generate(
    server, peft_adapter_dir, make_llm
):
    as_files = upload(server, "fresh", peft_files(peft_adapter_dir), system_prompt="Be brief.", description="test")
    assert as_files.status_code == 201, as_files.text
    record = as_files.json()
    assert (record["name"], record["rank"], record["alpha"], record["status"]) == ("fresh", 8, 16.0, "ready")
    assert record["target_modules"] == ["q_proj", "v_proj", "up_proj"]
    assert len(record["sha256"]) == 64 and record["size_bytes"] > 0
    archive = zipped({f"adapter/{name}": data for name, data in peft_files(peft_adapter_dir)})
    as_zip = upload(server, "fresh-zip", [("fresh.zip", archive)])
    assert as_zip.status_code == 201, as_zip.text
    assert as_zip.json()["sha256"] == record["sha256"], "the same files, the same content hash"

    models = {m["id"]: m.get("parent") for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert models["fresh"] == MODEL and models["fresh-zip"] == MODEL
    offline = make_llm(max_loras=1)
    offline.add_adapter("fresh", peft_adapter_dir)
    prompt = "The best thing about mornings is"
    (expected,) = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), adapters=["fresh"])
    (base,) = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))
    assert expected.outputs[0].text != base.outputs[0].text, "the adapter must change the answer"
    assert greedy(server, "fresh", prompt) == expected.outputs[0].text
    assert greedy(server, "fresh-zip", prompt) == expected.outputs[0].text
    body = {"model": MODEL, "adapter_id": "fresh", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    by_adapter_id = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert by_adapter_id["choices"][0]["text"] == expected.outputs[0].text

    shown = httpx.get(f"{server.url}/admin/adapters/fresh", headers=ADMIN).json()
    assert shown["residency"] == "device" and shown["system_prompt"] == "Be brief."
    assert _eventually_counted(server, "fresh")
    patched = httpx.patch(f"{server.url}/admin/adapters/fresh", json={"description": "new"}, headers=ADMIN)
    assert patched.json()["description"] == "new" and patched.json()["system_prompt"] == "Be brief."
    for name in ("fresh", "fresh-zip"):
        assert httpx.delete(f"{server.url}/admin/adapters/{name}", headers=ADMIN).status_code == 200
    wait_until_idle(server.engine)
    assert not list((server.data_dir / "adapters").iterdir()), "the last user of the files deleted them"


def _eventually_counted(server, name: str) -> bool:
    """Usage is written in the background after the answer; give it a moment."""
    for _ in range(50):
        if httpx.get(f"{server.url}/admin/adapters/{name}", headers=ADMIN).json()["request_count"] >= 1:
            return True
        time.sleep(0.1)
    return False


def test_persona_system_prompt_applies_only_without_a_system_message(server):
    pirate = SAMPLES / "pirate"
    persona = "You are a pirate captain. Answer in one sentence."
    assert upload(server, "captain", peft_files(pirate), system_prompt=persona).status_code == 201
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")

    def ask(messages) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model="captain", messages=messages, max_tokens=24, temperature=0)

    question = {"role": "user", "content": "Where is the treasure?"}
    implicit = ask([question])
    explicit = ask([{"role": "system", "content": persona}, question])
    assert implicit.choices[0].message.content == explicit.choices[0].message.content
    assert implicit.usage.prompt_tokens == explicit.usage.prompt_tokens
    own = ask([{"role": "system", "content": "You are terse."}, question])
    assert own.usage.prompt_tokens != implicit.usage.prompt_tokens, "a request's own system message wins"
    httpx.delete(f"{server.url}/admin/adapters/captain", headers=ADMIN)


def counting(model: str, stream: bool = True) -> dict[str, object]:
    """A completion body that runs 48 tokens whatever the adapter says."""
    return {"model": model, "prompt": "Count to a hundred:", "max_tokens": 48, "ignore_eos": True, "stream": stream}


@contextmanager
def streaming(server, adapter: str, sample: str) -> Iterator[Iterator[str]]:
    """Upload `sample` as `adapter` and stream a counting completion for it; yields its lines past the first."""
    assert upload(server, adapter, peft_files(SAMPLES / sample)).status_code == 201
    with httpx.stream("POST", f"{server.url}/v1/completions", json=counting(adapter)) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        yield lines


def test_a_stream_running_for_a_deleted_adapter_finishes_and_new_requests_get_404(server):
    with streaming(server, "doomed", "robot") as lines:
        assert httpx.delete(f"{server.url}/admin/adapters/doomed", headers=ADMIN).status_code == 200
        after = httpx.post(f"{server.url}/v1/completions", json=counting("doomed", stream=False))
        assert after.status_code == 404
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_until_idle(server.engine)
    assert "doomed" not in server.engine.engine.adapters, "the engine let go once the stream ended"


def test_pin_keeps_an_adapter_on_the_device_and_pool_reports_it(server):
    assert upload(server, "pinned", peft_files(SAMPLES / "robot")).status_code == 201
    pinned = httpx.post(f"{server.url}/admin/adapters/pinned/pin", headers=ADMIN).json()
    assert (pinned["residency"], pinned["pinned"]) == ("device", True)
    pool = httpx.get(f"{server.url}/admin/pool", headers=ADMIN).json()
    assert [a["name"] for a in pool["device_adapters"] if a["pinned"]] == ["pinned"]
    pages = pool["pages"]
    assert pages["total"] == 512 and pool["adapter_slots"]["total"] == 8
    assert pages["adapters"] == sum(a["pages"] for a in pool["device_adapters"]) > 0, "its rows fill pool pages"
    assert pages["kv"] + pages["adapters"] + pages["free"] == 512
    assert pages["kv_capacity"] == 512 - pages["adapters"], "KV may have every page the adapters do not hold"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert f"loraserve_pool_pages_adapters {float(pages['adapters'])}" in metrics
    unpinned = httpx.post(f"{server.url}/admin/adapters/pinned/unpin", headers=ADMIN).json()
    assert unpinned["pinned"] is False
    httpx.delete(f"{server.url}/admin/adapters/pinned", headers=ADMIN)


def test_vllm_load_and_unload_routes_go_through_the_registry(server):
    loaded = httpx.post(
        f"{server.url}/v1/load_lora_adapter",
        json={"lora_name": "vl", "lora_path": str(SAMPLES / "pirate")},
        headers=ADMIN,
    )
    assert loaded.status_code == 200, loaded.text
    assert "vl" in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "vl"}, headers=ADMIN)
    assert unloaded.status_code == 200
    assert httpx.get(f"{server.url}/admin/adapters/vl", headers=ADMIN).status_code == 404


@pytest.fixture(scope="module")
def limited_server(loaded_model, tmp_path_factory):
    """Small limits, so oversize uploads and zip bombs are cheap to make."""
    yield from start_server(
        loaded_model, tmp_path_factory.mktemp("limited"), max_upload_bytes=6 << 20, max_unpacked_bytes=8 << 20
    )


def _tar_gz(members: dict[str, bytes], link: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        if link is not None:
            info = tarfile.TarInfo(link)
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            archive.addfile(info)
    return buffer.getvalue()


def _mismatched_shapes(tmp_path: Path) -> list[tuple[str, bytes]]:
    tensors = load_file(SAMPLES / "pirate" / "adapter_model.safetensors")
    first = sorted(tensors)[0]
    tensors[first] = tensors[first][:, :100].contiguous()
    save_file(tensors, tmp_path / "weights.safetensors")
    return [("adapter_config.json", (SAMPLES / "pirate" / PEFT_FILES[0]).read_bytes()),
            ("adapter_model.safetensors", (tmp_path / "weights.safetensors").read_bytes())]  # fmt: skip


def test_each_bad_upload_gets_its_status_and_a_json_error_and_changes_nothing(limited_server, tmp_path):
    server = limited_server
    good = peft_files(SAMPLES / "pirate")
    config = good[0]
    assert upload(server, "taken", good).status_code == 201
    before = data_snapshot(server)
    bomb = zipped({"adapter_config.json": config[1], "adapter_model.safetensors": bytes(64 << 20)})
    pickle = ("adapter_model.bin", b"\x80\x04not unpickled")

    def send(*files: tuple[str, bytes], name: str = "x", headers=ADMIN) -> httpx.Response:
        return upload(server, name, list(files), headers=headers)

    def replace(*files: tuple[str, bytes], name: str = "taken", headers=ADMIN) -> httpx.Response:
        parts = [("files", (file_name, data)) for file_name, data in files]
        return httpx.put(f"{server.url}/admin/adapters/{name}", files=parts, headers=headers, timeout=60)

    too_large = "payload_too_large"
    cases = {
        "no token": (lambda: send(*good, headers={}), 401, None),
        "wrong token": (lambda: send(*good, headers={"Authorization": "Bearer nope"}), 403, None),
        "duplicate name": (lambda: send(*good, name="taken"), 409, "adapter_exists"),
        "dot-dot name": (lambda: send(*good, name="../evil"), 422, "name"),
        "slash name": (lambda: send(*good, name="a/b"), 422, "name"),
        "dot-dot member": (lambda: send(("a.zip", zipped({"../" + n: d for n, d in good}))), 422, "archive"),
        "absolute member": (lambda: send(("a.tgz", _tar_gz({"/tmp/" + n: d for n, d in good}))), 422, "archive"),
        "symlink member": (lambda: send(("a.tar.gz", _tar_gz(dict(good), link="evil"))), 422, "archive"),
        "zip bomb": (lambda: send(("a.zip", bomb)), 413, too_large),
        "oversize upload": (
            lambda: send(config, ("adapter_model.safetensors", bytes(7 << 20))),
            413,
            "payload_too_large",
        ),
        "pickle weights": (lambda: send(config, pickle), 422, "adapter_model.bin"),
        "pickle in archive": (lambda: send(("a.zip", zipped(dict([config, pickle])))), 422, "adapter_model.bin"),
        "mismatched shapes": (lambda: send(*_mismatched_shapes(tmp_path)), 422, None),
        "no files": (lambda: send(), 422, "files"),
        # New weights for an adapter (PUT) pass the same checks, under the upload's size limit.
        "replace: zip bomb": (lambda: replace(("a.zip", bomb)), 413, too_large),
        "replace: oversize": (lambda: replace(config, ("adapter_model.safetensors", bytes(7 << 20))), 413, too_large),
        "replace: pickle weights": (lambda: replace(config, pickle), 422, "adapter_model.bin"),
        "replace: mismatched shapes": (lambda: replace(*_mismatched_shapes(tmp_path)), 422, None),
        "replace: no token": (lambda: replace(*good, headers={}), 401, None),
        "replace: unknown name": (lambda: replace(*good, name="ghost"), 404, "adapter_not_found"),
    }
    for case, (attempt, status, code) in cases.items():
        response = attempt()
        assert response.status_code == status, (case, response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"], case
        if code is not None:
            assert error["code"] == code, (case, error)
        assert data_snapshot(server) == before, f"{case} changed the registry or the file store"
    assert not any((server.data_dir / "uploads").iterdir()), "no upload left its scratch files"


def test_inference_errors_are_json_with_their_status(server):
    unknown = httpx.post(f"{server.url}/v1/completions", json={"model": "no-such-adapter", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    lorax_unknown = httpx.post(f"{server.url}/generate", json={"inputs": "hi", "parameters": {"adapter_id": "nope"}})
    assert lorax_unknown.status_code == 404 and lorax_unknown.json()["error"]["code"] == "adapter_not_found"
    bad_top_p = httpx.post(f"{server.url}/generate", json={"inputs": "hi", "parameters": {"top_p": 2.0}})
    assert bad_top_p.status_code == 400 and bad_top_p.json()["error"]["code"] == "parameters.top_p"
    unsupported = httpx.post(f"{server.url}/generate", json={"inputs": "hi", "parameters": {"typical_p": 0.5}})
    assert unsupported.status_code == 400 and unsupported.json()["error"]["code"] == "parameters.typical_p"
    assert httpx.get(f"{server.url}/admin/adapters/unknown", headers=ADMIN).status_code == 404
    wait_until_idle(server.engine)


def test_samples_are_registered_on_the_first_start_only(loaded_model, tmp_path):
    for running in start_server(loaded_model, tmp_path, register_samples=True):
        names = [m["id"] for m in httpx.get(f"{running.url}/v1/models").json()["data"]]
        assert names == [MODEL, "french-tutor", "pirate", "robot", "shakespeare"]
        httpx.delete(f"{running.url}/admin/adapters/robot", headers=ADMIN)
    for running in start_server(loaded_model, tmp_path, register_samples=True):
        names = [m["id"] for m in httpx.get(f"{running.url}/v1/models").json()["data"]]
        assert "robot" not in names, "a deleted sample stays deleted"
    shutil.rmtree(tmp_path)


def test_openapi_documents_what_each_route_answers_and_the_answers_match(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    plain = {"/metrics", "/health", "/ready"}  # Prometheus text, and {"status": ...}
    undocumented = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            answer = next(r for code, r in operation["responses"].items() if code.startswith("2"))
            body = answer.get("content", {}).get("application/json", {}).get("schema", {})
            if path not in plain and "$ref" not in json.dumps(body):
                undocumented.append(f"{method.upper()} {path}")
    assert undocumented == [], "routes whose answer /openapi.json does not describe"
    models = schema["components"]["schemas"]
    assert {"ChatCompletion", "Completion", "GenerateResponse", "AdapterRecord", "Pool", "KeyRecord"} <= set(models)
    assert set(models["Pool"]["properties"]) >= {"pages", "adapter_slots", "device_adapters", "host_cache"}
    # What the routes answer is what the schema says.
    model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True},
    )
    parsed = ChatCompletion.model_validate(chat.json())
    assert parsed.choices[0].logprobs is not None and len(parsed.choices[0].logprobs.content) == 4
    Pool.model_validate(httpx.get(f"{server.url}/admin/pool", headers=ADMIN).json())
    for record in httpx.get(f"{server.url}/admin/adapters", headers=ADMIN).json()["data"]:
        AdapterRecord.model_validate(record)


def scrape(server) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/metrics parsed by prometheus_client's parser: name -> [(labels, value)]."""
    text = httpx.get(f"{server.url}/metrics").text
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_metrics_carry_the_gauges_kubernetes_inference_routers_read_in_vllms_names(server):
    with streaming(server, "routed", "pirate") as lines:
        during = scrape(server)
        assert [line for line in lines if line == "data: [DONE]"]
    wait_until_idle(server.engine)
    after = scrape(server)
    assert during["vllm:num_requests_running"] == [({}, 1.0)] and during["vllm:num_requests_waiting"] == [({}, 0.0)]
    ((_, usage),) = during["vllm:kv_cache_usage_perc"]
    assert 0 < usage <= 1 and during["vllm:gpu_cache_usage_perc"] == [({}, usage)]
    ((labels, stamp),) = during["vllm:lora_requests_info"]
    assert labels == {"max_lora": "8", "running_lora_adapters": "routed", "waiting_lora_adapters": ""}
    assert abs(stamp - time.time()) < 60, "the value is when the label set was read: routers take the newest"
    assert after["vllm:num_requests_running"] == [({}, 0.0)]
    assert after["vllm:lora_requests_info"][0][0]["running_lora_adapters"] == ""
