"""A cluster's engine replica: the whole single server (engine, registry follower, HTTP app) in a Ray Serve replica.

The ingress forwards each HTTP request here as plain values (asgi_call.py); the replica's own app answers it, so
every route, error and stream is the single server's. Serve's model multiplexing routes an adapter's requests to the
replicas that hold it: `hold` is the `@serve.multiplexed` loader (its LRU as large as the engine's device slots), and
starts the adapter's disk read as the request arrives. Every POST_SECONDS the replica posts its pool, adapters and
metrics to the board (board.py) for the cluster-wide views, and tells the ledger (ledger.py), which counts quotas and
orders starts for the whole cluster, that it is alive with its running places. A dead engine fails Serve's health
check, and Serve starts a new replica in its place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from loraserve.cluster.asgi_call import ForwardedRequest, ResponseStart, call_asgi
from loraserve.cluster.board import POST_SECONDS, board
from loraserve.cluster.ledger import LedgerAccounts, ledger
from loraserve.config import EngineConfig, ServerConfig
from loraserve.engine import LLMEngine
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.engine.stats import json_view
from loraserve.openmp import in_passing_thread, keep_serial
from loraserve.server.app import create_app

logger = logging.getLogger(__name__)


class EngineReplica:
    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async constructor
        self, engine_config: EngineConfig, server_config: ServerConfig, app_name: str
    ) -> None:
        keep_serial()  # as `loraserve serve`: the engine thread alone computes in parallel
        self.replica_id = serve.get_replica_context().replica_tag
        self.node_id = ray.get_runtime_context().get_node_id()
        self.board = board(app_name)
        self.ledger = ledger(app_name)
        self.places = engine_config.scheduler.max_num_seqs  # what this replica adds to the cluster's running places
        accounts = LedgerAccounts(self.ledger, self.replica_id, fail_closed=server_config.quota_failure == "closed")
        self.engine = AsyncLLMEngine(in_passing_thread(lambda: LLMEngine(engine_config)))
        self.app = create_app(self.engine, server_config, accounts)
        self.state = self.app.state.loraserve
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # the engine thread and the registry follower start
        await self.ledger.join.remote(self.replica_id, self.places)

        async def start_reading(adapter: str) -> str:  # a function: Serve keeps its LRU as an attribute of it
            if not self.state.catalog.serves(adapter):  # uploaded a moment ago, its registry note still on its way
                with contextlib.suppress(Exception):  # the registry down: the request answers for itself
                    await self.state.catalog.sync(adapter)
            self.engine.prefetch(adapter)  # its slot comes with its first step; Serve now routes its requests here
            return adapter

        self.hold = serve.multiplexed(max_num_models_per_replica=engine_config.lora.max_loras)(start_reading)
        self._posting = asyncio.create_task(self._post_forever())

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        if adapter := serve.get_multiplexed_model_id():
            await self.hold(adapter)
        async for item in call_asgi(self.app, request):
            yield item

    async def snapshot(self) -> dict[str, Any]:
        stats = await self.engine.call(lambda engine: engine.stats())
        return {
            "replica": self.replica_id,
            "node": self.node_id,
            "pid": os.getpid(),
            "model": self.state.model_name,
            "pool": json_view(stats),
            "metrics": self.state.metrics.render(stats).decode(),
        }

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped for good is replaced."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine stopped: {self.engine.error!r}")

    async def _post_forever(self) -> None:
        while True:
            try:
                self.ledger.join.remote(self.replica_id, self.places)  # a heartbeat: a silent replica's places go
                self.board.post.remote(self.replica_id, await self.snapshot())
            except Exception as error:  # the engine stopping, or the board restarting: the next post retries
                logger.warning("replica %s: not posted to the board: %s", self.replica_id, error)
            await asyncio.sleep(POST_SECONDS)

    def __del__(self) -> None:
        """Serve stops the replica: its engine thread ends (usage counts not yet flushed are lost)."""
        with contextlib.suppress(Exception):
            self._posting.cancel()
            self.engine.shutdown()
