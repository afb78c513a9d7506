"""`loraserve cluster` on a local Ray instance: an ingress and 2 engine replicas of the embedded model (1 CPU each,
small pools) over the PostgreSQL at 127.0.0.1:5432, driven through the ingress as clients drive one server.
Skipped, saying why, when Ray cannot start or no PostgreSQL answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import expect
from prometheus_client.parser import text_string_to_metric_families

from loraserve import SamplingParams
from loraserve.resources import SAMPLE_ADAPTERS
from loraserve.server.tenants import REFRESH_SECONDS
from tests.postgres_databases import empty_database, postgres_admin_url
from tests.server.conftest import ADMIN, ADMIN_TOKEN, free_port
from tests.server.test_admin_api import peft_files, upload, zipped

pytest.importorskip("ray", reason="loraserve cluster needs Ray Serve: pip install 'loraserve[ray]'")

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.postgres, pytest.mark.timeout(600)]

SAMPLES = ("pirate", "robot", "shakespeare", "french-tutor")
FOLLOW_SECONDS = 30  # registry notes arrive in milliseconds, board posts every 2 s; a replica starts in ~15 s
START_SECONDS = 180


@dataclass
class Cluster:
    url: str


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """`loraserve cluster` in a process of its own, as an operator starts it (Ray in the test process would leave
    an event loop behind for the tests after these)."""
    tmp = tmp_path_factory.mktemp("cluster")
    port = free_port()
    with empty_database(postgres_admin_url()) as db_url, (tmp / "cluster.log").open("w+") as log:
        command = [
            sys.executable, "-m", "loraserve.cli", "cluster", "--replicas", "2", "--replica-cpus", "1",
            "--db", db_url, "--admin-token", ADMIN_TOKEN, "--port", str(port), "--data-dir", str(tmp / "node-disk"),
            "--dtype", "float32", "--max-loras", "4", "--max-lora-rank", "16", "--num-pages", "512",
            "--max-num-seqs", "8",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        cluster = Cluster(f"http://127.0.0.1:{port}")
        try:
            deadline = time.monotonic() + START_SECONDS
            while not replicas_up(cluster, 2):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    output = log.read()
                    if "Ray could not start" in output:
                        print(output)
                        pytest.skip(f"Ray cannot start: {output.strip().splitlines()[-1]}")
                    pytest.fail(f"the cluster did not come up within {START_SECONDS} s:\n{output[-4000:]}")
                time.sleep(1)
            yield cluster
        finally:
            process.send_signal(signal.SIGTERM)  # serve.delete, ray.shutdown
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def replicas_up(cluster: Cluster, count: int) -> bool:
    try:
        response = httpx.get(f"{cluster.url}/admin/pool", headers=ADMIN)
    except httpx.HTTPError:
        return False
    # Until the application is deployed, Serve's proxy answers every path itself, in plain text.
    return response.status_code == 200 and len(response.json()["replicas"]) == count


def pids_titled(title: str) -> list[int]:
    """Processes whose command line holds `title` (Ray names its workers after their actor)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if title in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
    return found


def eventually(check: Callable[[], bool], what: str, seconds: float = FOLLOW_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.2)


def pool(cluster: Cluster) -> list[dict]:
    return httpx.get(f"{cluster.url}/admin/pool", headers=ADMIN).json()["replicas"]


def complete(cluster: Cluster, model: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=120)


def offline_greedy(make_llm, adapter: str | None, path: Path | None, prompt: str, max_tokens: int = 12) -> str:
    llm = make_llm(max_loras=1)
    if adapter is not None:
        llm.add_adapter(adapter, path)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    (output,) = llm.generate(prompt, params, adapters=[adapter], use_tqdm=False)
    return output.outputs[0].text


