"""The cluster's notice board: each replica posts what it holds every few seconds; the ingress reads it for the
cluster-wide views (/admin/pool, /admin/adapters/{name}'s holders, /metrics). A Ray actor, named, so any process of
the cluster finds it; a replica that stops posting drops off after STALE_SECONDS (killed, or replaced by Serve).
"""

from __future__ import annotations

import time
from typing import Any

import ray

NAMESPACE = "loraserve"
POST_SECONDS = 2.0
STALE_SECONDS = 10.0


@ray.remote(num_cpus=0)
class ReplicaBoard:
    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, dict[str, Any]]] = {}

    def post(self, replica: str, snapshot: dict[str, Any]) -> None:
        self._posts[replica] = (time.monotonic(), snapshot)

    def snapshots(self) -> list[dict[str, Any]]:
        """Every live replica's last post, ordered by replica id."""
        now = time.monotonic()
        self._posts = {r: post for r, post in self._posts.items() if now - post[0] <= STALE_SECONDS}
        return [snapshot for _, (_, snapshot) in sorted(self._posts.items())]


def board(app_name: str) -> Any:
    """The board of the Serve application `app_name`, created by whoever asks first; it outlives an ingress restart."""
    options = {"name": f"board-{app_name}", "namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached"}
    return ReplicaBoard.options(**options).remote()  # type: ignore[attr-defined]
