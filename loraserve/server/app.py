"""`create_app`: one FastAPI app per engine and data directory, so every test can start its own server."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from fastapi.staticfiles import StaticFiles

from loraserve.config import ServerConfig
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.lora import adapter_sandbox
from loraserve.registry import FileStore, Registry, sqlite_url, upgrade_database
from loraserve.resources import ADMIN_UI, SAMPLE_ADAPTERS
from loraserve.server import admin, admin_keys, health, lorax, openai, openai_responses
from loraserve.server.accounts import Accounts
from loraserve.server.auth import require_admin_token, require_api_key
from loraserve.server.body_limit import BodyLimitMiddleware
from loraserve.server.catalog import AdapterCatalog
from loraserve.server.errors import ERROR_RESPONSES, install_error_handlers
from loraserve.server.metrics import Metrics
from loraserve.server.openapi_limits import SchemaLimits, openapi_with_limits
from loraserve.server.registry_calls import RegistryCalls
from loraserve.server.state import ServerState, server_state
from loraserve.server.tenants import Tenants
from loraserve.tools.prompt import model_tool_format

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
_SAMPLES_MARKER = ".samples-registered"  # in the data directory: samples are offered once, never re-added


def create_app(engine: AsyncLLMEngine, config: ServerConfig, accounts: Accounts | None = None) -> FastAPI:
    """The HTTP server over `engine`. Migrates the registry (RegistryError if it cannot) and serves its adapters.
    `accounts`: where quotas and tenants' turns are kept (a cluster's ledger); default this process."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    url = config.db_url or sqlite_url(config.data_dir)
    upgrade_database(url)
    store = FileStore(config.data_dir / "adapters", min_leftover_age=config.orphan_grace)
    registry = Registry(url, store, config.files_in_database)
    calls = RegistryCalls(registry, timeout=config.registry_timeout)
    catalog = AdapterCatalog(registry, engine, calls)
    marker = config.data_dir / _SAMPLES_MARKER
    if config.register_samples and not marker.exists():
        catalog.register_samples(SAMPLE_ADAPTERS)
        marker.touch()
    catalog.load_registered(config.orphan_grace)
    admin.remove_stale_uploads(config.data_dir, config.orphan_grace)
    tenants = Tenants(registry, calls, config.api_keys, config.require_api_key, accounts)
    tenants.load()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        threading.Thread(target=adapter_sandbox.warm_up, name="loraserve-sandbox-warm-up", daemon=True).start()
        loops = (
            calls.probe_forever(),
            catalog.flush_usage_forever(),
            tenants.refresh_forever(),
            catalog.follow_registry_forever(),
            catalog.check_stored(),
        )
        background = [asyncio.create_task(loop) for loop in loops]
        try:
            yield
        finally:
            for task in background:
                task.cancel()
            await catalog.close(timeout=5)
            engine.shutdown()
            if calls.is_available:  # closing waits for connections a hung database still holds
                registry.close()

    app = FastAPI(title="loraserve", lifespan=lifespan, responses=ERROR_RESPONSES)
    app.openapi = openapi_with_limits(app, SchemaLimits.of(engine))  # type: ignore[method-assign]
    tokenizer = engine.tokenizer
    app.state.loraserve = ServerState(
        engine=engine,
        catalog=catalog,
        metrics=Metrics(),
        tenants=tenants,
        config=config,
        admin_token=config.admin_token or secrets.token_urlsafe(32),
        model_name=engine.model_name,
        tokenizer=tokenizer,
        special_token_ids=frozenset(tokenizer.all_special_ids),
        tool_format=model_tool_format(tokenizer, config.tool_call_parser),
        started_at=int(time.time()),
    )
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.max_body_bytes,
        max_upload_bytes=config.max_upload_bytes,
    )

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {"content": {PROMETHEUS_TEXT: {}}}})
    async def prometheus_metrics(request: Request) -> Response:
        state = server_state(request)
        stats = await state.engine.call(lambda e: e.stats())
        return Response(state.metrics.render(stats), media_type=PROMETHEUS_TEXT)

    # The page holds no data: everything it shows is fetched with the admin token.
    app.mount("/admin/ui", StaticFiles(directory=ADMIN_UI, html=True), name="admin-ui")
    inference = [Depends(require_api_key)]
    app.include_router(health.router)
    app.include_router(openai.router, dependencies=inference)
    app.include_router(openai_responses.router, dependencies=inference)
    app.include_router(lorax.router, dependencies=inference)
    app.include_router(admin.router, dependencies=[Depends(require_admin_token)])
    app.include_router(admin_keys.router, dependencies=[Depends(require_admin_token)])
    return app
