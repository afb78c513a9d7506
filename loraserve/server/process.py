"""Running the HTTP server in this process until it is stopped, or until the engine dies."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from loraserve.engine.async_engine import AsyncLLMEngine

# Longer than client pools keep an idle connection (httpx and the OpenAI SDK 5 s, aiohttp 15 s):
# were the server to close one first, a request sent on it at that moment fails (ReadError).
KEEP_ALIVE_SECONDS = 75


def run_server(
    app: FastAPI, engine: AsyncLLMEngine, host: str, port: int, exit_on_engine_death: bool, drain_timeout: int
) -> int:
    """Serve until SIGTERM or Ctrl-C, or (`exit_on_engine_death`) until the engine stops for good; the exit status.

    On SIGTERM or Ctrl-C no new connection is accepted and the requests running finish (streams included: the engine
    runs until they are done) for at most `drain_timeout` seconds, then are cut off. A server whose engine died answers
    nothing useful: exiting non-zero lets systemd, Kubernetes or Ray start a new one; else it stays up, /health 503."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=drain_timeout,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    server = uvicorn.Server(config)
    if exit_on_engine_death:
        engine.on_death = lambda _: setattr(server, "should_exit", True)  # uvicorn looks every 0.1 s
    server.run()
    return 1 if exit_on_engine_death and engine.error is not None else 0
