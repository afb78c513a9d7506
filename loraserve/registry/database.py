"""Open the registry database and migrate it with Alembic, turning every failure into a RegistryError.

SQLite (the default, in the data dir) or PostgreSQL, per the URL; errors name it (password hidden), say what to change.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from loraserve.errors import RegistryError
from loraserve.resources import MIGRATIONS_DIR

CONNECT_SECONDS = 5
BUSY_SECONDS = 10
_URL_HINT = "pass --db sqlite:///PATH or --db postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE"


def sqlite_url(data_dir: Path) -> str:
    """The URL of the default registry: a SQLite file in the data directory."""
    return f"sqlite:///{(data_dir / 'registry.db').absolute()}"


def masked_url(url: str) -> str:
    """`url` with its password replaced by ***, safe to log and to show in errors."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", url)


def create_registry_engine(url: str) -> Engine:
    """An engine for `url`, safe to use from several threads; raises RegistryError for a bad URL."""
    try:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            if parsed.database and parsed.database != ":memory:":
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            # Worker threads call it, each on its own pooled connection; a writer waits at most BUSY_SECONDS for a lock.
            return create_engine(parsed, connect_args={"check_same_thread": False, "timeout": BUSY_SECONDS})
        # pre_ping replaces connections a restarted PostgreSQL server has closed. The timeouts bound
        # a database that refuses slowly or holds a lock; one that hangs outright is bounded by the
        # server's RegistryCalls (a stopped server answers no driver timeout).
        return create_engine(
            parsed,
            pool_pre_ping=True,
            pool_timeout=BUSY_SECONDS,
            connect_args={
                "connect_timeout": CONNECT_SECONDS,
                "options": f"-c statement_timeout={BUSY_SECONDS * 1000} -c lock_timeout={BUSY_SECONDS * 1000}",
            },
        )
    except (ArgumentError, ImportError, OSError) as error:
        raise RegistryError(f"cannot open registry database {masked_url(url)}: {error}; {_URL_HINT}") from error


def upgrade_database(url: str) -> None:
    """Create the registry's tables or migrate them to this version of loraserve (Alembic `upgrade head`)."""
    _run_alembic(url, lambda config: command.upgrade(config, "head"))


def downgrade_database(url: str, revision: str = "base") -> None:
    """Migrate the registry back to `revision`; "base" drops every table."""
    _run_alembic(url, lambda config: command.downgrade(config, revision))


def check_database(engine: Engine) -> None:
    """Raise RegistryError unless the database is migrated to exactly this code's revision."""
    url = engine.url.render_as_string(hide_password=True)
    head = ScriptDirectory(str(MIGRATIONS_DIR)).get_current_head()
    try:
        with engine.connect() as connection:
            current = MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as error:
        raise RegistryError(f"cannot reach registry database {url}: {driver_message(error)}; {_URL_HINT}") from error
    if current != head:
        raise RegistryError(
            f"registry database {url} is at revision {current or 'none (empty)'} but this loraserve needs {head}: "
            "migrate it with upgrade_database first"
        )


def _run_alembic(url: str, run: Callable[[Config], None]) -> None:
    engine = create_registry_engine(url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser treats % as interpolation; URL-encoded passwords contain it.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    try:
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            run(config)
    except CommandError as error:
        raise RegistryError(
            f"cannot migrate registry database {masked_url(url)}: {error}. It was probably written by a newer "
            "loraserve: upgrade loraserve, or point --db at another database"
        ) from error
    except SQLAlchemyError as error:
        raise RegistryError(
            f"cannot migrate registry database {masked_url(url)}: {driver_message(error)}; check that the server runs, "
            f"the database exists and this user may connect, or {_URL_HINT}"
        ) from error
    finally:
        engine.dispose()


def driver_message(error: SQLAlchemyError) -> str:
    """The driver's own message, without SQLAlchemy's statement dump and help link."""
    return str(getattr(error, "orig", None) or error).strip()