def test_uploads_as_files_and_archive_serve_through_the_ingress_like_llm_generate(cluster, peft_adapter_dir, make_llm):
    as_files = upload(cluster, "fresh", peft_files(peft_adapter_dir), description="test")
    assert as_files.status_code == 201, as_files.text
    archive = zipped({f"adapter/{name}": data for name, data in peft_files(peft_adapter_dir)})
    as_zip = upload(cluster, "fresh-zip", [("fresh.zip", archive)])
    assert as_zip.status_code == 201, as_zip.text
    eventually(lambda: len(httpx.get(f"{cluster.url}/v1/models").json()["data"]) == 1 + len(SAMPLES) + 2, "listed")

    prompt = "The best thing about mornings is"
    expected = offline_greedy(make_llm, "fresh", peft_adapter_dir, prompt)
    for name in ("fresh", "fresh-zip"):  # whichever replica answers, it has the files (from the database)
        for _ in range(3):
            answer = complete(cluster, name, prompt)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == expected
    shown = httpx.get(f"{cluster.url}/admin/adapters/fresh", headers=ADMIN).json()
    eventually(
        lambda: httpx.get(f"{cluster.url}/admin/adapters/fresh", headers=ADMIN).json()["replicas"],
        "the record names the replica holding it",
    )
    assert shown["name"] == "fresh" and shown["sha256"] == as_zip.json()["sha256"]
    refused = upload(cluster, "fresh", peft_files(peft_adapter_dir))
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_exists", refused.text


