"""A new, empty PostgreSQL database for a run, dropped after it (the cluster benchmark's registry; the tests' too)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text


@contextmanager
def scratch_database(admin_url: str, prefix: str = "loraserve_scratch") -> Iterator[str]:
    """The URL of a new database on the server of `admin_url` (a database its user may CREATE DATABASE from), dropped
    with any connection left to it on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
