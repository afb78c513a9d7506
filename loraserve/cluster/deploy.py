"""`loraserve cluster`: the single server's HTTP contract on Ray Serve, an ingress and N engine replicas.

    ray start --head                                  # or nothing: a local Ray instance is started
    loraserve cluster --replicas 2 --db postgresql://user@host/loraserve

Every replica runs a whole engine on its share of a node (--replica-cpus, --replica-gpus) and the single server's app
over the one PostgreSQL registry, keeping adapter files in it too (--files-in-database), so replicas on other machines
need no shared disk. SQLite is refused: it is one file on one machine.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import replace

import ray
from ray import serve
from ray.serve import Application

from loraserve.cluster.ingress import Ingress
from loraserve.cluster.replica import EngineReplica
from loraserve.config import EngineConfig, ServerConfig
from loraserve.errors import ConfigError, LoraserveError

logger = logging.getLogger(__name__)

APP_NAME = "loraserve"
MAX_ONGOING_REQUESTS = 10_000  # Serve's default is 5; each engine queues and refuses (503 overloaded) on its own
HEALTH_CHECK_SECONDS = 2.0
ROUTINGS = ("affinity", "random")  # random: for comparisons (loraserve bench cluster)


def cluster_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    replicas: int,
    replica_cpus: float,
    replica_gpus: float,
    app_name: str = APP_NAME,
    routing: str = "affinity",
) -> Application:
    """The Serve application: the ingress over `replicas` engine replicas. ConfigError for a registry not shared."""
    if not (server_config.db_url or "").startswith("postgresql"):
        raise ConfigError("--db", "a cluster's replicas share one PostgreSQL registry (postgresql://...); not SQLite")
    if server_config.admin_token is None:
        raise ConfigError("--admin-token", "a cluster needs one admin token for every replica")
    if routing not in ROUTINGS:
        raise ConfigError("--routing", f"one of {', '.join(ROUTINGS)}, not {routing!r}")
    if replicas < 1:
        raise ConfigError("--replicas", "must be at least 1")
    server_config = replace(server_config, files_in_database=True)
    engine_replica = serve.deployment(
        name="EngineReplica",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        max_ongoing_requests=MAX_ONGOING_REQUESTS,
        health_check_period_s=HEALTH_CHECK_SECONDS,
    )(EngineReplica)
    ingress = serve.deployment(
        name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=MAX_ONGOING_REQUESTS
    )(Ingress)
    replica_app = engine_replica.bind(engine_config, server_config, app_name)
    limits = (server_config.max_body_bytes, server_config.max_upload_bytes)
    return ingress.bind(replica_app, server_config.admin_token, limits, app_name, routing == "affinity")


def run_cluster(app: Application, ray_address: str | None, host: str, port: int, app_name: str = APP_NAME) -> None:
    """Deploy `app` on the Ray cluster at `ray_address` (None: start a local one) and serve until SIGTERM or Ctrl-C."""
    try:
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=bool(os.environ.get("LORASERVE_RAY_LOGS")))
    except Exception as error:  # Ray's own errors name what failed; the caller only needs to know it did
        raise LoraserveError(f"Ray could not start: {error}") from error
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=app_name, route_prefix="/")
        print(f"loraserve: cluster serving on http://{host}:{port} (Ray {ray.get_runtime_context().gcs_address})")
        stop = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stop.set())
        stop.wait()
    finally:
        serve.delete(app_name)
        ray.shutdown()
