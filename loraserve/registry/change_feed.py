"""Adapter changes announced to every server that shares the registry database: PostgreSQL's NOTIFY.

Each write of an adapter's row (created, edited, marked failed, deleted) sends its name on CHANNEL in the write's own
transaction, so a notification is delivered exactly when its change commits and never without it. Every server LISTENs
(AdapterCatalog.follow_registry) and serves what the row now says. NOTIFY rather than a broadcast between Ray Serve
replicas: the registry stays the one source of truth, and plain `loraserve serve` processes on one database keep in step
too. SQLite has no notifications; a lone server needs none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg
from sqlalchemy import func, make_url, select
from sqlalchemy.orm import Session

logger = logging.getLogger(__name__)

CHANNEL = "loraserve_adapters"
RECONNECT_SECONDS = 1.0


def announce(session: Session, name: str) -> None:
    """Inside the write's transaction: delivered when it commits, dropped if it rolls back."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_notify(CHANNEL, name)))


def listen(url: str, deliver: Callable[[str | None], None], stop: threading.Event) -> None:
    """`deliver(name)` for each adapter anyone changes, until `stop` is set. Blocks: run it on its own thread.
    `deliver(None)` after each (re)connection: what changed while nobody listened is unknown, look at all."""
    conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    while not stop.is_set():
        try:
            with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as connection:
                connection.execute(f"LISTEN {CHANNEL}")
                deliver(None)
                while not stop.is_set():
                    for notification in connection.notifies(timeout=RECONNECT_SECONDS):
                        deliver(notification.payload)
        except psycopg.Error as error:
            logger.warning("not following registry changes (%s); retrying", " ".join(str(error).split()))
            stop.wait(RECONNECT_SECONDS)
