"""Running the HTTP server in this process until it is stopped, or until the engine dies."""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

from loraserve.engine.async_engine import AsyncLLMEngine


def run_server(app: FastAPI, engine: AsyncLLMEngine, host: str, port: int, exit_on_engine_death: bool) -> int:
    """Serve until Ctrl-C, or (`exit_on_engine_death`) until the engine stops for good; the exit status.

    A server whose engine has died answers nothing useful: exiting non-zero lets systemd,
    Kubernetes or Ray start a fresh one. Without it the server stays up and /health says 503.
    """
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    if exit_on_engine_death:
        engine.on_death = lambda _: setattr(server, "should_exit", True)  # uvicorn looks every 0.1 s
    server.run()
    return 1 if exit_on_engine_death and engine.error is not None else 0