def test_openai_and_lorax_clients_for_several_adapters_at_once(cluster, lorax_python, make_llm):
    prompt = "Tell me about the sea."
    answers: dict[str, str] = {}

    def ask(adapter: str) -> None:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120)
        chat = client.chat.completions.create(
            model=adapter, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
        )
        answers[adapter] = chat.choices[0].message.content or ""

    threads = [threading.Thread(target=ask, args=(adapter,)) for adapter in (*SAMPLES, *SAMPLES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert set(answers) == set(SAMPLES) and all(answers.values()), answers
    assert len(set(answers.values())) > 1, "each persona answers in its own words"

    script = Path(__file__).parents[1] / "server" / "lorax_client_script.py"
    run = subprocess.run(
        [str(lorax_python), str(script), cluster.url, "pirate", "Arr, the sea is", "12"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    expected = offline_greedy(make_llm, "pirate", SAMPLE_ADAPTERS / "pirate", "Arr, the sea is")
    assert result["generated_text"] == expected
    assert "".join(result["stream_texts"]) == expected == result["stream_final"]


def test_routing_keeps_an_adapter_on_the_replica_that_holds_it(cluster):
    assert upload(cluster, "affine", peft_files(SAMPLE_ADAPTERS / "robot")).status_code == 201
    assert complete(cluster, "affine", "Beep", max_tokens=2).status_code == 200, "served at once, by any replica"
    time.sleep(1)  # Serve's routers learn which replica loaded it
    for _ in range(6):
        assert complete(cluster, "affine", "Beep", max_tokens=2).status_code == 200
    time.sleep(3)  # the board's next posts
    holding = [p for p in pool(cluster) if any(a["name"] == "affine" for a in p["device_adapters"])]
    assert len(holding) == 1, "the later requests for the adapter went to the replica that already held it"


def stream_lines(cluster: Cluster, model: str, max_tokens: int) -> Iterator[str]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        yield from (line for line in response.iter_lines() if line)


def test_a_stream_running_while_its_adapter_is_deleted_finishes_and_then_it_is_gone_everywhere(cluster, tmp_path):
    assert upload(cluster, "doomed", peft_files(SAMPLE_ADAPTERS / "robot")).status_code == 201
    assert complete(cluster, "doomed", "Hi", 1).status_code == 200
    lines = stream_lines(cluster, "doomed", max_tokens=48)
    first = next(lines)
    assert first.startswith("data: {")
    assert httpx.delete(f"{cluster.url}/admin/adapters/doomed", headers=ADMIN).status_code == 200
    rest = list(lines)
    assert rest[-1] == "data: [DONE]" and len(rest) > 10, "the running stream finished on the old adapter"
    eventually(lambda: complete(cluster, "doomed", "Hi", 1).status_code == 404, "no replica serves it any more")


def test_a_client_leaving_a_stream_aborts_its_request_on_the_replica(cluster):
    lines = stream_lines(cluster, "pirate", max_tokens=2000)
    assert next(lines).startswith("data: {")
    eventually(lambda: any("pirate" in r["running_adapters"] for r in pool(cluster)), "running", seconds=5)
    lines.close()  # the client goes away, a minute of tokens before the end
    eventually(lambda: not any(r["running_sequences"] for r in pool(cluster)), "aborted on the replica", seconds=10)


def test_a_body_past_the_limit_is_refused_at_the_ingress_before_it_is_read_whole(cluster):
    too_big = b"{" + b" " * (8 << 20) + b"}"  # --max-body-bytes: 8 MiB

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield from (too_big[i : i + (1 << 20)] for i in range(0, len(too_big), 1 << 20))

    for content in (too_big, chunked()):
        refused = httpx.post(f"{cluster.url}/v1/completions", content=content, timeout=60)
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "payload_too_large", refused.text


def test_a_pin_reaches_every_replica(cluster):
    pinned = httpx.post(f"{cluster.url}/admin/adapters/shakespeare/pin", headers=ADMIN)
    assert pinned.status_code == 200, pinned.text

    def pinned_on_every_replica() -> bool:
        return all(
            any(a["name"] == "shakespeare" and a["pinned"] for a in replica["device_adapters"])
            for replica in pool(cluster)
        )

    try:
        eventually(pinned_on_every_replica, "shakespeare pinned on both replicas")
    except AssertionError as error:
        held = [(r["replica"], [(a["name"], a["pinned"]) for a in r["device_adapters"]]) for r in pool(cluster)]
        raise AssertionError(f"{error}; on the device now: {held}") from None
    assert httpx.post(f"{cluster.url}/admin/adapters/shakespeare/unpin", headers=ADMIN).status_code == 200


def test_cluster_views_label_each_replica(cluster):
    assert httpx.get(f"{cluster.url}/admin/pool").status_code == 401
    replicas = pool(cluster)
    assert len({r["replica"] for r in replicas}) == 2 and all("adapter_slots" in r for r in replicas)
    text = httpx.get(f"{cluster.url}/metrics").text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert {s.labels["replica"] for s in families[name].samples} == {r["replica"] for r in replicas}
    (info,) = {s.labels["max_lora"] for s in families["vllm:lora_requests_info"].samples}
    assert info == "4"


def test_the_admin_page_shows_the_replicas(cluster, browser):
    context = browser.new_context()
    page = context.new_page()
    page.goto(f"{cluster.url}/admin/ui/")
    page.get_by_label("Admin token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("button", name="Live").click()
    expect(page.locator("#replica-list li")).to_have_count(2)
    expect(page.locator("#slot-text")).to_contain_text("of 8 slots used")  # 4 on each replica
    context.close()


@contextlib.contextmanager
def keys_for(cluster: Cluster, *specs: dict) -> Iterator[list[str]]:
    """Keys made through the ingress, taken by every replica; inference opened again after (the mode is the
    registry's, and the tests after these send no key)."""
    keys = [httpx.post(f"{cluster.url}/admin/keys", json=spec, headers=ADMIN).json()["key"] for spec in specs]
    try:
        time.sleep(5 * REFRESH_SECONDS)  # each replica reads the keys every REFRESH_SECONDS (asking would spend quota)
        yield keys
    finally:
        assert httpx.put(f"{cluster.url}/admin/auth", json={"mode": "open"}, headers=ADMIN).status_code == 200
        time.sleep(5 * REFRESH_SECONDS)  # the other replica reads the mode as it reads the keys


def infer(cluster: Cluster, key: str) -> int:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count:", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=120).status_code


def test_a_keys_requests_per_minute_hold_across_both_replicas(cluster):
    with keys_for(cluster, {"tenant": "metered", "requests_per_minute": 60}) as (key,):
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool_:
            statuses = list(pool_.map(lambda _: infer(cluster, key), range(150)))
        elapsed = time.monotonic() - started
    served, refused = statuses.count(200), statuses.count(429)
    allowance = 60 + elapsed  # a minute's burst, then one a second
    assert served + refused == 150, statuses
    assert abs(served - allowance) <= 0.1 * 60, f"{served} served in {elapsed:.1f} s; each replica counting alone: ~120"


def test_two_flooding_tenants_share_the_cluster_by_their_weights(cluster):
    """16 running places (8 a replica); each tenant keeps 24 requests in flight through the ingress until 400 ended,
    each to its own adapter, so that routing by adapter may put each tenant on a replica of its own (where each
    replica alone would serve its one tenant as fast as it can: 1:1)."""
    with keys_for(cluster, {"tenant": "heavy", "weight": 2}, {"tenant": "light", "weight": 1}) as keys:
        askers = {"heavy": (keys[0], "pirate"), "light": (keys[1], "robot")}
        with ThreadPoolExecutor(1) as thread:  # a loop of its own: the page test leaves one running in this thread
            tokens = thread.submit(asyncio.run, flood(cluster, askers, num_requests=400)).result()
    assert 1.8 <= tokens["heavy"] / tokens["light"] <= 2.2, tokens


async def flood(
    cluster: Cluster, askers: dict[str, tuple[str, str]], num_requests: int, per_tenant: int = 24
) -> dict[str, int]:
    """The tokens each tenant (its key, the model it asks) was served by the first `num_requests` requests to end."""
    tokens, ended = dict.fromkeys(askers, 0), asyncio.Event()

    async def keep_asking(client: httpx.AsyncClient, tenant: str) -> None:
        nonlocal num_requests
        key, model = askers[tenant]
        headers = {"Authorization": f"Bearer {key}"}
        body = {"model": model, "prompt": "Count:", "max_tokens": 2, "ignore_eos": True}
        while num_requests > 0:
            answer = await client.post(f"{cluster.url}/v1/completions", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            if num_requests > 0:
                num_requests -= 1
                tokens[tenant] += answer.json()["usage"]["total_tokens"]
        ended.set()

    limits = httpx.Limits(max_connections=4 * per_tenant)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(keep_asking(client, t)) for t in askers for _ in range(per_tenant)]
        await asyncio.wait_for(ended.wait(), 300)
        for task in tasks:  # the requests still in flight are left: their clients go
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tokens


def test_a_replica_killed_mid_stream_ends_the_stream_with_an_error_and_is_replaced(cluster):
    lines = stream_lines(cluster, "french-tutor", max_tokens=400)
    assert next(lines).startswith("data: {")
    running: list[str] = []

    def one_replica_runs_it() -> bool:  # the board's posts come every 2 s
        running[:] = [r["replica"] for r in pool(cluster) if "french-tutor" in r["running_adapters"]]
        return len(running) == 1

    eventually(one_replica_runs_it, "the board shows the replica running the stream", seconds=5)
    (serving,) = running
    (pid,) = [r["pid"] for r in pool(cluster) if r["replica"] == serving]
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    rest = list(lines)
    assert time.monotonic() - killed_at < 10, "the stream ended within seconds"
    error = json.loads(rest[-1].removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed", rest[-1]

    eventually(lambda: len(pool(cluster)) == 2 and serving not in {r["replica"] for r in pool(cluster)}, "replaced")
    for adapter in SAMPLES:  # every adapter serves again, on the new replica or the other
        assert complete(cluster, adapter, "Hello", 2).status_code == 200


def test_an_ingress_restart_loses_nothing(cluster):
    before = httpx.get(f"{cluster.url}/admin/adapters", headers=ADMIN).json()["data"]
    (pid,) = pids_titled("ServeReplica:loraserve:Ingress")
    os.kill(pid, signal.SIGKILL)

    def answers() -> bool:
        try:
            return httpx.get(f"{cluster.url}/admin/adapters", headers=ADMIN, timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    eventually(answers, "a new ingress answers")
    after = httpx.get(f"{cluster.url}/admin/adapters", headers=ADMIN).json()["data"]
    assert [a["name"] for a in after] == [a["name"] for a in before]
