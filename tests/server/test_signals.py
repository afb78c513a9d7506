"""Signals during 16 streams over the 4 sample adapters, on a real server process: SIGTERM lets every
running stream finish and then exits, cutting what runs past --drain-timeout; after SIGKILL a restart
on the same data serves every registered adapter."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.server.server_process import ADMIN, ServerProcess, server_process

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ADAPTERS = ["french-tutor", "pirate", "robot", "shakespeare"]
STREAMS = 16
TOKENS = 48


async def stream_chat(
    client: httpx.AsyncClient, index: int, started: asyncio.Event, counter: list[int], max_tokens: int
) -> dict:
    body = {"model": ADAPTERS[index % 4], "messages": [{"role": "user", "content": f"Tell me story {index}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    tokens, finish, done = 0, None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                choice = event["choices"][0]
                tokens += bool(choice["delta"].get("content"))
                finish = choice.get("finish_reason") or finish
                if tokens == 1:
                    counter[0] += 1
                    if counter[0] == STREAMS:
                        started.set()
    return {"finish": finish, "done": done}


async def streams_with_signal(
    server: ServerProcess, sig: signal.Signals, max_tokens: int = TOKENS
) -> tuple[list, float]:
    """16 streams; `sig` once every one has its first token. Returns their outcomes and when the signal went."""
    started, counter = asyncio.Event(), [0]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        tasks = [asyncio.create_task(stream_chat(client, i, started, counter, max_tokens)) for i in range(STREAMS)]
        await asyncio.wait_for(started.wait(), timeout=120)
        server.process.send_signal(sig)
        sent = time.monotonic()
        return await asyncio.gather(*tasks, return_exceptions=True), sent


def test_sigterm_lets_running_streams_finish_then_exits_within_the_drain_timeout(tmp_path):
    with server_process(tmp_path / "data", None, "--drain-timeout", "60") as server:
        outcomes, sent = asyncio.run(streams_with_signal(server, signal.SIGTERM))
        assert all(outcome == {"finish": "length", "done": True} for outcome in outcomes), outcomes
        # uvicorn re-raises the signal once drained, so the exit status says "stopped by SIGTERM".
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - sent < 60, "exited within the drain timeout"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.url}/health", timeout=2)


def test_streams_longer_than_the_drain_timeout_are_cut_and_the_server_exits_on_time(tmp_path):
    with server_process(tmp_path / "data", None, "--drain-timeout", "2") as server:
        outcomes, sent = asyncio.run(streams_with_signal(server, signal.SIGTERM, max_tokens=2000))
        server.process.wait(timeout=60)
        assert time.monotonic() - sent < 15, "the drain is bounded by --drain-timeout (2 s) and the shutdown after"
        assert all(outcome != {"finish": "length", "done": True} for outcome in outcomes), "2,000 tokens in 2 s"


def test_after_sigkill_mid_streams_a_restart_serves_every_registered_adapter(tmp_path):
    data_dir = tmp_path / "data"
    with server_process(data_dir, None, "--drain-timeout", "5") as server:
        outcomes, _ = asyncio.run(streams_with_signal(server, signal.SIGKILL))
        assert all(isinstance(outcome, httpx.TransportError) for outcome in outcomes), outcomes
        assert server.process.wait(timeout=30) == -signal.SIGKILL
    with server_process(data_dir, None, "--drain-timeout", "5") as restarted:
        names = {
            record["name"] for record in httpx.get(f"{restarted.url}/admin/adapters", headers=ADMIN).json()["data"]
        }
        assert names == set(ADAPTERS)
        for name in ADAPTERS:
            body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            response = httpx.post(f"{restarted.url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
