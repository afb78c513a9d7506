"""Empty databases on the shared PostgreSQL at 127.0.0.1:5432 (trust auth, a `test` database), dropped after use.

Without such a server the test is skipped, saying why.
"""

from __future__ import annotations

import getpass
from contextlib import AbstractContextManager

import pytest
from sqlalchemy import create_engine
from sqlalchemy.exc import SQLAlchemyError

from benchmarks.postgres import scratch_database

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


def empty_database(admin_url: str) -> AbstractContextManager[str]:
    """The URL of a new, empty database, dropped (with any connection left to it) on exit."""
    return scratch_database(admin_url, prefix="loraserve_test")
