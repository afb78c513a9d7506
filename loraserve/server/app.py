"""`create_app`: one FastAPI app per engine, so every test can start its own server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request

from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.server import openai
from loraserve.server.auth import require_api_key
from loraserve.server.errors import install_error_handlers
from loraserve.server.state import ServerState, server_state


def create_app(engine: AsyncLLMEngine, api_keys: frozenset[str] = frozenset()) -> FastAPI:
    """The HTTP server over `engine`; the engine thread runs while the app does."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="loraserve", lifespan=lifespan)
    app.state.loraserve = ServerState(
        engine=engine,
        model_name=engine.engine.loaded.name,
        tokenizer=engine.engine.tokenizer,
        started_at=int(time.time()),
        api_keys=api_keys,
    )
    install_error_handlers(app)

    @app.get("/health")
    async def health(request: Request) -> dict[str, str]:
        return {"status": "ok", "model": server_state(request).model_name}

    app.include_router(openai.router, dependencies=[Depends(require_api_key)])
    return app
