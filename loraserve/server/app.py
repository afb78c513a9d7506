"""`create_app`: one FastAPI app per engine and data directory, so every test can start its own server."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from loraserve.config import ServerConfig
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.errors import EngineDeadError
from loraserve.registry import FileStore, Registry, sqlite_url, upgrade_database
from loraserve.server import admin, lorax, openai
from loraserve.server.auth import require_admin_token, require_api_key
from loraserve.server.body_limit import BodyLimitMiddleware
from loraserve.server.catalog import AdapterCatalog
from loraserve.server.errors import domain_error, install_error_handlers
from loraserve.server.metrics import Metrics
from loraserve.server.state import ServerState, server_state

SAMPLE_ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
ADMIN_UI = Path(__file__).resolve().parents[2] / "admin_ui"
_SAMPLES_MARKER = ".samples-registered"  # in the data directory: samples are offered once, never re-added


def create_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The HTTP server over `engine`. Migrates the registry (RegistryError if it cannot) and serves its adapters."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    url = config.db_url or sqlite_url(config.data_dir)
    upgrade_database(url)
    registry = Registry(url, FileStore(config.data_dir / "adapters"))
    base_model = engine.engine.loaded.name
    catalog = AdapterCatalog(registry, engine, base_model)
    marker = config.data_dir / _SAMPLES_MARKER
    if config.register_samples and not marker.exists():
        catalog.register_samples(SAMPLE_ADAPTERS)
        marker.touch()
    catalog.load_registered()
    metrics = Metrics()
    engine.engine.adapters.stats.load_observers.append(metrics.adapter_load.observe)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            registry.close()

    app = FastAPI(title="loraserve", lifespan=lifespan)
    tokenizer = engine.engine.tokenizer
    app.state.loraserve = ServerState(
        engine=engine,
        catalog=catalog,
        metrics=metrics,
        config=config,
        admin_token=config.admin_token or secrets.token_urlsafe(32),
        model_name=base_model,
        tokenizer=tokenizer,
        special_token_ids=frozenset(tokenizer.all_special_ids),
        started_at=int(time.time()),
    )
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.max_body_bytes,
        max_upload_bytes=config.max_upload_bytes,
        upload_path="/admin/adapters",
    )

    @app.get("/health", response_model=None)
    async def health(request: Request) -> dict[str, str] | JSONResponse:
        """200 while inference works; 503 with the reason once the engine has stopped, so a supervisor restarts it."""
        state = server_state(request)
        if state.engine.error is not None:
            status, body = domain_error(EngineDeadError(f"the engine stopped: {state.engine.error!r}"))
            return JSONResponse(status_code=status, content={"status": "stopped", "engine": "stopped", **body})
        return {"status": "ok", "engine": "running", "model": state.model_name}

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        state = server_state(request)
        stats = await state.engine.call(lambda e: e.stats())
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The page holds no data: everything it shows is fetched with the admin token.
    app.mount("/admin/ui", StaticFiles(directory=ADMIN_UI, html=True), name="admin-ui")
    inference = [Depends(require_api_key)]
    app.include_router(openai.router, dependencies=inference)
    app.include_router(lorax.router, dependencies=inference)
    app.include_router(admin.router, dependencies=[Depends(require_admin_token)])
    return app
