"""Empty databases on the shared PostgreSQL at 127.0.0.1:5432 (trust auth, a `test` database), dropped after use.

Without such a server the test is skipped, saying why.
"""

from __future__ import annotations

import getpass
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import SQLAlchemyError

PG_SERVER = "127.0.0.1:5432"


def postgres_admin_url() -> str:
    """A URL of the server's `test` database that may CREATE DATABASE; skips the test when none answers."""
    failures = []
    for user in dict.fromkeys(["postgres", getpass.getuser()]):
        url = f"postgresql://{user}@{PG_SERVER}/test"
        engine = create_engine(url)
        try:
            with engine.connect():
                return url
        except SQLAlchemyError as error:
            failures.append(f"{user}: {' '.join(str(getattr(error, 'orig', error)).split())}")
        finally:
            engine.dispose()
    reason = f"no PostgreSQL at {PG_SERVER} ({'; '.join(failures)})"
    print(reason)
    pytest.skip(reason)


@contextmanager
def empty_database(admin_url: str) -> Iterator[str]:
    """The URL of a new, empty database, dropped (with any connection left to it) on exit."""
    name = f"loraserve_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
